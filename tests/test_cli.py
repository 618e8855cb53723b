"""The command line: ``python -m attnops --help`` / ``--version``, the single version source, progress lines."""
from __future__ import annotations

import io
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import attnops
from attnops.__main__ import COMMANDS, main
from attnops._progress import Progress, format_duration, progress_line

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_command_with_its_description():
    r = subprocess.run([sys.executable, "-m", "attnops", "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps the descriptions
    for name, (_, summary) in COMMANDS.items():
        assert f"{name} {' '.join(summary.split())}" in text
    assert "--version" in r.stdout


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnops {attnops.__version__}"


def test_pyproject_reads_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "attnops.__version__"}
    try:
        assert metadata.version("attnops") == attnops.__version__
    except metadata.PackageNotFoundError:
        pass  # not installed: nothing to compare


def test_no_command_prints_the_help_and_fails(capsys):
    assert main([]) == 2
    assert "check" in capsys.readouterr().err


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (7.4, "7s"), (59.6, "1m00s"), (130, "2m10s"),
                                           (3599, "59m59s"), (3725, "1h02m"), (-3, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_progress_line():
    assert progress_line(3, 12, "case", 40, 130) == "[3/12] case  elapsed 40s, ETA 2m10s"
    assert progress_line(1, 12, "case", 0.2, None) == "[1/12] case  elapsed 0s"


def test_progress_extrapolates_the_finished_steps_by_weight():
    now = [100.0]
    out = io.StringIO()
    progress = Progress([1, 3, 4], stream=out, clock=lambda: now[0])
    progress.next("a")
    now[0] += 10  # "a" (weight 1) took 10 s: 7 units left -> 70 s
    progress.next("b")
    now[0] += 30
    progress.next("c")  # 4 units done in 40 s: 4 units left -> 40 s
    now[0] += 40
    progress.finish("3 cases")
    assert out.getvalue().splitlines() == ["[1/3] a  elapsed 0s", "[2/3] b  elapsed 10s, ETA 1m10s",
                                           "[3/3] c  elapsed 40s, ETA 40s", "3 cases in 1m20s"]


def test_progress_redraws_one_line_and_erases_it():
    out = io.StringIO()
    progress = Progress([1, 1], stream=out, overwrite=True, clock=lambda: 0.0)
    progress.next("long label")
    progress.next("b")
    progress.finish()
    assert "\n" not in out.getvalue()
    assert out.getvalue().endswith("\r" + " " * len("[2/2] b  elapsed 0s, ETA 0s") + "\r")
