"""Ring attention and Ulysses on CPU Gloo at world sizes 2 and 4 against single-device attnops and the fp64 golden.

Spawning is the slow part, so one spawn per world size runs every case on one process group
(``_cases.worker``; its tests share one pytest-xdist worker); each test then checks its case's result on every
rank.
"""
from __future__ import annotations

import json

import pytest
import torch

from attnops.distributed.processes import run_ranks
from tests.distributed._cases import Case, failing_worker, worker

JOIN_TIMEOUT_S = 240

WORLD2 = [
    Case("ring_full_bnsd"),
    Case("ring_causal_bsnd_batch2", layout="BSND", b=2, causal=True, stats=True),
    Case("ring_causal_gqa_bsh_dv", layout="BSH", n1=4, n2=2, dv=4, causal=True),
    Case("ring_causal_tnd", layout="TND", lens=(8, 4, 12), causal=True, stats=True),
    Case("ring_full_tnd_gqa", layout="TND", lens=(4, 8), n1=4, n2=1),
    Case("ring_causal_alibi2_bnsd", causal=True, alibi=2),
    Case("ring_full_alibi3_sbh", layout="SBH", b=2, alibi=3),
    Case("ring_causal_dropout_bnsd", causal=True, keep_prob=0.8),
    Case("ring_full_dropout_tnd", layout="TND", lens=(8, 4), keep_prob=0.7),
    Case("ring_causal_fp16", causal=True, dtype=torch.float16),
    Case("ring_world1_causal", causal=True, own_group=True, stats=True),
    Case("ulysses_causal_bsnd_gqa_repeat", kind="ulysses", layout="BSND", n1=4, n2=1, causal=True),
    Case("ulysses_full_bnsd", kind="ulysses", b=2),
    Case("ulysses_causal_tnd", kind="ulysses", layout="TND", lens=(6, 10), causal=True),
    Case("ulysses_alibi_dropout", kind="ulysses", causal=True, alibi=2, keep_prob=0.8),
    Case("ulysses_pse_tensor_bsh", kind="ulysses", layout="BSH", alibi=1),
]

WORLD4 = [
    Case("ring_causal_bnsd", s=32, causal=True, stats=True),
    Case("ring_causal_tnd_gqa_alibi", layout="TND", lens=(16, 16), n1=4, n2=2, causal=True, alibi=2),
    Case("ring_causal_dropout_bsnd", layout="BSND", causal=True, keep_prob=0.8),
    Case("ulysses_causal_gqa_repeat_dropout", kind="ulysses", layout="BSND", n1=4, n2=2, causal=True,
         keep_prob=0.8),
]


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


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(worker, 2, tmp_path_factory.mktemp("world2"), WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(worker, 4, tmp_path_factory.mktemp("world4"), WORLD4)


def _check(results: list[dict], name: str) -> None:
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.xdist_group("world2")  # one worker spawns the world for all of them
@pytest.mark.parametrize("name", [c.name for c in WORLD2])
def test_world2(world2, name):
    _check(world2, name)


@pytest.mark.xdist_group("world4")  # one worker spawns the world for all of them
@pytest.mark.parametrize("name", [c.name for c in WORLD4])
def test_world4(world4, name):
    _check(world4, name)


def test_rank_failing_mid_step_raises_everywhere(tmp_path):
    """The last rank raises inside a backward step; the others must raise too (no hang), by their own group
    timeout: the failed rank stays alive until they have reported."""
    results = _spawn(failing_worker, 2, tmp_path, 2.0)
    assert "injected failure" in results[1]["outcome"]
    assert results[0]["outcome"] != "returned", results[0]
    assert results[1]["others_reported_while_alive"], results
