"""Stand-ins for MindSpeed's own compiled attention ops (what its op builders' ``load()`` returns), on attnops.

MindSpeed builds ``npu_fusion_attention_v2`` / ``npu_fusion_attention_grad_v2`` (``FusionAttentionV2OpBuilder``) and
``npu_ring_attention_update`` (``RingAttentionUpdateOpBuilder``) as C++ extensions and calls them positionally.
Without an NPU, make the builders return :data:`OPS`::

    import mindspeed.op_builder as op_builder
    from attnops.torch_npu.mindspeed_ops import OPS
    op_builder.FusionAttentionV2OpBuilder.load = lambda self: OPS
    op_builder.RingAttentionUpdateOpBuilder.load = lambda self: OPS

The functions keep the extensions' positional signatures and return what they return.
"""
from __future__ import annotations

import types

from .attention_update import npu_ring_attention_update as _ring_update
from .fusion_attention import npu_fusion_attention_grad_v2 as _grad_v2
from .fusion_attention import npu_fusion_attention_v2 as _forward_v2


def npu_fusion_attention_v2(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                            keep_prob, pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen,
                            actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, pse_type, q_start_idx,
                            kv_start_idx):
    """``(attention_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels)``."""
    return _forward_v2(query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
                       atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tokens=pre_tokens,
                       next_tokens=next_tokens, inner_precise=inner_precise, prefix=prefix,
                       actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                       gen_mask_parallel=gen_mask_parallel, sync=sync, pse_type=pse_type, q_start_idx=q_start_idx,
                       kv_start_idx=kv_start_idx)


def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask,
                                 softmax_max, softmax_sum, softmax_in, attention_in, scale, keep_prob, pre_tokens,
                                 next_tokens, inner_precise, seed, offset, numels, prefix, actual_seq_qlen,
                                 actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, pse_type, q_start_idx,
                                 kv_start_idx):
    """``(dq, dk, dv, dpse)``."""
    return _grad_v2(query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask,
                    atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in,
                    attention_in=attention_in, scale_value=scale, keep_prob=keep_prob, pre_tokens=pre_tokens,
                    next_tokens=next_tokens, inner_precise=inner_precise, seed=seed, offset=offset, numels=numels,
                    prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                    sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel, sync=sync, pse_type=pse_type,
                    q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)[:4]


def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                              cur_softmax_sum, actual_seq_qlen=None, layout="SBH"):
    """``(attn_out, softmax_max, softmax_sum)`` of two partial results."""
    return _ring_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                        cur_softmax_sum, actual_seq_qlen=actual_seq_qlen, input_layout=layout)


OPS = types.SimpleNamespace(npu_fusion_attention_v2=npu_fusion_attention_v2,
                            npu_fusion_attention_grad_v2=npu_fusion_attention_grad_v2,
                            npu_ring_attention_update=npu_ring_attention_update)
