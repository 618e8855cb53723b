"""Every kernel family's tuning candidates compile for sm_90 without a GPU (``python -m attnops aot``'s machinery),
within its shared memory, and each launch has candidates besides its default that spill no more than the default
(those the tuner times; it rejects the others by the GPU's own spill count). One AOT case per operator."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json
from attnops._core.triton import tuned
from attnops._core.triton.aot import SHARED_LIMIT, TARGETS, KernelLaunch, compile_launch
from attnops._core.triton.registry import all_aot_cases
first = {}
for key, case in all_aot_cases().items():
    first.setdefault(case.operator, case)
out = []
for case in first.values():
    for launch in case.launches():
        candidates = tuned.candidates(launch.configs)
        variants = compile_launch(KernelLaunch(launch.kernel, launch.function, launch.values, candidates),
                                  TARGETS["sm_90"])
        out.append(dict(operator=case.operator, kernel=launch.kernel, spills=[v.n_spills for v in variants],
                        fits=all(v.shared <= SHARED_LIMIT[90] for v in variants)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_candidates_compile_and_some_beside_the_default_do_not_spill_more():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    launches = json.loads(run.stdout.strip().splitlines()[-1])
    from attnops._core.triton.registry import all_aot_cases

    assert {r["operator"] for r in launches} == {c.operator for c in all_aot_cases().values()}
    for r in launches:
        assert r["fits"], r
        default, *others = r["spills"]
        assert any(s <= default for s in others), r
