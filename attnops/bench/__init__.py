"""Benchmarks: a registry of cases (:mod:`.cases`) and a runner (:func:`main`, ``python -m attnops bench``).

``python -m attnops bench`` lists the suites (name and one line each); ``--suite NAME`` runs one.
"""
from .cases import SUITES, Suite, register_suite, suite_cases
from .runner import main, run_case
from .types import Case

__all__ = ["SUITES", "Case", "Suite", "main", "register_suite", "run_case", "suite_cases"]
