"""The Triton NSA kernels compile for real NVIDIA GPUs: every launch of the registered AOT cases
(``attnops/ops/nsa/triton/aot.py``, built from the launchers' own plans: selected attention, compression,
compressed attention with the FlashAttention forward it runs, decode) compiled down to cubin for sm_90 / sm_80
without a GPU, within the target's shared memory and without register spills in the configuration the launcher runs
(less the aot check's exemptions).

The compile runs in a child process without ``TRITON_INTERPRET`` (this process runs the kernels through the
interpreter). A representative subset runs in CI; the full case x target matrix is slow.
"""
import re

import pytest

from tests.aot_compile import assert_compiles

pytest.importorskip("triton")

KERNELS = {"selected": {"selected_fwd_kernel", "selected_delta_kernel", "selected_dq_kernel", "selected_keys_kernel",
                        "selected_dkdv_kernel", "selected_dkdv_reduce_kernel"},
           "compress": {"compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel"},
           "compress-attention-causal": {"fwd_kernel", "importance_kernel", "topk_kernel"},
           "compress-attention-mask": {"fwd_kernel", "importance_kernel", "topk_kernel"},
           "decode": {"selected_decode_kernel", "decode_merge_kernel", "compress_decode_kernel",
                      "compress_decode_score_kernel", "topk_kernel", "compress_cache_kernel"}}
DIMS = {"selected": ("d64-dv64", "d128-dv128", "d192-dv128"), "compress": ("d128", "d192"),
        "compress-attention-causal": ("d128-dv128", "d192-dv128"),
        "compress-attention-mask": ("d128-dv128", "d192-dv128"),
        "decode": ("d128-dv128", "d192-dv128")}


def check(case: str, target: str) -> None:
    assert_compiles(case, target, KERNELS[re.match(r"nsa/(.+)-(fp16|bf16|fp32)-", case).group(1)])


@pytest.mark.parametrize("case,target", [("nsa/selected-fp16-d192-dv128", "sm_90"),
                                         ("nsa/selected-fp32-d128-dv128", "sm_80"),
                                         ("nsa/compress-bf16-d192", "sm_90"),
                                         ("nsa/compress-attention-mask-fp32-d128-dv128", "sm_80"),
                                         ("nsa/compress-attention-causal-bf16-d192-dv128", "sm_90"),
                                         ("nsa/decode-bf16-d192-dv128", "sm_90")])
def test_nsa_kernels_compile(case, target):
    check(case, target)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", [f"nsa/{kind}-{dtype}-{dims}" for dtype in ("fp16", "bf16", "fp32")
                                  for kind, dims_list in DIMS.items() for dims in dims_list])
def test_nsa_kernels_compile_matrix(case, target):
    check(case, target)
