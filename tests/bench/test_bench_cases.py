"""The benchmark harness on tiny cases: both dense FlashAttention layouts feed SDPA the same values, the output check
compares the two implementations element for element, and the DSA sample times the same rows with sparse and
dense attention."""
import pytest
import torch

from attnops.bench.cases import suite_cases
from attnops.bench.types import Case
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


def test_dsa_sampled_rows_are_spread_and_timed_alike_by_sparse_and_dense(monkeypatch):
    from attnops.bench import dsa
    from attnops.bench.types import sampled_row_chunks

    chunks = sampled_row_chunks(32768, (16, 64))
    assert len(chunks) == 16 and chunks[0] == (992, 1056) and chunks[-1] == (31712, 31776)
    case = Case(name="x", op="dsa_sparse", sq=96, skv=96, seq_lens=(96,), heads=2, kv_heads=1, d=40, dv=32,
                causal=True, layout="TND", params={"topk": 96, "rope": 8, "sample": (3, 4)})
    assert case.kept_pairs() == sum(i + 1 for lo, hi in sampled_row_chunks(96, (3, 4)) for i in range(lo, hi))
    inp = dsa.dsa_inputs(case, torch.device("cpu"), 0)
    outs = []
    per_chunk = dsa._per_chunk
    monkeypatch.setattr(dsa, "_per_chunk", lambda inp, call: outs.append(per_chunk(inp, call)) or outs[-1])
    dsa.build_dsa(case, inp, "cpu").fn()
    dsa.build_dense_rows(case, inp, "cpu").fn()
    assert outs[0].shape == (12, 2, 32)  # top-k >= S: the sparse rows read every allowed key, as dense does
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
