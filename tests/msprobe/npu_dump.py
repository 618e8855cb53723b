"""Hand-written msprobe dumps whose tensors are pickled as torch_npu pickles them on an NPU."""
from __future__ import annotations

import json
import sys
import types
from collections import OrderedDict
from pathlib import Path

import torch


def _rebuild_npu_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, npu_storage_info):
    raise AssertionError("only pickled by reference, never called")


class _NpuPickled:
    """Pickles like a tensor on an NPU: ``torch_npu.utils.storage._rebuild_npu_tensor(storage, ...)`` with the
    CPU copy's typed storage and an ND format flag (torch_npu's ``Tensor._reduce_ex``)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach().contiguous()

    def __reduce_ex__(self, proto):
        t = self.tensor
        storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
        return _rebuild_npu_tensor, (storage, t.storage_offset(), tuple(t.shape), t.stride(), False, OrderedDict(),
                                     True)


def save_npu_tensor(tensor: torch.Tensor, file: Path) -> None:
    """``torch.save`` of ``tensor`` as an NPU process writes it (needs a ``torch_npu.utils.storage`` module to
    pickle the function by reference: a throwaway one is put in ``sys.modules`` meanwhile)."""
    names = ("torch_npu", "torch_npu.utils", "torch_npu.utils.storage")
    saved = {n: sys.modules.get(n) for n in names}
    fake = {n: types.ModuleType(n) for n in names}
    fake["torch_npu.utils.storage"]._rebuild_npu_tensor = _rebuild_npu_tensor
    _rebuild_npu_tensor.__module__ = "torch_npu.utils.storage"
    sys.modules.update(fake)
    try:
        torch.save(_NpuPickled(tensor), file)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _tensor_record(name: str, t: torch.Tensor, tensors: dict, with_data: bool) -> dict:
    record = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "requires_grad": False}
    if with_data and t.numel():
        record["data_name"] = f"{name}.pt"
        tensors[record["data_name"]] = t
    return record


def _encode(name: str, value, tensors: dict, with_data: bool):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return _tensor_record(name, value, tensors, with_data)
    if isinstance(value, (list, tuple)):
        return [_encode(f"{name}.{i}", v, tensors, with_data) for i, v in enumerate(value)]
    return {"type": type(value).__name__, "value": value}


def write_dump(rank_dir: Path, calls: dict[str, dict], *, with_data: bool = True) -> Path:
    """A dump.json (+ NPU-pickled .pt files) in ``rank_dir`` from ``{entry name: {"input_args": [...],
    "input_kwargs": {...}, "output": [...]} | {"input": [...], "output": [...]}}``."""
    tensors: dict[str, torch.Tensor] = {}
    data = {}
    for entry, fields in calls.items():
        record = {}
        for key, value in fields.items():
            if key == "input_kwargs":
                record[key] = {k: _encode(f"{entry}.kwargs.{k}", v, tensors, with_data) for k, v in value.items()}
            else:
                base = "input" if key == "input_args" else key
                record[key] = _encode(f"{entry}.{base}", value, tensors, with_data)
        data[entry] = record
    (rank_dir / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
    for data_name, t in tensors.items():
        save_npu_tensor(t, rank_dir / "dump_tensor_data" / data_name)
    (rank_dir / "dump.json").write_text(json.dumps({"task": "tensor" if with_data else "statistics", "level": "L1",
                                                    "framework": "pytorch", "dump_data_dir": str(rank_dir),
                                                    "data": data}))
    return rank_dir
