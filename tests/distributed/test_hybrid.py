"""Hybrid context parallelism (Ulysses group x ring group) on CPU Gloo at world sizes 2 and 4 against single-device
attnops and the fp64 golden (the machinery of ``_cases``), bad configurations raising on every rank, and the bytes
every mode sends (cases in ``_modes``, run by the session fixtures of ``conftest.py``)."""
from __future__ import annotations

import pytest

from tests.distributed._hybrid import PROBES
from tests.distributed._modes import HYBRID_WORLD2, HYBRID_WORLD4
from tests.distributed.test_context_parallel import _check


@pytest.mark.parametrize("name", [c.name for c in HYBRID_WORLD2])
def test_world2(modes_world2, name):
    _check(modes_world2, name)


@pytest.mark.parametrize("name", [c.name for c in HYBRID_WORLD4])
def test_world4(modes_world4, name):
    _check(modes_world4, name)


@pytest.mark.parametrize("name,argument", [(name, argument) for name, argument, _ in PROBES])
def test_bad_configuration_raises_on_every_rank(modes_world4, name, argument):
    for rank, res in enumerate(modes_world4):
        assert res[name].startswith(f"ParamInvalidError: {argument}: expected"), (rank, res[name])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bytes_sent_match_the_formulas(modes_world4, dtype):
    """Counted around the collectives at world size 4 (ring, Ulysses and all-gather over 4 ranks, hybrid 2 x 2)."""
    _check(modes_world4, f"traffic_{dtype}")


def test_rank_failure_raises_on_every_rank(modes_world2):
    """The last rank fails between the Ulysses all-to-alls; the other raises (no hang)."""
    assert "injected failure" in modes_world2[1]["hybrid_rank_failure"]
    assert modes_world2[0]["hybrid_rank_failure"] != "returned"
