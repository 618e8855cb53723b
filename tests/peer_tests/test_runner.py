"""``python -m attnops peer-tests`` on tiny synthetic flash-attn (flash-attn 2 and FA3) and op-plugin checkouts: the
stand-in imports, the CUDA-to-CPU mapping, the size rule, the seeded sample, the exclusions, a missing third-party
package, the op-plugin file rule and SoC, skips by the file itself and by SoC, and the table."""
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


FA3_TESTS = '''
import torch
from flash_attn_interface import flash_attn_func


def test_fa3():
    q = torch.randn(1, 4, 2, 64, device="cuda")
    out = flash_attn_func(q, q, q)
    assert (out[0] if isinstance(out, tuple) else out).shape == q.shape
'''

OP_PLUGIN_TESTS = '''
import unittest

import torch
import torch_npu
from torch_npu.testing.common_utils import SupportedDevices
from torch_npu.testing.testcase import TestCase


class TestToyAttention(TestCase):
    def test_passes(self):
        self.assertRtolEqual(torch.ones(2, device="npu").cpu().numpy(), torch.ones(2).numpy())

    @SupportedDevices(["Ascend910_93"])
    def test_other_soc(self):
        raise AssertionError("never runs on an Ascend910B")

    @unittest.skip("not here")
    def test_skipped(self):
        raise AssertionError("never runs")
'''


def _checkout(tmp_path: Path) -> Path:
    tests = tmp_path / "tests"
    (tests / "layers").mkdir(parents=True)
    (tests / "test_flash_attn.py").write_text(ATTENTION_TESTS)
    (tests / "test_rotary.py").write_text(EXCLUDED_TESTS)
    (tests / "layers" / "test_rotary.py").write_text("import a_package_that_is_not_installed\n")
    (tmp_path / "hopper").mkdir()
    (tmp_path / "hopper" / "test_flash_attn.py").write_text(FA3_TESTS)
    (tmp_path / "hopper" / "test_util.py").write_text("def test_never_collected():\n    raise AssertionError\n")
    ops = tmp_path / "test" / "test_custom_ops"
    ops.mkdir(parents=True)
    (ops / "test_npu_toy_attention.py").write_text(OP_PLUGIN_TESTS)
    (ops / "test_npu_matmul.py").write_text("def test_not_attention():\n    raise AssertionError\n")
    return tmp_path


def _run(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "attnops", "peer-tests", "--flash-attn", str(checkout),
                           "--op-plugin", str(checkout), "--npu-soc", "Ascend910B1", *args],
                          capture_output=True, text=True, env=env, cwd=checkout, timeout=600)


def _row(output: str, name: str) -> list[int]:
    line = next(line for line in output.splitlines() if line.strip().startswith(name + " "))
    return [int(x) for x in line.split()[-9:-1]]


def test_runner_table_on_a_synthetic_checkout(tmp_path):
    result = _run(_checkout(tmp_path), "--sample", "2", "--seed", "3")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr  # test_fails failed
    assert "'cuda' and 'cuda:N' -> 'cpu'" in out and "size rule" in out
    # collected, excluded, too large, sampled out, passed, failed, skipped, other SoC
    assert _row(out, "test_attention") == [12, 0, 4, 6, 2, 0, 0, 0]  # 512*512*{64,128} are over the rule
    assert _row(out, "test_fails") == [1, 0, 0, 0, 0, 1, 0, 0]
    assert _row(out, "test_skips") == [1, 0, 0, 0, 0, 0, 1, 0]
    assert _row(out, "test_compilation_count") == [1, 1, 0, 0, 0, 0, 0, 0]
    assert _row(out, "test_plain") == [1, 0, 0, 0, 1, 0, 0, 0]
    assert _row(out, "test_fa3") == [1, 0, 0, 0, 1, 0, 0, 0]
    assert "excluded file hopper/test_util.py" in out and "test_never_collected" not in out
    assert _row(out, "TestToyAttention::test_passes") == [1, 0, 0, 0, 1, 0, 0, 0]
    assert _row(out, "TestToyAttention::test_skipped") == [1, 0, 0, 0, 0, 0, 1, 0]
    assert _row(out, "TestToyAttention::test_other_soc") == [1, 0, 0, 0, 0, 0, 0, 1]
    assert "test_npu_matmul.py" not in out and "op-plugin files: test/test_custom_ops/test_*.py named" in out
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
