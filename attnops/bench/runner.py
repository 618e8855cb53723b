"""``python -m attnops bench --suite NAME``: time the operators of a benchmark suite against their baselines
(PyTorch's SDPA and others), print min/median times, GFLOP/s and the ratios, and write the results.

Without ``--suite`` it lists the suites and runs nothing; ``--list`` also lists their cases. Results (JSON, and
a PNG chart when matplotlib is installed) go to ``./attnops-bench-results`` in the current directory unless
``--out DIR`` says otherwise; progress with an ETA goes to stderr."""
from __future__ import annotations

import argparse
import gc
import importlib
import re
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from .._progress import Progress
from .cases import SUITES, suite_cases
from .impls import BUILDERS, OURS, is_peer, make_inputs
from .report import PlotSkipped, environment, write_json, write_plot
from .timing import L2Flusher, PeakMemory, busy_processes, summarize, synchronize, time_once, wait_until_idle
from .types import Case, Unavailable

DEFAULT_OUT = "attnops-bench-results"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--suite", default=None, metavar="NAME",
                    help=f"the suite to run (one of: {', '.join(sorted(SUITES))}); without it the suites are listed")
    ap.add_argument("--filter", default=None, help="regular expression: only cases whose name matches")
    ap.add_argument("--repeat", type=int, default=None, help="timed repetitions per implementation (suite default)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls per implementation")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the suite's device)")
    ap.add_argument("--impls", default=None,
                    help=f"comma-separated implementations to run (default: {OURS} and the case's baselines)")
    ap.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                    help=f"folder for the JSON/PNG results (default: ./{DEFAULT_OUT} in the current directory; "
                         "the repository keeps its recorded runs in benchmarks/results)")
    ap.add_argument("--idle-wait", type=float, default=0.0,
                    help="CPU only: before each repetition wait up to this many seconds for the machine to be "
                         "idle (other processes distort CPU timings); 0 disables")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--no-check", action="store_true", help="skip comparing the outputs against the baselines'")
    ap.add_argument("--isolate", action="store_true",
                    help="run every case in a fresh Python process (no allocator/library state carried over from "
                         "the previous case)")
    ap.add_argument("--list", action="store_true",
                    help="list the cases of every suite (of --suite when given), then exit")


def _list_suites(file: TextIO | None = None) -> None:
    file = sys.stdout if file is None else file
    print("Benchmark suites (run one with: python -m attnops bench --suite NAME; their cases: --list):", file=file)
    width = max(map(len, SUITES))
    for name, suite in sorted(SUITES.items()):
        count = f"{len(suite.cases)} case{'s' * (len(suite.cases) != 1)}"
        print(f"  {name:{width}s}  {suite.device:4s} {count:9s} {suite.description}", file=file)


def _list_cases(names: list[str]) -> None:
    for name in names:
        suite = SUITES[name]
        print(f"{name} [{suite.device}, repeat {suite.repeat}]: {suite.description}")
        if suite.details:
            print(f"  {suite.details}")
        for c in suite.cases:
            print(f"    {c.name}  ({c.flops() / 1e9:.1f} GFLOP; baselines: {', '.join(c.baselines) or '-'})")


