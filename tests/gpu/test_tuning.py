"""Tuned tiles: the candidates of a launch, the table lookup (a table of this GPU and Triton version selects a
candidate; a missing table, another GPU's or Triton version's, or a configuration that is no longer a candidate keeps
the default), ``gpu-report --tune`` in the plan, and ``gpu-report --tune --interpret`` writing a table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnops._core.triton import tuned
from attnops._core.triton.launch import Launch
from attnops.gpu import report

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
GPU = "Fake GPU 80GB"
LAUNCH = Launch("fwd_kernel", (1024, 8), (torch.zeros(4, dtype=torch.float16), 7), dict(BLOCK_D=64, CAUSAL=True),
                block_axis="BLOCK_M")
CONFIGS = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3),
           triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)]
WIDE = tuned.signature(CONFIGS[1])


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """Launchers on ``cuda:0`` named ``GPU``, reading tables from ``tmp_path``; caches cleared around the test."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU)
    monkeypatch.setenv("ATTNOPS_TUNED_DIR", str(tmp_path))
    tuned.load_table.cache_clear()
    tuned._device_table.cache_clear()
    yield tmp_path
    tuned.load_table.cache_clear()
    tuned._device_table.cache_clear()


def _write(directory: Path, chosen: dict, gpu: str = GPU, version: str | None = None, file_gpu: str = GPU) -> None:
    version = version or triton.__version__
    entry = dict(family="flash_attention", kernel="fwd_kernel", bucket=tuned.bucket(LAUNCH, CONFIGS), chosen=chosen)
    table = dict(format=tuned.FORMAT, gpu=gpu, triton=version, entries=[entry])
    (directory / tuned.table_name(file_gpu, version)).write_text(json.dumps(table))


def _chosen() -> dict:
    return tuned.signature(tuned.choose("flash_attention", LAUNCH, CONFIGS, torch.device("cuda", 0)))


def test_candidates_are_the_family_configs_then_warp_and_stage_variants():
    found = [(c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in tuned.candidates(CONFIGS)]
    assert found == [(64, 8, 3), (128, 8, 3), (64, 8, 2), (64, 8, 4)]
    four_warps = triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)
    found = [(c.kwargs, c.num_warps, c.num_stages) for c in tuned.candidates([four_warps])]
    assert found == [({"BLOCK_N": 32}, 4, 1), ({"BLOCK_N": 32}, 4, 2), ({"BLOCK_N": 32}, 8, 1),
                     ({"BLOCK_N": 32}, 8, 2)]


def test_table_selects_a_candidate(fake_gpu):
    _write(fake_gpu, WIDE)
    assert _chosen() == WIDE


def test_missing_table_keeps_the_default(fake_gpu):
    assert _chosen() == tuned.signature(CONFIGS[0])


@pytest.mark.parametrize("other", [dict(version="0.0.1"), dict(gpu="NVIDIA A100", file_gpu="NVIDIA A100"),
                                   dict(gpu="NVIDIA A100")])
def test_table_of_another_gpu_or_triton_version_is_ignored(fake_gpu, other):
    _write(fake_gpu, WIDE, **other)
    assert _chosen() == tuned.signature(CONFIGS[0])


def test_a_configuration_that_is_no_candidate_keeps_the_default(fake_gpu):
    _write(fake_gpu, dict(WIDE, tiles={"BLOCK_M": 256, "BLOCK_N": 64}))
    assert _chosen() == tuned.signature(CONFIGS[0])


def test_cpu_launches_never_read_tables(fake_gpu):
    _write(fake_gpu, WIDE)
    assert tuned.choose("flash_attention", LAUNCH, CONFIGS, torch.device("cpu")) is CONFIGS[0]


@pytest.mark.parametrize("flags", [["--tune"], ["--tune", "--interpret", "--quick"]])
def test_tune_runs_first(flags, tmp_path):
    args = report.parser().parse_args(flags + ["--tuned-dir", str(tmp_path)])
    first = report.plan(args, tmp_path)[0]
    assert first.name == "tune" and first.command[first.command.index("--dir") + 1] == str(tmp_path.resolve())


@pytest.mark.slow
def test_interpret_tune_writes_a_table(tmp_path):
    """``gpu-report --tune --interpret --quick`` with a small budget: the tune step writes the interpreter's table
    (the steps after it are skipped for the budget)."""
    tables = tmp_path / "tuned"
    run = subprocess.run([sys.executable, "-m", "attnops", "gpu-report", "--interpret", "--quick", "--tune",
                          "--tuned-dir", str(tables), "--budget", "40", "--out", str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    (md,) = (tmp_path / "out").glob("gpu-report-interpret-*.md")
    assert "| tune | done |" in md.read_text(), run.stdout[-3000:] + run.stderr[-2000:]
    (path,) = tables.glob("cpu-interpreter-triton*.json")
    table = json.loads(path.read_text())
    assert table["gpu"] == "cpu-interpreter" and table["triton"] == triton.__version__ and table["entries"]
    entry = table["entries"][0]
    assert entry["default"] == entry["timings"][0]["config"] and entry["timings"][0]["status"] == "ok"
