"""Every public entry point that computes attention (or writes/reads a KV cache) is exercised on ``meta`` tensors
inside ``gpu_dry_run()`` by some dry-run test: a new entry without one fails here. Workspace-size queries compute
nothing on a device and are left out."""
from pathlib import Path

import attnops
import attnops.aclnn
import attnops.nn
import attnops.torch_npu

TESTS = Path(__file__).resolve().parents[1]
NOT_COMPUTING = ("Error", "Result", "Warning", "PagedKVCache", "AclnnExecutor", "FusedInferAttentionPlan")


def _entries() -> list[str]:
    names = [n for n in attnops.__all__ if not any(word in n for word in NOT_COMPUTING)]
    names += [n for n in attnops.aclnn.__all__ if not any(word in n for word in NOT_COMPUTING)]
    names += [*attnops.torch_npu.OPS, *attnops.torch_npu.ATB_OPS]
    names += ["NativeSparseAttention", "NSACache"]
    return [n for n in names if not n.endswith(("get_workspace", "get_max_workspace"))]


def test_every_entry_point_has_a_dry_run_test():
    sources = "\n".join(p.read_text() for p in TESTS.rglob("test_*dry_run*.py"))
    names = _entries()
    two_phase = [n for n in names if n + "_get_workspace_size" in attnops.aclnn.__all__]
    missing = [n for n in names if n not in sources and not (n.endswith("_get_workspace_size") and
                                                              "two_phase" in sources)]
    assert not missing, f"entry points without a gpu_dry_run test: {missing}"
    assert two_phase, "the aclnn operators' two-phase form is covered through the 'two_phase' tests"