def _build(name: str, case: Case, inputs, device) -> tuple[object | None, dict]:
    try:
        return BUILDERS[name](case, inputs, device), {"status": "ok"}
    except Unavailable as e:
        return None, {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - one broken baseline must not stop the suite
        return None, {"status": "error", "reason": f"{type(e).__name__}: {e}"[:300]}


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return float((a.detach().float() - b.detach().float()).abs().max())


def run_case(case: Case, device: torch.device, *, repeat: int, warmup: int, impls: list[str] | None,
             idle_wait: float, seed: int, check: bool, log=print) -> dict:
    """One case: build, warm up, time (see :func:`_time_all`) and compare its implementations; the case's
    ``threads`` parameter, where given, is the thread count from the build on (the caller's is restored)."""
    threads = torch.get_num_threads()
    try:
        if "threads" in case.params:
            torch.set_num_threads(case.params["threads"])
        return _run_case(case, device, repeat=repeat, warmup=warmup, impls=impls, idle_wait=idle_wait, check=check,
                         seed=seed, log=log)
    finally:
        torch.set_num_threads(threads)


def _set_threads(case: Case, r) -> None:
    """The thread count of ``r``'s calls: its own, else the case's ``threads`` (else left as it is)."""
    count = r.threads or case.params.get("threads")
    if count is not None and count != torch.get_num_threads():
        torch.set_num_threads(count)


def _run_case(case: Case, device: torch.device, *, repeat: int, warmup: int, impls: list[str] | None,
              idle_wait: float, seed: int, check: bool, log) -> dict:
    names = [OURS, *case.baselines] if impls is None else [n for n in impls if n == OURS or n in BUILDERS]
    inputs = make_inputs(case, device, seed)
    runnables, results = {}, {}
    for name in names:
        r, info = _build(name, case, inputs, device)
        results[name] = info
        if r is not None:
            runnables[name] = r
        elif info["status"] != "ok":
            log(f"  {name}: {info['status']} ({info['reason']})")
    flush = L2Flusher(device)
    for name, r in list(runnables.items()):
        try:
            for _ in range(warmup):
                _set_threads(case, r)
                r.reset()
                r.fn()
            synchronize(device)
        except Exception as e:  # noqa: BLE001
            results[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:300]}
            del runnables[name]
    times: dict[str, list[float]] = {n: [] for n in runnables}
    idle: list[float] = []
    with busy_processes(case.params.get("beside_load", 0)):
        _time_all(case, runnables, results, times, idle, repeat, device, idle_wait, flush)
    flops = case.flops()
    for name, ts in times.items():
        stats = summarize(ts)
        results[name].update(stats, tflops_at_min=flops / stats["min_s"] / 1e12,
                             tflops_at_median=flops / stats["median_s"] / 1e12)
    ratios, checks = {}, {}
    ours = results.get(OURS, {})
    for name in case.baselines:
        base = results.get(name, {})
        if ours.get("status") == "ok" and base.get("status") == "ok":
            ratios[name] = {"min": base["min_s"] / ours["min_s"], "median": base["median_s"] / ours["median_s"]}
        if check and OURS in runnables and name in runnables and case.mode != "bwd":
            diff = _max_diff(runnables[OURS].output(), runnables[name].output())
            if diff is not None:
                checks[name] = {"max_abs_diff_out": diff}
    entry = {"case": case.describe(), "results": results, "ratios": ratios, "checks": checks}
    strongest = _strongest_peer(case, results)
    if strongest is not None:
        entry["strongest_peer"] = strongest
    if idle:
        entry["idle_fraction"] = {"min": min(idle), "mean": sum(idle) / len(idle)}
    runnables.clear()
    gc.collect()
    return entry


def _strongest_peer(case: Case, results: dict) -> str | None:
    """The baseline with the lowest median among the case's peers (other libraries: not attnops itself on other
    settings nor a reference such as the read bandwidth), or None."""
    timed = [name for name in case.baselines if is_peer(name) and results.get(name, {}).get("status") == "ok"]
    return min(timed, key=lambda name: results[name]["median_s"], default=None)


def _time_all(case: Case, runnables: dict, results: dict, times: dict, idle: list, repeat: int, device, idle_wait,
              flush) -> None:
    """``repeat`` rounds of one timed call of each runnable, the order reversed every other round; a runnable's
    calls run on its own thread count, else the case's ``threads``, else the caller's."""
    order = list(runnables)
    for rep in range(repeat):
        for name in (order if rep % 2 == 0 else order[::-1]):  # alternate the order: no positional bias
            r = runnables[name]
            _set_threads(case, r)
            if device.type == "cpu":
                frac = wait_until_idle(idle_wait)
                if frac is not None:
                    idle.append(frac)
            r.reset()
            synchronize(device)
            if case.track_memory and rep == 0:
                with PeakMemory(device) as mem:
                    t = time_once(r.fn, device, flush)
                results[name]["memory"] = mem.as_dict()
            else:
                t = time_once(r.fn, device, flush)
            times[name].append(t)


