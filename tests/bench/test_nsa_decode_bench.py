"""The nsa-cpu-decode suite's builders on a tiny case: decoding through the cache gives the recomputed output,
the prefill + decode case runs, the cache's bytes per token follow the formula; the decode operators' cases run
beside the read bandwidth over the bytes they read."""
from __future__ import annotations

import pytest
import torch

from attnops.bench import SUITES, Case, run_case
from attnops.bench.nsa_decode import cache_bytes_per_token
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
    assert {"nsa_selected_infer", "nsa_compress_infer"} <= {c.op for c in SUITES["nsa-cpu-decode"].cases}


@pytest.mark.parametrize("op, read", [("nsa_selected_infer", 3 * 16), ("nsa_compress_infer", 256 // 4)])
def test_infer_cases_run_beside_the_read_bandwidth(op, read):
    case = Case(name=f"tiny-{op}", op=op, batch=2, heads=4, kv_heads=2, d=16, dv=8, sq=1, skv=256, dtype="bfloat16",
                baselines=("read-bandwidth",), params={"block": 16, "count": 3, "stride": 4})
    assert kv_bytes(case) == 2 * read * 2 * (16 + 8) * 2  # B, keys per request and KV head, N2, D + Dv, bf16
    entry = run_case(case, torch.device("cpu"), repeat=1, warmup=1, impls=None, idle_wait=0.0, seed=0, check=True,
                     log=print)
    assert all(entry["results"][impl]["status"] == "ok" for impl in ("attnops", "read-bandwidth")), entry
