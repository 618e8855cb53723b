"""Batch x heads past CUDA's 65535 programs per grid axis: the NSA training kernels (selected attention, compression,
compressed-attention scores) fold their (batch, head) pairs into grid axes 1 and 2 (``FOLD``, programs past the last
pair return at once). In the interpreter with the limit lowered to 3, every output and gradient still matches the fp64
golden; at the real limit, calls with more pairs are accepted and planned folded (``meta`` tensors, launches
recorded)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops._core.triton.launch import KernelFamily
from attnops.ops.nsa.triton import family
from attnops.testing import gpu_dry_run

from ..nsa_helpers import check_compress, check_compress_attention, check_selected, cum, randn, random_topk
from .conftest import DEVICE

pytest.importorskip("triton")


@pytest.fixture
def grids(monkeypatch, triton_backend):
    """At most 3 programs per grid axis for the NSA kernels; yields each launched kernel's ``(axes 1 and 2, FOLD)``
    (FlashAttention's kernels keep their own limit)."""
    monkeypatch.setattr(family, "MAX_GRID", 3)
    seen = {}
    run = KernelFamily.run

    def recording(self, launch, device):
        seen[launch.kernel] = (launch.grid[1:], launch.kwargs.get("FOLD"))
        return run(self, launch, device)

    monkeypatch.setattr(KernelFamily, "run", recording)
    return seen


def test_selected_attention_forward_and_backward(grids):
    q_lens, kv_lens, bs = [5, 0, 3, 4], [16, 8, 16, 24], 8  # 4 batches x 2 KV heads: 8 pairs, 3 folds
    q, k, v = (randn(sum(n), h, d, seed=s).to(DEVICE) for n, h, d, s in ((q_lens, 4, 16, 1), (kv_lens, 2, 16, 2),
                                                                         (kv_lens, 2, 8, 3)))
    topk = random_topk(q_lens, kv_lens, 2, 2, bs, seed=4).to(DEVICE)
    check_selected(q, k, v, topk, block=bs, q_lens=q_lens, kv_lens=kv_lens, causal=True)
    folded = ("selected_fwd_kernel", "selected_dq_kernel", "selected_keys_kernel")  # dK/dV: a 1D grid of list chunks
    assert {name: grids[name] for name in folded} == dict.fromkeys(folded, ((3, 3), True))


def test_compression_forward_and_backward(grids):
    x, w = randn(40, 2, 16, seed=5).to(DEVICE), randn(4, 2, seed=6).to(DEVICE)  # 3 batches x 2 heads: 6 pairs
    check_compress(x, w, 4, 2, [11, 13, 30])
    assert {name: grids[name] for name in ("compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel")} == \
        dict.fromkeys(("compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel"), ((3, 2), True))


def test_compressed_attention_scores(grids):
    q_lens, cmp_lens = [5, 9, 4], [7, 21, 12]  # 3 batches x 2 KV heads: 6 pairs
    q, k, v = (randn(sum(n), h, d, seed=s).to(DEVICE) for n, h, d, s in ((q_lens, 4, 16, 7), (cmp_lens, 2, 16, 8),
                                                                         (cmp_lens, 2, 8, 9)))
    check_compress_attention(q, k, v, block=32, stride=16, select_block=32, count=2, q_lens=q_lens,
                             cmp_lens=cmp_lens, backward=False)
    assert grids["importance_kernel"] == ((3, 2), True)


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, device="meta", dtype=dtype)


BATCHES = 65536  # one-token batches, one KV head: 65536 pairs, 2 folds (more batches than one grid axis holds)


def test_more_pairs_than_a_grid_axis_holds_are_planned_folded():
    lens = cum([1] * BATCHES)
    kv = cum([64] * BATCHES)
    q, k, v = _meta(BATCHES, 4, 64), _meta(64 * BATCHES, 1, 64), _meta(64 * BATCHES, 1, 64)
    with gpu_dry_run() as launches:
        attnops.nsa_selected_attention(q, k, v, _meta(BATCHES, 1, 1, dtype=torch.int32), select_block_size=64,
                                       actual_seq_qlen=lens, actual_seq_kvlen=kv)
        attnops.nsa_compress(k, _meta(32, 1), block_size=32, stride=32, actual_seq_len=kv)
        attnops.nsa_compress_attention(q, k[:2 * BATCHES], v[:2 * BATCHES], compress_block_size=32,
                                       compress_stride=32, select_block_size=64, select_block_count=1,
                                       actual_seq_qlen=lens, actual_cmp_seq_kvlen=cum([2] * BATCHES))
    folded = {r.kernel: (r.grid[1:], r.constexprs.get("FOLD")) for r in launches if r.family == "nsa"}
    assert folded == dict.fromkeys(("selected_fwd_kernel", "compress_fwd_kernel", "importance_kernel"),
                                   ((65535, 2), True)) | {"topk_kernel": ((), None)}
