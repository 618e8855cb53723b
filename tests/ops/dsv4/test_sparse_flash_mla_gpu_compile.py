"""sparse_flash_mla's Triton kernels compile for real NVIDIA GPUs: every launch of the registered AOT cases
(``attnops/ops/dsv4/triton/sparse_flash_mla_aot.py``, built from the launcher's own plan at DeepSeek-V4's shapes)
compiled down to cubin for sm_90 / sm_80 without a GPU, within the target's shared memory, without register spills,
with 16-byte key loads and with Hopper's wgmma for the 16-bit products on sm_90.

The compile runs in a child process without ``TRITON_INTERPRET``. One case runs in CI; the matrix is slow."""
import pytest

from tests.aot_compile import compile_case

pytest.importorskip("triton")

CASES = [f"dsv4/sparse-flash-mla-{kind}-{dtype}" for dtype in ("fp16", "bf16", "fp32")
         for kind in ("prefill-csa", "prefill-hca", "paged-prefill-csa", "decode-csa", "decode-hca")]
COMBINE = "sparse_flash_mla_combine_kernel"


def check(case: str, target: str) -> None:
    variants = compile_case(case, target)
    split = "decode" in case
    assert {v["kernel"] for v in variants} == (
        {"sparse_flash_mla_split_kernel", COMBINE} if split else {"sparse_flash_mla_kernel"})
    for v in variants:
        assert v["shared"] <= v["limit"] and v["spills"] == 0, v
        if v["kernel"] != COMBINE:
            assert v["ptx"]["ld_global_narrow"] == 0, v
            assert target != "sm_90" or case.endswith("fp32") or v["ptx"]["wgmma"] > 0, v


def test_decode_split_compiles_with_wgmma_and_no_spills():
    check("dsv4/sparse-flash-mla-decode-csa-bf16", "sm_90")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", CASES)
def test_every_case_compiles(case, target):
    check(case, target)
