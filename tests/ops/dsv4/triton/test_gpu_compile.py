"""The DeepSeek-V4 compressor and lightning indexer v2 kernels compile for real NVIDIA GPUs: every launch of the
registered AOT cases (``compressor_aot.py``, ``indexer_v2_aot.py``, built from the launchers' own plans at
DeepSeek-V4's shapes) compiled down to cubin for sm_90 / sm_80 without a GPU, within the target's shared memory,
without register spills (less the aot check's exemptions), and with Hopper's wgmma for the 16-bit projection and
indexer products on sm_90.

The compile runs in a child process without ``TRITON_INTERPRET`` (tens of seconds a case): all slow."""
import pytest

from tests.aot_compile import compile_case, spill_rule_holds

pytest.importorskip("triton")

DTYPES = ("fp16", "bf16", "fp32")
COMPRESSOR = [f"dsv4-compressor/{shape}-{dtype}" for shape in ("c4a", "c4li", "c128a", "c4a-norm-rope")
              for dtype in DTYPES]
INDEXER = [f"dsv4-indexer-v2/{kind}-top{topk}-{dtype}" for kind in ("bsnd", "paged") for topk in (512, 1024)
           for dtype in DTYPES]
PRODUCTS = {"compressor_project_kernel", "indexer_v2_kernel"}


def check(case: str, target: str) -> None:
    variants = compile_case(case, target)
    kernels = ({"indexer_v2_kernel"} if "indexer" in case else
               {"compressor_project_kernel", "compressor_pool_kernel", "compressor_save_kernel"})
    assert {v["kernel"] for v in variants} == kernels
    for v in variants:
        assert v["shared"] <= v["limit"] and spill_rule_holds(case, target, v), v
        if target == "sm_90" and not case.endswith("fp32") and v["kernel"] in PRODUCTS:
            assert v["ptx"]["wgmma"] > 0 and v["ptx"]["mma_sync"] == 0, v


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", COMPRESSOR + INDEXER)
def test_every_case_compiles(case, target):
    check(case, target)
