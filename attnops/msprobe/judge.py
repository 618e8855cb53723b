"""Judge every fused-attention call of a dump: rebuild it, run G and E, and judge each dumped result N."""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .._core.errors import AclnnError
from .dump import DumpDir, find_dump_dirs, load_dump
from .rebuild import Unsupported, attention_entries, not_dumped_reason, rebuild_call
from .references import INDEX_RESULTS, emulate, golden, not_dumped, npu_results
from .verdict import TensorVerdict, judge_indices, judge_tensor

__all__ = ["TensorResult", "CallResult", "judge_dump", "judge_path", "judge_unit"]


@dataclass
class TensorResult:
    """One compared tensor: ``tensor`` is the dump's label (``output.0``), ``name`` the result's name."""

    tensor: str
    name: str
    verdict: TensorVerdict


@dataclass
class CallResult:
    """``reason``: why a call is SKIP; ``note``: how it was judged when E is not the NPU emulation."""

    call: str
    where: str
    verdict: str
    reason: str = ""
    note: str = ""
    tensors: list[TensorResult] = field(default_factory=list)


def _judge_call(entry, dump: DumpDir, forwards: dict) -> CallResult:
    where = f"{dump.step}/{dump.rank}" if dump.step else dump.rank
    try:
        call = rebuild_call(entry, dump)
        call.forwards = forwards
        n, absent = npu_results(call), not_dumped(call)
        if not n and absent:
            raise Unsupported(not_dumped_reason([m for _, m in absent.values()]))
        g, (e, note) = golden(call), emulate(call)
    except Unsupported as exc:
        return CallResult(entry.name, where, "SKIP", str(exc))
    except (AclnnError, NotImplementedError) as exc:  # arguments attnops cannot run: no verdict either way
        return CallResult(entry.name, where, "SKIP", f"attnops cannot re-run it: {type(exc).__name__}: {exc}")
    result = CallResult(entry.name, where, "PASS", note=note)
    for label, (name, npu) in n.items():
        if label not in e:
            result.tensors.append(TensorResult(label, name, TensorVerdict(
                "FAIL", [f"dumped {label} has no counterpart in the re-run call"])))
            continue
        if name in INDEX_RESULTS:
            result.tensors.append(TensorResult(label, name, judge_indices(npu, e[label][1])))
            continue
        result.tensors.append(TensorResult(label, name, judge_tensor(npu, e[label][1], g[label][1])))
    for label, (name, m) in absent.items():
        result.tensors.append(TensorResult(label, name, TensorVerdict(
            "SKIP", ["not judged: dumped as statistics only, without tensor data"], dtype=m.dtype, shape=m.shape)))
    missing = sorted(set(e) - set(n) - set(absent))
    if missing:
        result.tensors.append(TensorResult(missing[0], e[missing[0]][0], TensorVerdict(
            "FAIL", [f"the re-run call has {', '.join(missing)} but the dump has no such tensor"])))
    if any(t.verdict.verdict == "FAIL" for t in result.tensors):
        result.verdict = "FAIL"
    return result


def _entries(dump: DumpDir, api: str | None) -> list:
    entries = attention_entries(dump)
    if api is not None:
        entries = [e for e in entries if fnmatch.fnmatch(e.api, api) or fnmatch.fnmatch(e.name, api)]
    return entries


def _units(entries: list) -> list[list[str]]:
    """Entry names in units judged together: a call number's ``.forward`` and ``.backward`` entries share one
    unit (the references run their forward once for both), in dump order of each unit's first entry."""
    units: dict[str, list[str]] = {}
    for e in entries:
        units.setdefault(e.name.rsplit(".", 1)[0], []).append(e.name)
    return list(units.values())


def judge_unit(dump: DumpDir, names: list[str]) -> Iterator[CallResult]:
    """The results of the calls ``names`` of ``dump``, one by one (one unit of :func:`_units`: the references'
    forward results are shared between them)."""
    forwards: dict = {}
    return (_judge_call(dump.entries[n], dump, forwards) for n in names)


def judge_dump(dump: DumpDir, api: str | None = None) -> list[CallResult]:
    """Results for the fused-attention calls of one rank directory; ``api``: an fnmatch pattern on the API name
    (``npu_fusion_attention*``) or on the entry name."""
    entries = _entries(dump, api)
    results = {}
    for names in _units(entries):
        results.update(zip(names, judge_unit(dump, names)))
    return [results[e.name] for e in entries]


def judge_path(path: str | Path, *, step: int | None = None, rank: int | None = None, api: str | None = None,
               jobs: int = 1, on_result: Callable[[CallResult, int, int], None] | None = None) -> list[CallResult]:
    """:func:`judge_dump` over every rank directory under ``path`` (dump root, step or rank directory), in dump
    order. ``jobs`` > 1 judges that many units (:func:`_units`) at once in worker processes
    (:mod:`.parallel_judge`); ``on_result(result, done, total)`` is called as each call's result arrives (in
    completion order: call by call, or unit by unit from the workers)."""
    dumps = [load_dump(d) for d in find_dump_dirs(path, step=step, rank=rank)]
    entries = [(dump, _entries(dump, api)) for dump in dumps]
    total = sum(len(es) for _, es in entries)
    work = [(dump, names) for dump, es in entries for names in _units(es)]
    done: dict[tuple[str, str], CallResult] = {}

    def collect(dump: DumpDir, names: list[str], results: list[CallResult]) -> None:
        for n, r in zip(names, results):
            done[str(dump.path), n] = r
            if on_result is not None:
                on_result(r, len(done), total)

    if jobs > 1 and len(work) > 1:
        from .parallel_judge import judge_units
        judge_units(work, jobs, collect)
    else:
        for dump, names in work:
            for name, result in zip(names, judge_unit(dump, names)):
                collect(dump, [name], [result])
    return [done[str(dump.path), e.name] for dump, es in entries for e in es]
