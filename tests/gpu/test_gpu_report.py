"""``python -m attnops gpu-report``: the peak table, the GPU suite registry, the refusal without CUDA, the step order,
the time budget (a hanging step killed at its cap, a running step killed and later steps skipped when the budget
runs out, the summary written after every step and when stopped by a signal: fake steps through ``--interpret``),
and the whole ``--interpret --quick`` flow (Triton's interpreter on the CPU)."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnops.gpu import report, steps
from attnops.gpu.families import KERNEL_FAMILIES
from attnops.gpu.peaks import peak_for
from attnops.gpu.suites import GPU_SUITES, GpuSuite, register_gpu_suite

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,model", [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                                        ("NVIDIA H200", "H200 SXM"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB")])
def test_known_peaks(name, model):
    assert peak_for(name).model == model and peak_for(name).bf16_tflops > 0 and peak_for(name).hbm_gbps > 0


def test_unknown_gpu_has_unknown_peaks():
    peak = peak_for("NVIDIA GeForce RTX 4090")
    assert peak.bf16_tflops is None and "unknown" in peak.describe()


def test_gpu_suites_registry():
    from attnops.bench import SUITES

    assert "fa-gpu" in GPU_SUITES
    for s in GPU_SUITES.values():
        assert SUITES[s.suite].device == "cuda" and s.smoke_suite in SUITES
    with pytest.raises(ValueError, match="already registered"):
        register_gpu_suite(GpuSuite("fa-gpu", "fa-smoke", "x"))


def test_memory_bound_rate_uses_bytes():
    case = dict(dtype="bfloat16", batch=2, heads=4, kv_heads=1, sq=1, skv=100, d=8, dv=8)
    assert report.bytes_moved(case) == 2 * (2 * 1 * 4 * 16 + 2 * 100 * 1 * 16)
    int8_kv = dict(case, params={"kv": "int8"})
    assert report.bytes_moved(int8_kv) == 2 * 2 * 1 * 4 * 16 + 2 * 100 * 1 * 16


def test_default_output_folder_is_in_the_current_directory():
    assert report.parser().parse_args([]).out == "attnops-gpu-report"
    assert report.parser().parse_args(["--out", "elsewhere"]).out == "elsewhere"


def test_hanging_step_is_killed_at_its_cap(tmp_path):
    code = "import time; print('started', flush=True); time.sleep(60); print('finished', flush=True)"
    step = steps.Step("hang", [sys.executable, "-c", code], expected_s=1, cap_s=2)
    steps.run_step(step, tmp_path / "hang.log", dict(os.environ))
    assert step.status == steps.TIMEOUT and "started" in step.tail and "finished" not in step.tail
    assert 2 <= step.seconds < 30


def test_running_step_is_killed_when_the_budget_runs_out(tmp_path):
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    run = [steps.Step("long", sleep, expected_s=0.5, cap_s=60), steps.Step("next", sleep, expected_s=0.1, cap_s=60)]
    steps.run_within_budget(run, time.perf_counter() + 2, lambda s: tmp_path / f"{s.name}.log", dict(os.environ),
                            progress=lambda: None)
    assert [s.status for s in run] == [steps.KILLED_BUDGET, steps.SKIPPED_BUDGET] and run[0].seconds < 30


@pytest.mark.parametrize("flags", [[], ["--quick"], ["--interpret"], ["--interpret", "--quick"]])
def test_steps_run_most_valuable_first(flags, tmp_path):
    """Each family's tests, (CUDA) the tests no family claims, check, one benchmark per suite, then the rest."""
    args = report.parser().parse_args(flags)
    names = [s.name for s in report.plan(args, tmp_path)]
    tests = [f"tests-{f.name}" for f in KERNEL_FAMILIES] + ([] if args.interpret else ["tests-integration"])
    first_bench = [f"bench-{s}" for s in GPU_SUITES]
    rest = [] if args.quick else [f"bench-{s}-rest" for s in GPU_SUITES]
    assert names == tests + ["check"] + first_bench + rest


def test_rest_of_a_suite_is_every_case_but_the_quick_ones():
    from attnops.bench.cases import suite_cases

    args = report.parser().parse_args([])
    for suite in GPU_SUITES.values():
        quick, rest = (report.bench_command(suite, args, Path("."), quick_cases=q)[-1] for q in (True, False))
        names = [c.name for c in suite_cases(suite.suite)]
        picked = [n for n in names if re.search(quick, n)] + [n for n in names if re.search(rest, n)]
        assert picked and sorted(picked) == sorted(names)