_ISOLATED = """
import json, sys
import torch
from attnops.bench.cases import suite_cases
from attnops.bench.runner import run_case
a = json.loads(sys.argv[1])
case = [c for c in suite_cases(a["suite"]) if c.name == a["case"]][0]
entry = run_case(case, torch.device(a["device"]), repeat=a["repeat"], warmup=a["warmup"], impls=a["impls"],
                 idle_wait=a["idle_wait"], seed=a["seed"], check=a["check"], log=lambda *x: print(*x, file=sys.stderr))
print("@@ENTRY@@" + json.dumps(entry))
"""


def _run_isolated(suite: str, case: Case, device: torch.device, **kw) -> dict:
    """:func:`run_case` in a child interpreter; returns its entry (an error entry if the child failed)."""
    import json
    import subprocess

    args = json.dumps({"suite": suite, "case": case.name, "device": str(device), **kw})
    r = subprocess.run([sys.executable, "-c", _ISOLATED, args], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("@@ENTRY@@"):
            return json.loads(line[len("@@ENTRY@@"):])
    reason = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"case": case.describe(), "results": {"attnops": {"status": "error", "reason": reason}}, "ratios": {},
            "checks": {}}


def _fmt_seconds(t: float) -> str:
    """Seconds, or microseconds below a millisecond (host-overhead timings)."""
    return f"{t * 1e6:8.1f} us" if t < 1e-3 else f"{t:8.4f} s "


def _fmt_row(case: Case, entry: dict) -> list[str]:
    lines = []
    for name, r in entry["results"].items():
        if r.get("status") != "ok":
            lines.append(f"  {name:15s} {r.get('status')}: {r.get('reason', '')}")
            continue
        mem = r.get("memory", {}).get("peak_bytes")
        mem_s = f"  peak {mem / 2**30:.2f} GiB" if mem else ""
        rate = f"  {r['tflops_at_min'] * 1e3:7.1f} GFLOP/s" if case.flops() else ""
        lines.append(f"  {name:15s} min {_fmt_seconds(r['min_s'])}  median {_fmt_seconds(r['median_s'])}{rate}{mem_s}")
    ours, limit = entry["results"].get(OURS, {}), case.params.get("limit_s")
    if limit and ours.get("status") == "ok":
        lines.append(f"  limit {_fmt_seconds(limit)}: {'met' if ours['median_s'] <= limit else 'OVER'} (median)")
    for name, q in entry["ratios"].items():
        lines.append(f"  ratio {name}/{OURS}: {q['min']:.3f} (min)  {q['median']:.3f} (median)")
    if "strongest_peer" in entry:
        name = entry["strongest_peer"]
        q = entry["ratios"].get(name, {}).get("median")
        lines.append(f"  strongest peer: {name}" + (f" (attnops {q:.2f}x its speed, medians)" if q else ""))
    for name, c in entry["checks"].items():
        lines.append(f"  max|out - {name}| = {c['max_abs_diff_out']:.2e}")
    return lines


