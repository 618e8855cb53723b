"""KV all-gather context parallelism on CPU Gloo at world sizes 2 and 4 against single-device attnops and the fp64
golden (the machinery of ``_cases``), and the NSA / DSA pipelines on the gathered keys (``_sparse_cases``); cases in
``_modes``, run by the session fixtures of ``conftest.py``."""
from __future__ import annotations

import pytest

from tests.distributed._modes import ALLGATHER_WORLD2, ALLGATHER_WORLD4
from tests.distributed._sparse_cases import sparse_checks
from tests.distributed.test_context_parallel import _check


@pytest.mark.parametrize("name", [c.name for c in ALLGATHER_WORLD2])
def test_world2(modes_world2, name):
    _check(modes_world2, name)


@pytest.mark.parametrize("name", [c.name for c in ALLGATHER_WORLD4])
def test_world4(modes_world4, name):
    _check(modes_world4, name)


@pytest.mark.parametrize("name", [name for name, _ in sparse_checks(2)])
def test_nsa_dsa_pipelines_world2(modes_world2, name):
    _check(modes_world2, name)


@pytest.mark.parametrize("name", [name for name, _ in sparse_checks(4)])
def test_nsa_dsa_pipelines_world4(modes_world4, name):
    _check(modes_world4, name)


def test_rank_failure_raises_on_every_rank(modes_world2):
    """The last rank fails between the all-gather and the reduce-scatter; the other raises (no hang)."""
    assert "injected failure" in modes_world2[1]["allgather_rank_failure"]
    assert modes_world2[0]["allgather_rank_failure"] != "returned"
