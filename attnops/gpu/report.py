"""``python -m attnops gpu-report [--quick] [--out DIR] [--interpret]``: validate and time every GPU path in one run.

Steps (each a child process with its own time budget: a failing or hanging step is killed, reported, and the
next one runs): the environment (GPU, driver, CUDA, torch, Triton, the GPU's peak figures), the CUDA tests
(``pytest -m cuda`` and the Triton kernel tests, compiled), ``python -m attnops check``, and the GPU benchmark
suites (:mod:`.suites`) against SDPA (flash, cuDNN) and FlexAttention, in TFLOP/s (or GB/s) and % of the peak.
Writes the benchmark JSON/PNG, one log per step and a markdown summary ``gpu-report-<gpu>-<date>.md`` into the
output folder (``./attnops-gpu-report`` unless ``--out DIR``); exits 1 on any failure.

Without CUDA it exits 2, unless ``--interpret``: the same flow on the CPU through Triton's interpreter at tiny
sizes (interpreter kernel tests, the Triton rows of ``check``, the suites' smoke stand-ins).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .peaks import Peak, peak_for
from .suites import GPU_SUITES, GpuSuite

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "attnops-gpu-report"  # in the current directory; the recorded runs use --out benchmarks/results
INTERPRET_ENV = {"ATTNOPS_TRITON_INTERPRET": "1", "TRITON_INTERPRET": "1"}
KERNEL_TESTS = "tests/ops/flash_attention/triton"
NSA_KERNEL_TESTS = "tests/ops/nsa/triton"  # compressed attention and decode kernels (the full CUDA run)
FIA_KERNEL_TESTS = "tests/ops/fused_infer_attention/triton"  # decode kernels and prefill (the full CUDA run)
DSA_KERNEL_TESTS = "tests/ops/dsa/triton"  # lightning indexer and sparse attention kernels (the full CUDA run)
# budgets in seconds: (full, quick); the sum stays under 9 min (full) and 3.5 min (quick) on one H100
BUDGETS = {"tests": (210, 75), "check": (60, 30), "bench": (270, 90)}
INTERPRET_BUDGETS = {"tests": (600, 90), "check": (600, 60), "bench": (300, 60)}
QUICK_KERNEL_TESTS = "test_dtypes_causal"  # --interpret --quick: tiny causal fp16 and fp32 problems
QUICK_CHECK_CASE = "BSH causal mode 2 fp16"


@dataclass
class Step:
    name: str
    command: list[str]
    budget_s: float
    env: dict = field(default_factory=dict)
    status: str = "not run"  # "pass" | "FAIL" | "TIMEOUT" | "not run"
    seconds: float = 0.0
    tail: str = ""
    log: Path | None = None

    @property
    def ok(self) -> bool:
        return self.status == "pass"


def run_step(step: Step, out_dir: Path, tag: str) -> Step:
    """Run ``step.command`` in its own process group under ``step.budget_s``; on timeout kill the whole group
    (pytest workers, NCCL children); its output goes to ``<tag>-<step>.log``."""
    step.log = out_dir / f"{tag}-{step.name}.log"
    env = dict(os.environ, **step.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    print(f"== {step.name} (budget {step.budget_s:.0f} s): {' '.join(step.command)}", flush=True)
    start = time.perf_counter()
    with open(step.log, "w") as log:
        proc = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=step.budget_s)
            step.status = "pass" if rc == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            step.status = "TIMEOUT"
    step.seconds = time.perf_counter() - start
    step.tail = "\n".join(step.log.read_text(errors="replace").splitlines()[-25:])
    print(step.tail if not step.ok else step.tail.splitlines()[-1] if step.tail else "", flush=True)
    print(f"== {step.name}: {step.status} in {step.seconds:.1f} s", flush=True)
    return step


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


def plan(args, out_dir: Path) -> list[Step]:
    """The test, check and benchmark steps of this run."""
    py, pick = sys.executable, (1 if args.quick else 0)
    budgets = INTERPRET_BUDGETS if args.interpret else BUDGETS
    env = INTERPRET_ENV if args.interpret else {}
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if args.interpret:
        tests = pytest + [f"{KERNEL_TESTS}/test_kernels.py"] + (["-k", QUICK_KERNEL_TESTS] if args.quick else [])
        check = [py, "-m", "attnops.gpu.triton_check"] + (["--filter", QUICK_CHECK_CASE] if args.quick else [])
    else:  # the CUDA tests; the full run adds the Triton kernel tests, which run compiled (bf16 too) on a GPU
        tests = pytest + ["-m", "cuda", "tests"] if args.quick else pytest + [
            "tests/cuda", f"{KERNEL_TESTS}/test_kernels.py", f"{KERNEL_TESTS}/test_verify.py", NSA_KERNEL_TESTS,
            FIA_KERNEL_TESTS, DSA_KERNEL_TESTS]
        check = [py, "-m", "attnops", "check"]
    steps = [Step("tests", tests, budgets["tests"][pick], env), Step("check", check, budgets["check"][pick], env)]
    for suite in GPU_SUITES.values():
        steps.append(Step(f"bench-{suite.suite}", bench_command(suite, args, out_dir),
                          budgets["bench"][pick] / len(GPU_SUITES), env))
    return steps


def bench_command(suite: GpuSuite, args, out_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "attnops", "bench", "--out", str(out_dir), "--impls", ",".join(suite.impls)]
    if args.interpret:
        cmd[-1] = ",".join(suite.smoke_impls)
        cmd += ["--suite", suite.smoke_suite, "--device", "cpu", "--repeat", "1", "--warmup", "0"]
        return cmd + (["--filter", suite.smoke_quick_filter] if args.quick else [])
    cmd += ["--suite", suite.suite]
    return cmd + (["--filter", suite.quick_filter, "--repeat", "5", "--warmup", "2"] if args.quick else [])


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
    parts = [f"# attnops GPU report: {env['gpu']}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Mode: {mode}. Commit: {_commit()}. Total {total_s:.0f} s.", "",
             _table(["item", "value"], [[k, v] for k, v in env.items()] + [["peak", peak.describe()]]), "",
             "## Steps", "", _table(["step", "result", "time (s)", "budget (s)", "log"],
                                    [[s.name, s.status, f"{s.seconds:.1f}", f"{s.budget_s:.0f}",
                                      s.log.name if s.log else ""] for s in steps]), ""]
    if bench:
        parts += ["## Benchmarks", "", _table(["case", "implementation", "median", "rate", "% of peak", "note"],
                                              bench), ""]
    for s in steps:
        if not s.ok:
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
    p.add_argument("--quick", action="store_true", help="a subset of tests and benchmarks (under 3.5 minutes)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder (default: ./{DEFAULT_OUT} in the current directory)")
    p.add_argument("--interpret", action="store_true",
                   help="without a GPU: the same flow on the CPU through Triton's interpreter at tiny sizes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("gpu-report needs a CUDA GPU and torch with CUDA (torch.cuda.is_available() is False); "
              "use --interpret to run the same flow through Triton's interpreter on the CPU", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env, peak = environment(args.interpret)
    for key, value in env.items():
        print(f"{key:12s} {value}")
    print(f"{'peak':12s} {peak.describe()}", flush=True)
    tag = f"gpu-report-{_slug('interpret' if args.interpret else env['gpu'])}-" \
          f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    before = set(out_dir.glob("*.json"))
    steps = plan(args, out_dir)
    problems = []
    if importlib.util.find_spec("pytest") is None:
        problems.append("pytest is not installed in this Python: the test step cannot run "
                        "(install pytest, or run the tests elsewhere)")
        steps[0].status = "FAIL"
        steps[0].tail = problems[-1]
    if not (ROOT / "tests").is_dir():
        problems.append(f"no tests/ folder next to the attnops package ({ROOT}): install attnops editable from "
                        "a checkout (pip install --no-deps --no-build-isolation -e .)")
        steps[0].status = "FAIL"
        steps[0].tail = problems[-1]
    for problem in problems:
        print(f"!! {problem}", file=sys.stderr)
    for step in steps:
        if step.status == "not run":
            run_step(step, out_dir, tag)
    new_json = sorted(set(out_dir.glob("*.json")) - before)
    bench = bench_rows(new_json, peak)
    if bench:
        print(_table(["case", "implementation", "median", "rate", "% of peak", "note"], bench))
    path = out_dir / f"{tag}.md"
    path.write_text(summary(env, peak, args, steps, bench, time.perf_counter() - start))
    failed = [s.name for s in steps if not s.ok]
    print(f"wrote {path}")
    print(f"gpu-report: {len(steps) - len(failed)} of {len(steps)} steps passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