def _fake_plan(order_file: Path):
    """Steps that append their name to ``order_file``: three that fit a 20 s budget (one of them failing), one that
    would not (skipped, and so is the small one after it)."""
    def plan(args, out_dir):
        def step(name, expected_s, rc=0):
            code = f"open({str(order_file)!r}, 'a').write({name!r} + '\\n'); raise SystemExit({rc})"
            return steps.Step(name, [sys.executable, "-c", code], expected_s=expected_s, cap_s=30)

        return [step("tests-fake", 1), step("check", 1, rc=1), step("bench-fake", 1), step("bench-fake-rest", 600),
                step("bench-small", 0.1)]

    return plan


def test_budget_skips_what_does_not_fit_and_writes_the_summary(tmp_path):
    order = tmp_path / "order.txt"
    rc = report.main(["--interpret", "--budget", "20", "--out", str(tmp_path)], plan_steps=_fake_plan(order))
    assert rc == 1  # check failed
    assert order.read_text().split() == ["tests-fake", "check", "bench-fake"]
    (md,) = tmp_path.glob("gpu-report-interpret-*.md")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:4] for line in md.read_text().splitlines()
            if line.startswith("| tests-fake") or line.startswith("| check") or line.startswith("| bench-")}
    assert rows["tests-fake"][0] == "done" and rows["check"][0] == "failed" and rows["bench-fake"][0] == "done"
    assert rows["bench-fake-rest"] == ["skipped (budget)", "0.0", "600"]
    assert rows["bench-small"][0] == "skipped (budget)"
    assert float(rows["tests-fake"][1]) >= 0 and "of a 20 s budget" in md.read_text()  # elapsed recorded
    assert len(list(tmp_path.glob("gpu-report-interpret-*-tests-fake.log"))) == 1


def test_measured_times_are_the_next_estimates(tmp_path):
    done = steps.Step("tests-fake", [], expected_s=1, cap_s=3, status=steps.DONE, seconds=40.0)
    report.save_timings([done, steps.Step("check", [], expected_s=5, cap_s=15, status=steps.FAILED, seconds=1.0)],
                        tmp_path, "cuda")
    planned = [steps.Step("tests-fake", [], expected_s=1, cap_s=3), steps.Step("check", [], expected_s=5, cap_s=15)]
    report.load_estimates(planned, tmp_path, "cuda")
    assert (planned[0].expected_s, planned[0].cap_s) == (40.0, 120.0) and planned[1].expected_s == 5
    report.load_estimates(again := [steps.Step("tests-fake", [], expected_s=1, cap_s=3)], tmp_path, "interpret")
    assert again[0].expected_s == 1


SIGNALLED_RUN = """
import sys, time
from pathlib import Path
from attnops.gpu import report, steps
started = Path(sys.argv[1]) / "started"
def plan(args, out_dir):
    wait = f"open({str(started)!r}, 'w').close(); import time; time.sleep(60)"
    return [steps.Step("tests-fake", [sys.executable, "-c", "pass"], 1, 30),
            steps.Step("check", [sys.executable, "-c", wait], 1, 90), steps.Step("bench-fake", [], 1, 30)]
sys.exit(report.main(["--interpret", "--out", sys.argv[1]], plan_steps=plan))
"""


def test_stopped_run_kills_its_step_and_writes_the_summary(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED_RUN, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    (md,) = tmp_path.glob("gpu-report-interpret-*.md")
    text = md.read_text()
    assert "| tests-fake | done |" in text and "| check | interrupted |" in text
    assert "| bench-fake | skipped (interrupted) |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda():
    run = subprocess.run([sys.executable, "-m", "attnops", "gpu-report"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr and "--interpret" in run.stderr


def test_interpret_quick_flow(tmp_path):
    """The whole flow through the interpreter (about 1.5 min on 2 CPU cores): every step passes, the summary and
    the benchmark JSON are written."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-m", "attnops", "gpu-report", "--interpret", "--quick", "--out",
                          str(tmp_path), "--budget", "600"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    (md,) = tmp_path.glob("gpu-report-interpret-*.md")
    text = md.read_text()
    for family in KERNEL_FAMILIES:
        assert f"| tests-{family.name} | done |" in text
    assert "| check | done |" in text
    for suite in GPU_SUITES.values():
        assert f"| bench-{suite.suite} | done |" in text
        assert list(tmp_path.glob(f"{suite.smoke_suite}-cpu-*.json"))
