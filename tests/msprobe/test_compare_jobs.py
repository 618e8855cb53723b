"""``attnops compare --jobs N`` (worker processes, dump order kept), progress lines, and the chunked metrics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnops.__main__ import main
from attnops.msprobe import judge_path
from attnops.msprobe import metrics as metrics_module
from attnops.msprobe.metrics import compute_metrics, histogram_edges, metrics_against

DATA = Path(__file__).parent / "data"


def test_jobs_give_the_sequential_records_in_dump_order(tmp_path, capsys):
    assert main(["compare", str(DATA / "correct"), "--json", str(tmp_path / "one.json")]) == 0
    one = capsys.readouterr().out
    assert main(["compare", str(DATA / "correct"), "--jobs", "3", "--json", str(tmp_path / "three.json")]) == 0
    assert capsys.readouterr().out == one
    assert json.loads((tmp_path / "three.json").read_text()) == json.loads((tmp_path / "one.json").read_text())


def test_forward_and_backward_of_a_call_number_are_judged_together():
    calls = [r.call for r in judge_path(DATA / "correct", api="npu_fusion_attention")]
    assert calls == ["NPU.npu_fusion_attention.0.forward", "NPU.npu_fusion_attention.0.backward",
                     "NPU.npu_fusion_attention.1.forward", "NPU.npu_fusion_attention.1.backward"]


def test_progress_lines_per_call_on_stderr(capsys):
    assert main(["compare", str(DATA / "corrupt"), "--progress"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    total = len(judge_path(DATA / "corrupt"))
    assert len(lines) == total
    assert [line.split("]")[0] for line in lines] == [f"[{i}/{total}" for i in range(1, total + 1)]
    assert "FAIL  step0/proc24766  NPU.npu_fusion_attention.0.forward  elapsed " in lines[0]
    assert "[" not in captured.out  # stdout keeps only the results


def test_quiet_and_non_terminal_stderr_have_no_progress(capsys):
    for argv in (["compare", str(DATA / "statistics")], ["compare", str(DATA / "statistics"), "--quiet"]):
        assert main(argv) == 0
        assert capsys.readouterr().err == ""


def test_jobs_must_be_positive(capsys):
    assert main(["compare", str(DATA / "correct"), "--jobs", "0"]) == 2
    assert capsys.readouterr().err == "attnops compare: --jobs 0: expected a positive number of processes\n"


@pytest.mark.parametrize("chunk", [3, 1 << 16])
def test_chunked_metrics_match_one_pass_with_nonfinite_elements(monkeypatch, chunk):
    monkeypatch.setattr(metrics_module, "CHUNK", chunk)
    g = torch.Generator().manual_seed(1)
    bench = torch.randn(1000, generator=g, dtype=torch.float64)
    bench[::97] = 0.0
    actual = (bench + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64)).bfloat16()
    actual[5], bench[7] = float("nan"), float("inf")
    (m, hist), = metrics_against(bench, [actual], torch.bfloat16)
    keep = torch.isfinite(actual.double()) & torch.isfinite(bench)
    a, b = actual.double()[keep], bench[keep]
    err = (a - b).abs()
    large = b.abs() > 2.0 ** -10
    assert m.rmse == pytest.approx(float(err.square().mean().sqrt()), rel=1e-12)
    assert m.mean_rel_err == pytest.approx(float((err[large] / (b[large].abs() + 2.0 ** -8)).mean()), rel=1e-12)
    assert m.max_abs_err == float(err.max())
    assert m == compute_metrics(actual, bench, torch.bfloat16)
    assert int(hist.sum()) == int((err > 0).sum())  # every non-zero error counted once
    edges = histogram_edges()
    i = int(torch.searchsorted(edges, err.max(), right=True)) - 1
    assert hist[i] >= 1 and edges[i] <= err.max() < edges[i + 1]
