"""FlashAttention's tolerance rule: an implementation may err at most ``factor`` times as much as plain
PyTorch in the same low precision (the baseline), plus a floor of rounding error that scales with the precision,
the reduction length and the magnitude of the values, never with one machine's summation order.

    err      = max|actual   - golden|        (float64)
    base_err = max|baseline - golden|
    floor    = 2 * max|(g_low + 0.3 - 0.3) - g_low|          output rounding, g_low = golden.to(actual.dtype)
             + 2 * eps(acc) * sqrt(K) * max(1, max|golden|)   accumulation
    pass iff err <= factor * base_err + floor

``K`` (``reduction``) is the number of terms summed into one output element along the computation's chain of
reductions (attention: the head dim of the scores plus the keys of ``P V``; 1 for an elementwise result).
``eps(acc)`` is the machine epsilon of the accumulation dtype: fp32 for fp16/bf16/fp32 results (attnops computes
in fp32), fp64 for fp64. A sum of ``K`` rounded terms errs by about ``eps * sqrt(K)`` times the magnitude of its
partial sums (their rounding errors add up like a random walk); the factor 2 covers the maximum over elements. The
magnitude is the golden's, but at least 1: the products are formed from unit-scale inputs, and a result that cancels
to about 0 (a gradient through a one-key softmax) still carries their rounding. The first term is the rounding of
the result to its own dtype (at least that of 0.3, so results near zero keep a floor).
The baseline term carries the rest, so the floor only matters where the baseline happens to round luckily: a
summation order (SIMD width, blocking) that differs from the baseline's then stays within the bound on every CPU.

Forward outputs use factor 2, gradients factor 3.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .golden import seq_lengths

__all__ = ["assert_close_to_golden", "max_abs_err", "default_floor", "attention_reductions",
           "fa_reductions", "fia_reduction", "sfa_reductions", "kl_reductions", "nsa_layer_reduction"]


def max_abs_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| in float64 (0 for empty tensors; equal infinities count as 0; NaN propagates)."""
    if tuple(a.shape) != tuple(b.shape):
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    diff = torch.where(a64 == b64, torch.zeros_like(a64), (a64 - b64).abs())
    if bool(torch.isnan(diff).any()):
        return float("nan")
    return float(diff.max())


def default_floor(golden: Tensor, dtype: torch.dtype, reduction: int = 1) -> float:
    """The output rounding of ``dtype`` at the golden's magnitude plus the accumulation error of a ``reduction``-term
    sum at that magnitude, at least 1 (the module's formula; infinities and NaN of the golden are left out)."""
    if reduction < 1:
        raise ValueError(f"reduction: expected a number of summed terms >= 1, got {reduction}")
    if golden.numel() == 0:
        return 0.0
    g = golden.detach().to(dtype)
    r = ((g + 0.3 - 0.3) - g).abs().to(torch.float64)
    rounding = 2.0 * float(torch.where(torch.isfinite(r), r, torch.zeros_like(r)).max())
    g64 = golden.detach().to(torch.float64).abs()
    magnitude = max(1.0, float(torch.where(torch.isfinite(g64), g64, torch.zeros_like(g64)).max()))
    eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps if dtype.is_floating_point else 0.0
    return rounding + 2.0 * eps * math.sqrt(reduction) * magnitude


def attention_reductions(d: int, dv: int, sq: int, skv: int) -> dict[str, int]:
    """``reduction`` of each attention output (``[.., Sq, D]`` queries, ``Skv`` keys, value dim ``Dv``): the scores
    sum over D, the output and its statistics over the keys, dP over Dv, dV and dK over the queries, dQ over the
    keys; the chain's lengths add up. Keys: out, softmax_max, softmax_sum, lse, dq, dk, dv, dpse."""
    fwd = d + skv
    return dict(out=fwd, softmax_max=fwd, softmax_sum=fwd, lse=fwd, dq=d + dv + skv, dk=d + dv + sq, dv=d + sq,
                dpse=d + dv)


_SEQ_DIM = {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0}


def fa_reductions(query, key, value, *, layout: str, head_num: int, actual_seq_qlen=None,
                  actual_seq_kvlen=None) -> dict[str, int]:
    """:func:`attention_reductions` of a FlashAttention call in ``layout`` (TND: its longest sequences)."""
    if layout == "TND":
        sq = max(seq_lengths(actual_seq_qlen), default=1)
        skv = max(seq_lengths(actual_seq_kvlen), default=1)
    else:
        sq, skv = query.shape[_SEQ_DIM[layout]], key.shape[_SEQ_DIM[layout]]
    packed = layout in ("BSH", "SBH")
    d = query.shape[-1] // head_num if packed else query.shape[-1]
    dv = value.shape[-1] // (key.shape[-1] // d) if packed else value.shape[-1]
    return attention_reductions(d, dv, sq, skv)


def _fia_key_len(key, layout: str) -> int:
    """Longest key sequence a FusedInferAttention key (tensor or list of per-batch tensors) in ``layout`` holds."""
    if isinstance(key, (list, tuple)):
        return max(_fia_key_len(k, layout) for k in key)
    if layout == "TND":
        return key.shape[0]
    return key.shape[2] if layout == "BNSD" else key.shape[1]


