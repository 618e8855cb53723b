"""The benchmark harness on tiny FlashAttention cases: both dense layouts feed SDPA the same values, and the output
check compares the two implementations element for element."""
import pytest
import torch

from attnops.bench.cases import Case, suite_cases
from attnops.bench.impls import make_inputs
from attnops.bench.runner import run_case


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_fa_case_matches_sdpa(layout, causal, mode):
    case = Case(name="tiny", mode=mode, heads=2, kv_heads=2, sq=40, skv=40, d=16, dv=16, causal=causal,
                layout=layout)
    entry = run_case(case, torch.device("cpu"), repeat=1, warmup=0, impls=None, idle_wait=0.0, seed=0,
                     check=True, log=lambda *_: None)
    assert entry["results"]["attnops"]["status"] == "ok"
    assert entry["results"]["sdpa"]["status"] == "ok"
    assert entry["checks"]["sdpa"]["max_abs_diff_out"] < 1e-5
    assert entry["ratios"]["sdpa"]["min"] > 0


def test_layouts_hold_the_same_values():
    kw = dict(name="tiny", heads=2, kv_heads=2, sq=8, skv=8, d=4, dv=4)
    bnsd, bsnd = (make_inputs(Case(layout=lay, **kw), torch.device("cpu")) for lay in ("BNSD", "BSND"))
    for a, b in zip((bnsd.q, bnsd.k, bnsd.v, bnsd.dy), (bsnd.q, bsnd.k, bsnd.v, bsnd.dy)):
        assert a.is_contiguous() and torch.equal(a, b.transpose(1, 2))


def test_fa_cpu_suite_covers_both_layouts():
    layouts = {c.layout for c in suite_cases("fa-cpu")}
    assert layouts == {"BNSD", "BSND"}
