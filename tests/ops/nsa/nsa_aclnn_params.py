"""Valid base parameters of the five aclnn NSA operators, in the aclnn parameter order (dicts keyed by the
signature names), for the aclnn value, two-phase and validation tests."""
from __future__ import annotations

import torch

from attnops import aclnn
from tests.ops.nsa.nsa_helpers import randn

OPS = {
    "nsa_compress": (aclnn.nsa_compress, aclnn.nsa_compress_get_workspace_size),
    "nsa_compress_grad": (aclnn.nsa_compress_grad, aclnn.nsa_compress_grad_get_workspace_size),
    "nsa_selected_attention": (aclnn.nsa_selected_attention, aclnn.nsa_selected_attention_get_workspace_size),
    "nsa_selected_attention_grad": (aclnn.nsa_selected_attention_grad,
                                    aclnn.nsa_selected_attention_grad_get_workspace_size),
    "nsa_compress_attention": (aclnn.nsa_compress_attention, aclnn.nsa_compress_attention_get_workspace_size),
}
SELECTED_OPS = ("nsa_selected_attention", "nsa_selected_attention_grad")
COMPRESS_OPS = ("nsa_compress", "nsa_compress_grad")
H = torch.float16
CAUSAL = torch.ones(64, 64, dtype=torch.bool).triu(1)


def compress_params(*, n=2, d=16, block=16, stride=16, lens=(16, 48), dtype=H):
    t = sum(lens)
    return dict(input=randn(t, n, d, dtype=dtype, seed=1), weight=randn(block, n, dtype=dtype, seed=2),
                act_seq_len=list(_cum(lens)), layout="TND", compress_block_size=block, compress_stride=stride,
                act_seq_len_type=0)


def compress_grad_params(*, n=2, d=16, block=32, stride=16, lens=(32, 48), dtype=H):
    t = sum(lens)
    rows = sum(0 if s < block else (s - block) // stride + 1 for s in lens)
    return dict(output_grad=randn(rows, n, d, dtype=dtype, seed=3), input=randn(t, n, d, dtype=dtype, seed=1),
                weight=randn(block, n, dtype=dtype, seed=2), act_seq_len=list(_cum(lens)),
                compress_block_size=block, compress_stride=stride, act_seq_len_type=0, layout="TND")


def _cum(lens):
    acc = 0
    for n in lens:
        acc += n
        yield acc


def selected_inputs(*, n1=2, n2=1, d=192, dv=128, q_lens=(2, 4), kv_lens=(32, 48), bs=16, count=2, dtype=H):
    q = randn(sum(q_lens), n1, d, dtype=dtype, seed=4)
    k = randn(sum(kv_lens), n2, d, dtype=dtype, seed=5)
    v = randn(sum(kv_lens), n2, dv, dtype=dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    rows = []
    for sq, skv in zip(q_lens, kv_lens):
        nblk = max(skv // bs, 1)
        for _ in range(sq):
            if nblk >= count:  # distinct blocks
                rows.append(torch.stack([torch.randperm(nblk, generator=g)[:count] for _ in range(n2)]))
            else:  # (invalid configurations only)
                rows.append(torch.randint(0, nblk, (n2, count), generator=g))
    topk = torch.stack(rows).to(torch.int32)
    return q, k, v, topk


def selected_params(**kw):
    q_lens, kv_lens = kw.get("q_lens", (2, 4)), kw.get("kv_lens", (32, 48))
    bs, count = kw.get("bs", 16), kw.get("count", 2)
    q, k, v, topk = selected_inputs(**kw)
    return dict(query=q, key=k, value=v, topk_indices=topk, atten_mask=CAUSAL, actual_seq_qlen=list(_cum(q_lens)),
                actual_seq_kvlen=list(_cum(kv_lens)), scale_value=q.shape[-1] ** -0.5, head_num=q.shape[1],
                input_layout="TND", sparse_mode=2, selected_block_size=bs, selected_block_count=count)


def selected_grad_params(*, forward=False, **kw):
    """Grad parameters; the forward outputs come from the aclnn forward with ``forward=True``, else they are
    random tensors of the right shapes and dtypes (so that invalid configurations can be built)."""
    p = selected_params(**kw)
    q, v = p["query"], p["value"]
    if forward:
        smax, ssum, out = aclnn.nsa_selected_attention(*p.values())
    else:
        out = randn(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, seed=12)
        smax = randn(q.shape[0], q.shape[1], 8, seed=13)
        ssum = randn(q.shape[0], q.shape[1], 8, seed=14).abs() + 1
    dy = randn(*out.shape, dtype=out.dtype, seed=8)
    return dict(query=p["query"], key=p["key"], value=p["value"], attention_out=out, attention_out_grad=dy,
                softmax_max=smax, softmax_sum=ssum, topk_indices=p["topk_indices"],
                actual_seq_qlen=p["actual_seq_qlen"], actual_seq_kvlen=p["actual_seq_kvlen"],
                atten_mask=p["atten_mask"], scale_value=p["scale_value"],
                selected_block_size=p["selected_block_size"], selected_block_count=p["selected_block_count"],
                head_num=p["head_num"], input_layout="TND", sparse_mode=p["sparse_mode"])


def compress_attention_params(*, n1=2, n2=1, d=32, dv=16, q_lens=(2, 6), cmp_lens=(5, 7), block=32, stride=16,
                              sel_block=32, count=2, dtype=H):
    m = sel_block // stride
    sel = [-(-c // m) for c in cmp_lens]
    mask = torch.zeros(max(q_lens), max(cmp_lens), dtype=torch.bool)
    mask[0, 1:] = True
    tmask = torch.zeros(max(q_lens), max(sel), dtype=torch.bool)
    tmask[:, 0] = True
    return dict(query=randn(sum(q_lens), n1, d, dtype=dtype, seed=9),
                key=randn(sum(cmp_lens), n2, d, dtype=dtype, seed=10),
                value=randn(sum(cmp_lens), n2, dv, dtype=dtype, seed=11), atten_mask=mask, topk_mask=tmask,
                actual_seq_qlen=list(_cum(q_lens)), actual_cmp_seq_kvlen=list(_cum(cmp_lens)),
                actual_sel_seq_kvlen=list(_cum(sel)), scale_value=d ** -0.5, head_num=n1, input_layout="TND",
                sparse_mode=1, compress_block_size=block, compress_stride=stride, select_block_size=sel_block,
                select_block_count=count)


BASE = {
    "nsa_compress": compress_params,
    "nsa_compress_grad": compress_grad_params,
    "nsa_selected_attention": selected_params,
    "nsa_selected_attention_grad": selected_grad_params,
    "nsa_compress_attention": compress_attention_params,
}


def base_params(op, **kw):
    return BASE[op](**kw)
