"""``torch_npu.atb.npu_multi_head_latent_attention`` (ATB MultiLatentAttention, the ``krope_ctkv`` cache mode):
MLA decode over paged caches kept as two parts, the latent ``ctkv [num_blocks, block_size, kv_heads, Dc]`` and the
rotary ``k_rope [num_blocks, block_size, kv_heads, Dr]``. Query token ``i`` (``q_nope [T, N, Dc]``,
``q_rope [T, N, Dr]``) attends to the first ``context_lens[i]`` tokens of its sequence (``block_tables[i]``):
``softmax(qk_scale * (q_nope ctkv^T + q_rope k_rope^T)) ctkv``. With ``return_lse`` it also gives the log-sum-exp of
each row's scaled scores (natural log, ``[T, N, 1]`` in the query's dtype), which ring attention merges with."""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from ._common import reject_unsupported, with_overloads
from .atb import _write
from .kv_cache import gather_sequences

CACHE_MODES = (None, "krope_ctkv")
CALC_TYPES = (None, "calc_type_undefined", "calc_type_ring")


def npu_multi_head_latent_attention(q_nope: Tensor, q_rope: Tensor, ctkv: Tensor, k_rope: Tensor,
                                    block_tables: Tensor, context_lens, q_headnum: int, qk_scale: float,
                                    kv_headnum: int, return_lse: bool = False, *, mask: Tensor | None = None,
                                    qseqlen: Tensor | None = None, qk_descale: Tensor | None = None,
                                    pv_descale: Tensor | None = None, mask_type: str | None = None,
                                    calc_type: str | None = None, cache_mode: str | None = None,
                                    workspace: Tensor | None = None, output: Tensor | None = None,
                                    lse: Tensor | None = None):
    """The attention output ``[T, N, Dc]`` (written into ``output`` when given), and with ``return_lse`` the pair
    ``(output, lse)`` (``lse`` written when given). ``mask_type`` "undefined" only; ``calc_type`` undefined or
    "calc_type_ring" (same result; the ring form is the one that returns the lse on the NPU); the int8 NZ cache
    mode and its descales are not supported; ``workspace`` is accepted and unused."""
    from ..ops.flash_attention import flash_attention

    reject_unsupported(mask=mask, qseqlen=qseqlen, qk_descale=qk_descale, pv_descale=pv_descale)
    require(mask_type in (None, "undefined", "mask_type_undefined"), "mask_type", '"undefined" (no mask)', mask_type)
    require(calc_type in CALC_TYPES, "calc_type", f"one of {list(CALC_TYPES)}", calc_type)
    require(cache_mode in CACHE_MODES, "cache_mode", '"krope_ctkv"', cache_mode)
    heads = check_int("q_headnum", q_headnum, lo=1)
    kv_heads = check_int("kv_headnum", kv_headnum, lo=1)
    check_tensor("q_nope", q_nope, ndim=3, shape=(None, heads, None))
    check_tensor("q_rope", q_rope, ndim=3, shape=(q_nope.shape[0], heads, None), device=q_nope.device)
    check_tensor("ctkv", ctkv, ndim=4, shape=(None, None, kv_heads, q_nope.shape[2]), device=q_nope.device)
    check_tensor("k_rope", k_rope, ndim=4, shape=(*ctkv.shape[:3], q_rope.shape[2]), device=q_nope.device)
    lens = int_list("context_lens", context_lens)
    tokens = q_nope.shape[0]
    require(len(lens) == tokens, "context_lens", f"one length per query token ({tokens})", lens)
    latent, rope = gather_sequences(ctkv, k_rope, block_tables, lens)
    result = flash_attention(torch.cat([q_nope, q_rope], -1), torch.cat([latent, rope], -1), latent, layout="TND",
                             scale=check_scale("qk_scale", qk_scale), actual_seq_qlen=list(range(1, tokens + 1)),
                             actual_seq_kvlen=list(itertools.accumulate(lens)), return_stats=True)
    out = result.out if output is None else output
    if output is not None:
        _write(output, result.out)
    if not return_lse:
        return out
    row_lse = (result.softmax_max[..., :1] + result.softmax_sum[..., :1].log()).to(q_nope.dtype)
    if lse is None:
        return out, row_lse
    check_tensor("lse", lse, shape=tuple(row_lse.shape), device=q_nope.device)
    lse.copy_(row_lse)
    return out, lse


def _npu_multi_head_latent_attention_get_workspace(q_nope: Tensor, *args, **kwargs) -> Tensor:
    """The workspace :func:`npu_multi_head_latent_attention` needs: an empty uint8 tensor (attnops needs none)."""
    check_tensor("q_nope", q_nope)
    return torch.empty(0, dtype=torch.uint8, device=q_nope.device)


npu_multi_head_latent_attention = with_overloads(npu_multi_head_latent_attention)
_npu_multi_head_latent_attention_get_workspace = with_overloads(_npu_multi_head_latent_attention_get_workspace)
