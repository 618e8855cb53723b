"""FlashAttention-3's names (attnops.flash_attn.fa3) against flash-attn 2's functions and their refusals; and
``torch.compile(fullgraph=True)`` through the flash-attn functions, forward (with the LSE) and backward."""
import pytest
import torch

from attnops._core.errors import ParamInvalidError
from attnops.flash_attn import fa3, flash_attn_func, flash_attn_varlen_func


def _qkv(seed=0, hq=4, hk=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 12, hq, 16, generator=g), *(torch.randn(2, 12, hk, 16, generator=g) for _ in range(2))


def test_fa3_functions_equal_flash_attn_2():
    q, k, v = _qkv()
    options = dict(causal=True, window_size=(4, -1), softcap=3.0)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert torch.equal(fa3.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True, **options), out)
    out3, lse3 = fa3.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert torch.equal(out3, out) and torch.equal(lse3, lse)
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    flat = [x.reshape(24, *x.shape[2:]) for x in (q, k, v)]
    assert torch.equal(fa3.flash_attn_varlen_func(*flat, cu, cu, 19, 19, **options),
                       flash_attn_varlen_func(*flat, cu, cu, 19, 19, **options))
    qkv = torch.cat([q, k, v], dim=2)  # [B, S, H + 2 * H_k, D]
    assert torch.equal(fa3.flash_attn_qkvpacked_func(qkv, num_heads_q=4, **options), out)


@pytest.mark.parametrize("call,name", [
    (lambda q: fa3.flash_attn_func(q, q, q, k_descale=torch.ones(1, 4)), "k_descale"),
    (lambda q: fa3.flash_attn_func(q, q, q, qv=q[..., :3, :]), "qv"),
    (lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=1.5), "attention_chunk"),
    (lambda q: fa3.flash_attn_qkvpacked_func(q, num_heads_q=3), "num_heads_q"),
])
def test_fa3_unsupported_options_raise(call, name):
    with pytest.raises(ParamInvalidError, match=name):
        call(torch.randn(1, 8, 4, 16))


def test_compile_fullgraph_forward_lse_and_backward():
    q, k, v = _qkv(1)
    slopes = torch.rand(4)
    cu = torch.tensor([0, 7, 24], dtype=torch.int32)

    def step(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes,
                                      return_attn_probs=True)
        flat = flash_attn_varlen_func(*(x.reshape(24, *x.shape[2:]) for x in (q, k, v)), cu, cu, 17, 17,
                                      window_size=(3, 1))
        return out.sum() + flat.square().sum(), lse

    leaves_c, leaves_e = ([x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2))
    (loss_c, lse_c), (loss_e, lse_e) = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves_c), \
        step(*leaves_e)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(lse_c, lse_e)
    for a, b in zip(torch.autograd.grad(loss_c, leaves_c), torch.autograd.grad(loss_e, leaves_e)):
        torch.testing.assert_close(a, b)
