"""NSA and DSA pipelines under KV all-gather (run inside spawned workers): every rank runs the pipeline on one
device and on its shard, and compares its local outputs and gradients with the single-device ones."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import attnops
from attnops.distributed import (allgather_lightning_indexer, allgather_lightning_indexer_kl_loss,
                                 allgather_nsa_compress_attention, allgather_nsa_selected_attention,
                                 allgather_sequence, allgather_sparse_flash_attention, ring_shard)
from tests.helpers import cum, randn

TIGHT = dict(rtol=1e-5, atol=2e-6)


def _sharder(split: str, lens: list[int], rank: int, world: int):
    if split == "head_tail":
        return lambda x, dim=0: ring_shard(x.movedim(dim, 0), rank, world, layout="TND",
                                           actual_seq_len=cum(lens)).movedim(0, dim)
    return lambda x, dim=0: x.narrow(dim, rank * x.shape[dim] // world, x.shape[dim] // world)


def _leaves(tensors, shard=None):
    return [(shard(t) if shard else t).detach().clone().requires_grad_() for t in tensors]


def _close(name, mine, ref):
    torch.testing.assert_close(mine, ref, **TIGHT, msg=lambda m: f"{name}: {m}")


def dsa_pipeline(rank: int, world: int, split: str, lens: list[int]) -> None:
    """Indexer -> sparse attention (MLA: key is value, with rope) -> KL loss, forward and backward."""
    t, lk = sum(lens), dict(actual_seq_lengths_query=cum(lens))
    lk["actual_seq_lengths_kv"] = lk["actual_seq_lengths_key"] = cum(lens)
    q, qr, kv, kr = randn(t, 2, 8, seed=1), randn(t, 2, 4, seed=2), randn(t, 1, 8, seed=3), randn(t, 1, 4, seed=4)
    qi, ki, w, dy = randn(t, 2, 8, seed=5), randn(t, 1, 8, seed=6), randn(t, 2, seed=7).abs(), randn(t, 2, 8, seed=8)
    idx = attnops.lightning_indexer(qi, ki, w, sparse_count=4, layout="TND", actual_seq_lengths_query=lk[
        "actual_seq_lengths_query"], actual_seq_lengths_key=cum(lens)).sparse_indices
    g = _leaves((q, qr, kv, kr, qi, ki, w))
    res = attnops.sparse_flash_attention(g[0], g[2], g[2], idx, scale=0.3, query_rope=g[1], key_rope=g[3],
                                         layout="TND", actual_seq_lengths_query=cum(lens),
                                         actual_seq_lengths_kv=cum(lens))
    res.attention_out.backward(dy)
    loss = attnops.lightning_indexer_kl_loss(q, kv, g[4], g[5], g[6], idx, res.softmax_max, res.softmax_sum,
                                             scale=0.3, query_rope=qr, key_rope=kr, layout="TND",
                                             actual_seq_lengths_query=cum(lens), actual_seq_lengths_key=cum(lens))
    loss.sum().backward()

    shard = _sharder(split, lens, rank, world)
    lq, lqr, lkv, lkr, lqi, lki, lw = _leaves((q, qr, kv, kr, qi, ki, w), shard)
    common = dict(actual_seq_len=cum(lens), split=split)
    kv_all, kr_all, ki_all = (allgather_sequence(x, **common) for x in (lkv, lkr, lki))
    my_idx = allgather_lightning_indexer(lqi, ki_all.detach(), lw, sparse_count=4, **common).sparse_indices
    assert torch.equal(my_idx, shard(idx)), "sparse_indices"
    mine = allgather_sparse_flash_attention(lq, kv_all, kv_all, my_idx, scale=0.3, query_rope=lqr, key_rope=kr_all,
                                            **common)
    _close("attention_out", mine.attention_out, shard(res.attention_out.detach()))
    _close("softmax_max", mine.softmax_max, shard(res.softmax_max, 1))
    _close("softmax_sum", mine.softmax_sum, shard(res.softmax_sum, 1))
    mine.attention_out.backward(shard(dy))
    my_loss = allgather_lightning_indexer_kl_loss(lq.detach(), kv_all.detach(), lqi, ki_all, lw, my_idx,
                                                  mine.softmax_max, mine.softmax_sum, scale=0.3,
                                                  query_rope=lqr.detach(), key_rope=kr_all.detach(), **common)
    my_loss.sum().backward()
    total = my_loss.detach().clone()
    dist.all_reduce(total)
    _close("loss", total, loss.detach())
    for name, leaf, ref in zip(("dq", "dq_rope", "dkv", "dk_rope", "dq_index", "dk_index", "dweights"),
                               (lq, lqr, lkv, lkr, lqi, lki, lw), g):
        _close(name, leaf.grad, shard(ref.grad))


def nsa_pipeline(rank: int, world: int, split: str, lens: list[int]) -> None:
    """Compress (on the gathered keys) -> compressed attention with top-k -> selected attention, forward and
    backward; the compression weights' gradients summed over the ranks."""
    t, block, stride, sel = sum(lens), 4, 2, 4
    cmp_cum = cum([(n - block) // stride + 1 for n in lens])
    q, k, v = randn(t, 4, 8, seed=1), randn(t, 2, 8, seed=2), randn(t, 2, 4, seed=3)
    wk, wv = randn(block, 2, seed=4, scale=0.5), randn(block, 2, seed=5, scale=0.5)
    dy1, dy2 = randn(t, 4, 4, seed=6), randn(t, 4, 4, seed=7)
    opts = dict(compress_block_size=block, compress_stride=stride, select_block_size=sel, select_block_count=2,
                scale=0.3, causal=True, local_blocks=1)

    def pipeline(q, k, v, wk, wv, attend_cmp, attend_sel, qlens):
        k_cmp = attnops.nsa_compress(k, wk, block_size=block, stride=stride, actual_seq_len=cum(lens))
        v_cmp = attnops.nsa_compress(v, wv, block_size=block, stride=stride, actual_seq_len=cum(lens))
        ca = attend_cmp(q, k_cmp, v_cmp, **opts, **qlens, actual_cmp_seq_kvlen=cmp_cum)
        return ca, attend_sel(q, k, v, ca.topk_indices, select_block_size=sel, causal=True, **qlens)

    g = _leaves((q, k, v, wk, wv))
    ca, out = pipeline(*g, attnops.nsa_compress_attention,
                       functools.partial(attnops.nsa_selected_attention, actual_seq_kvlen=cum(lens)),
                       dict(actual_seq_qlen=cum(lens)))
    ((ca.out * dy1).sum() + (out * dy2).sum()).backward()

    shard = _sharder(split, lens, rank, world)
    lq, lk, lv = _leaves((q, k, v), shard)
    lwk, lwv = _leaves((wk, wv))
    common = dict(actual_seq_len=cum(lens), split=split)
    my_ca, my_out = pipeline(lq, allgather_sequence(lk, **common), allgather_sequence(lv, **common), lwk, lwv,
                             allgather_nsa_compress_attention, allgather_nsa_selected_attention, common)
    assert torch.equal(my_ca.topk_indices, shard(ca.topk_indices)), "topk_indices"
    _close("compress_attention.out", my_ca.out, shard(ca.out.detach()))
    _close("selected_attention.out", my_out, shard(out.detach()))
    ((my_ca.out * shard(dy1)).sum() + (my_out * shard(dy2)).sum()).backward()
    for name, leaf, ref in zip(("dq", "dk", "dv"), (lq, lk, lv), g):
        _close(name, leaf.grad, shard(ref.grad))
    for name, leaf, ref in (("dweight_k", lwk, g[3]), ("dweight_v", lwv, g[4])):
        total = leaf.grad.clone()
        dist.all_reduce(total)
        _close(name, total, ref.grad)


def _on_this_rank(pipeline, world: int, split: str, lens: list[int]) -> None:
    pipeline(dist.get_rank(), world, split, lens)


def sparse_checks(world: int) -> list[tuple[str, object]]:
    """``(name, check)`` of the NSA/DSA pipelines at the world size (run inside a worker)."""
    if world == 2:
        runs = [("dsa_head_tail", dsa_pipeline, "head_tail", [8, 12]),
                ("dsa_contiguous", dsa_pipeline, "contiguous", [5, 9]),
                ("nsa_head_tail", nsa_pipeline, "head_tail", [16, 8]),
                ("nsa_contiguous", nsa_pipeline, "contiguous", [12, 8])]
    else:
        runs = [("dsa_head_tail", dsa_pipeline, "head_tail", [8, 16]),
                ("nsa_head_tail", nsa_pipeline, "head_tail", [16, 16])]
    return [(name, functools.partial(_on_this_rank, fn, world, split, lens)) for name, fn, split, lens in runs]
