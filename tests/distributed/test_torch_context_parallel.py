"""attnops' FlashAttention inside PyTorch's ``context_parallel()`` on CPU Gloo at world sizes 2 and 4 (cases in
``_torch_cp_cases``, run by the session fixtures of ``conftest.py``)."""
from __future__ import annotations

import pytest

from tests.distributed._torch_cp_cases import torch_cp_checks
from tests.distributed.test_context_parallel import _check


@pytest.mark.parametrize("name", [name for name, _ in torch_cp_checks(2)])
def test_world2(modes_world2, name):
    _check(modes_world2, name)


@pytest.mark.parametrize("name", [name for name, _ in torch_cp_checks(4)])
def test_world4(modes_world4, name):
    _check(modes_world4, name)
