"""The Triton FIA decode and prefill kernels compile for real NVIDIA GPUs: every launch of the registered AOT cases
(``attnops/ops/fused_infer_attention/triton/aot.py``, built from the launcher's own plans) compiled down to cubin
for sm_90 / sm_80 without a GPU, within the target's shared memory and without register spills. A representative
subset runs in CI; the full case x target matrix is slow."""
import pytest

from attnops.ops.fused_infer_attention.triton.aot import PREFILL_CASES
from tests.aot_compile import assert_compiles

pytest.importorskip("triton")

CASES = [f"decode-{kind}-{dtype}-{dims}" for dtype in ("fp16", "bf16", "fp32")
         for kind, dims in (("dense", "d128-g4"), ("dense", "d192-dv128-g8"), ("paged", "d128"),
                            ("masked-pse", "g16-sq4"))] + \
        [f"decode-{kind}-{dtype}-d128" for kind in ("paged-int8", "paged-int4", "nz", "nz-int8", "int8-out")
         for dtype in ("fp16", "bf16")]


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
