"""The compressed decode's split over the compressed keys (FlashDecoding): split counts from shapes, and a split run
that is bitwise repeatable and agrees with the unsplit one."""
from __future__ import annotations

import torch

from attnops.ops.nsa.decode import CompressSelection
from attnops.ops.nsa.paged_kv import PagedKV
from attnops.ops.nsa.triton import infer_launch
from attnops.ops.nsa.triton.family import KERNELS
from attnops.ops.nsa.triton.infer_launch import DECODE_PROGRAMS, SPLIT_KEYS, decode_splits

from ..nsa_helpers import randn
from .conftest import DEVICE


def test_split_counts():
    """B=1 fills two waves of 132 SMs at long contexts; B=64 x 4 KV heads needs 2 splits, x 8 none; short contexts
    split into key tiles."""
    splits, chunk = decode_splits(1, 4, 4096)
    assert 4 * splits >= DECODE_PROGRAMS and (splits, chunk) == (86, 48)
    assert decode_splits(1, 1, 65536) == (274, 240)
    assert decode_splits(64, 4, 4096) == (2, 2048)
    assert decode_splits(64, 8, 4096) == (1, 4096)
    assert decode_splits(1, 4, 40) == decode_splits(1, 4, 37) == (3, SPLIT_KEYS)  # host list or capacity: alike
    assert decode_splits(1, 1, 0) == (1, SPLIT_KEYS)
    for batch, n2, keys in ((1, 1, 10_000), (3, 2, 777), (2, 4, 65)):
        splits, chunk = decode_splits(batch, n2, keys)
        assert (splits - 1) * chunk < keys <= splits * chunk  # every split holds keys


def _run(kv, sel, q, k, v, table, splits):
    """The compressed decode with ``splits`` forced (the planner's split count otherwise)."""
    original = infer_launch.decode_splits
    if splits is not None:
        infer_launch.decode_splits = lambda batch, n2, keys: (splits, -(-keys // splits))
    try:
        (out, topk), launches = infer_launch.compress_decode_plan(kv, sel, q, k, v, table, interpret=True)
    finally:
        infer_launch.decode_splits = original
    scores = launches[1].args[3]
    KERNELS.run_all(launches, q.device)
    return out, topk, scores


def test_split_decode_matches_unsplit_and_repeats():
    """Scores (from the merged final statistics) and outputs of 4 splits vs 1: equal up to the sums' rounding; the
    split run twice: bitwise equal."""
    lens, n2, g, d = (70, 33), 2, 4, 32
    page = 8
    pages = [-(-n // page) for n in lens]
    table = torch.arange(sum(pages), dtype=torch.int32).reshape(len(lens), -1)
    q = randn(len(lens), n2 * g, d, dtype=torch.float32, seed=1).to(DEVICE)
    k = randn(sum(pages), page, n2, d, dtype=torch.float32, seed=2).to(DEVICE)
    v = randn(sum(pages), page, n2, d, dtype=torch.float32, seed=3).to(DEVICE)
    kv = PagedKV(len(lens), n2 * g, n2, d, lens, d ** -0.5, table.shape[1] * page)
    sel = CompressSelection(32, 16, 64, 3)
    table = table.to(DEVICE)
    one = _run(kv, sel, q, k, v, table, 1)
    four, again = (_run(kv, sel, q, k, v, table, 4) for _ in range(2))
    for a, b in zip(four, again):
        assert torch.equal(a, b)
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=1e-6)
    finite = one[2].isfinite()
    assert torch.equal(finite, four[2].isfinite())
    torch.testing.assert_close(four[2][finite], one[2][finite], rtol=1e-5, atol=1e-7)
