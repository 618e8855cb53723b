"""The flash-attn functions on attnops' Triton kernels (on CUDA, else Triton's interpreter; fp16/fp32, tiny
shapes): softcap (forward, the dK/dV pass with dQ and the separate dQ kernel), bottom-right ALiBi, windows and GQA
against the fp64 ``attention_ref`` by the tolerance rule."""
import pytest
import torch

from attnops.flash_attn import flash_attn_func
from attnops.ops.common.triton import launch
from tests.flash_attn.attention_ref import attention_ref
from tests.flash_attn.test_interface import _check, _inputs
from tests.triton_backend import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2(-inf) in numpy


@pytest.mark.parametrize("fused", [True, False], ids=["dq-in-pass", "dq-kernel"])
@pytest.mark.parametrize("dtype,causal,window_size,alibi,sq,sk,hk", [
    (torch.float32, True, (-1, -1), True, 13, 21, 2),
    (torch.float16, False, (5, 3), False, 19, 16, 1),
])
def test_softcap_on_the_kernels(dtype, causal, window_size, alibi, sq, sk, hk, fused, triton_backend,
                                monkeypatch):
    monkeypatch.setattr(launch, "dq_in_pass", lambda device: fused)
    q, k, v, dout = (x.to(DEVICE) for x in _inputs(1, sq, sk, 4, hk, 16, dtype, seed=5))
    slopes = torch.rand(4, device=DEVICE) if alibi else None
    options = dict(causal=causal, window_size=window_size, softcap=1.5, alibi_slopes=slopes)

    def actual(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
        return out, lse

    _check(actual, lambda q, k, v, dtype: attention_ref(q, k, v, dtype=dtype, **options), q, k, v, dout)
    assert "fwd_kernel" in triton_backend and ("dq_kernel" in triton_backend) != fused
