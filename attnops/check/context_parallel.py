"""Context-parallel check cases: :func:`attnops.distributed.ring_flash_attention` and
:func:`attnops.distributed.ulysses_flash_attention` at world size 2 on CPU Gloo, forward output and q/k/v gradients
(gathered from the ranks' shards) against the fp64 golden of attention over the whole sequence.

One spawn of two processes runs every case (a file store in a temporary directory, a Gloo timeout, a join
timeout); a hang, a crash or a machine that cannot spawn makes the rows FAIL with the reason. Reference only.
"""
from __future__ import annotations

import functools
import os
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..distributed import ring_flash_attention, ring_shard, ring_unshard, ulysses_flash_attention
from ..distributed.processes import run_ranks
from ..distributed.sharding import SEQ_DIM
from ..testing import golden
from ..testing.compare import fa_reductions
from .case import CheckCase, Comparison
from .flash_attention import CAUSAL_2048

WORLD_SIZE = 2
GROUP_TIMEOUT_S = 60  # a rank waiting for a dead or stuck peer raises after this
JOIN_TIMEOUT_S = 120  # the parent kills the processes after this
OUTPUTS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class CPCase:
    """Global self-attention inputs: dense ``BSND`` ``[b, S, N, D]`` with ``lens=(S,)``, or ``TND`` with ``lens``
    the global sequence lengths; ``kind`` picks the scheme (ring: load-balanced chunks; Ulysses: contiguous)."""

    name: str
    kind: str
    layout: str
    lens: tuple[int, ...]
    n1: int
    n2: int
    b: int = 1
    d: int = 16
    dtype: torch.dtype = torch.float32
    causal: bool = True

    @property
    def cumulative(self) -> list[int]:
        return torch.tensor(self.lens).cumsum(0).tolist()

    def inputs(self) -> list[torch.Tensor]:
        """Global ``q, k, v, dy``, the same in every process."""
        gen = torch.Generator().manual_seed(sum(map(ord, self.name)))
        lead = (sum(self.lens),) if self.layout == "TND" else (self.b, self.lens[0])
        shapes = [(*lead, n, self.d) for n in (self.n1, self.n2, self.n2, self.n1)]
        return [torch.randn(s, generator=gen).to(self.dtype) for s in shapes]

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        if self.kind == "ring":
            return ring_shard(x, rank, WORLD_SIZE, layout=self.layout,
                              actual_seq_len=self.cumulative if self.layout == "TND" else None)
        dim = SEQ_DIM[self.layout]
        size = x.shape[dim] // WORLD_SIZE
        return x.narrow(dim, rank * size, size)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "ring":
            return ring_unshard(shards, layout=self.layout,
                                actual_seq_len=self.cumulative if self.layout == "TND" else None)
        return torch.cat(shards, SEQ_DIM[self.layout])

    def run_distributed(self, rank: int) -> list[torch.Tensor]:
        """This rank's output and q/k/v gradients."""
        q, k, v, dy = (self.shard(x, rank) for x in self.inputs())
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fn = ring_flash_attention if self.kind == "ring" else ulysses_flash_attention
        kw = dict(actual_seq_len=self.cumulative) if self.layout == "TND" else {}
        out = fn(*leaves, layout=self.layout, scale=self.d ** -0.5, causal=self.causal, **kw)
        out.backward(dy)
        return [out.detach()] + [x.grad for x in leaves]

    def golden_kwargs(self) -> dict:
        kw = dict(head_num=self.n1, input_layout=self.layout, scale=self.d ** -0.5)
        if self.causal:
            kw.update(atten_mask=CAUSAL_2048, sparse_mode=2)
        if self.layout == "TND":
            kw.update(actual_seq_qlen=self.cumulative, actual_seq_kvlen=self.cumulative)
        return kw


CASES = [
    CPCase("ring causal BSND fp16, batch 2", "ring", "BSND", (32,), 2, 2, b=2, dtype=torch.float16),
    CPCase("ring causal TND varlen, GQA 2", "ring", "TND", (8, 20, 12), 4, 2),
    CPCase("ulysses causal BSND, GQA 2", "ulysses", "BSND", (32,), 4, 2),
]


def _worker(rank: int, store: str, out_dir: str) -> None:
    """One rank: every case on one Gloo group; saves ``{case: [out, dq, dk, dv] or traceback text}``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    results: dict[str, object] = {}
    for case in CASES:
        try:
            results[case.name] = case.run_distributed(rank)
        except Exception:  # noqa: BLE001 - reported as the case's FAIL row
            results[case.name] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@functools.cache
def _spawn_all() -> list[dict] | str:
    """Every rank's results, or why there are none (spawn impossible, hang, crash)."""
    with tempfile.TemporaryDirectory(prefix="attnops-check-") as tmp:
        try:
            procs, hung = run_ranks(_worker, WORLD_SIZE, (os.path.join(tmp, "store"), tmp), JOIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no processes on this machine: every row FAILs with the reason
            return f"cannot spawn {WORLD_SIZE} processes: {type(exc).__name__}: {' '.join(str(exc).split())}"
        if hung:
            return f"processes {hung} did not finish within {JOIN_TIMEOUT_S} s (killed)"
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                return f"rank {r} exited with code {p.exitcode} before reporting"
            results.append(torch.load(path))
        return results


def _run(case: CPCase) -> list[Comparison]:
    ranks = _spawn_all()
    if isinstance(ranks, str):
        raise RuntimeError(ranks)
    for r, res in enumerate(ranks):
        if isinstance(res[case.name], str):
            raise RuntimeError(f"rank {r}: {res[case.name].strip().splitlines()[-1]}")
    actual = [case.unshard([res[case.name][i] for res in ranks]) for i in range(len(OUTPUTS))]
    q, k, v, dy = case.inputs()
    kw = case.golden_kwargs()
    gold = [golden.fa_forward(q, k, v, **kw)[0], *golden.fa_backward(dy, q, k, v, **kw)[:3]]
    base = [golden.fa_forward(q, k, v, dtype=case.dtype, **kw)[0],
            *golden.fa_backward(dy, q, k, v, dtype=case.dtype, **kw)[:3]]
    red = fa_reductions(q, k, v, layout=case.layout, head_num=case.n1, actual_seq_qlen=kw.get("actual_seq_qlen"),
                        actual_seq_kvlen=kw.get("actual_seq_kvlen"))
    return [Comparison(name, a, g, b, 2.0 if name == "out" else 3.0, red[name])
            for name, a, g, b in zip(OUTPUTS, actual, gold, base)]


def cases() -> list[CheckCase]:
    return [CheckCase(f"attnops.distributed.{c.kind}_flash_attention", f"{c.name}, world size {WORLD_SIZE} gloo",
                      (lambda _backend, c=c: _run(c))) for c in CASES]
