"""The DSA kernels with lengths and block tables as the operators pass them on from a GPU (``Call.host`` None: the
tensors as given, unread on the host) give exactly what they give with the host path's uploaded lengths, and clamp
what points outside the tensors: lengths past the capacity, sparse indices past a row's keys or negative (CUDA when
there is a GPU, else Triton's CPU interpreter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import attnops
from attnops.ops.dsa.validate import indexer_call, sparse_attention_call
from tests.ops.dsa.dsa_helpers import pack_keys, pack_query, pack_rows, randn, random_rows

from .conftest import DEVICE

pytest.importorskip("triton")

from attnops.ops.dsa.triton import launch  # noqa: E402

F = torch.float32
LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BSND"), ("BSND", "PA_BSND")]
Q_LENS, K_LENS = [3, 0, 2], [5, 4, 20]


def _on_device(call):
    """``call`` as the operators build it when its lengths live on a device: nothing read on the host."""
    names = ("actual_seq_lengths_query", "actual_seq_lengths_kv", "block_table")
    return dataclasses.replace(call, host=None, device_values=names)


def _case(layout_q, layout_kv, seed=0):
    qs = [randn(n, 4, 16, dtype=F, seed=seed + b) for b, n in enumerate(Q_LENS)]
    ks = [randn(n, 16, dtype=F, seed=seed + 20 + b) for b, n in enumerate(K_LENS)]
    q, q_len = pack_query(qs, layout_q)
    k, k_len, table = pack_keys(ks, layout_kv)
    return q.to(DEVICE), q_len.to(DEVICE), k.to(DEVICE), k_len.to(DEVICE), None if table is None else table.to(DEVICE)


@pytest.mark.parametrize("layout_q,layout_kv", LAYOUTS)
def test_device_lengths_give_the_host_paths_results(triton_backend, layout_q, layout_kv):
    q, q_len, k, k_len, table = _case(layout_q, layout_kv)
    w = randn(*q.shape[:-1], dtype=F, seed=7).to(DEVICE)
    kw = dict(layout_query=layout_q, actual_seq_lengths_query=q_len.long(), block_table=table)
    idx_call = indexer_call(q, k, w, layout_key=layout_kv, actual_seq_lengths_key=k_len.long(), sparse_count=8,
                            sparse_mode=3, return_value=False, **kw)
    host_idx, _ = launch.indexer_for(idx_call, q, k, w, 8, False)
    device_idx, _ = launch.indexer_for(_on_device(idx_call), q, k, w, 8, False)
    assert torch.equal(host_idx, device_idx)
    rows = pack_rows(random_rows(Q_LENS, K_LENS, 6, seed=3), layout_q, q.shape[1] if layout_q == "BSND" else None)
    rows = rows.to(DEVICE)
    sfa_call = sparse_attention_call(q, k, k, rows, query_rope=None, key_rope=None, sinks=None, layout_kv=layout_kv,
                                     actual_seq_lengths_kv=k_len.long(), sparse_mode=3, sparse_block_size=1, **kw)
    host = launch.sparse_attention_for(sfa_call, q, k, k, rows, None, None, None, 0.25, 1)
    device = launch.sparse_attention_for(_on_device(sfa_call), q, k, k, rows, None, None, None, 0.25, 1)
    for a, b in zip(host, device):
        assert torch.equal(a, b)
    assert triton_backend.count("indexer_topk_kernel") == 2 and triton_backend.count("sparse_attention_kernel") == 2


def test_out_of_range_values_are_clamped_or_masked(triton_backend):
    """A key length past the block table's capacity reads the capacity; entries past a row's keys, negative ones and
    -1 read nothing; a block id outside the cache contributes no keys, whatever its value (paged TND)."""
    q, q_len, k, k_len, table = _case("TND", "PA_BSND", seed=1)
    capacity = table.shape[1] * k.shape[1]
    rows = pack_rows(random_rows(Q_LENS, K_LENS, 6, seed=4), "TND").to(DEVICE)
    kw = dict(query_rope=None, key_rope=None, sinks=None, layout_query="TND", layout_kv="PA_BSND", sparse_mode=0,
              sparse_block_size=1, actual_seq_lengths_query=q_len, block_table=table)
    clean_call = sparse_attention_call(q, k, k, rows, actual_seq_lengths_kv=k_len, **kw)
    want = launch.sparse_attention_for(clean_call, q, k, k, rows, None, None, None, 0.25, 1)[0]
    bad_rows = torch.cat([rows, torch.tensor([10**6, -7, capacity], dtype=torch.int32,
                                             device=DEVICE).expand(rows.shape[0], 1, 3)], -1)
    bad_call = _on_device(dataclasses.replace(clean_call, kv_lens=k_len))
    got = launch.sparse_attention_for(bad_call, q, k, k, bad_rows, None, None, None, 0.25, 1)[0]
    assert torch.equal(got, want)
    big = _on_device(dataclasses.replace(clean_call, kv_lens=torch.full_like(k_len, 10**6)))
    assert torch.equal(launch.sparse_attention_for(big, q, k, k, rows, None, None, None, 0.25, 1)[0], want)
    outs = []
    for first, second in ((10**6, -5), (-1, k.shape[0])):  # block ids outside the cache: masked alike
        moved = table.clone()
        moved[2, 0], moved[2, 1] = first, second
        outs.append(launch.sparse_attention_for(dataclasses.replace(big, block_table=moved), q, k, k, rows, None,
                                                None, None, 0.25, 1)[0])
    assert torch.equal(*outs) and not torch.equal(outs[0], want)
    with pytest.raises(attnops.ParamInvalidError, match="actual_seq_lengths_kv"):  # the same value on the CPU
        sparse_attention_call(q.cpu(), k.cpu(), k.cpu(), rows.cpu(), actual_seq_lengths_kv=torch.full_like(
            k_len.cpu(), capacity + 1), **{**kw, "actual_seq_lengths_query": q_len.cpu(), "block_table": table.cpu()})
