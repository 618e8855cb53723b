"""The Triton FIA decode and prefill kernels compile for real NVIDIA GPUs: every launch of the registered AOT cases
(``attnops/ops/fused_infer_attention/triton/aot.py``, built from the launcher's own plans) compiled down to cubin
for sm_90 / sm_80 without a GPU, within the target's shared memory and without register spills. A representative
subset runs in CI; the full case x target matrix is slow."""
import pytest

from attnops._core.triton.registry import AOT_CASES
from attnops.ops.fused_infer_attention.triton.aot import PREFILL_CASES
from tests.aot_compile import assert_compiles, compile_case

pytest.importorskip("triton")

CASES = sorted(name.split("/", 1)[1] for name in AOT_CASES if name.startswith("fused_infer_attention/decode-"))


def check(case: str, target: str) -> None:
    kernels = {"prefill_kernel"} if case.startswith("prefill-") else {"split_kernel", "merge_kernel"}
    assert_compiles(f"fused_infer_attention/{case}", target, kernels)


@pytest.mark.parametrize("case,target", [("decode-paged-bf16-d128", "sm_90"), ("decode-paged-int4-fp16-d128", "sm_80"),
                                         ("decode-masked-pse-fp32-g16-sq4", "sm_90"), ("decode-nz-int8-bf16-d128", "sm_90"),
                                         ("decode-int8-out-bf16-d128", "sm_80"), ("prefill-paged-nz-bf16-d128", "sm_90"),
                                         ("prefill-dense-fp16-d128", "sm_80"), ("prefill-masked-pse-fp32-d128", "sm_90")])
def test_fia_kernels_compile(case, target):
    check(case, target)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", CASES + list(PREFILL_CASES))
def test_fia_kernels_compile_matrix(case, target):
    check(case, target)


@pytest.mark.parametrize("case,wgmma", [("decode-paged-bnsd-int8-bf16-d128", False),
                                        ("decode-dense-fp16-d64-g4", False), ("decode-dense-bf16-d128-g64", True)])
def test_split_kernel_takes_hoppers_fast_path(case, wgmma):
    """sm_90, the configuration the launcher runs: K/V (and pse/mask) load as 16-byte vectors or ``cp.async``, no
    element at a time; 64 query rows per program make ``wgmma`` products, fewer rows ``mma.sync``."""
    (split,) = [v for v in compile_case(f"fused_infer_attention/{case}", "sm_90")
                if v["kernel"] == "split_kernel" and v["default"]]
    ptx = split["ptx"]
    assert ptx["ld_global_narrow"] == 0 and ptx["cp_async"] > 0, ptx
    assert (ptx["wgmma"] > 0, ptx["mma_sync"] == 0) == (wgmma, wgmma), ptx
