"""A rank failing between two collectives of the KV all-gather and the hybrid modes (run inside a world-size-2
worker, last): the failing rank raises, the other must raise too (group timeout or closed connection), never hang.
Each check runs on a fresh group with a short timeout; the broken groups are never used again."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

import attnops.distributed.allgather as allgather
import attnops.distributed.ring as ring
from attnops.distributed import allgather_flash_attention, hybrid_flash_attention
from tests.helpers import randn

TIMEOUT = timedelta(seconds=3)


def _failing(*args, **kwargs):
    raise RuntimeError("injected failure")


def _outcome(module, run) -> str:
    """Run ``run()`` with ``module.flash_attention`` failing on the last rank; the exception text, or "returned"."""
    original = module.flash_attention
    if dist.get_rank() == dist.get_world_size() - 1:
        module.flash_attention = _failing
    try:
        run()
        return "returned"
    except Exception as e:  # noqa: BLE001 - the outcome is the check's subject
        return f"{type(e).__name__}: {e}"
    finally:
        module.flash_attention = original


def allgather_rank_failure() -> str:
    """The last rank fails after the K/V all-gather; the others wait for its dK/dV in the reduce-scatter."""
    group = dist.new_group([0, 1], timeout=TIMEOUT)
    q = randn(1, 4, 2, 8, seed=dist.get_rank()).requires_grad_()
    return _outcome(allgather, lambda: allgather_flash_attention(q, q, q, group=group, causal=True).sum().backward())


def hybrid_rank_failure() -> str:
    """Ulysses over both ranks: the last rank fails after the first all-to-all, the other waits in the next."""
    ulysses = dist.new_group([0, 1], timeout=TIMEOUT)
    singles = [dist.new_group([r]) for r in range(2)]
    q = randn(1, 4, 2, 8, seed=dist.get_rank())
    return _outcome(ring, lambda: hybrid_flash_attention(q, q, q, ulysses_group=ulysses,
                                                         ring_group=singles[dist.get_rank()], causal=True))


FAILURE_CHECKS = [("allgather_rank_failure", allgather_rank_failure), ("hybrid_rank_failure", hybrid_rank_failure)]