def run(args: argparse.Namespace) -> int:
    """List the suites, or run ``args.suite`` and write its results; 0 on success, 2 on a usage error."""
    if args.suite is not None and args.suite not in SUITES:
        print(f"python -m attnops bench: error: unknown suite {args.suite!r}", file=sys.stderr)
        _list_suites(sys.stderr)
        return 2
    if args.list:
        _list_cases(sorted(SUITES) if args.suite is None else [args.suite])
        return 0
    if args.suite is None:
        _list_suites()
        return 0
    suite = SUITES[args.suite]
    device = torch.device(args.device or suite.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"python -m attnops bench: error: suite {suite.name} needs CUDA, which is not available here",
              file=sys.stderr)
        return 2
    pattern = re.compile(args.filter) if args.filter else None
    cases = [c for c in suite_cases(suite.name) if pattern is None or pattern.search(c.name)]
    if not cases:
        print(f"python -m attnops bench: error: --filter {args.filter!r} matches no case of suite {suite.name}; "
              "its cases are:", file=sys.stderr)
        print("\n".join(c.name for c in suite.cases), file=sys.stderr)
        return 2
    repeat = suite.repeat if args.repeat is None else max(1, args.repeat)
    warmup = suite.warmup if args.warmup is None else max(0, args.warmup)
    if suite.multiprocess or suite.runner:
        return _run_own(suite, cases, repeat, warmup, Path(args.out))
    impls = None if args.impls is None else [s.strip() for s in args.impls.split(",") if s.strip()]
    env = environment(device)
    print(f"suite {suite.name}: {len(cases)} case(s) on {env['device']['name']}, torch {env['torch']}, "
          f"commit {str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}; repeat {repeat}, "
          f"warm-up {warmup}", flush=True)
    entries = []
    t0 = time.perf_counter()
    progress = Progress([c.flops() for c in cases])  # the ETA scales the elapsed time by the FLOPs left
    for case in cases:
        progress.next(case.name)
        print(f"{case.name} ({case.mode}, {case.flops() / 1e9:.1f} GFLOP)", flush=True)
        kw = dict(repeat=repeat, warmup=warmup, impls=impls, idle_wait=args.idle_wait, seed=args.seed,
                  check=not args.no_check)
        entry = _run_isolated(suite.name, case, device, **kw) if args.isolate else run_case(case, device, **kw)
        entries.append(entry)
        print("\n".join(_fmt_row(case, entry)), flush=True)
    progress.finish(f"{len(cases)} case(s)")
    result = {"suite": suite.name, "description": suite.description, "details": suite.details, "environment": env,
              "settings": {"repeat": repeat, "warmup": warmup, "idle_wait_s": args.idle_wait, "seed": args.seed,
                           "timer": "cuda events + L2 flush" if device.type == "cuda" else "time.perf_counter",
                           "filter": args.filter, "impls": impls, "isolate": args.isolate},
              "wall_s": time.perf_counter() - t0, "cases": entries}
    stem = f"{suite.name}-{device.type}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    out_dir = Path(args.out)
    print(f"wrote {write_json(result, out_dir, stem).resolve()}")
    try:
        print(f"wrote {write_plot(result, out_dir, stem).resolve()}")
    except PlotSkipped as e:
        print(f"plot skipped: {e}")
    return 0


def _run_own(suite, cases: list[Case], repeat: int, warmup: int, out_dir: Path) -> int:
    """A suite with its own runner: cases on spawned process groups (context parallelism) or ``suite.runner``'s
    module."""
    if suite.runner:
        module = importlib.import_module(f"{__package__}.{suite.runner}")
        run_suite, format_row = module.run_suite, module.format_row
    else:
        from .context_parallel import format_row, run_cp_suite as run_suite

    env = environment(torch.device("cpu"))
    t0 = time.perf_counter()
    entries = run_suite(cases, repeat, warmup)
    for entry in entries:
        print(entry["case"]["name"])
        print(format_row(entry), flush=True)
    result = {"suite": suite.name, "description": suite.description, "details": suite.details, "environment": env,
              "settings": {"repeat": repeat, "warmup": warmup, "timer": "time.perf_counter"},
              "wall_s": time.perf_counter() - t0, "cases": entries}
    stem = f"{suite.name}-cpu-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    print(f"wrote {write_json(result, out_dir, stem).resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m attnops bench [--suite NAME] [options]``."""
    from ..__main__ import main as cli

    return cli(["bench", *(sys.argv[1:] if argv is None else argv)])
