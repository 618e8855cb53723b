"""Judge every fused-attention call of a dump: rebuild it, run G and E, and judge each dumped result N."""
from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .._core.errors import AclnnError
from .._core.workspace import drop_cached_workspaces
from .dump import DumpDir
from .rebuild import Unsupported, attention_entries, not_dumped_reason, rebuild_call
from .references import INDEX_RESULTS, emulate, golden, not_dumped, npu_results
from .verdict import TensorVerdict, judge_indices, judge_tensor

__all__ = ["TensorResult", "CallResult", "judge_dump", "judge_unit", "entries_of", "units"]


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
        g = golden(call)
        drop_cached_workspaces()  # each re-run's workspaces would stay allocated through the next one
        e, note = emulate(call)
        drop_cached_workspaces()
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


def entries_of(dump: DumpDir, api: str | None) -> list:
    """The fused-attention entries of ``dump`` (those matching ``api``, see :func:`judge_dump`), in dump order."""
    entries = attention_entries(dump)
    if api is not None:
        entries = [e for e in entries if fnmatch.fnmatch(e.api, api) or fnmatch.fnmatch(e.name, api)]
    return entries


def units(entries: list) -> list[list[str]]:
    """Entry names in units judged together: a call number's ``.forward`` and ``.backward`` entries share one
    unit (the references run their forward once for both), in dump order of each unit's first entry."""
    units: dict[str, list[str]] = {}
    for e in entries:
        units.setdefault(e.name.rsplit(".", 1)[0], []).append(e.name)
    return list(units.values())


def judge_unit(dump: DumpDir, names: list[str]) -> Iterator[CallResult]:
    """The results of the calls ``names`` of ``dump``, one by one (one unit of :func:`units`: the references'
    forward results are shared between them)."""
    forwards: dict = {}
    return (_judge_call(dump.entries[n], dump, forwards) for n in names)


def judge_dump(dump: DumpDir, api: str | None = None) -> list[CallResult]:
    """Results for the fused-attention calls of one rank directory; ``api``: an fnmatch pattern on the API name
    (``npu_fusion_attention*``) or on the entry name."""
    entries = entries_of(dump, api)
    results = {}
    for names in units(entries):
        results.update(zip(names, judge_unit(dump, names)))
    return [results[e.name] for e in entries]
