"""The pytest plugin of the runner: per test function, excludes (:mod:`.exclusions`), drops the cases over the size
rule (:mod:`.sizes`), keeps a seeded sample of the rest, and records every outcome."""
from __future__ import annotations

import dataclasses
import random
import re
from collections import defaultdict

import pytest

from .exclusions import exclusion_reason
from .sizes import fits


STAND_INS = ("flash_attn", "flash_attn_interface", "torch_npu", "attnops")  # their import errors are failures
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
OTHER_SOC = "Only run on"  # how torch_npu.testing's SupportedDevices and SkipIfNotGteCANNVersion skip


def function_id(nodeid: str) -> str:
    """``file::function`` (or ``file::Class::method``) of a case's node id."""
    return nodeid.split("[", 1)[0]


@dataclasses.dataclass
class FunctionCounts:
    """What became of one test function's cases."""
    collected: int = 0
    excluded: int = 0
    too_large: int = 0
    sampled_out: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0  # by the test file itself: unittest.skip, pytest.skip / skipif
    other_soc: int = 0  # by the file's SupportedDevices / SkipIfNotGteCANNVersion: made for another SoC or CANN


class PeerTestsPlugin:
    """Registered with ``pytest.main(plugins=[...])``; read :attr:`functions`, :attr:`failures` and
    :attr:`collection_errors` afterwards. ``select``: regular expressions, a test function runs when its
    ``file::function`` id matches one (None: all)."""

    def __init__(self, sample: int | None, seed: int, select: tuple[str, ...] | None = None):
        self.sample, self.seed = sample, seed
        self.select = None if not select else [re.compile(pattern) for pattern in select]
        self.functions: dict[str, FunctionCounts] = defaultdict(FunctionCounts)
        self.reasons: dict[str, str] = {}  # function -> exclusion reason
        self.failures: dict[str, str] = {}  # node id -> first line of the error
        self.collection_errors: dict[str, str] = {}  # file -> error
        self.collection_skips: dict[str, str] = {}  # file -> why it was skipped
        self.excluded_files: dict[str, str] = {}  # file -> why the runner does not run it
        self._decided: dict[str, bool] = {}  # function -> whether any of its cases runs (decided at generation)
        self._outcome: dict[str, str] = {}

    def _selected(self, function: str) -> bool:
        return self.select is None or any(pattern.search(function) for pattern in self.select)

    def _chosen(self, function: str, cases: list[dict]) -> list[int]:
        """The indices of the ``cases`` (their parameters) of ``function`` that run; counts the others."""
        counts = self.functions[function]
        counts.collected += len(cases)
        reason = exclusion_reason(function)
        if reason is not None:
            counts.excluded += len(cases)
            self.reasons[function] = reason
            return []
        fitting = [i for i, params in enumerate(cases) if fits(params)]
        counts.too_large += len(cases) - len(fitting)
        if self.sample is not None and len(fitting) > self.sample:
            chosen = sorted(random.Random(f"{self.seed}:{function}").sample(range(len(fitting)), self.sample))
            counts.sampled_out += len(fitting) - self.sample
            fitting = [fitting[i] for i in chosen]
        return fitting

    @pytest.hookimpl(wrapper=True)
    def pytest_generate_tests(self, metafunc):
        """Decide a parametrized function's cases as soon as they are generated, so that the cases that do not run
        are never built (flash-attn's test file parametrizes half a million)."""
        result = yield
        calls = getattr(metafunc, "_calls", None)
        function = function_id(metafunc.definition.nodeid)
        if calls:
            kept = self._chosen(function, [call.params for call in calls]) if self._selected(function) else []
            metafunc._calls = [calls[i] for i in kept]
            self._decided[function] = bool(kept)
        return result

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        """Apply the same choice to the cases not decided at generation (unparametrized functions)."""
        by_function: dict[str, list] = defaultdict(list)
        for item in items:
            by_function[function_id(item.nodeid)].append(item)
        kept, deselected = [], []
        for function, cases in by_function.items():
            if function in self._decided:
                chosen = range(len(cases)) if self._decided[function] else []
            elif self._selected(function):
                chosen = self._chosen(function, [getattr(getattr(c, "callspec", None), "params", {}) for c in cases])
            else:
                chosen = []
            chosen = set(chosen)
            kept += [case for i, case in enumerate(cases) if i in chosen]
            deselected += [case for i, case in enumerate(cases) if i not in chosen]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = kept

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        """A test file that imports a third-party package which is not installed is skipped, naming it."""
        report = yield
        missing = _MISSING_MODULE.search(str(report.longrepr or "")) if report.failed else None
        if missing and missing.group(1).split(".")[0] not in STAND_INS:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"needs the package {missing.group(1)!r}, not installed")
        return report

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors[report.nodeid] = _first_error_line(report)
        elif report.skipped and isinstance(report.longrepr, tuple):
            self.collection_skips[report.nodeid] = report.longrepr[-1]

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self._outcome[report.nodeid] = "failed"
            self.failures.setdefault(report.nodeid, _first_error_line(report))
        elif report.skipped:
            reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
            self._outcome.setdefault(report.nodeid, "other_soc" if OTHER_SOC in reason else "skipped")
        elif report.when == "call":
            self._outcome.setdefault(report.nodeid, "passed")

    def pytest_sessionfinish(self, session):
        for nodeid, outcome in self._outcome.items():
            counts = self.functions[function_id(nodeid)]
            setattr(counts, outcome, getattr(counts, outcome) + 1)


def _first_error_line(report) -> str:
    """The exception line of a failed report (``E   ...``), else its last line."""
    text = str(report.longrepr or "")
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    if errors:
        return errors[0]
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[-1])
    return text.strip().splitlines()[-1] if text.strip() else "failed"
