"""``python -m attnops gpu-report [--budget SECONDS] [--quick] [--out DIR] [--interpret] [--tune [--tuned-dir DIR]]``:
validate and time every GPU path in one run, within a time budget.

Steps, most valuable first (each a child process; :mod:`.steps`): with ``--tune`` first the tuning of every
kernel's tile candidates (:mod:`.tune`, the table the later steps' launchers read), then the CUDA tests of each kernel family (one pytest
run per family, :mod:`.families`, then ``tests/cuda/`` files no family claims), ``python -m attnops check``, one
benchmark per GPU suite (:mod:`.suites`; its ``--quick`` cases), then the rest of each suite. A step starts only
when the time left of ``--budget`` (default 420 s) fits its expected time (the time it took last time in this output
folder, else the planned one); a running step is killed when the budget runs out, or at its own cap. The summary
``gpu-report-<gpu>-<date>.md`` (each step done / failed / skipped for budget, with its time), one log per step
and the benchmark JSON/PNG go into the output folder (``./attnops-gpu-report`` unless ``--out DIR``); the summary
is rewritten after every step and when the run is stopped by SIGTERM/SIGINT/SIGHUP. Exit status: 0 every step
done, 1 a step failed, 3 none failed but some did not run for the budget, 128+N stopped by signal N.

Without CUDA it exits 2, unless ``--interpret``: the same flow on the CPU through Triton's interpreter at tiny
sizes (interpreter kernel tests, the Triton rows of ``check``, the suites' smoke stand-ins).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .._core.triton.tuned import tuned_dir
from .families import KERNEL_FAMILIES, family_test_args, integration_test_args
from .peaks import Peak, peak_for
from .steps import DONE, FAILED, FAILURES, KILLED_BUDGET, Interrupted, Step, run_within_budget, stop_on_signals
from .suites import GPU_SUITES, GpuSuite

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "attnops-gpu-report"  # in the current directory; the recorded runs use --out benchmarks/results
DEFAULT_BUDGET_S = 420  # a lent GPU: 15 min of device time with the start, at most 10 min per command
INTERPRET_ENV = {"ATTNOPS_TRITON_INTERPRET": "1", "TRITON_INTERPRET": "1"}
QUICK_CHECK_CASE = "BSH causal mode 2 fp16"
TIMINGS_FILE = "gpu-report-timings.json"  # measured step times per mode, the next run's estimates
CAP_FACTOR = 3  # a step is killed at this multiple of its expected time
# planned seconds per step on one H100 (full, quick) and through the interpreter on 2 CPU cores (full, quick)
EXPECTED_S = {
    "cuda": {"tests-fa": (60, 25), "tests-nsa": (60, 20), "tests-fia": (40, 15), "tests-dsa": (40, 30),
             "tests-dsv4-compressor-indexer": (30, 10), "tests-dsv4-sfm": (30, 15), "tests-integration": (45, 30),
             "check": (45, 30), "bench": (25, 20), "bench-rest": (60, 0)},
    "interpret": {"tests-fa": (600, 25), "tests-nsa": (600, 25), "tests-fia": (600, 35), "tests-dsa": (600, 25),
                  "tests-dsv4-compressor-indexer": (300, 25), "tests-dsv4-sfm": (120, 20), "check": (600, 15),
                  "bench": (60, 10), "bench-rest": (120, 0)},
}
TUNE_EXPECTED_S = {"cuda": (120, 45), "interpret": (60, 15)}  # the tune step (--tune), as EXPECTED_S


def mode_key(args) -> str:
    return ("interpret" if args.interpret else "cuda") + ("-quick" if args.quick else "")


def plan(args, out_dir: Path) -> list[Step]:
    """The steps of this run, most valuable first: each family's tests, the tests no family claims (CUDA only),
    check, each suite's quick benchmark, then (without ``--quick``) the rest of each suite."""
    py, pick = sys.executable, (1 if args.quick else 0)
    expected = EXPECTED_S["interpret" if args.interpret else "cuda"]
    env = INTERPRET_ENV if args.interpret else {}
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]

    def step(name: str, command: list[str], key: str | None = None) -> Step:
        seconds = expected[key or name][pick]
        return Step(name, command, seconds, CAP_FACTOR * seconds, env, ROOT)

    steps = [tune_step(args, env)] if args.tune else []
    steps += [step(f"tests-{f.name}", pytest + family_test_args(f, args.interpret, args.quick))
              for f in KERNEL_FAMILIES]
    if not args.interpret:
        steps.append(step("tests-integration", pytest + integration_test_args()))
    if args.interpret:
        check = [py, "-m", "attnops.gpu.triton_check"] + (["--filter", QUICK_CHECK_CASE] if args.quick else [])
    else:
        check = [py, "-m", "attnops", "check"]
    steps.append(step("check", check))
    steps += [step(f"bench-{s.suite}", bench_command(s, args, out_dir, quick_cases=True), "bench")
              for s in GPU_SUITES.values()]
    if not args.quick:
        steps += [step(f"bench-{s.suite}-rest", bench_command(s, args, out_dir, quick_cases=False), "bench-rest")
                  for s in GPU_SUITES.values() if _has_other_cases(s, args.interpret)]
    return steps


