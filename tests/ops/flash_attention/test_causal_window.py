"""flash-attn style ``causal`` / ``window_size`` on the Pythonic API against an fp64 golden fed the explicit mask
built straight from flash-attn's statement (bottom-right aligned: keep ``(i, j)`` iff
``i + Skv - Sq - left <= j <= i + Skv - Sq + right``, -1 unbounded, causal: right = 0), forward and backward,
BNSD and TND, Sq == Skv and Sq != Skv; and the errors of mixing them with the CANN mask arguments."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamInvalidError
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from tests.helpers import F64, TRIU2048, cum, make_qkv


def flash_attn_keep(sq: int, skv: int, causal: bool, window_size) -> torch.Tensor:
    """Bool [Sq, Skv], True = kept, from flash-attn's documented rule."""
    left, right = window_size
    right = 0 if causal else right
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None]
    keep = torch.ones(sq, skv, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i + skv - sq - left
    if right >= 0:
        keep &= j <= i + skv - sq + right
    return keep


def _bnsd(x: torch.Tensor) -> torch.Tensor:  # [S, N, D] -> [1, N, S, D]
    return x.permute(1, 0, 2).unsqueeze(0)


def golden_batches(q, k, v, dy, *, q_lens, kv_lens, causal, window_size, scale, dtype):
    """(out, dq, dk, dv) per batch of BNSD ([B, N, S, D]) or TND inputs, by the golden with the explicit mask."""
    tnd = q.dim() == 3
    batches = len(q_lens) if tnd else q.shape[0]
    outs, grads = [], [[], [], []]
    q0 = k0 = 0
    for b in range(batches):
        if tnd:
            sq, skv = q_lens[b], kv_lens[b]
            qb, kb, vb, dyb = (_bnsd(t[o:o + n]) for t, o, n in ((q, q0, sq), (k, k0, skv), (v, k0, skv), (dy, q0, sq)))
            q0, k0 = q0 + sq, k0 + skv
        else:
            qb, kb, vb, dyb = (t[b:b + 1] for t in (q, k, v, dy))
            sq, skv = qb.shape[2], kb.shape[2]
        kw = dict(head_num=q.shape[-2] if tnd else q.shape[1], input_layout="BNSD", scale=scale,
                  atten_mask=~flash_attn_keep(sq, skv, causal, window_size), sparse_mode=0, dtype=dtype)
        out = fa_forward(qb, kb, vb, **kw)[0]
        dq, dk, dv, _ = fa_backward(dyb, qb, kb, vb, **kw)
        back = (lambda t: t.squeeze(0).permute(1, 0, 2)) if tnd else (lambda t: t)
        outs.append(back(out))
        for acc, g in zip(grads, (dq, dk, dv)):
            acc.append(back(g))
    return (torch.cat(outs), *(torch.cat(g) for g in grads))


def check_window(q, k, v, dy, *, causal, window_size, q_lens=None, kv_lens=None, backend="auto"):
    """Forward (with stats) and flash_attention_backward vs the golden with FlashAttention's tolerance rule."""
    tnd = q.dim() == 3
    kw = dict(causal=causal, window_size=window_size, scale=0.35, backend=backend)
    if tnd:
        kw.update(layout="TND", actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))
    res = attnops.flash_attention(q, k, v, return_stats=True, **kw)
    grads = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, **kw)
    lens = dict(q_lens=q_lens, kv_lens=kv_lens, causal=causal, window_size=window_size, scale=0.35)
    gold = golden_batches(q.cpu(), k.cpu(), v.cpu(), dy.cpu(), dtype=F64, **lens)
    base = golden_batches(q.cpu(), k.cpu(), v.cpu(), dy.cpu(), dtype=q.dtype, **lens)
    red = fa_reductions(q, k, v, layout="TND" if tnd else "BNSD", head_num=q.shape[-2 if tnd else 1],
                        actual_seq_qlen=kw.get("actual_seq_qlen"), actual_seq_kvlen=kw.get("actual_seq_kvlen"))
    for name, got, g, b, factor in zip(("out", "dq", "dk", "dv"), (res.out, *grads[:3]), gold, base, (2, 3, 3, 3)):
        assert_close_to_golden(name, got.cpu(), g, b, factor=factor, reduction=red[name])


WINDOWS = [(True, (-1, -1)), (False, (3, 2)), (False, (-1, 0)), (False, (0, -1)), (True, (2, -1)), (False, (1, 4))]


@pytest.mark.parametrize("causal,window_size", WINDOWS)
@pytest.mark.parametrize("sq,skv", [(7, 7), (5, 9), (9, 5)])
def test_bnsd_matches_golden(causal, window_size, sq, skv):
    q, k, v, dy = make_qkv("BNSD", b=2, n1=2, sq=sq, skv=skv, seed=sq * 10 + skv)
    check_window(q, k, v, dy, causal=causal, window_size=window_size)


@pytest.mark.parametrize("causal,window_size", WINDOWS)
def test_tnd_matches_golden_per_batch_alignment(causal, window_size):
    """Every batch is aligned at its own bottom-right corner (Sq_b != Skv_b, an empty batch)."""
    q_lens, kv_lens = [4, 0, 6, 3], [6, 2, 3, 3]
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, q_lens=q_lens, kv_lens=kv_lens, seed=7)
    check_window(q, k, v, dy, causal=causal, window_size=window_size, q_lens=q_lens, kv_lens=kv_lens)


def test_causal_equals_sparse_mode_3_and_window_equals_mode_4():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=2, sq=6, skv=9, seed=3)
    assert torch.equal(attnops.flash_attention(q, k, v, causal=True),
                       attnops.flash_attention(q, k, v, atten_mask=TRIU2048, sparse_mode=3))
    assert torch.equal(attnops.flash_attention(q, k, v, window_size=(2, 1)),
                       attnops.flash_attention(q, k, v, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=2,
                                               next_tokens=1))


def test_autograd_through_causal():
    q, k, v, dy = (t.double() for t in make_qkv("BNSD", b=1, n1=1, sq=3, skv=4, d=4, seed=5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.gradcheck(lambda a, b, c: attnops.flash_attention(a, b, c, causal=True, window_size=(1, -1)),
                             leaves)


MIXED = {
    "causal_and_sparse_mode": dict(causal=True, sparse_mode=2, atten_mask=TRIU2048),
    "causal_and_mask": dict(causal=True, atten_mask=TRIU2048),
    "window_and_pre_tokens": dict(window_size=(2, 2), pre_tokens=3),
    "window_and_next_tokens": dict(window_size=(2, 2), next_tokens=0),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixing_flash_attn_and_cann_mask_arguments_raises(case):
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=4, seed=1)
    with pytest.raises(ParamInvalidError, match="causal/window_size alone"):
        attnops.flash_attention(q, k, v, **MIXED[case])


@pytest.mark.parametrize("kw,match", [
    (dict(causal=1), "causal: expected a bool"),
    (dict(window_size=(2,)), "window_size: expected a pair"),
    (dict(window_size=(-2, 0)), "window_size: expected a pair"),
    (dict(window_size=(1.5, 0)), "window_size: expected a pair"),
    (dict(window_size=(True, 0)), "window_size: expected a pair"),
])
def test_bad_causal_window_values_raise(kw, match):
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=4, seed=1)
    with pytest.raises(ParamInvalidError, match=match):
        attnops.flash_attention(q, k, v, **kw)
