"""The paged-KV-cache kernels compile for real NVIDIA GPUs: the launches of the registered AOT cases
(``attnops/torch_npu/triton/aot.py``, from the launcher's own plan) compiled down to cubin for sm_90 / sm_80 without a
GPU, within the target's shared memory and without register spills. One case per target in CI, the rest slow."""
import pytest

from tests.aot_compile import assert_compiles

pytest.importorskip("triton")

KERNELS = {"write": "scatter_kv_kernel", "read": "gather_kv_kernel"}
CASES = [f"torch_npu/kv-cache-{op}-{dtype}-{layout}-w{width}" for op in KERNELS for dtype in ("int8", "fp16", "fp32")
         for layout in ("nd", "nz") for width in (1024, 576)]


def check(case: str, target: str) -> None:
    assert_compiles(case, target, {KERNELS[case.split("-")[2]]})


@pytest.mark.parametrize("case,target", [("torch_npu/kv-cache-write-fp16-nz-w576", "sm_90"),
                                         ("torch_npu/kv-cache-read-int8-nd-w1024", "sm_80")])
def test_kv_cache_kernels_compile(case, target):
    check(case, target)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", CASES)
def test_kv_cache_kernels_compile_matrix(case, target):
    check(case, target)