def tune_step(args, env: dict) -> Step:
    """The ``tune`` step (:mod:`.tune`): no new kernel shape starts after its planned time."""
    seconds = TUNE_EXPECTED_S["interpret" if args.interpret else "cuda"][1 if args.quick else 0]
    cmd = [sys.executable, "-m", "attnops.gpu.tune", "--dir", str(Path(args.tuned_dir).resolve()),
           "--seconds", str(seconds)]
    if args.interpret:
        cmd += ["--interpret", "--repeats", "1"]
    return Step("tune", cmd + (["--quick"] if args.quick else []), seconds, CAP_FACTOR * seconds, env, ROOT)


def bench_command(suite: GpuSuite, args, out_dir: Path, quick_cases: bool) -> list[str]:
    """``attnops bench`` on the suite's quick cases (``quick_cases``) or on the others; the quick run (``--quick``)
    times fewer repeats."""
    cmd = [sys.executable, "-m", "attnops", "bench", "--out", str(out_dir)]
    if args.interpret:
        cmd += ["--impls", ",".join(suite.smoke_impls), "--suite", suite.smoke_suite, "--device", "cpu",
                "--repeat", "1", "--warmup", "0"]
        pattern = suite.smoke_quick_filter
    else:
        cmd += ["--impls", ",".join(suite.impls), "--suite", suite.suite] + (
            ["--repeat", "5", "--warmup", "2"] if args.quick else [])
        pattern = suite.quick_filter
    return cmd + ["--filter", pattern if quick_cases else _excluding(pattern)]


def _excluding(pattern: str) -> str:
    """A regular expression that ``re.search`` matches on exactly the names ``pattern`` does not match."""
    return f"^(?!.*(?:{pattern}))"


def _has_other_cases(suite: GpuSuite, interpret: bool) -> bool:
    from ..bench.cases import suite_cases

    name, pattern = (suite.smoke_suite, suite.smoke_quick_filter) if interpret else (suite.suite, suite.quick_filter)
    return any(re.search(_excluding(pattern), c.name) for c in suite_cases(name))


def load_estimates(steps: list[Step], out_dir: Path, mode: str) -> None:
    """Plan each step with the time it took when it last ran to the end in this output folder and mode."""
    measured = _read_timings(out_dir).get(mode, {})
    for step in steps:
        if step.name in measured:
            step.expected_s = measured[step.name]
            step.cap_s = max(step.cap_s, CAP_FACTOR * step.expected_s)


def save_timings(steps: list[Step], out_dir: Path, mode: str) -> None:
    timings = _read_timings(out_dir)
    timings.setdefault(mode, {}).update({s.name: round(s.seconds, 1) for s in steps if s.status == DONE})
    (out_dir / TIMINGS_FILE).write_text(json.dumps(timings, indent=1, sort_keys=True) + "\n")


