"""The ``golden-cpu`` suite: the CPU cost of judging NPU calls (``python -m attnops compare``) and of the float64
golden of ``npu_fusion_attention``, side by side with msprobe's own CPU bench function.

Every measurement runs in a fresh subprocess, so its peak RSS is its own: CPU time is the process's user + system
time over all its threads (``os.wait4``), peak memory its maximum resident set. Cases:

- ``compare-*``: the whole ``python -m attnops compare DUMP --quiet`` process (imports included) on a dump of one
  causal BNSD bf16 ``npu_fusion_attention`` call, forward and backward (golden and NPU emulation of each). The
  dump is written once per run (not measured) with the emulation's results as the NPU's.
- ``bench-msprobe-*`` / ``bench-attnops-*``: msprobe's ``npu_fusion_attention`` + ``npu_fusion_attention_grad``
  bench functions (dense ``[B, N, S, S]`` float64) and attnops' ones (:mod:`attnops.msprobe.bench_functions`) on
  the same arguments; CPU time and the peak RSS growth of the two calls (the imports excluded). msprobe's cases
  are skipped, with the reason, without ``mindstudio-probe`` (``pip install "attnops[msprobe]"``).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .types import Case

__all__ = ["CASES", "run_suite", "format_row", "write_dump"]


def _case(kind: str, heads: int, s: int) -> Case:
    return Case(name=f"{kind}-b1-n{heads}-s{s}-d128-bf16-causal", mode="fwd+bwd", batch=1, heads=heads,
                kv_heads=heads, sq=s, skv=s, d=128, dv=128, dtype="bfloat16", causal=True, layout="BNSD",
                baselines=(), params={"kind": kind})


CASES = (_case("compare", 32, 4096), _case("compare", 8, 32768), _case("bench-msprobe", 8, 2048),
         _case("bench-attnops", 8, 2048))


def _inputs(case: Case) -> tuple[list[torch.Tensor], dict]:
    """q, k, v, dy (BNSD bf16, seeded) and the causal call's keyword arguments (sparse mode 2)."""
    g = torch.Generator().manual_seed(0)
    shape = (case.batch, case.heads, case.sq, case.d)
    tensors = [torch.randn(shape, generator=g).bfloat16() for _ in range(4)]
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return tensors, dict(atten_mask=mask, scale=case.d ** -0.5, sparse_mode=2)


def _record(name: str, value, tensors: dict):
    if isinstance(value, torch.Tensor):
        tensors[f"{name}.pt"] = value
        return {"type": "torch.Tensor", "dtype": str(value.dtype), "shape": list(value.shape),
                "data_name": f"{name}.pt"}
    if isinstance(value, (list, tuple)):
        return [_record(f"{name}.{i}", v, tensors) for i, v in enumerate(value)]
    return None if value is None else {"type": type(value).__name__, "value": value}


def write_dump(case: Case, rank_dir: Path) -> None:
    """A msprobe tensor dump of the case's call (forward and backward entries), the NPU's results being the
    emulation's (``precision="npu"``)."""
    import attnops

    (q, k, v, dy), kwargs = _inputs(case)
    opts = dict(layout="BNSD", head_num=case.heads, precision="npu", **kwargs)
    fwd = attnops.flash_attention(q, k, v, return_stats=True, **opts)
    grads = attnops.flash_attention_backward(dy, q, k, v, fwd.out, fwd.softmax_max, fwd.softmax_sum, **opts)
    name = "NPU.npu_fusion_attention.0"
    tensors: dict[str, torch.Tensor] = {}
    data = {f"{name}.forward": {
        "input_args": _record(f"{name}.forward.input", [q, k, v, case.heads, "BNSD"], tensors),
        "input_kwargs": {n: _record(f"{name}.forward.kwargs.{n}", x, tensors) for n, x in kwargs.items()},
        "output": _record(f"{name}.forward.output", [fwd.out, fwd.softmax_max, fwd.softmax_sum], tensors)},
        f"{name}.backward": {"input": _record(f"{name}.backward.input", [dy], tensors),
                             "output": _record(f"{name}.backward.output", list(grads[:3]), tensors)}}
    (rank_dir / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
    for data_name, t in tensors.items():
        torch.save(t, rank_dir / "dump_tensor_data" / data_name)
    (rank_dir / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L1", "framework": "pytorch",
                                                    "dump_data_dir": str(rank_dir), "data": data}))


