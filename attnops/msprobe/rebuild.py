"""Dump entries back into calls: the torch_npu arguments by parameter name (bound to attnops.torch_npu's own
signature, defaults applied) and the NPU's results.

A ``.backward`` entry takes its forward arguments from the ``.forward`` entry of the same call number: its
``input`` are the gradients of the forward's outputs (``dy`` first) and its ``output`` the gradients of the
forward's inputs (``dq, dk, dv, ...``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from .. import torch_npu
from .dump import DumpDir, DumpFormatError, Entry, MissingTensor, decode_value

__all__ = ["ATTENTION_APIS", "SUPPORTED_APIS", "FA_APIS", "FA_GRAD_APIS", "FIA_APIS", "NSA_APIS", "Call",
           "Unsupported", "rebuild_call", "attention_entries", "bind_arguments", "not_dumped_reason"]

FA_APIS = ("npu_fusion_attention", "npu_fusion_attention_v2", "npu_fusion_attention_v3")
FA_GRAD_APIS = ("npu_fusion_attention_grad", "npu_fusion_attention_grad_v2", "npu_fusion_attention_grad_v3")
FIA_APIS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2", "npu_prompt_flash_attention",
            "npu_incre_flash_attention")
NSA_TRAINING_APIS = ("npu_nsa_select_attention", "npu_nsa_compress_attention", "npu_nsa_compress")
NSA_APIS = NSA_TRAINING_APIS + ("npu_nsa_select_attention_grad", "npu_nsa_compress_grad",
                                "npu_nsa_select_attention_infer", "npu_nsa_compress_attention_infer")
TRAINING_APIS = FA_APIS + NSA_TRAINING_APIS  # with a .backward entry
SUPPORTED_APIS = FA_APIS + FA_GRAD_APIS + FIA_APIS + NSA_APIS
# fused-attention APIs this command reports on; those not in SUPPORTED_APIS are SKIP with the reason
NOT_RERUN = {"npu_nsa_compress_infer": "an in-place update of a paged cache, not an attention result"}
ATTENTION_APIS = SUPPORTED_APIS + tuple(NOT_RERUN)


class Unsupported(Exception):
    """A call that cannot be re-run (the message is the SKIP reason)."""


@dataclass
class Call:
    """One dumped call: ``arguments`` (the forward's, by torch_npu parameter name), the NPU ``outputs`` as dumped,
    and for a backward the ``grads`` it received."""

    name: str
    api: str
    direction: str
    arguments: dict[str, Any]
    outputs: list[Any]
    grads: list[Any] = field(default_factory=list)


def attention_entries(dump: DumpDir) -> list[Entry]:
    """The fused-attention entries of a dump (``api_filter`` is applied by the caller), in dump order."""
    return [e for e in dump.entries.values() if e.api in ATTENTION_APIS]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _field(entry: Entry, key: str) -> Any:
    if key not in entry.record:
        raise DumpFormatError(f"{entry.tensor_dir.parent / 'dump.json'}: {entry.name} has no '{key}' field")
    value, where = entry.record[key], f"{entry.name}.{key}"
    if key == "input_kwargs":
        if not isinstance(value, dict):
            raise DumpFormatError(f"{where}: expected an object, got {type(value).__name__}")
        return {name: decode_value(v, f"{where}.{name}", entry.tensor_dir) for name, v in value.items()}
    return decode_value(value, where, entry.tensor_dir)


def _missing(values: Any) -> list[MissingTensor]:
    if isinstance(values, MissingTensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    return [m for v in values for m in _missing(v)] if isinstance(values, list) else []


def not_dumped_reason(missing: list[MissingTensor]) -> str:
    """The SKIP reason of a call whose tensors ``missing`` were dumped as statistics only."""
    return (f"tensor data not dumped (statistics-level dump): {missing[0].where}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def bind_arguments(api: str, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch_npu.<api>``'s arguments by parameter name, defaults applied (TypeError when they do not fit)."""
    bound = inspect.signature(getattr(torch_npu, api)).bind(*_as_list(args), **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _bind(forward: Entry, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        return bind_arguments(forward.api, args, kwargs)
    except TypeError as exc:
        raise DumpFormatError(f"{forward.name}: its arguments do not fit torch_npu.{forward.api} ({exc})") from None


def rebuild_call(entry: Entry, dump: DumpDir) -> Call:
    """The :class:`Call` of ``entry``; raises :class:`Unsupported` (SKIP) or :class:`DumpFormatError`."""
    if entry.api in NOT_RERUN:
        raise Unsupported(f"{entry.api} is not re-run: {NOT_RERUN[entry.api]}")
    forward = entry
    if entry.direction == "backward":
        if entry.api not in TRAINING_APIS:
            raise Unsupported(f"{entry.api} is inference-only: no backward to rebuild")
        forward = dump.entries.get(entry.name.removesuffix("backward") + "forward")
        if forward is None:
            raise Unsupported(f"the forward entry {entry.name.removesuffix('backward')}forward is not in the dump "
                              "(its arguments are needed to re-run the backward)")
    args, kwargs = _field(forward, "input_args"), _field(forward, "input_kwargs")
    outputs = _as_list(_field(entry, "output"))
    grads = _as_list(_field(entry, "input")) if entry.direction == "backward" else []
    missing = _missing([args, kwargs, grads])  # outputs dumped as statistics only are named by the judge
    if missing:
        raise Unsupported(not_dumped_reason(missing))
    return Call(entry.name, entry.api, entry.direction, _bind(forward, args, kwargs), outputs, grads)
