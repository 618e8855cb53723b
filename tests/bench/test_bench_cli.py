"""``python -m attnops bench`` as a command: the suite listing, where results go, the skipped plot, progress."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import attnops
from attnops.bench import SUITES, Case, Suite, main
from attnops.bench import runner

DEVELOPMENT_WORDS = re.compile(r"\b(issue|session|helper|acceptance|todo)\b", re.IGNORECASE)


def test_without_a_suite_it_lists_the_suites_and_runs_nothing(monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(runner, "run_case", must_not_run)
    monkeypatch.setattr(runner, "environment", must_not_run)
    assert main([]) == 0
    out = capsys.readouterr().out
    for name, suite in SUITES.items():
        assert re.search(rf"^  {re.escape(name)} .*{re.escape(suite.description)}$", out, re.MULTILINE)
    assert not DEVELOPMENT_WORDS.search(out)


def test_suite_texts_are_for_users():
    for suite in SUITES.values():
        assert "\n" not in suite.description and len(suite.description) <= 130, suite.name
        assert not DEVELOPMENT_WORDS.search(suite.description + " " + suite.details), suite.name


def test_an_unknown_suite_is_an_error_that_lists_the_suites(capsys):
    assert main(["--suite", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite 'nope'" in err and all(name in err for name in SUITES)


@pytest.fixture
def tiny_suite(monkeypatch, tmp_path):
    """A registered one-case suite, run in an empty current directory."""
    case = Case(name="tiny-fwd", heads=2, kv_heads=2, sq=16, skv=16, d=8, dv=8)
    monkeypatch.setitem(SUITES, "tiny", Suite(name="tiny", description="one tiny case", cases=(case,), repeat=1,
                                              warmup=0))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_results_go_to_the_current_directory_and_the_missing_plot_is_reported(tiny_suite, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # matplotlib is not installed
    assert main(["--suite", "tiny"]) == 0
    captured = capsys.readouterr()
    written = list((tiny_suite / "attnops-bench-results").glob("tiny-cpu-*.json"))
    assert len(written) == 1 and [p for p in tiny_suite.rglob("*") if p.is_file()] == written
    package = Path(attnops.__file__).resolve().parent
    assert package not in written[0].resolve().parents
    result = json.loads(written[0].read_text())
    assert result["suite"] == "tiny" and result["cases"][0]["results"]["attnops"]["status"] == "ok"
    plot_lines = [line for line in captured.out.splitlines() if "plot" in line]
    assert plot_lines == ["plot skipped: matplotlib is not installed; pip install matplotlib (or the [bench] extra)"]
    assert re.fullmatch(r"\[1/1\] tiny-fwd  elapsed \d+s", captured.err.splitlines()[0])
    assert re.fullmatch(r"1 case\(s\) in \d+s", captured.err.splitlines()[-1])


def test_out_selects_the_results_folder(tiny_suite, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--suite", "tiny", "--out", "benchmarks/results"]) == 0
    assert len(list((tiny_suite / "benchmarks" / "results").glob("tiny-cpu-*.json"))) == 1
    assert not (tiny_suite / "attnops-bench-results").exists()


def test_a_filter_that_matches_nothing_lists_the_suites_cases(tiny_suite, capsys):
    assert main(["--suite", "tiny", "--filter", "bwd"]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == ["tiny-fwd"]


def test_host_overhead_suite_times_every_scenario_on_the_triton_path(tmp_path, capsys):
    """Every case of the host-overhead suite runs on the Triton path (launches recorded, nothing falls back)."""
    assert main(["--suite", "host-overhead", "--repeat", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("host-overhead-meta-*.json")
    result = json.loads(written.read_text())
    assert len(result["cases"]) == len(SUITES["host-overhead"].cases)
    for entry in result["cases"]:
        assert entry["results"]["attnops"]["status"] == "ok", entry["case"]["name"]
    assert " us " in capsys.readouterr().out
