"""The nsa-cpu-decode suite's builders on a tiny case: decoding through the cache gives the recomputed output,
the prefill + decode case runs, the cache's bytes per token follow the formula; the decode operators' cases run
beside the read bandwidth over the bytes they read and beside their PyTorch peers, which agree with them (the
compressed cases' compared output holds the chosen blocks too)."""
from __future__ import annotations

import pytest
import torch

from attnops.bench import SUITES, Case, run_case
from attnops.bench.nsa_decode import cache_bytes_per_token
from attnops.bench.nsa_peers import PEERS
from attnops.bench.sparse_infer import kv_bytes

SHAPE = dict(batch=2, heads=4, kv_heads=2, d=16, dv=16, sq=1, dtype="float32",
             params={"hidden": 32, "block": 16, "count": 3, "window": 16, "stride": 4, "steps": 5, "chunk": 16})


def test_decode_matches_recompute_and_prefill_decode_runs():
    kw = dict(repeat=1, warmup=1, impls=None, idle_wait=0.0, seed=0, check=True, log=print)
    cpu = torch.device("cpu")
    entry = run_case(Case(name="tiny-decode", op="nsa_decode", skv=70, baselines=("nsa-recompute",), **SHAPE), cpu,
                     **kw)
    assert entry["results"]["attnops"]["status"] == "ok", entry
    assert entry["results"]["nsa-recompute"]["status"] == "ok", entry
    assert entry["checks"]["nsa-recompute"]["max_abs_diff_out"] < 1e-5
    entry = run_case(Case(name="tiny-prefill", op="nsa_prefill_decode", skv=40, baselines=(), track_memory=True,
                          **SHAPE), cpu, **kw)
    assert entry["results"]["attnops"]["status"] == "ok", entry


def test_cache_bytes_per_token():
    case = Case(name="tiny-memory", op="nsa_prefill_decode", skv=64, baselines=(), **SHAPE)
    kv = 2 * 2 * 16 * 4  # K and V, N2=2, D=16, fp32
    cmp_rows = 64 // 4  # the rows a decoding step attends: 4 selection blocks of 16 tokens, 4 rows each
    want = kv + kv * cmp_rows / 64 + 4 * (64 // 16) / 64  # + block table (int32, 4 pages per sequence)
    assert cache_bytes_per_token(case) == want


def test_suite_registered():
    names = [c.name for c in SUITES["nsa-cpu-decode"].cases]
    assert any("decode-t16384" in n for n in names) and sum("prefill-decode" in n for n in names) >= 3
    infer = [c for c in SUITES["nsa-cpu-decode"].cases if c.op in PEERS]
    assert {(c.op, c.batch, c.skv, c.dtype, c.params["threads"]) for c in infer} == {
        (op, b, skv, dt, t) for op in PEERS for b, skv in ((1, 32768), (8, 4096))
        for dt in ("float32", "bfloat16", "float16") for t in (1, 2)}
    assert all(set(PEERS[c.op]) <= set(c.baselines) and ("attnops-1t" in c.baselines) == (c.params["threads"] == 2)
               for c in infer)


def _tiny_infer(op: str, dtype: str, baselines: tuple[str, ...]) -> Case:
    return Case(name=f"tiny-{op}", op=op, batch=2, heads=4, kv_heads=2, d=16, dv=8, sq=1, skv=256, dtype=dtype,
                baselines=baselines, params={"block": 16, "count": 5, "stride": 4, "threads": 2})


def _run(case: Case) -> dict:
    return run_case(case, torch.device("cpu"), repeat=1, warmup=1, impls=None, idle_wait=0.0, seed=0, check=True,
                    log=print)


@pytest.mark.parametrize("op, read", [("nsa_selected_infer", 5 * 16), ("nsa_compress_infer", 256 // 4)])
def test_infer_cases_run_beside_the_read_bandwidth(op, read):
    case = _tiny_infer(op, "bfloat16", ("read-bandwidth", "attnops-1t"))
    assert kv_bytes(case) == 2 * read * 2 * (16 + 8) * 2  # B, keys per request and KV head, N2, D + Dv, bf16
    entry = _run(case)
    assert all(entry["results"][impl]["status"] == "ok" for impl in ("attnops", "read-bandwidth", "attnops-1t")), entry
    assert entry["checks"]["attnops-1t"]["max_abs_diff_out"] == 0
    assert "strongest_peer" not in entry  # neither is a peer


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-3)])
@pytest.mark.parametrize("op, peers", [("nsa_selected_infer", ("sdpa-folded-gather",)),
                                       ("nsa_compress_infer", PEERS["nsa_compress_infer"])])
def test_infer_peers_agree(op, peers, dtype, tol):
    entry = _run(_tiny_infer(op, dtype, peers))
    for peer in peers:
        assert entry["results"][peer]["status"] == "ok", entry
        assert entry["checks"][peer]["max_abs_diff_out"] < tol, entry  # compressed: a different block differs by 1
    assert entry["strongest_peer"] in peers


@pytest.mark.slow  # torch.compile
def test_flex_peer_agrees():
    entry = _run(_tiny_infer("nsa_selected_infer", "bfloat16", ("flex-paged",)))
    if entry["results"]["flex-paged"]["status"] == "skipped":
        pytest.skip(entry["results"]["flex-paged"]["reason"])
    assert entry["checks"]["flex-paged"]["max_abs_diff_out"] < 1e-2, entry
