"""``python -m attnops peer-tests`` on a tiny synthetic flash-attn checkout: the stand-in imports, the CUDA-to-CPU
mapping, the size rule, the seeded sample, the exclusions, a missing third-party package, and the table."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from attnops.peer_tests.plugin import PeerTestsPlugin
from attnops.peer_tests.sizes import MAX_SCORES, case_size, fits

ROOT = Path(__file__).resolve().parents[2]

ATTENTION_TESTS = '''
import pytest
import torch
from flash_attn import flash_attn_func
from flash_attn.flash_attn_interface import _get_block_size_n

IS_SM80 = torch.cuda.get_device_capability("cuda") == (8, 0)


@pytest.mark.parametrize("seqlen", [16, 512])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_attention(seqlen, d, causal):
    q = torch.randn(1, min(seqlen, 16), 2, d, device="cuda").cuda()
    assert q.device.type == "cpu" and IS_SM80
    assert flash_attn_func(q, q, q, causal=causal).shape == q.shape


def test_fails():
    assert 1 == 2, "boom"


def test_skips():
    pytest.skip("not here")
'''

EXCLUDED_TESTS = '''
def test_compilation_count():
    raise AssertionError("never runs: excluded")


def test_plain():
    pass
'''


def _checkout(tmp_path: Path) -> Path:
    tests = tmp_path / "tests"
    (tests / "layers").mkdir(parents=True)
    (tests / "test_flash_attn.py").write_text(ATTENTION_TESTS)
    (tests / "test_rotary.py").write_text(EXCLUDED_TESTS)
    (tests / "layers" / "test_rotary.py").write_text("import a_package_that_is_not_installed\n")
    return tmp_path


def _run(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "attnops", "peer-tests", "--flash-attn", str(checkout), *args],
                          capture_output=True, text=True, env=env, cwd=checkout, timeout=600)


def _row(output: str, name: str) -> list[int]:
    line = next(line for line in output.splitlines() if line.strip().startswith(name + " "))
    return [int(x) for x in line.split()[-7:]]


def test_runner_table_on_a_synthetic_checkout(tmp_path):
    result = _run(_checkout(tmp_path), "--sample", "2", "--seed", "3")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr  # test_fails failed
    assert "'cuda' and 'cuda:N' -> 'cpu'" in out and "size rule" in out
    # collected, excluded, too large, sampled out, passed, failed, skipped
    assert _row(out, "test_attention") == [12, 0, 4, 6, 2, 0, 0]  # 512*512*{64,128} are over the rule
    assert _row(out, "test_fails") == [1, 0, 0, 0, 0, 1, 0]
    assert _row(out, "test_skips") == [1, 0, 0, 0, 0, 0, 1]
    assert _row(out, "test_compilation_count") == [1, 1, 0, 0, 0, 0, 0]
    assert _row(out, "test_plain") == [1, 0, 0, 0, 1, 0, 0]
    assert "FAILED tests/test_flash_attn.py::test_fails: AssertionError: boom" in out
    assert "skipped file tests/layers/test_rotary.py: needs the package 'a_package_that_is_not_installed'" in out


def test_size_rule_reads_the_case_parameters():
    assert case_size({"seqlen_q": 113, "seqlen_k": 203, "d": 64}) == 113 * 203 * 64
    assert case_size({"seqlen": 256, "headdim": 128}) == MAX_SCORES and fits({"seqlen": 256, "headdim": 128})
    assert not fits({"seqlen": 257, "d": 128}) and fits({"dtype": "fp16"})


def test_select_matches_file_and_function():
    plugin = PeerTestsPlugin(None, 0, ("test_attention$", "^tests/other.py::"))
    assert plugin._selected("tests/test_flash_attn.py::test_attention")
    assert plugin._selected("tests/other.py::test_anything")
    assert not plugin._selected("tests/test_flash_attn.py::test_attention_varlen")
    assert PeerTestsPlugin(None, 0)._selected("tests/x.py::test_y")


def test_the_sample_is_seeded_per_function():
    cases = [{"d": d} for d in range(20)]
    picks = [PeerTestsPlugin(3, seed)._chosen("f.py::test_x", cases) for seed in (0, 0, 1)]
    assert picks[0] == picks[1] and len(picks[0]) == 3 and picks[0] != picks[2]
    assert PeerTestsPlugin(None, 0)._chosen("f.py::test_x", cases) == list(range(20))  # --sample 0: all
