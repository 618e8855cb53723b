"""Ring attention and Ulysses on CPU Gloo at world sizes 2 and 4 against single-device attnops and the fp64 golden.

Spawning is the slow part, so one spawn per world size runs every case of every mode on one process group (the
``modes_world*`` fixtures of ``conftest.py``, cases in ``_modes``); each test then checks its case's result on every
rank.
"""
from __future__ import annotations

import json

import pytest

from attnops.distributed.processes import run_ranks
from tests.distributed._cases import failing_worker
from tests.distributed._modes import RING_WORLD2, RING_WORLD4

JOIN_TIMEOUT_S = 240

def _spawn(fn, world: int, tmp_path, *args) -> list[dict]:
    """Run ``fn(rank, world, init_file, out_dir, *args)`` on ``world`` processes; return every rank's JSON."""
    procs, hung = run_ranks(fn, world, (world, str(tmp_path / "store"), str(tmp_path), *args), JOIN_TIMEOUT_S)
    assert not hung, f"processes {hung} did not finish within {JOIN_TIMEOUT_S} s"
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} exited with code {procs[r].exitcode} before reporting"
        results.append(json.loads(path.read_text()))
    return results


def _check(results: list[dict], name: str) -> None:
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", [c.name for c in RING_WORLD2])
def test_world2(modes_world2, name):
    _check(modes_world2, name)


@pytest.mark.parametrize("name", [c.name for c in RING_WORLD4])
def test_world4(modes_world4, name):
    _check(modes_world4, name)


def test_rank_failing_mid_step_raises_everywhere(tmp_path):
    """The last rank raises inside a backward step; the others must raise too (no hang), by their own group
    timeout: the failed rank stays alive until they have reported."""
    results = _spawn(failing_worker, 2, tmp_path, 2.0)
    assert "injected failure" in results[1]["outcome"]
    assert results[0]["outcome"] != "returned", results[0]
    assert results[1]["others_reported_while_alive"], results
