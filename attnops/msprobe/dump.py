"""Reading msprobe's PyTorch dumps: ``dump.json`` plus ``dump_tensor_data/*.pt``, without mindstudio-probe.

Layout: ``dump_path/step<S>/rank<R>|proc<pid>/{dump.json, dump_tensor_data/}``. ``dump.json`` maps entry names
``{prefix}.{api}.{call#}.{forward|backward}`` to the call's arguments and results: a forward has ``input_args``,
``input_kwargs`` and ``output``, a backward ``input`` (gradients of the forward's outputs) and ``output``
(gradients of its inputs). Tensors carry statistics and, in a tensor dump, ``data_name``: their ``.pt`` file.

An NPU saves its tensors through torch_npu's pickler, which rebuilds them with
``torch_npu.utils.storage._rebuild_npu_tensor(storage, offset, size, stride, requires_grad, hooks, npu_format)``;
:func:`load_tensor` allow-lists a stand-in for it that rebuilds the same CPU tensor, so such files load with
``weights_only=True`` and no torch_npu. The storage holds the logical (ND) values, so ``npu_format`` (the
device-side layout torch_npu re-applies on an NPU) is not needed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["DumpFormatError", "MissingTensor", "Entry", "DumpDir", "find_dump_dirs", "load_dump", "load_tensor",
           "decode_value"]

ENTRY_NAME = re.compile(r"^(?P<prefix>[^.]+)\.(?P<api>[^.]+)\.(?P<index>\d+)\.(?P<direction>forward|backward)$")


class DumpFormatError(ValueError):
    """A dump directory, ``dump.json`` field or tensor file is not in msprobe's format (names the file/field)."""


def _rebuild_npu_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, npu_format=None):
    """Stand-in for torch_npu's unpickling function: the same tensor on the CPU."""
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks)


class _Format:
    """Stand-in for ``torch_npu.npu._format.Format``, the device layout some torch_npu versions pickle."""

    def __init__(self, *args):
        self.args = args


_rebuild_npu_tensor.__module__ = "torch_npu.utils.storage"
_Format.__module__, _Format.__name__, _Format.__qualname__ = "torch_npu.npu._format", "Format", "Format"
NPU_GLOBALS = [_rebuild_npu_tensor, _Format]


@dataclass(frozen=True)
class MissingTensor:
    """A tensor argument whose data was not dumped (statistics level): its recorded dtype and shape."""

    where: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Entry:
    """One dump.json entry, e.g. ``NPU.npu_fusion_attention.0.forward``, with values decoded lazily."""

    name: str
    prefix: str
    api: str
    index: int
    direction: str
    record: dict
    tensor_dir: Path


@dataclass
class DumpDir:
    """One ``rank*``/``proc*`` directory: its entries by name."""

    path: Path
    step: str
    rank: str
    entries: dict[str, Entry] = field(default_factory=dict)


def _dirs(path: Path, pattern: str) -> list[Path]:
    return sorted((p for p in path.iterdir() if p.is_dir() and re.fullmatch(pattern, p.name)),
                  key=lambda p: (len(p.name), p.name))


def find_dump_dirs(path: str | Path, *, step: int | None = None, rank: int | None = None) -> list[Path]:
    """The rank/proc directories (those holding ``dump.json``) under ``path``: a dump root, a step or a rank dir.

    ``step``/``rank`` select ``step<step>`` and ``rank<rank>`` (proc directories have no rank and are dropped by
    ``rank``). Raises :class:`DumpFormatError` when nothing matches.
    """
    root = Path(path)
    if not root.is_dir():
        raise DumpFormatError(f"{root}: expected a msprobe dump directory (dump root, step or rank), got "
                              f"{'a file' if root.exists() else 'a path that does not exist'}")
    if (root / "dump.json").is_file():
        found = [root]
    else:
        steps = _dirs(root, r"step\d+")
        if steps:
            steps = [s for s in steps if step is None or s.name == f"step{step}"]
        elif re.fullmatch(r"step\d+", root.name) and (step is None or root.name == f"step{step}"):
            steps = [root]
        found = [r for s in steps for r in _dirs(s, r"rank\d+|proc\d+") if (r / "dump.json").is_file()]
    if rank is not None:
        found = [r for r in found if r.name == f"rank{rank}"]
    if not found:
        wanted = "".join(f" {n}={v}" for n, v in (("--step", step), ("--rank", rank)) if v is not None)
        raise DumpFormatError(f"{root}: no step*/rank*|proc*/dump.json found{wanted or ''} (give a msprobe "
                              "dump_path, one of its step directories or one rank/proc directory)")
    return found


