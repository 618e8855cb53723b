"""Dense golden of the NSA layer and of :class:`attnops.nn.NativeSparseAttention`, composed from the operator
goldens (:mod:`attnops.testing.golden_nsa`, :func:`attnops.testing.golden.fa_forward`) as the layer's docstring
specifies; independent of :mod:`attnops.ops`. Computed in ``dtype`` (float64: the golden; lower: the baseline).

Every sequence length must be a multiple of ``select_block`` with at least ``count`` selection blocks (the
operators' own constraints): then no padding is involved, and a top-k slot on a block after the token is fully
masked by causality, so it needs no ``-1``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import golden_nsa as G
from .golden import fa_forward

_TRIU = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # sparse_mode 4's canonical mask


def _cum(lens: list[int]) -> list[int]:
    return torch.tensor(lens).cumsum(0).tolist()


def native_sparse_attention(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, wk: Tensor, wv: Tensor,
                            lens: list[int], *, block: int, stride: int, select_block: int, count: int, window: int,
                            local_blocks: int, scale: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """Packed ``q [T, N1, D]``, ``k [T, N2, D]``, ``v [T, N2, Dv]``, ``gates [T, N1, 3]``, compression weights
    ``[block, N2]``; sequences of ``lens`` tokens -> ``[T, N1, Dv]``."""
    for n in lens:
        if n % select_block or n // select_block < count:
            raise ValueError(f"golden layer: length {n} must be a multiple of select_block={select_block} with at "
                             f"least count={count} blocks")
    act = _cum(lens)
    k_cmp, v_cmp = G.nsa_compress(k, wk, block, stride, act, dtype=dtype), G.nsa_compress(v, wv, block, stride, act,
                                                                                       dtype=dtype)
    cmp_lens = [0 if n < block else (n - block) // stride + 1 for n in lens]
    rows = torch.arange(max(lens)).unsqueeze(1)
    mask = (torch.arange(max(cmp_lens)) * stride + block - 1).unsqueeze(0) > rows  # complete blocks only
    own, cols = rows // select_block, torch.arange(max(lens) // select_block).unsqueeze(0)
    forced = (cols == 0) | ((cols <= own) & (cols > own - local_blocks))
    sel = _cum([-(-c // (select_block // stride)) for c in cmp_lens])
    o_cmp, topk, _, _ = G.nsa_compress_attention(q, k_cmp, v_cmp, scale, q.shape[1], block, stride, select_block,
                                                 count, mask, forced, act, _cum(cmp_lens), sel, dtype=dtype)
    o_slc = G.nsa_selected_attention(q, k, v, topk, scale, select_block, act, act, True, dtype=dtype)[0]
    out = gates[..., 0:1].to(dtype) * o_cmp + gates[..., 1:2].to(dtype) * o_slc
    if window > 0:
        o_win = fa_forward(q, k, v, head_num=q.shape[1], input_layout="TND", atten_mask=_TRIU, scale=scale,
                           pre_tokens=window - 1, next_tokens=0, actual_seq_qlen=act, actual_seq_kvlen=act,
                           sparse_mode=4, dtype=dtype)[0]
        out = out + gates[..., 2:3].to(dtype) * o_win
    return out


def _rotary(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE: pairs ``(i, i + D/2)`` rotated by ``pos * theta**(-2i/D)``."""
    d = x.shape[-1]
    angle = pos.to(x.dtype).view(-1, 1, 1) * theta ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)


def nsa_module(module, x: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """:class:`attnops.nn.NativeSparseAttention` on ``x [B, S, hidden]`` (every row a sequence)."""
    b, s, _ = x.shape
    n1, n2, d = module.num_heads, module.num_kv_heads, module.head_dim
    cfg = module.config
    w = {name: p.detach().to(dtype) for name, p in module.named_parameters()}
    xs = x.to(dtype).flatten(0, 1)
    pos = torch.arange(s).repeat(b)
    q = _rotary((xs @ w["q_proj.weight"].T).view(-1, n1, d), pos, module.rope_theta)
    k = _rotary((xs @ w["k_proj.weight"].T).view(-1, n2, d), pos, module.rope_theta)
    v = (xs @ w["v_proj.weight"].T).view(-1, n2, d)
    gates = torch.sigmoid(xs @ w["g_proj.weight"].T + w["g_proj.bias"]).view(-1, n1, 3)
    block = cfg["compress_block_size"]
    mean = torch.full((block, n2), 1.0 / block, dtype=dtype)
    wk, wv = (w.get("compress_weight_k", mean), w.get("compress_weight_v", mean))
    out = native_sparse_attention(q, k, v, gates, wk, wv, [s] * b, block=block, stride=cfg["compress_stride"],
                                  select_block=cfg["select_block_size"], count=cfg["select_block_count"],
                                  window=cfg["window_size"], local_blocks=cfg["local_blocks"], scale=d ** -0.5,
                                  dtype=dtype)
    return (out.flatten(-2) @ w["o_proj.weight"].T).view(b, s, -1)
