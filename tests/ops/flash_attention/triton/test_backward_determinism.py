"""The Triton FlashAttention backward is deterministic and its dK/dV pass fills the GPU: dQ/dK/dV (and the pse
gradient) are bitwise equal across two runs and two processes, with dQ split over several partials and a GQA group
summed from per-head partials; the form of GPUs before sm_90 (a dQ kernel beside the pass); the host rule that
sizes the dQ partials (``launch.dq_splits``)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnops
from attnops.ops.common.problem import build_problem
from attnops.ops.common.triton import launch
from tests.helpers import TRIU2048, check_fa, make_qkv

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2(-inf) in numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[4]
# GQA 4:2 with 150 keys: 3 dQ partials per query head (16-key blocks in the interpreter: 3-4 key blocks each)
SHAPE = dict(b=1, n1=4, n2=2, sq=70, skv=150, d=16)
CALL = dict(layout="BNSD", head_num=4, scale=0.3, atten_mask=TRIU2048, sparse_mode=2, pse_type=1)


def _gradients() -> list[torch.Tensor]:
    """dQ, dK, dV and the pse gradient of the fixed problem on the Triton backend."""
    q, k, v, dy = (t.to(DEVICE) for t in make_qkv("BNSD", **SHAPE, seed=21))
    pse = torch.randn(1, 4, SHAPE["sq"], SHAPE["skv"], generator=torch.Generator().manual_seed(22)).to(DEVICE)
    kw = dict(CALL, atten_mask=TRIU2048.to(DEVICE), backend="triton")
    res = attnops.flash_attention(q, k, v, pse=pse, return_stats=True, **kw)
    grads = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, pse=pse, **kw)
    return [g.cpu() for g in grads if g is not None]


def test_split_dq_and_gqa_partials_match_the_golden():
    p = build_problem(*make_qkv("BNSD", **SHAPE, seed=21)[:3], **CALL)
    assert launch.dq_splits(p, torch.device("cpu")) == 3
    q, k, v, dy = (t.to(DEVICE) for t in make_qkv("BNSD", **SHAPE, seed=21))
    pse = torch.randn(1, 4, SHAPE["sq"], SHAPE["skv"], generator=torch.Generator().manual_seed(22)).to(DEVICE)
    check_fa(q, k, v, dy, backend="triton", pse=pse, **dict(CALL, atten_mask=TRIU2048.to(DEVICE)))


def test_dq_kernel_form_matches_the_golden(monkeypatch, triton_backend):
    """GPUs before sm_90 run the dK/dV pass without dQ, then the dQ kernel (GQA's dK/dV partials summed as usual)."""
    monkeypatch.setattr(launch, "dq_in_pass", lambda device: False)
    q, k, v, dy = (t.to(DEVICE) for t in make_qkv("BNSD", **SHAPE, seed=23))
    pse = torch.randn(1, 4, SHAPE["sq"], SHAPE["skv"], generator=torch.Generator().manual_seed(24)).to(DEVICE)
    check_fa(q, k, v, dy, backend="triton", pse=pse, keep_prob=0.8, drop="seed", drop_seed=5,
             **dict(CALL, atten_mask=TRIU2048.to(DEVICE)))
    assert triton_backend[-5:] == ["preprocess_kernel", "dkdv_kernel", "dq_kernel", "grad_sum_kernel",
                                   "grad_sum_kernel"]


def test_gradients_bitwise_equal_across_runs():
    first, second = _gradients(), _gradients()
    assert len(first) == 4
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.slow
def test_gradients_bitwise_equal_across_processes():
    first = _gradients()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = ("import json, torch; from tests.ops.flash_attention.triton.test_backward_determinism import _gradients; "
            "print(json.dumps([g.double().flatten().tolist() for g in _gradients()]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    other = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(torch.equal(a.double().flatten(), torch.tensor(b, dtype=torch.float64)) for a, b in zip(first, other))


@pytest.mark.parametrize("b,n1,skv,splits", [
    (1, 32, 4096, 9),  # MQA/GQA at B=1, 4k keys: 9 x 32 = 288 programs, over two waves of 132 SMs
    (8, 32, 4096, 2),  # 256 pairs: two partials give two waves
    (64, 32, 4096, 1),  # enough pairs: one partial (the fp32 accumulator of dQ)
    (1, 1, 64, 1),  # one key block: nothing to split
    (1, 1, 1 << 20, launch.MAX_DQ_SPLITS),  # memory bound: at most MAX_DQ_SPLITS fp32 copies of dQ
])
def test_dq_splits_fill_two_waves_within_the_memory_bound(b, n1, skv, splits):
    q = torch.empty(b, n1, 16, 64, device="meta")
    k = torch.empty(b, 1, skv, 64, device="meta")
    p = build_problem(q, k, k, layout="BNSD", head_num=n1, scale=0.1)
    assert launch.dq_splits(p, torch.device("meta")) == splits
