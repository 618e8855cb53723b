"""Built-in DeepSeek-V4 check cases against the fp64 goldens (:mod:`attnops.testing.golden_dsv4`,
:mod:`~attnops.testing.golden_compressor`, :mod:`~attnops.testing.golden_indexer_v2`), through every dialect: the
Pythonic API, ``cann_ops_transformer``, vllm-ascend's ``_C_ascend`` ops and the aclnn operators."""
from __future__ import annotations

import torch

from .. import aclnn, cann_ops_transformer as cot, compressor, lightning_indexer_v2, sparse_flash_mla
from ..testing import golden_compressor as gold_cmp
from ..testing import golden_dsv4 as gold
from ..testing import golden_indexer_v2 as gold_idx
from ..testing.compare import attention_reductions
from ..torch_npu.dsv4 import C_ASCEND_DSV4_OPS
from .case import CheckCase, Comparison

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
RATIO, BLOCK, WIN = 4, 16, 7


def _randn(*shape, dtype=F32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _paged(rows: list[torch.Tensor], tables: list[list[int]], blocks: int) -> torch.Tensor:
    """A ``[blocks, BLOCK, 1, D]`` cache holding each batch's rows at its table's blocks."""
    cache = torch.zeros(blocks, BLOCK, 1, rows[0].shape[-1], dtype=rows[0].dtype)
    for r, table in zip(rows, tables):
        for j in range(r.shape[0]):
            cache[table[j // BLOCK], j % BLOCK, 0] = r[j]
    return cache


class _Decode:
    """vllm-ascend's prefill/decode call: TND bf16 queries of 3 and 1 tokens, paged sliding-window and compressed
    caches (ori lengths 37 and 20, compressed by 4), CSA index rows of 4, per-head sinks."""

    q_lens, ori_lens, heads, dim, topk = [3, 1], [37, 20], 4, 128, 4

    def __init__(self):
        self.cmp_lens = [n // RATIO for n in self.ori_lens]
        self.residual = [n % RATIO for n in self.ori_lens]
        self.q = _randn(sum(self.q_lens), self.heads, self.dim, dtype=BF16, seed=1)
        self.oris = [_randn(n, self.dim, dtype=BF16, seed=2 + b) for b, n in enumerate(self.ori_lens)]
        self.cmps = [_randn(n, self.dim, dtype=BF16, seed=4 + b) for b, n in enumerate(self.cmp_lens)]
        self.sinks = _randn(self.heads, seed=6)
        self.ori_table, self.cmp_table = [[5, 1, 3], [0, 4]], [[2], [0]]
        g = torch.Generator().manual_seed(7)
        self.rows = []
        for lq, lc, res in zip(self.q_lens, self.cmp_lens, self.residual):
            batch_rows = []
            for i in range(lq):
                thr = gold.cmp_threshold(lq, lc, i, RATIO, 3, lc * RATIO + res)
                pick = torch.randperm(thr, generator=g)[:self.topk].tolist()
                batch_rows.append(pick + [-1] * (self.topk - len(pick)))
            self.rows.append(batch_rows)
        self.scale = self.dim ** -0.5

    def kwargs(self) -> dict:
        """The call under attnops' / ops-transformer's names (``scale`` for ``softmax_scale``)."""
        return dict(ori_kv=_paged(self.oris, self.ori_table, 6), cmp_kv=_paged(self.cmps, self.cmp_table, 3),
                    cmp_sparse_indices=_i32([r for rows in self.rows for r in rows])[:, None],
                    ori_block_table=_i32([t + [-1] * (3 - len(t)) for t in self.ori_table]),
                    cmp_block_table=_i32(self.cmp_table), cu_seqlens_q=_i32([0, 3, 4]),
                    seqused_ori_kv=_i32(self.ori_lens), seqused_cmp_kv=_i32(self.cmp_lens),
                    cmp_residual_kv=_i32(self.residual), sinks=self.sinks, cmp_ratio=RATIO, ori_win_left=WIN,
                    layout_q="TND", layout_kv="PA_BBND")

    def golden(self, dtype) -> torch.Tensor:
        outs, start = [], 0
        for b, lq in enumerate(self.q_lens):
            outs.append(gold.sparse_flash_mla(self.q[start:start + lq].to(dtype), self.oris[b].to(dtype),
                                              self.cmps[b].to(dtype), self.rows[b], self.sinks.to(dtype), self.scale,
                                              ratio=RATIO, win_left=WIN, residual=self.residual[b], dtype=dtype)[0])
            start += lq
        return torch.cat(outs)

    def reduction(self) -> int:
        return attention_reductions(self.dim, self.dim, max(self.q_lens), WIN + 1 + self.topk)["out"]


def _attention(via):
    def run(_backend):
        case = _Decode()
        kw = case.kwargs()
        q, scale = case.q, case.scale
        if via == "api":
            out = sparse_flash_mla(q, kw.pop("ori_kv"), scale=scale, **kw).attn_out
        elif via == "cot":
            out = cot.sparse_flash_mla(q, softmax_scale=scale, **kw)[0]
        elif via == "c_ascend":
            for name in ("seqused_cmp_kv", "cmp_residual_kv"):
                kw.pop(name)
            out = C_ASCEND_DSV4_OPS["npu_sparse_attn_sharedkv"](
                q, softmax_scale=scale, seqused_kv=kw.pop("seqused_ori_kv"), **{**kw, "layout_kv": "PA_ND"})[0]
        else:
            size, executor = aclnn.sparse_flash_mla_get_workspace_size(
                q, kw["ori_kv"], kw["cmp_kv"], None, kw["cmp_sparse_indices"], kw["ori_block_table"],
                kw["cmp_block_table"], kw["cu_seqlens_q"], None, None, None, kw["seqused_ori_kv"],
                kw["seqused_cmp_kv"], kw["cmp_residual_kv"], None, None, kw["sinks"], None, scale, RATIO, 4, 3, WIN,
                0, "TND", "PA_BBND", 1, False)
            out = aclnn.sparse_flash_mla(None, size, executor, None)[0]
        return [Comparison("attn_out", out, case.golden(F64), case.golden(BF16), reduction=case.reduction())]
    return run


class _Training:
    """A BSND fp32 HCA training call (prefix of 2 compressed keys per batch, residual 1) with sinks."""

    s, heads, dim, ori_win_left = 9, 2, 32, 3

    def __init__(self):
        self.leaves = [_randn(1, self.s, self.heads, self.dim, seed=8), _randn(1, self.s, 1, self.dim, seed=9),
                       _randn(1, 2, 1, self.dim, seed=10), _randn(self.heads, seed=11)]
        self.dout = _randn(1, self.s, self.heads, self.dim, seed=12)
        self.options = dict(cmp_ratio=RATIO, ori_win_left=self.ori_win_left,
                            cmp_residual_kv=_i32([1]), scale=0.2)

    def golden_grads(self, dtype) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).requires_grad_() for t in self.leaves]
        out, _ = gold.sparse_flash_mla(leaves[0][0], leaves[1][0, :, 0], leaves[2][0, :, 0], None, leaves[3], 0.2,
                                       ratio=RATIO, win_left=self.ori_win_left, residual=1, dtype=dtype)
        return list(torch.autograd.grad(out, leaves, self.dout[0].to(dtype)))

    def comparisons(self, grads) -> list[Comparison]:
        red = attention_reductions(self.dim, self.dim, self.s, self.ori_win_left + 1 + 2)
        reductions = (red["dq"], red["dk"], red["dk"], red["dk"])
        return [Comparison(name, g, want, base, 3.0, r) for name, g, want, base, r in zip(
            ("d_q", "d_ori_kv", "d_cmp_kv", "d_sinks"), grads, self.golden_grads(F64), self.golden_grads(F32),
            reductions)]


def _grad(via):
    def run(_backend):
        case = _Training()
        q, ori, cmp, sinks = case.leaves
        opts = dict(case.options)
        if via == "api":
            leaves = [t.clone().requires_grad_() for t in case.leaves]
            out = sparse_flash_mla(leaves[0], leaves[1], cmp_kv=leaves[2], sinks=leaves[3], **opts).attn_out
            return case.comparisons(torch.autograd.grad(out, leaves, case.dout))
        scale = opts.pop("scale")
        out, lse = cot.sparse_flash_mla(q, ori_kv=ori, cmp_kv=cmp, sinks=sinks, softmax_scale=scale,
                                        return_softmax_lse=True, **opts)
        masks = dict(ori_mask_mode=4, cmp_mask_mode=3, ori_win_right=0)
        if via == "cot":
            grads = cot.sparse_flash_mla_grad(q, case.dout, out, lse, ori, cmp, sinks=sinks, softmax_scale=scale,
                                              **masks, **opts)
        else:
            grads = aclnn.sparse_flash_mla_grad(q, case.dout, out, lse, ori, cmp, None, None, None, None, None, None,
                                                None, None, opts["cmp_residual_kv"], None, None, sinks, None, scale,
                                                RATIO, 4, 3, case.ori_win_left, 0, "BSND", "BSND")
        return case.comparisons(grads[:4])
    return run


def _compressor_inputs(dtype):
    hidden, dim, coff, n = 64, 32, 2, 4 * RATIO + 2
    x = _randn(n, hidden, dtype=dtype, seed=13)
    wkv, wgate = (_randn(coff * dim, hidden, dtype=dtype, seed=14 + i) * hidden ** -0.5 for i in range(2))
    ape = _randn(RATIO, coff * dim, seed=16)
    return x, wkv.to(dtype), wgate.to(dtype), ape


def _compressor(via):
    def run(_backend):
        x, wkv, wgate, ape = _compressor_inputs(BF16)
        state = torch.zeros(3, BLOCK, 2 * wkv.shape[0])
        table, cu = _i32([[1, 2]]), _i32([0, x.shape[0]])
        rows = x.shape[0] // RATIO
        extra = {}
        if via == "c_ascend":
            weight, sin, cos = _randn(32, seed=17), _randn(rows + 1, 8, seed=18), _randn(rows + 1, 8, seed=19)
            out = C_ASCEND_DSV4_OPS["compressor"](x, wkv, wgate, state, ape, weight, sin, cos, table, cu, None, None,
                                                  8, RATIO, 2, 1e-6, 2, 1)
            extra = dict(weight=weight, sin=sin[:rows], cos=cos[:rows])
        elif via == "cot":
            out = cot.compressor(x, wkv, wgate, state, ape, RATIO, state_block_table=table, cu_seqlens=cu, coff=2)
        else:
            out = compressor(x, wkv, wgate, state, ape, cmp_ratio=RATIO, coff=2, state_block_table=table,
                             cu_seqlens=cu)

        def golden(dtype):
            rows_, _ = gold_cmp.compress(x, wkv, wgate, ape, coff=2, dtype=dtype)
            if not extra:
                return rows_
            return gold_cmp.rms_norm_rope(rows_, extra["weight"], extra["sin"], extra["cos"], eps=1e-6,
                                          rope_head_dim=8, rotary_mode=2, dtype=dtype)
        reduction = x.shape[1] + 2 * RATIO + (wkv.shape[0] // 2 if extra else 0)
        return [Comparison("cmp_kv", out[:rows], golden(F64), golden(BF16), reduction=reduction)]
    return run


def _indexer(via):
    def run(_backend):
        heads, dim, topk = 4, 64, 3
        q, k, w = _randn(1, 12, heads, dim, seed=20), _randn(1, 3, 1, dim, seed=21), _randn(1, 12, heads, seed=22)
        q_codes = k_codes = None
        if via == "c_ascend":
            q_codes = torch.randint(-8, 8, q.shape, generator=torch.Generator().manual_seed(23), dtype=torch.int8)
            k_codes = torch.randint(-8, 8, k.shape, generator=torch.Generator().manual_seed(24), dtype=torch.int8)
            sq, sk = _randn(1, 12, heads, seed=25).abs() + 0.5, _randn(1, 3, 1, seed=26).abs() + 0.5
            q, k = q_codes * sq[..., None], k_codes * sk[..., None]
        residual = _i32([2])
        if via == "api":
            idx, vals = lightning_indexer_v2(q, k, w, topk=topk, mask_mode=3, cmp_ratio=RATIO,
                                             cmp_residual_k=residual)
        elif via == "cot":
            idx, vals = cot.lightning_indexer(q, k, w, topk, cmp_residual_k=residual, mask_mode=3, cmp_ratio=RATIO,
                                              return_value=1)
        elif via == "aclnn":
            idx, vals = aclnn.lightning_indexer_v2(q, k, w, None, None, None, None, residual, None, None, None, topk,
                                                   -1, "BSND", "BSND", 3, RATIO, 1)
        else:
            idx, vals = C_ASCEND_DSV4_OPS["npu_vllm_quant_lightning_indexer"](
                q_codes, k_codes, w, sq, sk, actual_seq_lengths_query=_i32([12]),
                actual_seq_lengths_key=_i32([3 * RATIO + 2]), sparse_count=topk, cmp_ratio=RATIO, return_value=True)
        want_idx, _ = gold_idx.lightning_indexer_v2(q[0], k[0, :, 0], w[0], topk, mask_mode=3, cmp_ratio=RATIO,
                                                    residual=2)
        rows = torch.tensor(want_idx)

        def selected(dtype):
            scores = gold_idx.scores(q[0], k[0, :, 0], w[0], dtype=dtype)
            return torch.where(rows >= 0, scores.gather(1, rows.clamp_min(0)), float("-inf"))

        return [Comparison("sparse_indices", idx[0, :, 0].double(), rows.double(), rows.double()),
                Comparison("sparse_values", vals[0, :, 0], selected(F64), selected(F32), reduction=heads + dim)]
    return run


def cases() -> list[CheckCase]:
    decode = "vllm-ascend decode: TND bf16, paged ori + compressed caches, CSA top-4, sinks"
    training = "BSND fp32, HCA prefix, sinks: d_q, d_ori_kv, d_cmp_kv, d_sinks"
    c4a = "C4A bf16 (coff 2, ratio 4), packed x, state cache"
    indexer = "causal over compressed keys (ratio 4, residual 2), top-3 with values"
    return [
        CheckCase("sparse_flash_mla", decode, _attention("api")),
        CheckCase("cann_ops_transformer.sparse_flash_mla", decode, _attention("cot")),
        CheckCase("_C_ascend.npu_sparse_attn_sharedkv", decode + " (seqused_kv, PA_ND)", _attention("c_ascend")),
        CheckCase("aclnn.sparse_flash_mla", "two-phase, " + decode, _attention("aclnn")),
        CheckCase("sparse_flash_mla(+grad)", training, _grad("api")),
        CheckCase("cann_ops_transformer.sparse_flash_mla_grad", training, _grad("cot")),
        CheckCase("aclnn.sparse_flash_mla_grad", training, _grad("aclnn")),
        CheckCase("compressor", c4a, _compressor("api")),
        CheckCase("cann_ops_transformer.compressor", c4a, _compressor("cot")),
        CheckCase("_C_ascend.compressor", c4a + ", RMSNorm + interleaved RoPE", _compressor("c_ascend")),
        CheckCase("lightning_indexer_v2", "BSND fp32, " + indexer, _indexer("api")),
        CheckCase("cann_ops_transformer.lightning_indexer", "BSND fp32, " + indexer, _indexer("cot")),
        CheckCase("aclnn.lightning_indexer_v2", "two-phase, BSND fp32, " + indexer, _indexer("aclnn")),
        CheckCase("_C_ascend.npu_vllm_quant_lightning_indexer", "BSND int8 q/k, per-token-head scales, " + indexer,
                  _indexer("c_ascend")),
    ]