def _read_timings(out_dir: Path) -> dict:
    path = out_dir / TIMINGS_FILE
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        return {}


def environment(interpret: bool) -> tuple[dict, Peak]:
    """Versions and device of this machine, and the GPU's peak figures."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda or "none",
           "triton": triton_version, "driver": "none", "gpu": "none (Triton interpreter on the CPU)"}
    if interpret:
        return env, Peak("CPU (interpreter)", None, None)
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1), driver=_driver_version())
    return env, peak_for(props.name)


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def bench_rows(paths: list[Path], peak: Peak) -> list[list[str]]:
    """One row per (case, implementation) of the benchmark JSON files: median time, TFLOP/s or GB/s, % of peak."""
    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        bound = GPU_SUITES.get(result["suite"], GpuSuite("", "", "")).bound
        for entry in result["cases"]:
            case = entry["case"]
            for impl, r in entry["results"].items():
                if r.get("status", "ok") != "ok" or "median_s" not in r:
                    rows.append([case["name"], impl, r.get("status", "?"), "", "", str(r.get("reason", ""))[:60]])
                    continue
                if bound == "memory":
                    rate, ref, unit = bytes_moved(case) / r["median_s"] / 1e9, peak.hbm_gbps, "GB/s"
                else:
                    rate, ref, unit = r["tflops_at_median"], peak.bf16_tflops, "TFLOP/s"
                share = "unknown" if ref is None else f"{100 * rate / ref:.1f}%"
                rows.append([case["name"], impl, f"{r['median_s'] * 1e3:.3f} ms", f"{rate:.2f} {unit}", share, ""])
    return rows


def bytes_moved(case: dict) -> float:
    """Bytes a memory-bound attention case reads and writes at least once: q, k, v (int8 KV: one byte each) and the
    output."""
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[case["dtype"]]
    kv_size = 1 if case.get("params", {}).get("kv") == "int8" else size
    b, n, kvn, sq, skv = case["batch"], case["heads"], case["kv_heads"], case["sq"], case["skv"]
    return size * b * sq * n * (case["d"] + case["dv"]) + kv_size * b * skv * kvn * (case["d"] + case["dv"])


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def summary(env: dict, peak: Peak, args, steps: list[Step], bench: list[list[str]], total_s: float) -> str:
    mode = ("interpret (CPU, Triton interpreter, tiny sizes)" if args.interpret else "CUDA") + (
        ", quick" if args.quick else "")
    counts = {status: sum(s.status == status for s in steps) for status in dict.fromkeys(s.status for s in steps)}
    parts = [f"# attnops GPU report: {env['gpu']}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Mode: {mode}. Commit: {_commit()}. Total {total_s:.0f} s of a {args.budget:.0f} s budget. Steps: "
             + ", ".join(f"{n} {status}" for status, n in counts.items()) + ".", "",
             _table(["item", "value"], [[k, v] for k, v in env.items()] + [["peak", peak.describe()]]), "",
             "## Steps", "", _table(["step", "result", "time (s)", "expected (s)", "log"],
                                    [[s.name, s.status, f"{s.seconds:.1f}", f"{s.expected_s:.0f}",
                                      s.log.name if s.log else ""] for s in steps]), ""]
    if bench:
        parts += ["## Benchmarks", "", _table(["case", "implementation", "median", "rate", "% of peak", "note"],
                                              bench), ""]
    for s in steps:
        if s.status in FAILURES or (s.status == KILLED_BUDGET and s.tail):
            parts += [f"## {s.name}: {s.status}", "", "```", s.tail, "```", ""]
    return "\n".join(parts)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "gpu"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnops gpu-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help=f"time for the whole run (default {DEFAULT_BUDGET_S}): no step starts unless its expected "
                        "time fits in what is left, a running step is killed when it runs out")
    p.add_argument("--quick", action="store_true", help="fewer tests and the quick benchmark cases only")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder (default: ./{DEFAULT_OUT} in the current directory)")
    p.add_argument("--interpret", action="store_true",
                   help="without a GPU: the same flow on the CPU through Triton's interpreter at tiny sizes")
    p.add_argument("--tune", action="store_true",
                   help="first time every kernel's tile candidates and write the table of this GPU and Triton "
                        "version that the launchers read (into --tuned-dir)")
    p.add_argument("--tuned-dir", default=str(tuned_dir()), metavar="DIR",
                   help="folder of the tuned tables, written by --tune and read by every step's launchers (default: "
                        "ATTNOPS_TUNED_DIR, else attnops/gpu/tuned in the package)")
    return p


def main(argv: list[str] | None = None, plan_steps: Callable[..., list[Step]] = plan) -> int:
    """Run the steps ``plan_steps(args, out_dir)`` within ``--budget`` and write the summary (after every step,
    and when stopped by a signal)."""
    start = time.perf_counter()
    args = parser().parse_args(argv)
    if args.budget <= 0:
        parser().error(f"--budget must be a positive number of seconds, got {args.budget:g}")
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("gpu-report needs a CUDA GPU and torch with CUDA (torch.cuda.is_available() is False); "
              "use --interpret to run the same flow through Triton's interpreter on the CPU", file=sys.stderr)
        return 2
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env, peak = environment(args.interpret)
    for key, value in env.items():
        print(f"{key:12s} {value}")
    print(f"{'peak':12s} {peak.describe()}", flush=True)
    tag = f"gpu-report-{_slug('interpret' if args.interpret else env['gpu'])}-" \
          f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    before = set(out_dir.glob("*.json"))
    steps = plan_steps(args, out_dir)
    load_estimates(steps, out_dir, mode_key(args))
    path = out_dir / f"{tag}.md"

    def bench() -> list[list[str]]:
        return bench_rows(sorted(set(out_dir.glob("*.json")) - before - {out_dir / TIMINGS_FILE}), peak)

    def write_summary() -> None:
        path.write_text(summary(env, peak, args, steps, bench(), time.perf_counter() - start))
        save_timings(steps, out_dir, mode_key(args))

    for problem in _test_problems():
        print(f"!! {problem}", file=sys.stderr)
        for step in steps:
            if step.name.startswith("tests-"):
                step.status, step.tail = FAILED, problem
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env["ATTNOPS_TUNED_DIR"] = str(Path(args.tuned_dir).resolve())
    stopped = None
    try:
        with stop_on_signals():
            write_summary()
            run_within_budget(steps, start + args.budget, lambda s: out_dir / f"{tag}-{s.name}.log", child_env,
                              write_summary)
    except Interrupted as stop:
        stopped = stop
        print(f"gpu-report: {stop}; writing what it has", file=sys.stderr)
    write_summary()
    if rows := bench():
        print(_table(["case", "implementation", "median", "rate", "% of peak", "note"], rows))
    failed = [s.name for s in steps if s.status in FAILURES]
    not_run = [s.name for s in steps if s.status not in FAILURES and s.status != DONE]
    print(f"wrote {path}")
    print(f"gpu-report: {len(steps) - len(failed) - len(not_run)} of {len(steps)} steps done"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; not run to the end: {', '.join(not_run)}" if not_run else ""))
    if stopped is not None:
        return 128 + stopped.signum
    return 1 if failed else 3 if not_run else 0


def _test_problems() -> list[str]:
    """Why the test steps cannot run here, if they cannot."""
    problems = []
    if importlib.util.find_spec("pytest") is None:
        problems.append("pytest is not installed in this Python: the test steps cannot run "
                        "(install pytest, or run the tests elsewhere)")
    if not (ROOT / "tests").is_dir():
        problems.append(f"no tests/ folder next to the attnops package ({ROOT}): install attnops editable from "
                        "a checkout (pip install --no-deps --no-build-isolation -e .)")
    return problems
