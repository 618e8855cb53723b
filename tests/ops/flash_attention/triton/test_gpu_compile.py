"""The Triton FlashAttention kernels compile for real NVIDIA GPUs: every launch of a problem (forward, preprocess,
the backward's dK/dV pass and grad sums; before sm_90 the dQ kernel beside the pass) in every tile configuration
the launcher would try, compiled ahead of time down to cubin for sm_90 (H100) and sm_80 (A100) without a GPU (``triton/aot.py``), within each target's shared memory and without heavy
register spills. The signatures come from the launchers' own plans (``aot_cases.py``).

The compile runs in a child process without ``TRITON_INTERPRET`` (this process runs the kernels through the
interpreter). A representative subset runs in CI; the full dtype x head dim x feature x target matrix is slow.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[4]
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # bytes of shared memory per block (opt-in maximum)
# 4-byte words of local memory per thread above which a config spills heavily: plain problems, and problems with
# per-element features (pse, explicit mask, dropout), whose extra tiles spill more (docs/triton.md)
MAX_SPILL_WORDS = 128
MAX_SPILL_WORDS_WITH_FEATURES = 512
ELEMENT_FEATURES = {"explicit", "pse_full0", "pse_full1", "pse_row", "alibi", "slopes2", "slopes3", "drop_seed",
                    "drop_packed"}
ALL_KERNELS = {"fwd_kernel", "preprocess_kernel", "dkdv_kernel", "grad_sum_kernel"}  # sm_90's backward
SM80_KERNELS = {"fwd_kernel", "preprocess_kernel", "dkdv_kernel", "dq_kernel"}  # before sm_90: the dQ kernel
DEVICE_LENGTH_KERNELS = {"prepare_kernel", "tail_kernel"}  # with cu_seqlens tensors (feature "device")
EVERYTHING = ["explicit", "pse_full1", "drop_seed"]  # explicit mask + pse (and its gradient) + Philox dropout


def case(dtype: str, d: int, dv: int | None = None, *features: str) -> dict:
    return dict(dtype=dtype, d=d, dv=d if dv is None else dv, features=list(features))


def compile_in_child(arch: int, problem: dict) -> dict:
    """``{kernel: [variants] or error}`` from ``aot_cases`` run in a process with the compiled (JIT) kernels."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    run = subprocess.run([sys.executable, "-m", "tests.ops.flash_attention.triton.aot_cases", str(arch),
                          json.dumps(problem)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_compiles(arch: int, problem: dict) -> list[str]:
    """Assert that every launch compiles within the target's shared memory; return the variants that spill more
    than the budget (``where: words``)."""
    result = compile_in_child(arch, problem)
    kernels = (ALL_KERNELS if arch >= 90 else SM80_KERNELS) | (DEVICE_LENGTH_KERNELS if "device" in problem["features"]
                                                               else set())
    assert set(result) - {"grad_sum_kernel"} == kernels - {"grad_sum_kernel"}  # grad sums: dQ splits, GQA dK/dV
    failures = {kernel: error for kernel, error in result.items() if isinstance(error, str)}
    assert not failures, failures
    spill_limit = MAX_SPILL_WORDS_WITH_FEATURES if ELEMENT_FEATURES & set(problem["features"]) else MAX_SPILL_WORDS
    spilling = []
    for kernel, variants in result.items():
        assert variants, f"{kernel}: no tile configuration"
        for v in variants:
            where = f"{kernel} {v['tiles']} warps={v['num_warps']} stages={v['num_stages']} on sm_{arch}"
            assert v["shared"] <= SHARED_LIMIT[arch], f"{where}: {v['shared']} bytes of shared memory"
            if v["n_spills"] > spill_limit:
                spilling.append(f"{where}: {v['n_spills']} words spilled")
    return spilling


CI_CASES = [
    (90, case("bf16", 128, 128, *EVERYTHING)),
    (80, case("fp16", 64, 64, "tnd", "device", "causal", "slopes3", "drop_packed", "mha")),
    (90, case("fp16", 256, 128, "pse_row", "band")),
]


@pytest.mark.parametrize("arch,problem", CI_CASES, ids=lambda x: x if isinstance(x, int) else "-".join(
    [x["dtype"], str(x["d"]), str(x["dv"]), *x["features"]]))
def test_kernels_compile(arch, problem):
    spilling = check_compiles(arch, problem)
    assert not spilling, spilling


def test_hopper_products_are_wgmma():
    """sm_90, the configurations the launcher runs: every product of the forward and of the backward's single pass
    is a wgmma, none an ``mma.sync`` (fast-path rule ``tensor cores``, ``attnops/_core/triton/fast_path.py``)."""
    from attnops._core.triton.fast_path import RULES, violations

    problem = case("bf16", 128, 128, "causal", "pse_row", "drop_packed")
    records = [dict(operator="flash_attention", case="bf16-d128", kernel=kernel, target="sm_90", tiles=v["tiles"],
                    warps=v["num_warps"], spills=v["n_spills"], default=v["default"], ptx=v["ptx"])
               for kernel, variants in compile_in_child(90, problem).items() for v in variants]
    tensor_cores = [rule for rule in RULES if rule.name == "tensor cores"]
    assert {r["kernel"] for r in records if tensor_cores[0].applies(r)} == {"fwd_kernel", "dkdv_kernel"}
    assert violations(records, tuple(tensor_cores)) == []


SLOW_CASES = [(arch, case(dtype, d, dv, *features)) for arch in (90, 80) for dtype in ("fp16", "bf16", "fp32")
              for d, dv in ((64, 64), (128, 128), (256, 256), (128, 64)) for features in (["causal"], EVERYTHING)]
SLOW_CASES += [(90, case("bf16", 128, 128, feature)) for feature in
               ("band", "prefix", "tnd", "pse_full0", "pse_row", "alibi", "slopes2", "slopes3", "drop_packed",
                "mha")]
SLOW_CASES += [(90, case("fp32", 128, 128, "tnd", "causal", "slopes2", "drop_seed")),
               (80, case("bf16", 256, 256, "pse_full0", "prefix", "drop_packed"))]


@pytest.mark.slow
@pytest.mark.parametrize("arch,problem", SLOW_CASES, ids=lambda x: x if isinstance(x, int) else "-".join(
    [x["dtype"], str(x["d"]), str(x["dv"]), *x["features"]]))
def test_kernels_compile_matrix(arch, problem):
    spilling = check_compiles(arch, problem)
    assert not spilling, spilling
