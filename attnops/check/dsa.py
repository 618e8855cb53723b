"""Built-in DSA and MLA check cases against the fp64 golden (:mod:`attnops.testing.golden_dsa`): the Pythonic
``lightning_indexer`` / ``sparse_flash_attention`` (+ gradients) / ``lightning_indexer_kl_loss``, the torch_npu
functions, vllm-ascend's ``_C_ascend`` twins, the aclnn operators, the MLA helpers and the ``DeepSeekSparseAttention``
module."""
from __future__ import annotations

import torch

from .. import aclnn, lightning_indexer, lightning_indexer_kl_loss, nn, sparse_flash_attention, torch_npu
from ..ops.dsa.quant_cache import dequantize, quantize
from ..testing import golden_dsa as gold
from ..testing.compare import kl_reductions, sfa_reductions
from ..torch_npu.dsa import C_ASCEND_OPS
from .case import CheckCase, Comparison

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
INT64_MAX = 2**63 - 1


def _randn(*shape, dtype=F32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _exact(name, actual, golden) -> Comparison:
    """Integer outputs: equal or fail (fp64 tensors, no baseline error to allow)."""
    return Comparison(name, actual.double(), golden.double(), golden.double())


def _indexer(via):
    def run(_backend):
        s, heads, d, k = 40, 4, 32 if via == "api" else 128, 8
        q, key, w = _randn(1, s, heads, d, seed=1), _randn(1, s, 1, d, seed=2), _randn(1, s, heads, seed=3).abs()
        if via == "npu":
            idx, vals = torch_npu.npu_lightning_indexer(q, key, w, sparse_count=k, return_value=True)
        elif via == "aclnn":
            ws, executor = aclnn.lightning_indexer_get_workspace_size(q, key, w, None, None, None, "BSND", "BSND", k,
                                                                      3, INT64_MAX, INT64_MAX, True)
            idx, vals = aclnn.lightning_indexer(None, ws, executor, None)
        else:
            idx, vals = lightning_indexer(q, key, w, sparse_count=k, return_value=True)
        rows = torch.tensor(gold.lightning_indexer(q[0], key[0, :, 0], w[0], k, 3))
        def selected(dtype):
            scores = gold.lightning_scores(q[0], key[0, :, 0], w[0], dtype=dtype)
            return torch.where(rows >= 0, scores.gather(1, rows.clamp_min(0)), float("-inf"))

        return [_exact("sparse_indices", idx[0, :, 0], rows),
                Comparison("sparse_values", vals[0, :, 0], selected(torch.float64), selected(F32),
                           reduction=d + heads)]  # q.k over d, then the weighted sum over the heads
    return run


def _paged_sfa_inputs(dtype, d, dr, heads=4):
    """Two requests (TND query of 3 and 1 tokens) over a shuffled paged latent cache with -1 padded indices."""
    q_lens, k_lens, block = [3, 1], [37, 20], 16
    q, qr = _randn(4, heads, d, dtype=dtype, seed=4), _randn(4, heads, dr, dtype=dtype, seed=5)
    lat, rope = _randn(8, block, 1, d, dtype=dtype, seed=6), _randn(8, block, 1, dr, dtype=dtype, seed=7)
    table = torch.tensor([[6, 1, 3], [0, 5, -1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    rows, per_batch = [], []
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        batch_rows = []
        for i in range(lq):
            a = lk - lq + i + 1
            pick = torch.randperm(a, generator=g)[:12].tolist()
            batch_rows.append(pick + [-1] * (12 - len(pick)))
        rows += batch_rows
        pos = torch.arange(lk)
        phys = table[b, pos // block].long()
        per_batch.append((lat[phys, pos % block, 0], rope[phys, pos % block, 0], batch_rows))
    args = dict(block_table=table, cu_q=torch.tensor([3, 4], dtype=torch.int32),
                k_lens=torch.tensor(k_lens, dtype=torch.int32))
    return q, qr, lat, rope, torch.tensor(rows, dtype=torch.int32)[:, None], per_batch, args


def _sfa_golden(q, qr, per_batch, scale, dtype=torch.float64):
    outs, starts = [], [0, 3]
    for (lat, rope, rows), s in zip(per_batch, starts):
        n = len(rows)
        outs.append(gold.sparse_flash_attention(q[s:s + n], lat, lat, rows, scale, q_rope=qr[s:s + n], k_rope=rope,
                                                dtype=dtype)[0])
    return torch.cat(outs)


def _sfa_paged(via):
    def run(_backend):
        d, dr = (512, 64) if via != "api" else (64, 16)
        q, qr, lat, rope, idx, per_batch, a = _paged_sfa_inputs(F16, d, dr)
        kw = dict(block_table=a["block_table"], actual_seq_lengths_query=a["cu_q"],
                  actual_seq_lengths_kv=a["k_lens"], query_rope=qr, key_rope=rope, sparse_block_size=1)
        if via == "npu":
            out = torch_npu.npu_sparse_flash_attention(q, lat, lat, idx, 0.05, layout_query="TND",
                                                       layout_kv="PA_BSND", attention_mode=2, **kw)[0]
        elif via == "c_ascend":
            out = C_ASCEND_OPS["npu_sparse_flash_attention"](q, lat, lat, idx, 0.05, layout_query="TND",
                                                              layout_kv="PA_BSND", **kw)[0]
        elif via == "aclnn":
            out = aclnn.sparse_flash_attention(q, lat, lat, idx, a["block_table"], a["cu_q"], a["k_lens"], qr, rope,
                                               0.05, 1, "TND", "PA_BSND", 3, INT64_MAX, INT64_MAX, 2, False)[0]
        else:
            out = sparse_flash_attention(q, lat, lat, idx, scale=0.05, layout="TND", layout_kv="PA_BSND",
                                         **kw).attention_out
        return [Comparison("attention_out", out, _sfa_golden(q, qr, per_batch, 0.05),
                           _sfa_golden(q, qr, per_batch, 0.05, dtype=F16),
                           reduction=sfa_reductions([3, 1], q.shape[1], d, dr, idx.shape[-1])["out"])]
    return run


def _sfa_grad(via):
    """BSND training call (MindSpeed-LLM's): forward, statistics and gradients vs the golden's autograd."""
    def run(_backend):
        s, heads, d, dr = 9, 2, (512 if via == "npu" else 32), (64 if via == "npu" else 8)
        leaves = [_randn(1, s, heads, d, seed=9), _randn(1, s, heads, dr, seed=10), _randn(1, s, 1, d, seed=11),
                  _randn(1, s, 1, dr, seed=12)]
        leaves = [t.requires_grad_() for t in leaves]
        g = torch.Generator().manual_seed(13)
        rows = [torch.randperm(i + 1, generator=g)[:4].tolist() for i in range(s)]
        rows = [r + [-1] * (4 - len(r)) for r in rows]
        idx = torch.tensor(rows, dtype=torch.int32)[None, :, None]
        q, qr, kv, kr = leaves
        if via == "npu":
            out, m, l = torch_npu.npu_sparse_flash_attention(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr,
                                                             attention_mode=2, return_softmax_lse=True)
        else:
            out, m, l = sparse_flash_attention(q, kv, kv, idx, scale=0.1, query_rope=qr, key_rope=kr)
        dy = _randn(*out.shape, seed=14)
        grads = torch.autograd.grad(out, leaves, dy)
        ref = [t.detach().double().requires_grad_() for t in leaves]
        go, gm, gl = gold.sparse_flash_attention(ref[0][0], ref[2][0, :, 0], ref[2][0, :, 0], rows, 0.1,
                                                 q_rope=ref[1][0], k_rope=ref[3][0, :, 0])
        ggrads = torch.autograd.grad(go, ref, dy[0].double())
        low = [t.detach().clone().requires_grad_() for t in leaves]
        base = gold.sparse_flash_attention(low[0][0], low[2][0, :, 0], low[2][0, :, 0], rows, 0.1, q_rope=low[1][0],
                                           k_rope=low[3][0, :, 0], dtype=F32)
        bgrads = torch.autograd.grad(base[0], low, dy[0])
        red = sfa_reductions([s], heads, d, dr, 4)
        red["dkv"] = red["dk"]
        cmps = [Comparison("attention_out", out[0].detach(), go.detach(), base[0].detach(), reduction=red["out"]),
                Comparison("softmax_max", m[0, 0], gm.detach(), base[1].detach(), reduction=red["max"]),
                Comparison("softmax_sum", l[0, 0], gl.detach(), base[2].detach(), reduction=red["sum"])]
        return cmps + [Comparison(n, a, gg, b, 3.0, red[n])
                       for n, a, gg, b in zip(("dq", "dq_rope", "dkv", "dk_rope"), grads, ggrads, bgrads)]
    return run


def _quant(via):
    def run(_backend):
        q = _randn(1, 6, 4, 576, dtype=BF16, seed=15)
        packed = quantize(_randn(1, 6, 1, 512, seed=16), _randn(1, 6, 1, 64, dtype=BF16, seed=17))
        rows = [list(range(i + 1))[::-1] + [-1] * (5 - i) for i in range(6)]
        idx = torch.tensor(rows, dtype=torch.int32)[None, :, None]
        if via == "npu":
            out = torch_npu.npu_kv_quant_sparse_flash_attention(q, packed, packed, idx, 0.05, 2, 2, attention_mode=2)
        else:
            out = C_ASCEND_OPS["npu_kv_quant_sparse_flash_attention"](q, packed, packed, idx, 0.05, key_quant_mode=2,
                                                                       value_quant_mode=2, attention_mode=2)[0]
        nope, rope = dequantize(packed[0, :, 0], BF16)
        nope = nope.to(BF16)
        kw = dict(q_rope=q[0, :, :, 512:], k_rope=rope)
        g = gold.sparse_flash_attention(q[0, :, :, :512], nope, nope, rows, 0.05, **kw)[0]
        base = gold.sparse_flash_attention(q[0, :, :, :512], nope, nope, rows, 0.05, dtype=BF16, **kw)[0]
        return [Comparison("attention_out", out[0], g, base, reduction=sfa_reductions([6], 4, 512, 64, 6)["out"])]
    return run


def _kl_loss(via):
    def run(_backend):
        s, heads, ni = 8, 4, 2
        d, dr, di = (32, 8, 16) if via == "api" else (512, 64, 128)
        q, qr, kv, kr = (_randn(s, heads, d, seed=18), _randn(s, heads, dr, seed=19), _randn(s, d, seed=20),
                         _randn(s, dr, seed=21))
        qi, ki, w = _randn(s, ni, di, seed=22), _randn(s, di, seed=23), _randn(s, ni, seed=24).abs()
        rows = [list(range(i + 1))[::-1][:4] + [-1] * (4 - min(4, i + 1)) for i in range(s)]
        _, m, l = gold.sparse_flash_attention(q, kv, kv, rows, 0.1, q_rope=qr, k_rope=kr)
        idx = torch.tensor(rows, dtype=torch.int32)[None, :, None]
        lead = dict(query_rope=qr[None], key_rope=kr[None, :, None])
        stats = (m.float()[None, None], l.float()[None, None])
        if via == "npu":
            dqi, dki, dw, loss = torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
                q[None], kv[None, :, None], qi[None], ki[None, :, None], w[None], idx, *stats, 0.1, **lead)
        elif via == "aclnn":
            dqi, dki, dw, loss = aclnn.sparse_lightning_indexer_grad_kl_loss(
                q[None], kv[None, :, None], qi[None], ki[None, :, None], w[None], idx, *stats, lead["query_rope"],
                lead["key_rope"], None, None, 0.1, "BSND", 3, INT64_MAX, INT64_MAX, True)
        else:
            leaves = [t.requires_grad_() for t in (qi[None].clone(), ki[None, :, None].clone(), w[None].clone())]
            loss = lightning_indexer_kl_loss(q[None], kv[None, :, None], *leaves, idx, *stats, scale=0.1, **lead)
            dqi, dki, dw = torch.autograd.grad(loss.sum(), leaves)
        golden = gold.indexer_kl_loss_grad(q, kv, qi, ki, w, rows, m, l, 0.1, q_rope=qr, k_rope=kr)
        base = gold.indexer_kl_loss_grad(q, kv, qi, ki, w, rows, *stats_f32(m, l), 0.1, q_rope=qr, k_rope=kr,
                                         dtype=F32)
        red = kl_reductions(s, heads, d, dr, ni, di, 4)
        return [Comparison("loss", loss.detach()[0], golden[0], base[0], reduction=red["loss"])] + [
            Comparison(n, a.reshape(g.shape), g, b, 3.0, red[n])
            for n, a, g, b in zip(("d_query_index", "d_key_index", "d_weights"), (dqi, dki, dw), golden[1:], base[1:])]
    return run


def stats_f32(m, l):
    return m.float(), l.float()


def _mla_helpers(via):
    def run(_backend):
        return _mla_helper_comparisons(via)
    return run


def _mla_helper_comparisons(via):
    kv, gamma, cos, sin = _randn(2, 1, 1, 576, seed=25), _randn(512, seed=26), _randn(2, 1, 1, 64, seed=27), \
        _randn(2, 1, 1, 64, seed=28)
    k_cache, ckv_cache = torch.zeros(2, 16, 1, 64, dtype=F16), torch.zeros(2, 16, 1, 512, dtype=F16)
    args = (kv.half(), gamma.half(), cos.half(), sin.half(), torch.tensor([20, 3]), k_cache, ckv_cache)
    if via == "aclnn":
        aclnn.kv_rms_norm_rope_cache(*args, None, None, None, None, 1e-5, "PA", False)
    else:
        torch_npu.npu_kv_rmsnorm_rope_cache(*args, cache_mode="PA")
    y = gold.rms_norm(kv.half()[..., :512], gamma.half(), 1e-5)
    k = gold.interleave_rope(kv.half()[..., 512:], cos.half(), sin.half())
    y16 = gold.rms_norm(kv.half()[..., :512], gamma.half(), 1e-5, dtype=F16)
    k16 = gold.interleave_rope(kv.half()[..., 512:], cos.half(), sin.half(), dtype=F16)
    x = _randn(2, 3, 4, 64, dtype=F16, seed=29)
    rope = aclnn.interleave_rope if via == "aclnn" else torch_npu.npu_interleave_rope
    rot = rope(x, cos.half()[:, :, :1].expand(2, 1, 4, 64).contiguous(),
               sin.half()[:, :, :1].expand(2, 1, 4, 64).contiguous())
    want = gold.interleave_rope(x, cos.half()[:, :, :1], sin.half()[:, :, :1])
    want16 = gold.interleave_rope(x, cos.half()[:, :, :1], sin.half()[:, :, :1], dtype=F16)
    # the RMS norm sums over the 512 latent dims; a rotated element sums two products
    return [Comparison("ckv_cache slot 20", ckv_cache[1, 4, 0], y[0, 0, 0], y16[0, 0, 0], reduction=512),
            Comparison("k_cache slot 3", k_cache[0, 3, 0], k[1, 0, 0], k16[1, 0, 0], reduction=2),
            Comparison("interleave_rope", rot, want, want16, reduction=2)]


def _mla_prolog(version, via="npu"):
    def run(_backend):
        he, hcq, n, d, hckv, dr, t = 64, 32, 4, 16, 32, 16, 5
        x = _randn(t, he, seed=30)
        w = [_randn(he, hcq, seed=31) * he ** -0.5, _randn(hcq, n * (d + dr), seed=32) * hcq ** -0.5,
             _randn(n, d, hckv, seed=33) * d ** -0.5, _randn(he, hckv + dr, seed=34) * he ** -0.5,
             _randn(hcq, seed=35), _randn(hckv, seed=36), _randn(t, dr, seed=37), _randn(t, dr, seed=38)]
        caches = (torch.zeros(2, 16, 1, hckv), torch.zeros(2, 16, 1, dr))
        slots = torch.tensor([3, 30, 17, -1, 0])
        if via == "aclnn" and version == 3:
            q, qr = aclnn.mla_prolog_v3_weight_nz(x, *w, *caches, slots, *[None] * 9, 1e-5, 1e-5, "PA_BSND", 0, 0, 0,
                                                  0, 0, 128, 1.0, 1.0)[:2]
        elif via == "aclnn":
            q, qr = aclnn.mla_prolog_v2_weight_nz(x, *w, slots, *caches, *[None] * 7, 1e-5, 1e-5, "PA_BSND")[:2]
        elif version == 3:
            q, qr = torch_npu.npu_mla_prolog_v3(x, *w, *caches, cache_index=slots)[:2]
        else:
            q, qr = torch_npu.npu_mla_prolog_v2(x, *w, slots, *caches)[:2]
        def golden(dtype):
            c_q = gold.rms_norm(x.to(dtype) @ w[0].to(dtype), w[4], 1e-5, dtype=dtype)
            u = (c_q @ w[1].to(dtype)).view(t, n, -1)
            gq = torch.einsum("tnd,ndh->tnh", u[..., :d], w[2].to(dtype))
            gqr = gold.interleave_rope(u[..., d:], w[7][:, None], w[6][:, None], dtype=dtype)
            return gq, gqr, gold.rms_norm((x.to(dtype) @ w[3].to(dtype))[:, :hckv], w[5], 1e-5, dtype=dtype)

        g, b = golden(torch.float64), golden(F32)
        chain = he + hcq + hcq  # x @ w_dq, its RMS norm, the up-projection
        return [Comparison("query", q, g[0], b[0], reduction=chain + d),
                Comparison("query_rope", qr, g[1], b[1], reduction=chain + 2),
                Comparison("kv_cache slot 30", caches[0].view(-1, hckv)[30], g[2][1], b[2][1], reduction=he + hckv)]
    return run


def _module(_backend):
    torch.manual_seed(0)
    m = nn.DeepSeekSparseAttention(48, 4, kv_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=12, index_heads=4,
                                   index_dim=16, index_topk=5)
    x = torch.randn(2, 12, 48)
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, 12)
        steps = torch.cat([m(x[:, :9], cache)] + [m(x[:, i:i + 1], cache) for i in range(9, 12)], 1)
    # q_proj, w_uk, the scores over latent + rope, P V over the selected keys, w_uv, o_proj
    red = m.q_proj.in_features + m.nope + m.kv_rank + m.rope_dim + m.index_topk + m.kv_rank + m.heads * m.v_dim
    return [Comparison("prefill + decode vs full forward", steps, full.double(), full, reduction=red)]


def cases() -> list[CheckCase]:
    return [
        CheckCase("lightning_indexer", "BSND fp32, causal, top-8 of 40 with values", _indexer("api")),
        CheckCase("npu_lightning_indexer", "BSND fp32, D=128, causal, return_value", _indexer("npu")),
        CheckCase("sparse_flash_attention", "TND fp16 query, shuffled PA_BSND latent cache, rope, -1 padding",
                  _sfa_paged("api")),
        CheckCase("npu_sparse_flash_attention", "vllm-ascend decode: TND fp16, PA_BSND 512+64, attention_mode 2",
                  _sfa_paged("npu")),
        CheckCase("_C_ascend.npu_sparse_flash_attention", "vllm-ascend's twin, same call", _sfa_paged("c_ascend")),
        CheckCase("sparse_flash_attention(+grad)", "BSND fp32, causal, rope, statistics and gradients",
                  _sfa_grad("api")),
        CheckCase("npu_sparse_flash_attention(+grad)", "MindSpeed-LLM training: BSND fp32, return_softmax_lse",
                  _sfa_grad("npu")),
        CheckCase("npu_kv_quant_sparse_flash_attention", "bf16 query, packed int8 656-byte rows", _quant("npu")),
        CheckCase("_C_ascend.npu_kv_quant_sparse_flash_attention", "vllm-ascend's twin, keyword quant modes",
                  _quant("c_ascend")),
        CheckCase("lightning_indexer_kl_loss", "BSND fp32, loss and indexer gradients", _kl_loss("api")),
        CheckCase("npu_sparse_lightning_indexer_grad_kl_loss", "BSND fp32, 512+64 main, 128 indexer",
                  _kl_loss("npu")),
        CheckCase("npu_kv_rmsnorm_rope_cache + npu_interleave_rope", "fp16, PA cache", _mla_helpers("npu")),
        CheckCase("npu_mla_prolog_v3", "fp32, PA_BSND slots with -1", _mla_prolog(3)),
        CheckCase("npu_mla_prolog_v2", "fp32, PA_BSND slots with -1", _mla_prolog(2)),
        CheckCase("aclnn.lightning_indexer", "two-phase, BSND fp32, D=128, return_values", _indexer("aclnn")),
        CheckCase("aclnn.sparse_flash_attention", "TND fp16, PA_BSND 512+64, attention_mode 2", _sfa_paged("aclnn")),
        CheckCase("aclnn.sparse_lightning_indexer_grad_kl_loss", "BSND fp32, 512+64 main, 128 indexer",
                  _kl_loss("aclnn")),
        CheckCase("aclnn.kv_rms_norm_rope_cache + aclnn.interleave_rope", "fp16, PA cache", _mla_helpers("aclnn")),
        CheckCase("aclnn.mla_prolog_v3_weight_nz", "fp32, PA_BSND slots with -1", _mla_prolog(3, "aclnn")),
        CheckCase("aclnn.mla_prolog_v2_weight_nz", "fp32, PA_BSND slots with -1", _mla_prolog(2, "aclnn")),
        CheckCase("nn.DeepSeekSparseAttention", "cached prefill + decode vs the full forward", _module),
    ]
