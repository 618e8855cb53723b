"""Shared test helpers: inputs in every layout, and the check of a FlashAttention call against the fp64 golden.

:func:`check_fa` runs the Pythonic forward (``return_stats=True``) and :func:`attnops.flash_attention_backward`,
then judges every output with FlashAttention's tolerance rule (``attnops.testing.compare``): the error against
the float64 golden may be at most 2x (forward) / 3x (gradients) the error of the golden's formula evaluated in
the input dtype, plus a floor of rounding error for the dtype and each output's reduction length. The golden
always gets copies of the inputs taken before the call, so an implementation that mutated its inputs is still
judged on the inputs the caller passed.
"""
from __future__ import annotations

import torch

import attnops
from attnops._core.dropout import DropoutSpec, keep_mask, pack_bits
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import FLT_LOWEST, FLT_MAX, fa_backward, fa_forward, seq_lengths

F64 = torch.float64
INT_MAX = 2147483647
TRIU2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
_RECT = torch.zeros(1024, 2048, dtype=torch.bool)
_RECT[:, 1024:] = True
PREFIX3072 = torch.cat([TRIU2048, _RECT])  # the canonical compressed mask of sparse_mode 6

__all__ = ["F64", "INT_MAX", "TRIU2048", "PREFIX3072", "FLT_MAX", "FLT_LOWEST", "randn", "noncontig",
           "make_qkv", "to_layout", "cum", "score_numel", "random_keep", "check_fa", "golden_kwargs"]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    """Deterministic normal samples (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)


def noncontig(x: torch.Tensor, how: str = "transpose") -> torch.Tensor:
    """The same values as ``x`` in a non-contiguous view: reversed strides, or every other element."""
    if how == "transpose":
        perm = list(range(x.dim()))[::-1]
        y = x.permute(perm).contiguous().permute(perm)
    elif how == "strided":
        y = torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]
    else:
        raise ValueError(how)
    assert torch.equal(y, x) and (y.numel() <= 1 or not y.is_contiguous())
    return y


def cum(lens) -> list[int]:
    """Per-batch lengths -> CANN cumulative list (no leading 0)."""
    out, acc = [], 0
    for n in lens:
        acc += n
        out.append(acc)
    return out


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, S, N, D] -> dense layout."""
    if layout == "BSND":
        return x
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.flatten(2).contiguous()
    if layout == "SBH":
        return x.permute(1, 0, 2, 3).flatten(2).contiguous()
    raise ValueError(layout)


def make_qkv(layout: str, *, b=2, n1=2, n2=None, sq=5, skv=None, d=8, dv=None, q_lens=None, kv_lens=None,
             t_extra=0, dtype=torch.float32, seed=0, scale=1.0):
    """(query, key, value, dy) in ``layout``; TND uses ``q_lens``/``kv_lens`` and ``t_extra`` unused tail rows."""
    n2 = n1 if n2 is None else n2
    skv = sq if skv is None else skv
    dv = d if dv is None else dv
    if layout == "TND":
        tq, tk = sum(q_lens) + t_extra, sum(kv_lens) + t_extra
        q = randn(tq, n1, d, dtype=dtype, seed=seed, scale=scale)
        k = randn(tk, n2, d, dtype=dtype, seed=seed + 1, scale=scale)
        v = randn(tk, n2, dv, dtype=dtype, seed=seed + 2)
        dy = randn(tq, n1, dv, dtype=dtype, seed=seed + 3)
        return q, k, v, dy
    q = to_layout(randn(b, sq, n1, d, dtype=dtype, seed=seed, scale=scale), layout)
    k = to_layout(randn(b, skv, n2, d, dtype=dtype, seed=seed + 1, scale=scale), layout)
    v = to_layout(randn(b, skv, n2, dv, dtype=dtype, seed=seed + 2), layout)
    dy = to_layout(randn(b, sq, n1, dv, dtype=dtype, seed=seed + 3), layout)
    return q, k, v, dy


def _dense_bs(x: torch.Tensor, layout: str) -> tuple[int, int]:
    if layout in ("BSND", "BSH"):
        return x.shape[0], x.shape[1]
    if layout == "BNSD":
        return x.shape[0], x.shape[2]
    return x.shape[1], x.shape[0]  # SBH


def score_numel(query, key, *, layout, head_num, actual_seq_qlen=None, actual_seq_kvlen=None) -> int:
    """Number of dropout-mask elements: ``N1 * sum_b Sq_b * Skv_b``."""
    if layout == "TND":
        lq, lk = seq_lengths(actual_seq_qlen), seq_lengths(actual_seq_kvlen)
        return head_num * sum(a * c for a, c in zip(lq, lk))
    bq, sq = _dense_bs(query, layout)
    _, skv = _dense_bs(key, layout)
    return head_num * bq * sq * skv