def load_dump(path: Path) -> DumpDir:
    """Parse ``path/dump.json`` (entry names checked; values are decoded on use by :func:`decode_value`)."""
    json_path = path / "dump.json"
    try:
        doc = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DumpFormatError(f"{json_path}: not readable as JSON ({exc})") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        raise DumpFormatError(f"{json_path}: expected a top-level object with a 'data' object, got "
                              f"{type(data).__name__ if isinstance(doc, dict) else type(doc).__name__}")
    step = path.parent.name if re.fullmatch(r"step\d+", path.parent.name) else ""
    dump = DumpDir(path, step, path.name)
    for name, record in data.items():
        match = ENTRY_NAME.match(name)
        if match is None or not isinstance(record, dict):
            continue  # modules (level L0/mix) and other records are not API calls
        dump.entries[name] = Entry(name, match["prefix"], match["api"], int(match["index"]), match["direction"],
                                   record, path / "dump_tensor_data")
    return dump


def load_tensor(file: Path) -> torch.Tensor:
    """Load one dumped ``.pt`` on the CPU with ``weights_only=True``, NPU-pickled files included."""
    try:
        with torch.serialization.safe_globals(NPU_GLOBALS):
            value = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a format error of that file
        raise DumpFormatError(f"{file}: not a loadable tensor file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(value, torch.Tensor):
        raise DumpFormatError(f"{file}: expected a saved tensor, got {type(value).__name__}")
    return value


def _dtype(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DumpFormatError(f"{where}: unknown torch.dtype {name!r}")
    return dtype


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def decode_value(value: Any, where: str, tensor_dir: Path) -> Any:
    """A dump.json value as the Python object the API received; tensors load from ``tensor_dir`` (a
    :class:`MissingTensor` when not dumped). ``where`` names the field in errors."""
    if value is None:
        return None
    if isinstance(value, list):
        return [decode_value(v, f"{where}[{i}]", tensor_dir) for i, v in enumerate(value)]
    if not isinstance(value, dict) or "type" not in value:
        raise DumpFormatError(f"{where}: expected null, a list or an object with 'type', got {value!r:.80}")
    kind = value["type"]
    if kind == "torch.Tensor":
        data_name = value.get("data_name")
        shape = tuple(value.get("shape") or ())
        if not data_name and 0 in shape:  # msprobe saves no file for an empty tensor
            return torch.empty(shape, dtype=_dtype(value.get("dtype"), f"{where}.dtype"))
        if not data_name:
            return MissingTensor(where, str(value.get("dtype")), shape)
        file = tensor_dir / data_name
        if not file.is_file():
            raise DumpFormatError(f"{where}: data_name {data_name!r} has no file in {tensor_dir}")
        return load_tensor(file)
    if kind in _SCALARS:
        if "value" not in value:
            raise DumpFormatError(f"{where}: a {kind} without 'value'")
        raw = value["value"]
        return float(raw) if kind == "float" else raw  # floats may be written as "inf"/"nan"
    if kind == "torch.dtype":
        return _dtype(value.get("value"), where)
    if kind == "torch.Size":
        return torch.Size(value.get("value") or [])
    raise DumpFormatError(f"{where}: unsupported value type {kind!r}")
