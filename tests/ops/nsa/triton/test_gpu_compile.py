"""The Triton NSA kernels compile for real NVIDIA GPUs: every launch of the registered AOT cases
(``attnops/ops/nsa/triton/aot.py``, built from the launchers' own plans: selected attention, compression,
compressed attention with the FlashAttention forward it runs, decode) compiled down to cubin for sm_90 / sm_80
without a GPU, within the target's shared memory and without register spills.

The compile runs in a child process without ``TRITON_INTERPRET`` (this process runs the kernels through the
interpreter). A representative subset runs in CI; the full case x target matrix is slow.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[4]
CHILD = """
import json, sys
from attnops._core.triton.aot import SHARED_LIMIT, TARGETS, compile_launch
from attnops._core.triton.registry import all_aot_cases
case, target = sys.argv[1], sys.argv[2]
out = []
for launch in all_aot_cases()[case].launches():
    for v in compile_launch(launch, TARGETS[target]):
        out.append(dict(kernel=v.kernel, spills=v.n_spills, shared=v.shared, limit=SHARED_LIMIT[TARGETS[target][1]]))
print(json.dumps(out))
"""
KERNELS = {"selected": {"selected_fwd_kernel", "selected_delta_kernel", "selected_dq_kernel",
                        "selected_dkdv_kernel"},
           "compress": {"compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel"},
           "compress-attention": {"fwd_kernel", "importance_kernel"},
           "decode": {"selected_decode_kernel", "compress_decode_kernel"}}
DIMS = {"selected": ("d128-dv128", "d192-dv128"), "compress": ("d128", "d192"),
        "compress-attention": ("d128-dv128", "d192-dv128"), "decode": ("d128-dv128", "d192-dv128")}


def compile_case(case: str, target: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", CHILD, case, target], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def check(case: str, target: str) -> None:
    variants = compile_case(case, target)
    kind = re.match(r"nsa/(.+)-(fp16|bf16|fp32)-", case).group(1)
    assert {v["kernel"] for v in variants} == KERNELS[kind]
    for v in variants:
        assert v["shared"] <= v["limit"], v
        assert v["spills"] == 0, v


@pytest.mark.parametrize("case,target", [("nsa/selected-fp16-d192-dv128", "sm_90"),
                                         ("nsa/selected-fp32-d128-dv128", "sm_80"),
                                         ("nsa/compress-bf16-d192", "sm_90"),
                                         ("nsa/compress-attention-fp32-d128-dv128", "sm_80"),
                                         ("nsa/decode-bf16-d192-dv128", "sm_90")])
def test_nsa_kernels_compile(case, target):
    check(case, target)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", [f"nsa/{kind}-{dtype}-{dims}" for dtype in ("fp16", "bf16", "fp32")
                                  for kind, dims_list in DIMS.items() for dims in dims_list])
def test_nsa_kernels_compile_matrix(case, target):
    check(case, target)
