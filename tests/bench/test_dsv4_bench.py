"""The dsv4-cpu suites' builders on tiny cases: a decode step gives the softmax over its window, its compressed
rows and the sink (keys gathered here from the paged stores), beside the dense baseline; the prefill case runs with
its peak memory."""
from __future__ import annotations

import pytest
import torch

from attnops.bench import SUITES, Case, run_case
from attnops.bench.dsv4 import build_dsv4, dsv4_inputs

CPU = torch.device("cpu")
KW = dict(repeat=1, warmup=1, impls=None, idle_wait=0.0, seed=0, check=False, log=print)


def _rows(store, table, count):
    """The first ``count`` logical rows ``[count, D]`` of a paged store."""
    pos = torch.arange(count)
    return store[table[0, pos // store.shape[1]].long(), pos % store.shape[1], 0]


@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_step_is_the_softmax_over_its_keys(ratio):
    case = Case(name="tiny-dsv4-decode", op="dsv4_decode", heads=4, kv_heads=1, sq=1, skv=1024, d=16, dv=16,
                baselines=("sdpa-dense-folded",), params={"window": 8, "topk": 5, "block": 16, "cmp_ratio": ratio})
    inp = dsv4_inputs(case, CPU, 0)
    run = build_dsv4(case, inp, CPU)
    run.fn()
    kw = inp.kwargs
    cmp = _rows(kw["cmp"], kw["cmp_table"], 1024 // ratio)
    keys = torch.cat([_rows(inp.k, kw["window_table"], 1024)[-8:],
                      cmp[kw["picks"].view(-1).long()] if ratio == 4 else cmp])
    logits = inp.q[0, 0].double() @ keys.double().T * inp.scale
    p = torch.softmax(torch.cat([logits, torch.zeros(4, 1, dtype=torch.float64)], 1), 1)[:, :-1]  # sink 0
    torch.testing.assert_close(run.output()[0, 0].double(), p @ keys.double(), atol=1e-5, rtol=1e-5)
    entry = run_case(case, CPU, **KW)
    assert all(entry["results"][n]["status"] == "ok" for n in ("attnops", "sdpa-dense-folded")), entry


def test_prefill_case_runs_with_its_memory():
    case = Case(name="tiny-dsv4-prefill", op="dsv4_prefill", heads=2, kv_heads=1, sq=64, skv=64, d=16, dv=16,
                baselines=(), track_memory=True, params={"window": 8, "topk": 4, "cmp_ratio": 4})
    assert case.kept_pairs() == sum(min(8, i + 1) + min(4, (i + 1) // 4) for i in range(64))
    entry = run_case(case, CPU, **KW)
    assert entry["results"]["attnops"]["status"] == "ok" and "memory" in entry["results"]["attnops"], entry


def test_suites_registered():
    decode = {c.name: c for c in SUITES["dsv4-cpu-decode"].cases}
    assert {c.params["cmp_ratio"] for c in decode.values()} == {4, 128}
    assert all(c.skv == 131072 and c.heads == 64 and c.d == 512 for c in decode.values())
    assert [c.skv for c in SUITES["dsv4-cpu-prefill"].cases] == [8192, 16384, 32768]