def _bench_functions(case: Case) -> dict:
    """Child side of a ``bench-*`` case: run the forward and grad bench functions once; their CPU time and
    peak-RSS growth."""
    import importlib
    import resource

    msprobe = case.params["kind"] == "bench-msprobe"
    functions = importlib.import_module("msprobe.pytorch.bench_functions.npu_fusion_attention" if msprobe
                                        else "attnops.msprobe.bench_functions")
    (q, k, v, dy), kwargs = _inputs(case)
    kwargs = dict(kwargs, sparse_mode=0, atten_mask=torch.ones(case.sq, case.skv, dtype=torch.bool).triu(1))
    before, rss0 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, smax, ssum = functions.npu_fusion_attention(q, k, v, case.heads, "BNSD", **kwargs)[:3]
    functions.npu_fusion_attention_grad(q, k, v, dy, case.heads, "BNSD", atten_mask=kwargs["atten_mask"],
                                        softmax_max=smax, softmax_sum=ssum, attention_in=out,
                                        scale_value=kwargs["scale"], sparse_mode=0)
    after = os.times()
    return {"cpu_s": after.user + after.system - before.user - before.system,
            "peak_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024}


def _measure_process(argv: list[str]) -> dict:
    """Run ``argv``; its CPU time (user + system, all threads), peak RSS, exit status and output."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=_child_env())
        _, status, usage = os.wait4(proc.pid, 0)  # reaps the child with its resource usage
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
                "status": proc.returncode, "stdout": out.read().decode(), "stderr": err.read().decode()[-2000:]}


def _child_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _measure_compare(dump: Path) -> dict:
    m = _measure_process([sys.executable, "-m", "attnops", "compare", str(dump), "--quiet"])
    if m["status"] not in (0, 1):
        raise RuntimeError(f"attnops compare exited {m['status']}: {m['stderr']}")
    return {"cpu_s": m["cpu_s"], "peak_rss_mb": m["peak_rss_mb"], "verdicts": m["stdout"].strip().splitlines()[-1]}


def _measure_bench(case: Case) -> dict:
    code = ("import json, sys; from attnops.bench.golden_cpu import CASES, _bench_functions; "
            f"print(json.dumps(_bench_functions(CASES[{CASES.index(case)}])))")
    m = _measure_process([sys.executable, "-c", code])
    if m["status"] != 0:
        raise RuntimeError(f"{case.name} failed: {m['stderr']}")
    return dict(json.loads(m["stdout"].strip().splitlines()[-1]), peak_rss_mb=m["peak_rss_mb"])


def _skip_reason(case: Case) -> str | None:
    if case.params["kind"] == "bench-msprobe":
        import importlib.util

        if importlib.util.find_spec("msprobe") is None:
            return "mindstudio-probe is not installed (pip install 'attnops[msprobe]')"
    return None


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run_suite(cases: list[Case], repeat: int, warmup: int) -> list[dict]:
    """Each case ``warmup + repeat`` times in fresh subprocesses; medians of the repeats."""
    entries = []
    with tempfile.TemporaryDirectory(prefix="attnops-golden-cpu-") as tmp:
        for case in cases:
            entry = {"case": case.describe(), "runs": []}
            entries.append(entry)
            reason = _skip_reason(case)
            if reason:
                entry["skipped"] = reason
                continue
            if case.params["kind"] == "compare":
                dump = Path(tmp) / case.name
                rank_dir = dump / "step0" / "rank0"
                write = [sys.executable, "-c", "from pathlib import Path; from attnops.bench.golden_cpu import CASES, "
                         f"write_dump; write_dump(CASES[{CASES.index(case)}], Path({str(rank_dir)!r}))"]
                subprocess.run(write, check=True, env=_child_env(), capture_output=True)
            for i in range(warmup + repeat):
                run = _measure_compare(dump) if case.params["kind"] == "compare" else _measure_bench(case)
                if i >= warmup:
                    entry["runs"].append(run)
            entry.update({k: _median(entry["runs"], k) for k in entry["runs"][0] if k in
                          ("cpu_s", "peak_rss_mb", "peak_rss_growth_mb")})
    return entries


def format_row(entry: dict) -> str:
    if "skipped" in entry:
        return f"  skipped: {entry['skipped']}"
    growth = f", peak RSS growth {entry['peak_rss_growth_mb']:.0f} MB" if "peak_rss_growth_mb" in entry else ""
    verdicts = f"  ({entry['runs'][0]['verdicts']})" if "verdicts" in entry["runs"][0] else ""
    return (f"  CPU {entry['cpu_s']:.1f} s, peak RSS {entry['peak_rss_mb']:.0f} MB{growth} (medians of "
            f"{len(entry['runs'])}){verdicts}")
