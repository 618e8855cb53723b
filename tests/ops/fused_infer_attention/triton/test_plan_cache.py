"""One-call FIA decodes reuse a decode plan while nothing it depends on changes (the layers of one step), and never
a stale one: new lengths, another block table, an in-place write to the block table, another shape or dtype, another
backend choice each make a new plan; calls the key cannot describe (inference tensors) are not cached. The last test
checks the results on the kernels (the interpreter on CPU) across changed lengths and pages."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.fused_infer_attention import backends
from attnops.ops.fused_infer_attention.triton import plan_cache
from attnops.testing import gpu_dry_run
from tests.ops.fused_infer_attention.triton.test_plan_run import BS, D, N, NKV, _cache, _check, _dev

M, F16, I32 = torch.device("meta"), torch.float16, torch.int32
B, BLOCKS, COLS = 4, 40, 10


@pytest.fixture
def plans(monkeypatch):
    """An empty cache; yields the list of plans made."""
    plan_cache.clear()
    made = []
    make = backends.make_plan
    monkeypatch.setattr(backends, "make_plan", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    yield made
    plan_cache.clear()


def _call(q, cache, table, lengths, **kw):
    with gpu_dry_run() as launches:
        attnops.fused_infer_attention(q, cache, cache, num_heads=N, num_key_value_heads=NKV, block_table=table,
                                      block_size=BS, actual_seq_lengths_kv=lengths, **kw)
    assert [x.kernel for x in launches] == ["split_kernel", "merge_kernel"]
    return launches


def _meta_call(table=None, lengths=(100, 3, 0, 160), dtype=F16, **kw):
    q, cache = torch.empty(B, N, 1, D, dtype=dtype, device=M), torch.empty(BLOCKS, NKV, BS, D, dtype=dtype, device=M)
    return _call(q, cache, torch.empty(B, COLS, dtype=I32, device=M) if table is None else table, list(lengths),
                 **kw)


def test_a_repeated_call_reuses_its_plan(plans):
    table = torch.empty(B, COLS, dtype=I32, device=M)
    for _ in range(3):
        _meta_call(table)  # each launches both kernels
    assert len(plans) == 1


def test_new_lengths_table_shape_dtype_or_backend_make_a_new_plan(plans, monkeypatch):
    table = torch.empty(B, COLS, dtype=I32, device=M)
    _meta_call(table)
    _meta_call(table, lengths=(100, 3, 1, 160))
    assert len(plans) == 2 and plans[1].lengths is not plans[0].lengths
    _meta_call(torch.empty(B, COLS, dtype=I32, device=M))  # another block table of the same shape
    assert len(plans) == 3
    _meta_call(table, dtype=torch.bfloat16)
    _meta_call(table, scale=0.5)
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    _meta_call(table)
    assert len(plans) == 6
    _meta_call(table)
    assert len(plans) == 6


def test_an_in_place_write_to_the_block_table_makes_a_new_plan(plans):
    table = torch.zeros(B, COLS, dtype=I32)
    q, cache = torch.empty(B, N, 1, D, dtype=F16), torch.empty(BLOCKS, NKV, BS, D, dtype=F16)
    _call(q, cache, table, [100, 3, 0, 160])
    _call(q, cache, table, [100, 3, 0, 160])
    table[0, 0] = 7
    _call(q, cache, table, [100, 3, 0, 160])
    assert len(plans) == 2


def test_inference_tensors_are_not_cached(plans):
    with torch.inference_mode():
        table = torch.zeros(B, COLS, dtype=I32)
    q, cache = torch.empty(B, N, 1, D, dtype=F16), torch.empty(BLOCKS, NKV, BS, D, dtype=F16)
    for _ in range(2):
        _call(q, cache, table, [100, 3, 0, 160])
    assert len(plans) == 2


def test_the_cache_keeps_at_most_its_capacity(plans):
    table = torch.empty(B, COLS, dtype=I32, device=M)
    for n in range(plan_cache.CAPACITY + 1):
        _meta_call(table, lengths=(n, 3, 0, 160))
    _meta_call(table, lengths=(plan_cache.CAPACITY, 3, 0, 160))
    assert len(plans) == plan_cache.CAPACITY + 1
    _meta_call(table, lengths=(0, 3, 0, 160))  # the least recently used, dropped
    assert len(plans) == plan_cache.CAPACITY + 2


def test_results_follow_changed_lengths_and_pages(plans, triton_backend):
    """Kernels vs golden on three calls: lengths [40, 7], the same lengths over other pages, lengths [7, 40]."""
    q = torch.randn(2, N, 1, D, generator=torch.Generator().manual_seed(0)).to(F16)
    for lens, seed in (([40, 7], 0), ([40, 7], 5), ([7, 40], 5)):
        kc, vc, bt = _cache(lens, seed=seed, capacity_blocks=4)
        out = attnops.fused_infer_attention(_dev(q), _dev(kc), _dev(vc), num_heads=N, num_key_value_heads=NKV,
                                            scale=0.25, block_table=_dev(bt), block_size=BS,
                                            actual_seq_lengths_kv=lens, return_lse=True)
        _check(triton_backend, out, q, kc, vc, lens=lens, bt=bt)
    assert len(plans) == 3
