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
    cases = {r["case"] for r in records}
    assert sum(r["default"] for r in records) == len(cases)  # one launch per case: its first configuration
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


def _record(**kw):
    record = dict(operator="flash_attention", case="bf16-d128-causal", kernel="dq_kernel", target="sm_90",
                  tiles={"BLOCK_M": 64}, warps=4, stages=2, registers=128, spills=0, shared=1024, default=True,
                  ptx=dict(wgmma=4, mma_sync=0, cp_async=2, tma=0, ld_global_narrow=0))
    record.update(kw)
    return record


def test_fast_path_rules():
    from attnops._core.triton.fast_path import violations

    good = _record()
    assert violations([good]) == []
    mma = _record(ptx=dict(good["ptx"], wgmma=0, mma_sync=8))
    assert [v.split(":")[0] for v in violations([mma])] == ["tensor cores"]
    assert violations([dict(mma, target="sm_80")]) == []  # wgmma is Hopper's
    assert violations([dict(mma, case="fp32-d128-causal")]) == []  # fp32 is outside the rules
    assert violations([dict(mma, default=False)]) == []  # only the configuration the launcher runs
    narrow = _record(operator="fused_infer_attention", case="decode-paged-fp16-d128", kernel="split_kernel",
                     ptx=dict(good["ptx"], ld_global_narrow=16))
    assert [v.split(":")[0] for v in violations([narrow])] == ["vector loads"]
    assert "narrow loads=16" in violations([narrow])[0]
    spills = _record(kernel="merge_kernel", operator="fused_infer_attention", spills=12, target="sm_80")
    assert [v.split(":")[0] for v in violations([spills])] == ["no spills"]
    # no spills covers every operator and every dtype
    for other in (dict(operator="dsa", case="sparse-attention-decode-fp32", kernel="sparse_attention_kernel"),
                  dict(operator="torch_npu", case="kv-cache-read-int8-nd-w576", kernel="gather_kv_kernel")):
        assert [v.split(":")[0] for v in violations([_record(**other, spills=2)])] == ["no spills"]


def test_compile_tests_take_the_checks_spill_rule():
    """The compile tests' spill rule (``tests.aot_compile.spill_rule_holds``) is the check's: the configuration the
    launcher runs must not spill unless exempt on that target; other autotuning candidates may."""
    from tests.aot_compile import spill_rule_holds

    variant = dict(kernel="indexer_v2_kernel", tiles={"BLOCK_N": 64}, warps=8, spills=4, default=True,
                   ptx=dict(wgmma=0, mma_sync=32, cp_async=8, tma=0, ld_global_narrow=0))
    case = "dsv4-indexer-v2/paged-top1024-bf16"
    assert spill_rule_holds(case, "sm_80", variant)
    assert not spill_rule_holds(case, "sm_90", variant)
    assert not spill_rule_holds("dsv4-indexer-v2/bsnd-top1024-bf16", "sm_80", variant)
    assert spill_rule_holds("dsv4-indexer-v2/bsnd-top1024-bf16", "sm_80", dict(variant, default=False))
    assert spill_rule_holds("dsv4-indexer-v2/bsnd-top1024-bf16", "sm_90", dict(variant, spills=0))


def test_backward_forms_run_on_their_target_only():
    """The registry marks the FlashAttention backward's form of each target: dQ in the dK/dV pass from sm_90 on,
    the dQ kernel beside the pass before; ``aot`` compiles (and checks) each only where it runs."""
    child = ("import json; from attnops._core.triton.registry import all_aot_cases; cases = all_aot_cases(); "
             "print(json.dumps({name: {launch.kernel: launch.targets for launch in cases[name].launches()} "
             "for name in ('flash_attention/bf16-d64-causal', 'flash_attention/bf16-d64-causal-dq-kernel')}))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")}
    run = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    forms = json.loads(run.stdout.strip().splitlines()[-1])
    fused, split = forms["flash_attention/bf16-d64-causal"], forms["flash_attention/bf16-d64-causal-dq-kernel"]
    assert fused["dkdv_kernel"] == ["sm_90"] and "dq_kernel" not in fused
    assert split["dkdv_kernel"] == split["dq_kernel"] == ["sm_80"]
    assert fused["fwd_kernel"] == split["preprocess_kernel"] == ["sm_90", "sm_80"]
