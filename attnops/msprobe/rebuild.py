"""Dump entries back into calls: the torch_npu arguments by parameter name (bound to attnops.torch_npu's own
signature, defaults applied) and the NPU's results. The DeepSeek-V4 ops, registered with msprobe as custom APIs,
bind to their dialect's function: :data:`DSV4_APIS` by the entry's prefix (``cann_ops_transformer`` or
``_C_ascend``, the one msprobe was given); a name only one dialect has needs no particular prefix.

A ``.backward`` entry takes its forward arguments from the ``.forward`` entry of the same call number: its
``input`` are the gradients of the forward's outputs (``dy`` first) and its ``output`` the gradients of the
forward's inputs (``dq, dk, dv, ...``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from .. import cann_ops_transformer, torch_npu
from ..torch_npu import dsv4 as vllm_dsv4
from .dump import DumpDir, DumpFormatError, Entry, MissingTensor, decode_value

__all__ = ["ATTENTION_APIS", "DSV4_APIS", "SUPPORTED_APIS", "dsv4_api",
           "FA_APIS", "FA_GRAD_APIS", "FIA_APIS", "NSA_APIS", "Call",
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
# DeepSeek-V4 custom APIs by dialect (the msprobe prefix they are registered under) -> the module defining them
DSV4_APIS = {
    "cann_ops_transformer": (cann_ops_transformer, ("sparse_flash_mla", "sparse_flash_mla_grad", "compressor",
                                                    "lightning_indexer")),
    "_C_ascend": (vllm_dsv4, ("npu_sparse_attn_sharedkv", "compressor", "npu_vllm_quant_lightning_indexer")),
}


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
    forwards: dict[str, Any] = field(default_factory=dict, repr=False)  # a reference's forward results and cast
    # inputs by its name, shared by the forward and backward calls of one call number (the backward re-runs no
    # forward)


def dsv4_api(entry: Entry) -> str | None:
    """``"<dialect>.<op>"`` of a DeepSeek-V4 entry (by its prefix, else the one dialect with that op), else None."""
    if entry.prefix in DSV4_APIS and entry.api in DSV4_APIS[entry.prefix][1]:
        return f"{entry.prefix}.{entry.api}"
    dialects = [d for d, (_, ops) in DSV4_APIS.items() if entry.api in ops]
    return f"{dialects[0]}.{entry.api}" if len(dialects) == 1 else None


def attention_entries(dump: DumpDir) -> list[Entry]:
    """The fused-attention entries of a dump (``api_filter`` is applied by the caller), in dump order."""
    return [e for e in dump.entries.values() if e.api in ATTENTION_APIS or dsv4_api(e) is not None]


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


def _function(api: str):
    """``torch_npu.<api>``, or the dialect function of a ``"<dialect>.<op>"`` DeepSeek-V4 name."""
    dialect, _, op = api.rpartition(".")
    return getattr(DSV4_APIS[dialect][0] if dialect else torch_npu, op)


def bind_arguments(api: str, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch_npu.<api>``'s (or a DeepSeek-V4 dialect function's) arguments by parameter name, defaults applied
    (TypeError when they do not fit)."""
    bound = inspect.signature(_function(api)).bind(*_as_list(args), **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _bind(forward: Entry, api: str, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        return bind_arguments(api, args, kwargs)
    except TypeError as exc:
        where = api if "." in api else f"torch_npu.{api}"
        raise DumpFormatError(f"{forward.name}: its arguments do not fit {where} ({exc})") from None


def rebuild_call(entry: Entry, dump: DumpDir) -> Call:
    """The :class:`Call` of ``entry``; raises :class:`Unsupported` (SKIP) or :class:`DumpFormatError`."""
    if entry.api in NOT_RERUN:
        raise Unsupported(f"{entry.api} is not re-run: {NOT_RERUN[entry.api]}")
    api = dsv4_api(entry) or entry.api
    if api != entry.api and entry.direction == "backward":
        raise Unsupported(f"the backward of {api} is not re-run (dump its grad op called directly)")
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
    return Call(entry.name, api, entry.direction, _bind(forward, api, args, kwargs), outputs, grads)
