"""The ``cp-cpu`` suite: context-parallel modes on CPU Gloo at 1, 2 and 4 processes, a fixed length per rank.

For every mode (ring, Ulysses, KV all-gather, hybrid Ulysses x ring) and world size, each rank runs causal
FlashAttention forward + backward on its shard (BSND, fp32, ``N1=8``, ``N2=2``, ``D=64``, ``per_rank`` tokens per
rank, so the global sequence grows with the world size); the time per step is the median over the repetitions on
rank 0, the bytes are what each rank sends per layer, counted around the collectives
(:func:`attnops.distributed.traffic.count_traffic`; the cross-rank argument check is off). World size 1 runs the
modes on a one-rank group: the operator alone, no traffic. On a 2-core machine the processes share the cores, so
the times show the traffic and orchestration cost rather than a speed-up.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from .types import Case

MODES = ("ring", "ulysses", "allgather", "hybrid")
WORLDS = (1, 2, 4)
PER_RANK = 512
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def cp_cases() -> tuple[Case, ...]:
    """One case per (mode, world size); hybrid needs both degrees > 1 (world size 4: 2 x 2)."""
    return tuple(Case(name=f"cp-{mode}-p{world}", op="context_parallel", mode="fwd+bwd", heads=HEADS,
                      kv_heads=KV_HEADS, sq=PER_RANK * world, skv=PER_RANK * world, d=HEAD_DIM, dv=HEAD_DIM,
                      causal=True, baselines=(), params={"world": world, "cp_mode": mode})
                 for world in WORLDS for mode in MODES if mode != "hybrid" or world == 4)


def _call(mode: str, world: int):
    import attnops.distributed as cp

    if mode == "hybrid":
        groups = cp.hybrid_groups(2, world // 2)
        return lambda q, k, v: cp.hybrid_flash_attention(q, k, v, ulysses_group=groups.ulysses,
                                                         ring_group=groups.ring, causal=True)
    fn = {"ring": cp.ring_flash_attention, "ulysses": cp.ulysses_flash_attention,
          "allgather": cp.allgather_flash_attention}[mode]
    return lambda q, k, v: fn(q, k, v, layout="BSND", causal=True)


def _worker(rank: int, world: int, init_file: str, out_dir: str, modes: list[str], repeat: int, warmup: int) -> None:
    import torch.distributed as dist

    from ..distributed.comm import set_rank_checks
    from ..distributed.traffic import count_traffic

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    set_rank_checks(False)
    gen = torch.Generator().manual_seed(rank)
    shapes = ((1, PER_RANK, HEADS, HEAD_DIM), (1, PER_RANK, KV_HEADS, HEAD_DIM), (1, PER_RANK, KV_HEADS, HEAD_DIM))
    results = {}
    for mode in modes:
        call = _call(mode, world)
        times, sent = [], {}
        for i in range(warmup + repeat):
            q, k, v = (torch.randn(*s, generator=gen).requires_grad_() for s in shapes)
            dist.barrier()
            t0 = time.perf_counter()
            with count_traffic() as fwd:
                out = call(q, k, v)
            with count_traffic() as bwd:
                out.backward(torch.ones_like(out))
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            sent = {"fwd": fwd.total, "bwd": bwd.total}
        results[mode] = {"step_s": statistics.median(times), "step_s_min": min(times), "bytes_sent": sent}
    if rank == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_cp_suite(cases: list[Case], repeat: int, warmup: int) -> list[dict]:
    """Run ``cases`` (grouped by world size, one spawn each); one entry per case."""
    from ..distributed.processes import run_ranks

    entries = []
    for world in sorted({c.params["world"] for c in cases}):
        mine = [c for c in cases if c.params["world"] == world]
        with tempfile.TemporaryDirectory() as tmp:
            modes = [c.params["cp_mode"] for c in mine]
            procs, hung = run_ranks(_worker, world, (world, os.path.join(tmp, "store"), tmp, modes, repeat, warmup),
                                    timeout_s=1800)
            path = Path(tmp, "rank0.json")
            if hung or not path.exists():
                raise RuntimeError(f"context-parallel benchmark at world size {world} failed "
                                   f"(exit codes {[p.exitcode for p in procs]}, killed {hung})")
            results = json.loads(path.read_text())
        for case in mine:
            entries.append({"case": case.describe(), **results[case.params["cp_mode"]]})
    return entries


def format_row(entry: dict) -> str:
    sent = entry["bytes_sent"]
    return (f"  step {entry['step_s'] * 1e3:9.1f} ms (min {entry['step_s_min'] * 1e3:.1f})   bytes sent per rank: "
            f"fwd {sent['fwd']:>10,}  bwd {sent['bwd']:>10,}")
