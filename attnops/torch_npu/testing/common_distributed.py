"""``torch_npu.testing.common_distributed``: ``skipIfUnsupportMultiNPU`` (the stand-in is one device)."""
from __future__ import annotations

import functools
import unittest

import torch


def skipIfUnsupportMultiNPU(npu_number_needed: int):
    """Skip the decorated test unless ``torch.npu.device_count()`` reaches ``npu_number_needed``."""
    def decorate(fn):
        @functools.wraps(fn)
        def run_if_enough(test, *args, **kwargs):
            if torch.npu.device_count() < npu_number_needed:
                raise unittest.SkipTest(f"Multi-NPU {npu_number_needed} condition not satisfied")
            return fn(test, *args, **kwargs)
        return run_if_enough
    return decorate
