"""The hybrid tests' worker: the ``_cases`` cases, then bad configurations (probes), each of which must raise an
attnops error naming the argument on every rank, without a hang, and the byte counts of every mode."""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from attnops.distributed import allgather_flash_attention, hybrid_flash_attention, hybrid_groups, ring_flash_attention
from tests.distributed._cases import Case, _init, run_cases, write_results
from tests.distributed._traffic import check_traffic
from tests.helpers import randn


def _degrees_not_dividing_the_world(groups):
    hybrid_groups(3, 1)


def _heads_not_dividing_the_ulysses_degree(groups):
    q = randn(1, 4, 3, 8)
    hybrid_flash_attention(q, q, q, ulysses_group=groups.ulysses, ring_group=groups.ring)


def _tnd_lengths_not_divisible_by_2r(groups):
    t = randn(3, 2, 8)
    hybrid_flash_attention(t, t, t, ulysses_group=groups.ulysses, ring_group=groups.ring, layout="TND",
                           actual_seq_len=[6, 12])


def _ring_group_missing(groups):
    q = randn(1, 4, 2, 8)
    hybrid_flash_attention(q, q, q, ulysses_group=groups.ulysses, ring_group=None)


def _causal_differs_across_ranks(groups):
    q = randn(1, 4, 2, 8)
    hybrid_flash_attention(q, q, q, ulysses_group=groups.ulysses, ring_group=groups.ring,
                           causal=dist.get_rank() == 0)


def _layout_differs_across_ranks(groups):
    q = randn(1, 4, 2, 8)
    ring_flash_attention(q, q, q, layout="BSND" if dist.get_rank() == 3 else "BNSD")


def _lengths_differ_across_ranks(groups):
    t = randn(6, 2, 8)
    allgather_flash_attention(t, t, t, layout="TND", actual_seq_len=[8, 24] if dist.get_rank() else [12, 24])


PROBES = [
    ("degrees", "ulysses_degree", _degrees_not_dividing_the_world),
    ("heads", "query", _heads_not_dividing_the_ulysses_degree),
    ("tnd_lengths", "actual_seq_len", _tnd_lengths_not_divisible_by_2r),
    ("ring_group", "ring_group", _ring_group_missing),
    ("causal_mismatch", "causal", _causal_differs_across_ranks),
    ("layout_mismatch", "layout", _layout_differs_across_ranks),
    ("lengths_mismatch", "actual_seq_len", _lengths_differ_across_ranks),
]


def hybrid_worker(rank: int, world: int, init_file: str, out_dir: str, cases: list[Case], probes: bool) -> None:
    """Run ``cases``, then (``probes``) every probe on Ulysses degree 2; record ``"ok"``/tracebacks and the
    probes' errors."""
    _init(rank, world, init_file, 30)
    results = run_cases(rank, world, cases)
    if probes:
        groups = hybrid_groups(2, world // 2)
        for dtype in (torch.float32, torch.float16):
            name = f"traffic_{str(dtype).split('.')[-1]}"
            try:
                check_traffic(world, groups, dtype)
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported to the parent test
                results[name] = traceback.format_exc()
        for name, _, probe in PROBES:
            try:
                probe(groups)
                results[name] = "returned"
            except Exception as e:  # noqa: BLE001 - the error is the test's subject
                results[name] = f"{type(e).__name__}: {e}"
    write_results(out_dir, rank, results)
    dist.destroy_process_group()
