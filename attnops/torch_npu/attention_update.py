"""torch_npu's merge helpers for context parallelism and chunked prefill, on :mod:`attnops.ops.attention_update`."""
from __future__ import annotations

from ..ops.attention_update import attention_update, ring_attention_update
from ._common import with_overloads


def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                              cur_softmax_sum, *, actual_seq_qlen=None, input_layout="SBH", input_softmax_layout=""):
    """``(attn_out, softmax_max, softmax_sum)`` of two partial results over disjoint keys.

    SBH: outputs ``[S, B, H]``, statistics ``[B, N, S, 8]``. TND: outputs ``[T, N, D]``, statistics ``[T, N, 8]``
    in FA's blocked layout (``input_softmax_layout=""``, with ``actual_seq_qlen`` an int64 tensor of prefix sums
    starting at 0) or true TND (``"TND"``).
    """
    return ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                                 cur_softmax_sum, actual_seq_qlen=actual_seq_qlen, input_layout=input_layout,
                                 input_softmax_layout=input_softmax_layout)


def npu_attention_update(lse, local_out, update_type):
    """``(out, lse_out)``: merge ``local_out[i] [B*S*N, D]`` by their fp32 ``lse[i] [B*S*N]``; ``lse_out`` is
    computed for both ``update_type`` values (torch_npu defines it for 1 only)."""
    return attention_update(lse, local_out, update_type)


npu_ring_attention_update = with_overloads(npu_ring_attention_update)
npu_attention_update = with_overloads(npu_attention_update)
