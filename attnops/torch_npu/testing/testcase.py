"""``torch_npu.testing.testcase``: ``TestCase`` (torch_npu's comparison rules: :meth:`TestCase.assertRtolEqual`, and
``assertEqual`` with an absolute tolerance ``prec``) and ``run_tests``."""
from __future__ import annotations

import os
import random
import unittest
from collections.abc import Mapping
from numbers import Number

import numpy as np
import torch

from .common_utils import set_npu_device
from .rtol import check_rtol_equal


def run_tests() -> None:
    """Run the calling file's tests (``unittest.main``)."""
    unittest.main()


def _is_iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


class TestCase(unittest.TestCase):
    """unittest's TestCase with torch_npu's seeding (``SEED``, 666 by default, before every test) and comparisons."""

    _precision = 1e-5
    maxDiff = None
    exact_dtype = False

    @property
    def precision(self) -> float:
        return self._precision

    @precision.setter
    def precision(self, prec: float) -> None:
        self._precision = prec

    @classmethod
    def setUpClass(cls) -> None:
        cls.npu_device = set_npu_device()

    def setUp(self) -> None:
        seed = int(os.getenv("SEED", "666"))
        torch.manual_seed(seed)
        random.seed(seed)

    def assertRtolEqual(self, x, y, prec=1.e-4, prec16=1.e-3, auto_trans_dtype=False, message=None):
        """torch_npu's relative/absolute rule (:func:`.rtol.check_rtol_equal`)."""
        reason = check_rtol_equal(x, y, prec, prec16, auto_trans_dtype)
        if reason:
            self.fail(message or reason)

    def _assert_tensors_close(self, x: torch.Tensor, y: torch.Tensor, prec, message, allow_inf, exact_dtype):
        super().assertEqual(x.size(), y.size(), message)
        if exact_dtype:
            super().assertEqual(x.dtype, y.dtype, message)
        if x.numel() == 0:
            return
        if (x.dtype == torch.bool) != (y.dtype == torch.bool):
            raise TypeError("assertEqual: expected both tensors to be bool or neither")
        a = x.detach().cpu()
        a = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a
        a = a.int() if a.dtype == torch.bool else a
        b = y.detach().cpu().to(a.dtype)
        diff = a - b
        if a.is_floating_point() or a.is_complex():
            nan = torch.isnan(a)
            self.assertTrue(torch.equal(nan, torch.isnan(b)), message)
            diff[nan] = 0
            if allow_inf:
                inf = torch.isinf(a)
                self.assertTrue(torch.equal(inf, torch.isinf(b)), message)
                diff[inf] = 0
        if diff.is_signed() and diff.dtype != torch.int8:
            diff = diff.abs().real if diff.is_complex() else diff.abs()
        self.assertLessEqual(diff.max().item(), prec, message)

    def _assert_numbers_close(self, x, y, prec, message, allow_inf) -> None:
        x = x.item() if isinstance(x, torch.Tensor) else x
        y = y.item() if isinstance(y, torch.Tensor) else y
        if abs(x) == float("inf") or abs(y) == float("inf"):
            if not allow_inf:
                self.fail(f"Expected finite numeric values - x={x}, y={y}")
            super().assertEqual(x, y, message)
            return
        super().assertLessEqual(abs(x - y), prec, message)

    def assertEqual(self, x, y, prec=None, message="", allow_inf=False, exact_dtype=None):
        """torch_npu's assertEqual: numbers and tensors within the absolute tolerance ``prec`` (the test's
        ``precision``, 1e-5, by default; NaNs in the same places), containers element by element, anything else by
        ``==``. A string in place of ``prec`` is the message."""
        if isinstance(prec, str) and not message:
            prec, message = None, prec
        prec = self.precision if prec is None else prec
        exact_dtype = self.exact_dtype if exact_dtype is None else exact_dtype
        if isinstance(x, Number) or isinstance(y, Number):
            self._assert_numbers_close(x, y, prec, message, allow_inf)
        elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            self._assert_tensors_close(x, y, prec, message, allow_inf, exact_dtype)
        elif isinstance(x, (str, bytes, set, np.bool_)) or isinstance(y, (str, bytes, set, np.bool_)):
            super().assertEqual(x, y, message)
        elif isinstance(x, Mapping) and isinstance(y, Mapping):
            super().assertEqual(set(x), set(y), message)
            for key in x:
                self.assertEqual(x[key], y[key], prec, message, allow_inf, exact_dtype)
        elif _is_iterable(x) and _is_iterable(y):
            super().assertEqual(len(x), len(y), message)
            for x_, y_ in zip(x, y):
                self.assertEqual(x_, y_, prec, message, allow_inf, exact_dtype)
        else:
            super().assertEqual(x, y, message)
