"""``torch_npu.testing`` (torch_npu's assertRtolEqual rule, SupportedDevices by the reported SoC, the CANN-version
skip), ``torch_npu.npu.utils``, and ``torch.npu.NPUGraph`` capture/replay with aclgraph task-group updates. Shim
scripts run in a fresh interpreter (the shim changes global state)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from attnops.torch_npu.npu_graph import (NPUGraph, graph, graph_task_group_begin, graph_task_group_end,
                                         graph_task_update_begin, graph_task_update_end)
from attnops.torch_npu.testing.rtol import check_rtol_equal

REPO = Path(__file__).resolve().parents[2]


def test_rtol_rule_counts_elements_outside_both_tolerances():
    x = np.ones(10000, dtype=np.float32)
    y = x.copy()
    y[:1] += 0.01  # 1 of 10000 outside both 1e-4 tests: allowed (at most prec * size = 1)
    assert check_rtol_equal(x, y) is None
    y[:2] += 0.01  # 2 outside both: "result error"
    assert check_rtol_equal(x, y) == "result error"
    y16 = x.astype(np.float16)
    y16[:5] = np.float16(1.0009765625)  # |diff| <= prec16 = 1e-3: within the absolute test everywhere
    assert check_rtol_equal(x.astype(np.float16), y16) is None
    assert check_rtol_equal(x, x.astype(np.float64)) == "dtype error"
    assert check_rtol_equal(x[:5], x[:6]) == "shape error"
    big = np.full(4, 1e6, dtype=np.float32)
    assert check_rtol_equal(big, big * (1 + 5e-5)) is None  # relative 5e-5 <= 1e-4 everywhere
    nan = np.array([np.nan, 1.0], dtype=np.float32)
    assert check_rtol_equal(nan, nan) is None and check_rtol_equal(nan, nan[::-1].copy()) is not None
    bf = torch.ones(8, dtype=torch.bfloat16)
    assert check_rtol_equal(bf, bf + 0.0078125) == "result error"  # bf16: allclose(rtol=atol=prec16)
    assert check_rtol_equal([np.float32(1.0), x], [np.float32(1.0), x]) is None


def test_graph_replays_recorded_calls_into_the_captured_outputs():
    x = torch.arange(4.0)
    g = NPUGraph()
    with graph(g):
        y = x * 2 + 1
        x.add_(1)
    assert torch.equal(y, torch.tensor([1.0, 3.0, 5.0, 7.0])) and torch.equal(x, torch.arange(1.0, 5.0))
    g.replay()  # x * 2 + 1 on the current x (1..4), then x += 1
    assert torch.equal(y, torch.arange(1.0, 5.0) * 2 + 1) and torch.equal(x, torch.arange(2.0, 6.0))


def test_task_group_update_replaces_the_group_on_replay():
    from attnops import torch_npu

    q, k, v = (torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = torch.zeros(1, 2, 3, 8)
    g = NPUGraph()
    with graph(g):
        graph_task_group_begin()
        out.copy_(torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5)[0])
        handle = graph_task_group_end()
    graph_task_update_begin(None, handle)
    out.copy_(torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.25)[0])
    graph_task_update_end()
    out.zero_()
    g.replay()
    gold = torch.softmax(0.25 * q.double() @ k.double().transpose(-1, -2), -1) @ v.double()
    assert (out.double() - gold).abs().max() < 1e-5


SHIM_TESTING = """
import unittest
import numpy as np
import torch
import attnops.torch_npu
assert attnops.torch_npu.install(soc={soc!r}, cann_version="8.5.0")
import torch_npu
import torch_npu.npu.utils as utils
from torch_npu.testing.testcase import TestCase
from torch_npu.testing.common_utils import (SkipIfNotGteCANNVersion, SupportedDevices, create_common_tensor,
                                            get_npu_device)

class Case(TestCase):
    @SupportedDevices(["Ascend910B"])
    def test_a2(self):
        pass

    @SupportedDevices(["Ascend910_93", "Ascend950"])
    def test_a3_a5(self):
        pass

    @SkipIfNotGteCANNVersion("9.0.0")
    def test_new_cann(self):
        pass

    def test_compare(self):
        cpu, npu = create_common_tensor([np.float32, 29, (2, 3)], -1, 1)
        self.assertRtolEqual(cpu, npu)
        self.assertEqual(cpu, npu + 5e-6)  # within the default precision 1e-5
        self.assertEqual(torch_npu.get_npu_format(npu), 29)
        with self.assertRaises(AssertionError):
            self.assertRtolEqual(cpu, npu + 1)

result = unittest.TextTestRunner(verbosity=0).run(unittest.defaultTestLoader.loadTestsFromTestCase(Case))
skipped = sorted(test.id().split(".")[-1] for test, _ in result.skipped)
assert result.wasSuccessful(), result.failures + result.errors
assert skipped == {skipped!r}, skipped
assert get_npu_device() == "npu:0" and utils.get_soc_version() == {version}
assert torch.npu.get_device_name() == {soc!r} and utils.get_cann_version() == "8.5.0"
assert not utils._is_gte_cann_version("9.0.0") and utils._is_gte_cann_version("8.1.RC1")
torch.npu.set_compile_mode(jit_compile=False)
assert torch.npu.is_jit_compile_false()
assert torch.accelerator.current_device() == torch.accelerator.current_device_index()
assert torch.ops.batch_invariant_ops.npu_fused_infer_attention_score_batch_invariant is \\
    torch_npu.npu_fused_infer_attention_score
assert torch_npu.atb.npu_paged_cache_load is torch.ops.atb.npu_paged_cache_load
cache = torch.zeros(4, 2)
torch.ops._C_ascend.npu_scatter_nd_update_v2(cache, torch.tensor([[1], [-1]]), torch.ones(2, 2))
assert cache.sum() == 2 and cache[1].sum() == 2
torch.npu.manual_seed(3)
state = torch.npu.get_rng_state()
a = torch.randn(3, device="npu"), torch_npu.npu_fusion_attention(*(torch.ones(1, 1, 4, 8),) * 3, 1, "BNSD",
                                                                 keep_prob=0.5)[4:6]
torch.npu.set_rng_state(state)
b = torch.randn(3, device="npu"), torch_npu.npu_fusion_attention(*(torch.ones(1, 1, 4, 8),) * 3, 1, "BNSD",
                                                                 keep_prob=0.5)[4:6]
drawn = (3, 0) if utils.get_soc_version() < 260 else (0, 0)  # Ascend950 keeps the given seed/offset
assert torch.equal(a[0], b[0]) and a[1] == b[1] == drawn
print("ok")
"""


@pytest.mark.parametrize("soc, skipped, version", [
    ("Ascend910B1", ["test_a3_a5", "test_new_cann"], 220),
    ("Ascend910_9391", ["test_a2", "test_new_cann"], 250),
    ("Ascend950PR_9599", ["test_a2", "test_new_cann"], 260),
])
def test_shim_testing_module_selects_by_the_reported_soc(soc, skipped, version):
    script = textwrap.dedent(SHIM_TESTING).format(soc=soc, skipped=skipped, version=version)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_soc_and_cann_version_are_checked():
    from attnops.torch_npu import soc

    with pytest.raises(ValueError, match="soc"):
        soc.configure("Ascend999")
    with pytest.raises(ValueError, match="cann_version"):
        soc.configure(cann_version="nine")
    soc.configure()
