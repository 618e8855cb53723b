"""``python -m attnops aot``: every operator's registered kernels compile ahead of time (one small kernel on both
targets here; ``tests/ops/flash_attention/triton/test_gpu_compile.py`` covers the FA kernels' configurations)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_aot_all_targets_one_kernel():
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-m", "attnops", "aot", "--target", "all", "--filter", "fp16-d64-causal",
                          "--kernel", "preprocess"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("flash_attention ")]
    assert {r[2] for r in rows} == {"sm_90", "sm_80"} and all(r[-1] == "ok" for r in rows)
    assert "0 failure(s)" in run.stdout


def test_aot_rejects_unknown_case():
    run = subprocess.run([sys.executable, "-m", "attnops", "aot", "--filter", "no-such-case"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "no AOT case matches" in run.stderr


def test_aot_json_records_resources_and_the_ptx_mix(tmp_path):
    out = tmp_path / "aot.json"
    run = subprocess.run([sys.executable, "-m", "attnops", "aot", "--target", "sm_90", "--filter", "fp16-d64-causal",
                          "--kernel", "fwd_kernel", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = json.loads(out.read_text())
    keys = {"operator", "case", "kernel", "target", "tiles", "warps", "stages", "registers", "spills", "shared",
            "default", "ptx"}
    assert records and all(set(r) == keys for r in records)
    assert sum(r["default"] for r in records) == 1  # one launch: its first configuration is the default
    assert all(set(r["ptx"]) == {"wgmma", "mma_sync", "cp_async", "tma", "ld_global_narrow"} for r in records)
    assert all(r["ptx"]["wgmma"] + r["ptx"]["mma_sync"] > 0 for r in records)  # the forward's two products


def test_ptx_counts():
    from attnops._core.triton.aot import PtxCounts

    ptx = """
    wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {...};
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {...};
    cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
    cp.async.commit_group;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2, {%r3, %r4}], [%r5];
    @%p1 ld.global.b16 { %rs1 }, [ %rd3 + 0 ];
    ld.global.nc.u8 %rs2, [%rd4];
    ld.global.v4.b32 { %r6, %r7, %r8, %r9 }, [ %rd5 + 0 ];
    ld.global.L1::evict_last.b32 %r10, [%rd6];
    """
    assert PtxCounts.of(ptx) == PtxCounts(wgmma=1, mma_sync=1, cp_async=1, tma=1, ld_global_narrow=2)
