"""Compile a registered AOT case (``attnops._core.triton.registry``) for a GPU target without a GPU, in a child
process without ``TRITON_INTERPRET`` (the test process runs the kernels through the interpreter)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys
from attnops._core.triton.aot import SHARED_LIMIT, TARGETS, compile_launch
from attnops._core.triton.registry import all_aot_cases
case, target = sys.argv[1], sys.argv[2]
out = []
for launch in all_aot_cases()[case].launches():
    if target not in launch.targets:
        continue
    for v in compile_launch(launch, TARGETS[target]):
        out.append(dict(kernel=v.kernel, tiles=v.tiles, warps=v.num_warps, spills=v.n_spills, shared=v.shared,
                        limit=SHARED_LIMIT[TARGETS[target][1]], default=v.default, ptx=vars(v.ptx)))
print(json.dumps(out))
"""


def compile_case(case: str, target: str) -> list[dict]:
    """``[{kernel, tiles, warps, spills, shared, limit, default, ptx}]`` (``ptx``:
    :class:`~attnops._core.triton.aot.PtxCounts`' fields) for every compiled variant of ``case`` ("operator/name") on
    ``target``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNOPS_TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", CHILD, case, target], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def spill_rule_holds(case: str, target: str, variant: dict) -> bool:
    """Whether the no-spill rule of ``python -m attnops aot --check`` holds for ``variant`` (of :func:`compile_case`):
    the configuration the launcher runs has no spills unless the rule exempts its case on ``target`` (the table in
    ``attnops/_core/triton/fast_path.py``, listed in docs/performance.md); other autotuning candidates may spill."""
    from attnops._core.triton.fast_path import RULES, violations

    operator, name = case.split("/", 1)
    record = dict(variant, operator=operator, case=name, target=target)
    return not violations([record], tuple(r for r in RULES if r.name == "no spills"))


def assert_compiles(case: str, target: str, kernels: set[str]) -> None:
    """Every launch of ``case`` compiles for ``target`` into exactly ``kernels``, within the target's shared memory
    and without register spills in the configuration the launcher runs (:func:`spill_rule_holds`)."""
    variants = compile_case(case, target)
    assert {v["kernel"] for v in variants} == kernels
    for v in variants:
        assert v["shared"] <= v["limit"], v
        assert spill_rule_holds(case, target, v), v