def random_keep(numel: int, keep_prob: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(numel, generator=g) < keep_prob


_GOLDEN_KEYS = ("head_num", "pse", "atten_mask", "keep_prob", "pre_tokens", "next_tokens", "prefix",
                "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "pse_type", "q_start_idx", "kv_start_idx",
                "softmax_layout")


def golden_kwargs(kw: dict, *, drop_keep=None) -> dict:
    """The golden's keyword arguments for a Pythonic call's keyword arguments."""
    g = {key: kw[key] for key in _GOLDEN_KEYS if key in kw}
    g["input_layout"] = kw.get("layout", "BNSD")
    g["scale"] = kw["scale"]
    if "cu_seqlens_q" in kw:
        g["actual_seq_qlen"] = list(kw["cu_seqlens_q"])[1:]
        g["actual_seq_kvlen"] = list(kw["cu_seqlens_k"])[1:]
    if drop_keep is not None:
        g["drop_keep"] = drop_keep
    return g


def _clone(x):
    return None if x is None else x.detach().clone()


def check_fa(query, key, value, dy=None, *, backward=True, drop="mask", drop_seed=0, **kw):
    """Run the Pythonic forward + backward and assert every output against the fp64 golden.

    ``kw`` are :func:`attnops.flash_attention` keywords (``scale`` and ``head_num`` required). With
    ``keep_prob`` < 1, ``drop="mask"`` passes a random packed ``drop_mask``; ``drop="seed"`` passes
    ``seed=drop_seed`` (the golden gets the Philox keep bits of the returned seed/offset).
    Returns a dict with the results (``out``, ``smax``, ``ssum``, ``dq``, ``dk``, ``dv``, ``dpse``) and the goldens.
    """
    assert "scale" in kw and "head_num" in kw
    layout = kw.get("layout", "BNSD")
    gq, gk, gv, gdy, gpse = (_clone(t) for t in (query, key, value, dy, kw.get("pse")))
    kw = dict(kw)
    keep_prob = kw.get("keep_prob", 1.0)
    drop_keep = None
    if keep_prob < 1.0:
        numel = score_numel(query, key, layout=layout, head_num=kw["head_num"],
                            actual_seq_qlen=golden_kwargs(kw).get("actual_seq_qlen"),
                            actual_seq_kvlen=golden_kwargs(kw).get("actual_seq_kvlen"))
        if drop == "mask":
            drop_keep = random_keep(numel, keep_prob, seed=drop_seed)
            kw["drop_mask"] = pack_bits(drop_keep)
        else:
            kw["seed"] = drop_seed
    res = attnops.flash_attention(query, key, value, return_stats=True, **kw)
    assert isinstance(res, attnops.FlashAttentionResult)
    if keep_prob < 1.0 and drop == "seed":
        assert res.seed == drop_seed
        drop_keep = keep_mask(DropoutSpec(keep_prob, (), seed=res.seed, offset=res.offset), numel)
    gkw = golden_kwargs({**kw, "pse": gpse}, drop_keep=drop_keep)
    g_out, g_max, g_sum = fa_forward(gq, gk, gv, dtype=F64, **gkw)
    b_out, b_max, b_sum = fa_forward(gq, gk, gv, dtype=query.dtype, **gkw)
    assert res.out.dtype == query.dtype and res.softmax_max.dtype == torch.float32
    red = fa_reductions(query, key, value, layout=layout, head_num=kw["head_num"],
                        actual_seq_qlen=gkw.get("actual_seq_qlen"), actual_seq_kvlen=gkw.get("actual_seq_kvlen"))
    for name, actual, gold, bl in zip(("out", "softmax_max", "softmax_sum"), (res.out, res.softmax_max,
                                                                            res.softmax_sum), (g_out, g_max, g_sum),
                                      (b_out, b_max, b_sum)):
        assert_close_to_golden(name, actual, gold, bl, factor=2, reduction=red[name])
    result = dict(out=res.out, smax=res.softmax_max, ssum=res.softmax_sum, golden_out=g_out, golden_max=g_max,
                  golden_sum=g_sum, seed=res.seed, offset=res.offset)
    if not backward:
        return result
    assert dy is not None
    bkw = {key_: val for key_, val in kw.items() if key_ != "seed"}
    if keep_prob < 1.0 and drop == "seed":
        bkw.update(seed=res.seed, offset=res.offset)
    dq, dk, dv, dpse = attnops.flash_attention_backward(dy, query, key, value, res.out, res.softmax_max,
                                                        res.softmax_sum, **bkw)
    g = fa_backward(gdy, gq, gk, gv, res.out, dtype=F64, **gkw)  # the operator's contract: D from attention_in
    base = fa_backward(gdy, gq, gk, gv, res.out, dtype=query.dtype, **gkw)
    for name, actual, gold, bl, like in zip(("dq", "dk", "dv", "dpse"), (dq, dk, dv, dpse), g, base,
                                            (query, key, value, kw.get("pse"))):
        if actual is not None:
            assert actual.shape == like.shape and actual.dtype == like.dtype, (name, actual.shape, like.shape)
        assert_close_to_golden(name, actual, gold, bl, factor=3, reduction=red[name])
    result.update(dq=dq, dk=dk, dv=dv, dpse=dpse, golden_grads=g)
    return result
