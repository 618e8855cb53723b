"""Judge every fused-attention call of a dump: rebuild it, run G and E, and judge each dumped result N."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from .._core.errors import AclnnError
from .dump import DumpDir, find_dump_dirs, load_dump
from .rebuild import Unsupported, attention_entries, not_dumped_reason, rebuild_call
from .references import INDEX_RESULTS, emulate, golden, not_dumped, npu_results
from .verdict import TensorVerdict, judge_indices, judge_tensor

__all__ = ["TensorResult", "CallResult", "judge_dump", "judge_path"]


@dataclass
class TensorResult:
    """One compared tensor: ``tensor`` is the dump's label (``output.0``), ``name`` the result's name."""

    tensor: str
    name: str
    verdict: TensorVerdict
    npu_errors: object = None  # |N - G| as a flat float64 tensor (for the report's histogram)
    emulation_errors: object = None


@dataclass
class CallResult:
    """``reason``: why a call is SKIP; ``note``: how it was judged when E is not the NPU emulation."""

    call: str
    where: str
    verdict: str
    reason: str = ""
    note: str = ""
    tensors: list[TensorResult] = field(default_factory=list)


def _judge_call(entry, dump: DumpDir) -> CallResult:
    where = f"{dump.step}/{dump.rank}" if dump.step else dump.rank
    try:
        call = rebuild_call(entry, dump)
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
        verdict = judge_tensor(npu, e[label][1], g[label][1])
        errors = {}
        if npu.is_floating_point() and npu.shape == g[label][1].shape:
            golden64 = g[label][1].double().reshape(-1)
            errors = dict(npu_errors=(npu.double().reshape(-1) - golden64).abs(),
                          emulation_errors=(e[label][1].double().reshape(-1) - golden64).abs())
        result.tensors.append(TensorResult(label, name, verdict, **errors))
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


def judge_dump(dump: DumpDir, api: str | None = None) -> list[CallResult]:
    """Results for the fused-attention calls of one rank directory; ``api``: an fnmatch pattern on the API name
    (``npu_fusion_attention*``) or on the entry name."""
    entries = attention_entries(dump)
    if api is not None:
        entries = [e for e in entries if fnmatch.fnmatch(e.api, api) or fnmatch.fnmatch(e.name, api)]
    return [_judge_call(e, dump) for e in entries]


def judge_path(path: str | Path, *, step: int | None = None, rank: int | None = None,
               api: str | None = None) -> list[CallResult]:
    """:func:`judge_dump` over every rank directory under ``path`` (dump root, step or rank directory)."""
    return [r for d in find_dump_dirs(path, step=step, rank=rank) for r in judge_dump(load_dump(d), api)]
