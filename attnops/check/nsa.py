"""Built-in NSA check cases: the aclnn NSA operators, the Pythonic API and (``via="npu"``, listed by
:mod:`attnops.check.torch_npu`) the torch_npu functions against the independent fp64 golden; the
``native_sparse_attention`` layer, the ``attnops.nn.NativeSparseAttention`` module and its cached decoding against
the golden composed from the operator goldens (:mod:`attnops.testing.golden_nsa_layer`)."""
from __future__ import annotations

import torch

from .. import aclnn, native_sparse_attention, nsa_compress, nsa_selected_attention, torch_npu
from ..testing import golden_nsa as gold
from ..testing import golden_nsa_layer as gold_layer
from ..testing.compare import attention_reductions, nsa_layer_reduction
from .case import CheckCase, Comparison


def _randn(*shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _cum(lens):
    out, acc = [], 0
    for n in lens:
        acc += n
        out.append(acc)
    return out


def _compress(dtype, via, lens, block=32, stride=16, n=2, d=32):
    def run(_backend):
        act = [0] + _cum(lens)
        x, w = _randn(sum(lens), n, d, dtype=dtype, seed=1), _randn(block, n, dtype=dtype, seed=2) / block ** 0.5
        golden = gold.nsa_compress(x, w, block, stride, act)
        base = gold.nsa_compress(x, w, block, stride, act, dtype=dtype)
        dy = _randn(*golden.shape, dtype=dtype, seed=3)
        if via == "aclnn":
            out = aclnn.nsa_compress(x, w, act, "TND", block, stride, 0)
            gi, gw = aclnn.nsa_compress_grad(dy, x, w, act, block, stride, 0, "TND")
        elif via == "npu":
            out = torch_npu.npu_nsa_compress(x, w, block, stride, actual_seq_len=act[1:])
            gi, gw = torch_npu.npu_nsa_compress_grad(dy, x, w, block, stride, actual_seq_len=act[1:])
        else:
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = nsa_compress(xx, ww, block_size=block, stride=stride, actual_seq_len=act)
            out.backward(dy)
            gi, gw = xx.grad, ww.grad
        g_grads = gold.nsa_compress_backward(dy, x, w, block, stride, act)
        b_grads = gold.nsa_compress_backward(dy, x, w, block, stride, act, dtype=dtype)
        # out: one block of tokens; input_grad: the compressed rows a token is in; weight_grad: every row and dim
        return [Comparison("output", out, golden, base, reduction=block),
                Comparison("input_grad", gi, g_grads[0], b_grads[0], 3.0, -(-block // stride)),
                Comparison("weight_grad", gw, g_grads[1], b_grads[1], 3.0, max(1, golden.shape[0] * d))]
    return run


def _topk(q_lens, kv_lens, n2, count, block, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for sq, skv in zip(q_lens, kv_lens):
        nblk = skv // block
        rows.append(torch.stack([torch.stack([torch.randperm(nblk, generator=gen)[:count] for _ in range(n2)])
                                 for _ in range(sq)]) if sq else torch.zeros(0, n2, count, dtype=torch.long))
    return torch.cat(rows).to(torch.int32)


def _selected(dtype, via, q_lens, kv_lens, n1, n2, d, dv, block, count, causal):
    def run(_backend):
        q = _randn(sum(q_lens), n1, d, dtype=dtype, seed=4)
        k = _randn(sum(kv_lens), n2, d, dtype=dtype, seed=5)
        v = _randn(sum(kv_lens), n2, dv, dtype=dtype, seed=6)
        topk = _topk(q_lens, kv_lens, n2, count, block, seed=7)
        scale, qc, kc = d ** -0.5, _cum(q_lens), _cum(kv_lens)
        g_out = gold.nsa_selected_attention(q, k, v, topk, scale, block, qc, kc, causal)
        b_out = gold.nsa_selected_attention(q, k, v, topk, scale, block, qc, kc, causal, dtype=dtype)
        dy = _randn(*g_out[0].shape, dtype=dtype, seed=8)
        if via == "aclnn":
            mask = torch.ones(64, 64, dtype=torch.bool).triu(1) if causal else None
            smax, ssum, out = aclnn.nsa_selected_attention(q, k, v, topk, mask, qc, kc, scale, n1, "TND",
                                                           2 if causal else 0, block, count)
            grads = aclnn.nsa_selected_attention_grad(q, k, v, out, dy, smax, ssum, topk, qc, kc, mask, scale, block,
                                                      count, n1, "TND", 2 if causal else 0)
        elif via == "npu":
            mask = dict(atten_mask=torch.ones(64, 64, dtype=torch.bool).triu(1)) if causal else {}
            lens = dict(actual_seq_qlen=qc, actual_seq_kvlen=kc)
            out, smax, ssum = torch_npu.npu_nsa_select_attention(q, k, v, topk, scale, n1, block, count, **mask,
                                                                 **lens)
            grads = torch_npu.npu_nsa_select_attention_grad(dy, q, k, v, out, smax, ssum, topk, scale, n1, block,
                                                            count, **mask, **lens)
        else:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out, smax, ssum = nsa_selected_attention(qq, kk, vv, topk, select_block_size=block, causal=causal,
                                                     scale=scale, actual_seq_qlen=qc, actual_seq_kvlen=kc,
                                                     return_stats=True)
            out.backward(dy)
            grads = (qq.grad, kk.grad, vv.grad)
        given = out.detach()  # the grad operator forms D = rowsum(dy * out) from the output it is given
        g_grads = gold.nsa_selected_attention_backward(dy, q, k, v, topk, scale, block, qc, kc, causal,
                                                       attention_in=given)
        b_grads = gold.nsa_selected_attention_backward(dy, q, k, v, topk, scale, block, qc, kc, causal, dtype=dtype,
                                                       attention_in=given)
        # a row attends its selected blocks' keys; a key's gradient sums over its GQA group's rows
        red = attention_reductions(d, dv, max(q_lens) * (n1 // n2), count * block)
        cmps = [Comparison(n, a, g, b, reduction=red[r]) for n, r, a, g, b in zip(
            ("attention_out", "softmax_max", "softmax_sum"), ("out", "softmax_max", "softmax_sum"), (out, smax, ssum),
            g_out, b_out)]
        return cmps + [Comparison(n, a, g, b, 3.0, red[n])
                       for n, a, g, b in zip(("dq", "dk", "dv"), grads, g_grads, b_grads)]
    return run


def _compress_attention(dtype, q_lens, cmp_lens, n1, n2, d, dv, block, stride, sel_block, count, via="aclnn"):
    def run(_backend):
        m = sel_block // stride
        sel_lens = [-(-c // m) for c in cmp_lens]
        q = _randn(sum(q_lens), n1, d, dtype=dtype, seed=9)
        k = _randn(sum(cmp_lens), n2, d, dtype=dtype, seed=10)
        v = _randn(sum(cmp_lens), n2, dv, dtype=dtype, seed=11)
        rows = torch.arange(max(q_lens)).view(-1, 1)
        atten_mask = torch.arange(max(cmp_lens)).view(1, -1) * stride + block - 1 > rows * 2  # causal-like
        topk_mask = torch.zeros(max(q_lens), max(sel_lens), dtype=torch.bool)
        topk_mask[:, 0] = True
        args = (d ** -0.5, n1, block, stride, sel_block, count, atten_mask, topk_mask, _cum(q_lens), _cum(cmp_lens),
                _cum(sel_lens))
        if via == "npu":
            out, topk, smax, ssum = torch_npu.npu_nsa_compress_attention(
                q, k, v, d ** -0.5, n1, block, stride, sel_block, count, topk_mask=topk_mask, atten_mask=atten_mask,
                actual_seq_qlen=_cum(q_lens), actual_cmp_seq_kvlen=_cum(cmp_lens), actual_sel_seq_kvlen=_cum(sel_lens))
        else:
            smax, ssum, out, topk = aclnn.nsa_compress_attention(q, k, v, atten_mask, topk_mask, _cum(q_lens),
                                                                 _cum(cmp_lens), _cum(sel_lens), d ** -0.5, n1, "TND",
                                                                 1, block, stride, sel_block, count)
        g = gold.nsa_compress_attention(q, k, v, *args)
        b = gold.nsa_compress_attention(q, k, v, *args, dtype=dtype)
        same = (topk == g[1]).float().mean()
        red = attention_reductions(d, dv, max(q_lens), max(cmp_lens))["out"]
        return [Comparison("attention_out", out, g[0], b[0], reduction=red),
                Comparison("softmax_max", smax, g[2], b[2], reduction=red),
                Comparison("softmax_sum", ssum, g[3], b[3], reduction=red),
                Comparison("topk_indices agreement", same.reshape(1).double(), torch.ones(1, dtype=torch.float64),
                           torch.ones(1, dtype=torch.float64))]
    return run


_LAYER = dict(block=8, stride=4, select_block=16, count=4, window=16, local_blocks=2)  # the golden's names
_LAYER_ARGS = dict(compress_block_size=_LAYER["block"], compress_stride=_LAYER["stride"],
                   select_block_size=_LAYER["select_block"], select_block_count=_LAYER["count"],
                   window_size=_LAYER["window"])  # the layer's and the module's names


def _layer(dtype, lens, n1, n2, d):
    def run(_backend):
        t = sum(lens)
        q, k, v = (_randn(t, n, d, dtype=dtype, seed=s) for n, s in ((n1, 12), (n2, 13), (n2, 14)))
        gates = torch.sigmoid(_randn(t, n1, 3, dtype=dtype, seed=15))
        wk, wv = (_randn(_LAYER["block"], n2, dtype=dtype, seed=s) / _LAYER["block"] ** 0.5 for s in (16, 17))
        out = native_sparse_attention(q, k, v, gates, wk, wv, actual_seq_len=_cum(lens), **_LAYER_ARGS,
                                      local_blocks=_LAYER["local_blocks"])
        args = (q, k, v, gates, wk, wv, lens)
        return [Comparison("attention_out", out, gold_layer.native_sparse_attention(*args, **_LAYER, scale=d ** -0.5),
                           gold_layer.native_sparse_attention(*args, **_LAYER, scale=d ** -0.5, dtype=dtype),
                           reduction=nsa_layer_reduction(max(lens), d, **_LAYER))]
    return run


def _module(dtype, compress, batch, seq, prefill=None):
    """The module's forward, or (``prefill``) a prefill then token-by-token decoding through its cache."""
    from ..nn import NativeSparseAttention

    def run(_backend):
        torch.manual_seed(0)
        m = NativeSparseAttention(32, 4, 2, 16, **_LAYER_ARGS, local_blocks=_LAYER["local_blocks"],
                                  compress=compress).to(dtype)
        x = _randn(batch, seq, 32, dtype=dtype, seed=18)
        with torch.no_grad():
            if prefill is None:
                out = m(x)
            else:
                cache = m.new_cache(batch)
                out = torch.cat([m(x[:, :prefill], cache=cache)]
                                + [m(x[:, i:i + 1], cache=cache) for i in range(prefill, seq)], 1)
            # the input projections over the hidden size, the layer, the output projection over the heads
            red = m.hidden_size + nsa_layer_reduction(seq, m.head_dim, **_LAYER) + m.num_heads * m.head_dim
            return [Comparison("output", out, gold_layer.nsa_module(m, x), gold_layer.nsa_module(m, x, dtype=dtype),
                               reduction=red)]
    return run


def cases() -> list[CheckCase]:
    sel = "nsa_selected_attention(+_grad)"
    return [
        CheckCase("nsa_compress(+_grad)", "aclnn fp16 varlen, leading 0, short seq", _compress(torch.float16, "aclnn",
                                                                                             [128, 20, 144])),
        CheckCase("nsa_compress(+_grad)", "python fp32 l=32 d=16", _compress(torch.float32, "api", [100, 64])),
        CheckCase(sel, "aclnn bf16 paper dims 192/128, causal", _selected(torch.bfloat16, "aclnn", [64, 48],
                                                                           [256, 192], 4, 1, 192, 128, 64, 3, True)),
        CheckCase(sel, "python fp32 GQA 4, not causal", _selected(torch.float32, "api", [20, 30], [64, 48], 8, 2,
                                                                   32, 16, 16, 2, False)),
        CheckCase("nsa_compress_attention", "aclnn fp16 top-k, GQA 2", _compress_attention(
            torch.float16, [40, 33], [18, 15], 4, 2, 32, 16, 32, 16, 64, 2)),
        CheckCase("native_sparse_attention", "fp32 varlen [64, 96], GQA 2, all branches",
                  _layer(torch.float32, [64, 96], 4, 2, 16)),
        CheckCase("nn.NativeSparseAttention", "fp32 B=2 S=80, weighted", _module(torch.float32, "weighted", 2, 80)),
        CheckCase("nn.NativeSparseAttention", "fp32 cached: prefill 37 + 43 decode steps, mean",
                  _module(torch.float32, "mean", 2, 80, prefill=37)),
    ]
