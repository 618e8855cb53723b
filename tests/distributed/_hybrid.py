"""Bad configurations (probes), each of which must raise an attnops error naming the argument on every rank without
a hang, and the byte counts of every mode (run inside a worker at world size 4)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from attnops.distributed import allgather_flash_attention, hybrid_flash_attention, hybrid_groups, ring_flash_attention
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


@functools.lru_cache(maxsize=None)
def _groups(world: int):
    return hybrid_groups(2, world // 2)  # collective: every rank reaches it at the same check


def _probe(probe, world: int) -> str:
    try:
        probe(_groups(world))
        return "returned"
    except Exception as e:  # noqa: BLE001 - the error is the probe's outcome
        return f"{type(e).__name__}: {e}"


def run_probes(world: int) -> list[tuple[str, object]]:
    """``(name, check)`` of the probes (outcome: the error raised) and the byte counts (fp32, fp16)."""
    return [*((name, functools.partial(_probe, probe, world)) for name, _, probe in PROBES),
            *((f"traffic_{str(dtype).split('.')[-1]}", lambda dtype=dtype: check_traffic(world, _groups(world), dtype))
              for dtype in (torch.float32, torch.float16))]
