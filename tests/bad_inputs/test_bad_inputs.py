"""Property-based bad-input suite over every public entry point of every dialect.

For each entry point (``registry.py``) hypothesis corrupts one argument of a small valid call
(``corruptions.py``); the call must raise an attnops error naming that argument, or return what the fp64 formula
returns (``judge.py``, ``check.py``). Cases still open elsewhere are listed in ``KNOWN_OPEN``.
"""
from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnops
import attnops.aclnn
import attnops.flash_attn
import attnops.nn
import attnops.torch_npu

from .check import run_corrupted
from .corruptions import candidates
from .judge import required_args, tensors
from .known_open import KNOWN_OPEN
from .registry import DIALECTS

MODULES = {"attnops": attnops, "attnops.aclnn": attnops.aclnn, "attnops.torch_npu": attnops.torch_npu,
           "attnops.flash_attn": attnops.flash_attn, "attnops.nn": attnops.nn}

# public names that are no tensor-computing entry point, each with the reason
EXCLUDED = {
    "attnops": {name: "an exception type" for name in ("AclnnError", "InferenceOnlyError", "ParamDtypeError",
                                                       "ParamInvalidError", "ParamNullptrError")}
    | {"PerformanceWarning": "a warning type", "PagedKVCache": "a container of cache tensors (validated by the "
       "fused_infer_attention call that reads it)"}
    | {name: "a result type" for name in ("CompressAttentionResult", "FlashAttentionResult",
                                          "FusedInferAttentionPlan", "FusedInferAttentionResult",
                                          "LightningIndexerResult", "SparseAttentionResult")},
    "attnops.aclnn": {"AclnnExecutor": "the executor handed from phase 1 to phase 2 (no tensor inputs)"},
    "attnops.torch_npu": {"install": "installs the torch_npu shim (no tensor inputs)"},
    "attnops.flash_attn": {"__version__": "a string", "install": "installs the flash_attn shim (no tensor inputs)",
                           "fa3": "a module (flash_attn_interface's functions under FA3's names)",
                           "flash_attn_interface": "a module re-exporting the functions covered here",
                           "layers": "a module (rotary embedding helpers)",
                           "bert_padding": "a module of index helpers (pad / unpad)"},
    "attnops.nn": {"NSACache": "a cache; its forward is NativeSparseAttention's with the cache",
                   "DSACache": "a cache; its forward is DeepSeekSparseAttention's with the cache"},
}
TWO_PHASE = "_get_workspace_size"  # aclnn phase 1 shares the factory of the one-shot operator

ENTRIES = [(d, name) for d, reg in DIALECTS.items() for name in reg]


def _entry_names(dialect: str) -> set[str]:
    names = set(MODULES[dialect].__all__) - set(EXCLUDED[dialect])
    return {n[:-len(TWO_PHASE)] if n.endswith(TWO_PHASE) else n for n in names}


@pytest.mark.parametrize("dialect", list(MODULES))
def test_every_entry_point_has_a_valid_call_factory(dialect):
    covered = {name.split("+")[0] for name in DIALECTS[dialect]}
    missing = _entry_names(dialect) - covered
    assert not missing, f"{dialect}: entry points without a valid-call factory in registry.py: {sorted(missing)}"
    stale = covered - set(MODULES[dialect].__all__)
    assert not stale, f"{dialect}: factories of names not in __all__: {sorted(stale)}"


@pytest.mark.parametrize("dialect,name", [e for e in ENTRIES if DIALECTS[e[0]][e[1]]().golden is not None])
def test_clean_call_matches_its_golden(dialect, name):
    """The goldens the suite judges with reproduce the valid call (else every judgement would be wrong)."""
    from attnops.testing.compare import default_floor, max_abs_err
    case = DIALECTS[dialect][name]()
    golden = case.golden(case.args)
    outputs = tensors(case.fn(**case.args))
    for i, g in enumerate(golden):
        err = max_abs_err(outputs[i], g)
        assert err <= 1e-4 + default_floor(g, outputs[i].dtype), f"output {i}: {err}"


def _open_candidates(dialect: str, name: str):
    case = DIALECTS[dialect][name]()
    return [c for c in candidates(case.args, required_args(case))
            if (f"{dialect}:{name}", *c.key) not in KNOWN_OPEN]


def _check(dialect, name, data):
    corruption = data.draw(st.sampled_from(_open_candidates(dialect, name)), label="corruption")
    position = data.draw(st.integers(0, 2**20), label="position")
    run_corrupted(DIALECTS[dialect][name], corruption, position)


@pytest.mark.parametrize("dialect,name", ENTRIES)
@settings(settings.get_profile("bad-inputs-ci"))
@given(data=st.data())
def test_bad_input(dialect, name, data):
    _check(dialect, name, data)


@pytest.mark.slow
@pytest.mark.parametrize("dialect,name", ENTRIES)
@settings(settings.get_profile("bad-inputs-slow"))
@given(data=st.data())
def test_bad_input_many(dialect, name, data):
    _check(dialect, name, data)


@pytest.mark.slow
@pytest.mark.parametrize("dialect,name", ENTRIES)
def test_every_corruption_once(dialect, name):
    """Each corruption of each argument at element 0 (the exhaustive sweep)."""
    failures = []
    for c in _open_candidates(dialect, name):
        try:
            run_corrupted(DIALECTS[dialect][name], c, 0)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    assert not failures, "\n".join(failures)
