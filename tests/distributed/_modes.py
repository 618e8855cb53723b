"""The multi-process cases of every mode (ring, Ulysses, hybrid, KV all-gather, PyTorch's ``context_parallel()``),
run by one spawn per world size (:func:`modes_worker`, shared by the test files through session fixtures in
``conftest.py``): spawning and importing is most of the cost of a case."""
from __future__ import annotations

import os
import traceback

import torch

from tests.distributed._cases import Case, _init, run_cases, write_results
from tests.distributed._failures import FAILURE_CHECKS
from tests.distributed._hybrid import run_probes
from tests.distributed._sparse_cases import sparse_checks
from tests.distributed._torch_cp_cases import torch_cp_checks

RING_WORLD2 = [
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

RING_WORLD4 = [
    Case("ring_causal_bnsd", s=32, causal=True, stats=True),
    Case("ring_causal_tnd_gqa_alibi", layout="TND", lens=(16, 16), n1=4, n2=2, causal=True, alibi=2),
    Case("ring_causal_dropout_bsnd", layout="BSND", causal=True, keep_prob=0.8),
    Case("ulysses_causal_gqa_repeat_dropout", kind="ulysses", layout="BSND", n1=4, n2=2, causal=True,
         keep_prob=0.8),
]


HYBRID_WORLD2 = [
    Case("hybrid_u2_causal_sbh", kind="hybrid", ulysses_degree=2, layout="SBH", b=2, causal=True),
    Case("hybrid_r2_causal_tnd_dropout", kind="hybrid", layout="TND", lens=(8, 4), causal=True, keep_prob=0.8),
]

HYBRID_WORLD4 = [
    Case("hybrid_u2r2_causal_bsnd", kind="hybrid", ulysses_degree=2, layout="BSND", causal=True, stats=True),
    Case("hybrid_u2r2_causal_tnd_gqa_repeat", kind="hybrid", ulysses_degree=2, layout="TND", lens=(8, 16), n1=4,
         n2=1, causal=True, stats=True),
    Case("hybrid_u2r2_causal_alibi_dv_bnsd", kind="hybrid", ulysses_degree=2, b=2, dv=4, causal=True, alibi=3),
    Case("hybrid_u2r2_full_dropout_bsh_batch2", kind="hybrid", ulysses_degree=2, layout="BSH", b=2, keep_prob=0.8),
    Case("hybrid_u2r2_causal_dropout_tnd", kind="hybrid", ulysses_degree=2, layout="TND", lens=(8, 8), causal=True,
         keep_prob=0.7),
    Case("hybrid_u4_causal_gqa", kind="hybrid", ulysses_degree=4, layout="BSND", n1=4, n2=2, causal=True),
    Case("hybrid_r4_causal_alibi", kind="hybrid", layout="BSND", causal=True, alibi=2),
]

ALLGATHER_WORLD2 = [
    Case("allgather_full_alibi2_bnsd", kind="allgather", alibi=2),
    Case("allgather_causal_bsnd", kind="allgather", layout="BSND", b=2, causal=True),
    Case("allgather_full_gqa_dv_bnsd", kind="allgather", n1=4, n2=2, dv=4),
    Case("allgather_causal_alibi_sbh", kind="allgather", layout="SBH", causal=True, alibi=2),
    Case("allgather_causal_tnd", kind="allgather", layout="TND", lens=(8, 4, 12), causal=True),
    Case("allgather_llama3_causal_tnd", kind="allgather", split="contiguous", layout="TND", lens=(5, 9, 2),
         causal=True),
    Case("allgather_contiguous_causal_bsh", kind="allgather", split="contiguous", layout="BSH", n1=4, n2=1,
         causal=True, s=10),
]

ALLGATHER_WORLD4 = [
    Case("allgather_causal_tnd_gqa", kind="allgather", layout="TND", lens=(16, 8), n1=4, n2=2, causal=True),
    Case("allgather_full_alibi3_bnsd", kind="allgather", s=32, alibi=3),
    Case("allgather_llama3_full_tnd", kind="allgather", split="contiguous", layout="TND", lens=(3, 11, 6)),
]

CASES = {2: RING_WORLD2 + HYBRID_WORLD2 + ALLGATHER_WORLD2, 4: RING_WORLD4 + HYBRID_WORLD4 + ALLGATHER_WORLD4}


def named_checks(world: int) -> list[tuple[str, object]]:
    """``(name, thunk)`` of every non-``Case`` check at the world size (NSA/DSA pipelines, PyTorch's region, and at
    world size 4 the bad-configuration probes and the byte counts, at 2 a rank failing mid-call)."""
    return [*sparse_checks(world), *torch_cp_checks(world),
            *(run_probes(world) if world == 4 else FAILURE_CHECKS)]  # failures last: they break their groups


def modes_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Every case and check of the world size on one process group; ``"ok"``, a traceback, or (probes, failures)
    the error. Exits without the collective teardown (a failure check leaves peers gone)."""
    _init(rank, world, init_file, 60)
    results = run_cases(rank, world, CASES[world])
    for name, check in named_checks(world):
        try:
            outcome = check()
            results[name] = "ok" if outcome is None else outcome
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    write_results(out_dir, rank, results)
    os._exit(0)
