"""KV all-gather context parallelism on CPU Gloo at world sizes 2 and 4 against single-device attnops and the fp64
golden (the machinery of ``_cases``), and the NSA / DSA pipelines on the gathered keys (``_sparse_cases``)."""
from __future__ import annotations

import pytest

from tests.distributed._cases import Case
from tests.distributed._sparse_cases import allgather_worker, sparse_checks
from tests.distributed.test_context_parallel import _check, _spawn

WORLD2 = [
    Case("allgather_full_alibi2_bnsd", kind="allgather", alibi=2),
    Case("allgather_causal_bsnd", kind="allgather", layout="BSND", b=2, causal=True),
    Case("allgather_full_gqa_dv_bnsd", kind="allgather", n1=4, n2=2, dv=4),
    Case("allgather_causal_alibi_sbh", kind="allgather", layout="SBH", causal=True, alibi=2),
    Case("allgather_causal_tnd", kind="allgather", layout="TND", lens=(8, 4, 12), causal=True),
    Case("allgather_llama3_causal_tnd", kind="allgather", split="contiguous", layout="TND", lens=(5, 9, 2),
         causal=True),
    Case("allgather_contiguous_causal_bsh", kind="allgather", split="contiguous", layout="BSH", n1=4, n2=1,
         causal=True, s=10),
]

WORLD4 = [
    Case("allgather_causal_tnd_gqa", kind="allgather", layout="TND", lens=(16, 8), n1=4, n2=2, causal=True),
    Case("allgather_full_alibi3_bnsd", kind="allgather", s=32, alibi=3),
    Case("allgather_llama3_full_tnd", kind="allgather", split="contiguous", layout="TND", lens=(3, 11, 6)),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(allgather_worker, 2, tmp_path_factory.mktemp("allgather2"), WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(allgather_worker, 4, tmp_path_factory.mktemp("allgather4"), WORLD4)


@pytest.mark.parametrize("name", [c.name for c in WORLD2])
def test_world2(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", [c.name for c in WORLD4])
def test_world4(world4, name):
    _check(world4, name)


@pytest.mark.parametrize("world", [2, 4])
def test_nsa_dsa_pipelines(world, world2, world4):
    results = world2 if world == 2 else world4
    for name, _, _ in sparse_checks(world):
        _check(results, name)