def fia_reduction(query, key, *, num_heads=1, input_layout="BSH", actual_seq_lengths_kv=None,
                  block_table=None, block_size=0, key_shared_prefix=None, actual_shared_prefix_len=None,
                  query_rope=None, **_) -> int:
    """``reduction`` of a FusedInferAttention output or lse (seed-named keywords): the scores' head dim (plus the
    rope dim) and the most keys one query row attends (longest ``actual_seq_lengths_kv``, else the key's length;
    a paged cache: its block table's reach), plus the shared prefix."""
    d = query.shape[-1] // int(num_heads) if input_layout == "BSH" else query.shape[-1]
    if query_rope is not None:
        d += query_rope.shape[-1] // int(num_heads) if input_layout == "BSH" else query_rope.shape[-1]
    if actual_seq_lengths_kv is not None:
        lens = [int(x) for x in torch.as_tensor(actual_seq_lengths_kv).reshape(-1).tolist()]
        # TND/NTD lengths are cumulative, but a paged cache takes per-batch lengths
        cumulative = input_layout.split("_")[0] in ("TND", "NTD") and block_table is None
        skv = max(seq_lengths(lens) if cumulative else lens, default=1)
    elif block_table is not None:
        skv = block_table.shape[-1] * int(block_size)
    else:
        skv = _fia_key_len(key, input_layout.split("_")[0])
    if key_shared_prefix is not None:
        skv += (int(torch.as_tensor(actual_shared_prefix_len).reshape(-1)[0]) if actual_shared_prefix_len is not None
                else _fia_key_len(key_shared_prefix, input_layout.split("_")[0]))
    return d + max(skv, 1)


def sfa_reductions(q_lens, heads: int, d: int, dr: int, keys_per_row: int, *, sinks=False) -> dict[str, int]:
    """The tolerance rule's ``reduction`` of sparse flash attention with K = V (``[Lq, heads, d]`` queries, rope dim
    ``dr``, at most ``keys_per_row`` selected keys and the sink): the scores sum over ``d + dr``; a key's
    gradient over every head of the rows that select it, twice for the shared K = V (dk: key and value
    gradients; dk_rope: the key gradient only). Keys: out, max, sum, dq, dq_rope, dk, dk_rope."""
    rows = max(max(q_lens, default=1), 1) * heads
    red = attention_reductions(d + dr, d, rows, max(keys_per_row + int(sinks), 1))
    return dict(out=red["out"], max=red["softmax_max"], sum=red["softmax_sum"], dq=red["dq"], dq_rope=red["dq"],
                dk=red["dk"] + rows, dk_rope=red["dk"])


def kl_reductions(q_len: int, heads: int, d: int, dr: int, index_heads: int, di: int, count: int) -> dict[str, int]:
    """The tolerance rule's ``reduction`` of the indexer KL loss of one batch (``q_len`` rows, ``count`` entries a
    row): the attention probabilities sum over ``d + dr`` and the ``heads``, the index scores over ``di`` and the
    ``index_heads``, the softmax over the entries; then the loss over every row's entries, ``d_key_index`` over the
    index heads of every row, ``d_query_index`` and ``d_weights`` over one row's entries."""
    chain = d + dr + heads + di + index_heads + count
    return dict(loss=chain + max(q_len, 1) * count, d_query_index=chain + count,
                d_key_index=chain + max(q_len, 1) * index_heads, d_weights=chain + count)


def nsa_layer_reduction(seq: int, d: int, *, block: int, stride: int, select_block: int, count: int, window: int,
                        **_) -> int:
    """``reduction`` of the NSA layer's output (``seq`` tokens, head dim ``d``, the layer's branch settings): key
    compression over a block, the scores over ``d``, ``P V`` over the longest branch (compressed keys, selected
    blocks, window), the gated sum of the three branches."""
    cmp_keys = max(0, (seq - block) // stride + 1)
    return block + d + max(cmp_keys, count * select_block, window) + 3


def assert_close_to_golden(name, actual, golden, baseline, *, factor: float = 2.0, reduction: int = 1,
                           floor=None) -> None:
    """Raise AssertionError unless max|actual-golden| <= factor*max|baseline-golden| + floor; ``floor`` defaults
    to :func:`default_floor` of the golden, the actual's dtype and ``reduction`` (summed terms per element)."""
    if actual is None or golden is None:
        if actual is None and golden is None:
            return
        raise AssertionError(f"{name}: actual is {'None' if actual is None else 'a tensor'} "
                             f"but golden is {'None' if golden is None else 'a tensor'}")
    err = max_abs_err(actual, golden)
    base_err = 0.0 if baseline is None else max_abs_err(baseline, golden)
    if floor is None:
        floor = default_floor(golden, actual.dtype, reduction)
    bound = factor * base_err + floor
    if not err <= bound:  # NaN fails
        raise AssertionError(f"{name}: err={err:.6g} > factor*base_err + floor = {factor}*{base_err:.6g} + "
                             f"{floor:.6g} = {bound:.6g} (err = max|actual-golden|, "
                             f"base_err = max|baseline-golden|, floor={floor:.6g})")
