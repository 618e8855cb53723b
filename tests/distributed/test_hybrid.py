"""Hybrid context parallelism (Ulysses group x ring group) on CPU Gloo at world sizes 2 and 4 against single-device
attnops and the fp64 golden (the machinery of ``_cases``), plus bad configurations raising on every rank."""
from __future__ import annotations

import pytest

from tests.distributed._cases import Case
from tests.distributed._hybrid import PROBES, hybrid_worker
from tests.distributed.test_context_parallel import _check, _spawn

WORLD2 = [
    Case("hybrid_u2_causal_sbh", kind="hybrid", ulysses_degree=2, layout="SBH", b=2, causal=True),
    Case("hybrid_r2_causal_tnd_dropout", kind="hybrid", layout="TND", lens=(8, 4), causal=True, keep_prob=0.8),
]

WORLD4 = [
    Case("hybrid_u2r2_causal_bsnd", kind="hybrid", ulysses_degree=2, layout="BSND", causal=True),
    Case("hybrid_u2r2_causal_tnd_gqa_repeat", kind="hybrid", ulysses_degree=2, layout="TND", lens=(8, 16), n1=4,
         n2=1, causal=True),
    Case("hybrid_u2r2_causal_alibi_dv_bnsd", kind="hybrid", ulysses_degree=2, b=2, dv=4, causal=True, alibi=3),
    Case("hybrid_u2r2_full_dropout_bsh_batch2", kind="hybrid", ulysses_degree=2, layout="BSH", b=2, keep_prob=0.8),
    Case("hybrid_u2r2_causal_dropout_tnd", kind="hybrid", ulysses_degree=2, layout="TND", lens=(8, 8), causal=True,
         keep_prob=0.7),
    Case("hybrid_u4_causal_gqa", kind="hybrid", ulysses_degree=4, layout="BSND", n1=4, n2=2, causal=True),
    Case("hybrid_r4_causal_alibi", kind="hybrid", layout="BSND", causal=True, alibi=2),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(hybrid_worker, 2, tmp_path_factory.mktemp("hybrid2"), WORLD2, False)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(hybrid_worker, 4, tmp_path_factory.mktemp("hybrid4"), WORLD4, True)


@pytest.mark.parametrize("name", [c.name for c in WORLD2])
def test_world2(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", [c.name for c in WORLD4])
def test_world4(world4, name):
    _check(world4, name)


@pytest.mark.parametrize("name,argument", [(name, argument) for name, argument, _ in PROBES])
def test_bad_configuration_raises_on_every_rank(world4, name, argument):
    for rank, res in enumerate(world4):
        assert res[name].startswith(f"ParamInvalidError: {argument}: expected"), (rank, res[name])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bytes_sent_match_the_formulas(world4, dtype):
    """Counted around the collectives at world size 4 (ring, Ulysses and all-gather over 4 ranks, hybrid 2 x 2)."""
    _check(world4, f"traffic_{dtype}")
