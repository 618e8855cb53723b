"""The decode tests again on the pure-PyTorch path (as on a machine without a C++ compiler): the same golden
comparisons with the compiled kernel switched off."""
from __future__ import annotations

import pytest

from attnops.ops.common import cpu_kernels

from .test_fia_values import (  # noqa: F401
    test_antiquant_separate_decode,
    test_int4_decode,
    test_layouts_gqa_lse,
    test_paged,
    test_paged_managed_antiquant_scales,
)


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
