"""attnops' FlashAttention inside PyTorch's ``context_parallel()`` on CPU Gloo at world sizes 2 and 4."""
from __future__ import annotations

import pytest

from tests.distributed._torch_cp_cases import checks, torch_cp_worker
from tests.distributed.test_context_parallel import _check, _spawn


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    world = request.param
    return world, _spawn(torch_cp_worker, world, tmp_path_factory.mktemp(f"torch_cp{world}"))


def test_every_entry_and_rotate_method(results):
    world, per_rank = results
    for name, _ in checks(world):
        _check(per_rank, name)


def test_sdpa_keeps_pytorchs_behaviour(results):
    _check(results[1], "sdpa_unchanged")
