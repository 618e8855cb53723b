"""The runner's table: cases per test function and per file, pass/fail/skip and why the others did not run."""
from __future__ import annotations

from collections import defaultdict

from .plugin import FunctionCounts, PeerTestsPlugin

COLUMNS = ("collected", "excluded", "too_large", "sampled_out", "passed", "failed", "skipped", "other_soc")
HEADERS = ("collected", "excluded", "too large", "sampled out", "passed", "failed", "skipped", "other SoC")
RATE = "pass rate"  # passed / (passed + failed)


def _row(name: str, counts: FunctionCounts, width: int) -> str:
    ran = counts.passed + counts.failed
    rate = f"{counts.passed / ran:.1%}" if ran else "-"
    return (f"{name:<{width}}" + "".join(f" {getattr(counts, c):>{len(h)}}" for c, h in zip(COLUMNS, HEADERS))
            + f" {rate:>{len(RATE)}}")


def _total(rows) -> FunctionCounts:
    total = FunctionCounts()
    for counts in rows:
        for column in COLUMNS:
            setattr(total, column, getattr(total, column) + getattr(counts, column))
    return total


def table(plugin: PeerTestsPlugin) -> str:
    """The per-function rows grouped by file, a total per file and overall, then exclusions, collection errors
    and failures (each with its first error line)."""
    by_file: dict[str, dict[str, FunctionCounts]] = defaultdict(dict)
    for function, counts in sorted(plugin.functions.items()):
        file, _, name = function.partition("::")
        by_file[file][name] = counts
    width = max([len(n) + 2 for names in by_file.values() for n in names] + [len(f) for f in by_file] + [10])
    lines = [" " * width + "".join(f" {h}" for h in (*HEADERS, RATE))]
    for file, functions in by_file.items():
        lines.append(file)
        lines += [_row("  " + name, counts, width) for name, counts in functions.items()]
        lines.append(_row("  (file total)", _total(functions.values()), width))
    lines.append(_row("TOTAL", _total(plugin.functions.values()), width))
    total = _total(plugin.functions.values())
    ran = total.passed + total.failed
    if ran:
        lines.append(f"pass rate of the cases that ran (passed / (passed + failed)): {total.passed / ran:.1%}")
    lines.append("skipped: by the test file itself (unittest.skip, pytest.skip, skipif); other SoC: by the file's "
                 "SupportedDevices / SkipIfNotGteCANNVersion, written for another SoC or CANN version")
    lines += [f"excluded file {file}: {reason}" for file, reason in sorted(plugin.excluded_files.items())]
    lines += [f"excluded {function}: {reason}" for function, reason in sorted(plugin.reasons.items())]
    lines += [f"skipped file {file}: {why}" for file, why in sorted(plugin.collection_skips.items())]
    lines += [f"collection error {file}: {error}" for file, error in sorted(plugin.collection_errors.items())]
    lines += [f"FAILED {nodeid}: {error}" for nodeid, error in sorted(plugin.failures.items())]
    return "\n".join(lines)
