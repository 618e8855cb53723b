"""Every private PyTorch name attnops uses, each behind a probe.

PyTorch has no public API for these (the parts of a ``torch.library.custom_op``, the dispatcher's thread-local key
sets, Dynamo's table of traced functions, ...); they are checked on the PyTorch version the tests run on (the floor
in ``pyproject.toml``). Each is looked up at import or when first needed; a name the installed PyTorch lacks raises
:class:`~attnops._core.errors.TorchFeatureMissing` naming it when used, except where a function here says what
runs instead.
:func:`missing` lists the absent ones.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

import torch

from .errors import TorchFeatureMissing

TESTED = "2.13"  # the PyTorch floor of pyproject.toml, which CI runs

# "module:attribute.attribute" of every private name below
NAMES = (
    "torch._C:_ForceDispatchKeyGuard", "torch._C:_dispatch_tls_local_include_set",
    "torch._C:_dispatch_tls_local_exclude_set", "torch._C:DispatchKeySet", "torch._C:DispatchKey",
    "torch._C:_len_torch_dispatch_stack", "torch._C:_are_functorch_transforms_active",
    "torch.autograd:_profiler_enabled", "torch._C:_get_privateuse1_backend_name", "torch._utils:_rebuild_tensor_v2",
    "torch.utils._pytree:tree_leaves", "torch.utils._python_dispatch:TorchDispatchMode",
    "torch._dynamo.trace_rules:get_torch_obj_rule_map",
    "torch._library.custom_ops:CustomOpDef",
)
# a CustomOpDef's private attributes, set per instance (custom_op_part checks them on the op it is given)
_CUSTOM_OP_PARTS = ("_init_fn", "_abstract_fn", "_setup_context_fn", "_backward_fn", "_qualname", "_opoverload")


def lookup(name: str):
    """The object ``name`` ("module:attribute.attribute") stands for, or None where this PyTorch lacks it."""
    module, _, path = name.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for attribute in path.split("."):
        obj = getattr(obj, attribute, None)
        if obj is None:
            return None
    return obj


def _missing_error(what: str) -> TorchFeatureMissing:
    return TorchFeatureMissing(f"attnops needs the PyTorch internal {what}, which PyTorch {torch.__version__} lacks "
                               f"(attnops is tested on PyTorch >= {TESTED})")


def require(name: str):
    """:func:`lookup`, raising :class:`TorchFeatureMissing` where the name is absent."""
    obj = lookup(name)
    if obj is None:
        raise _missing_error(name.replace(":", "."))
    return obj


def _bound(name: str):
    """``name`` looked up once, at import (so that ``torch.compile`` traces straight into it), or, where this
    PyTorch lacks it, a function that raises :class:`TorchFeatureMissing` naming it when called."""
    obj = lookup(name)
    if obj is not None:
        return obj

    def absent(*args, **kwargs):
        raise _missing_error(name.replace(":", "."))
    return absent


def missing() -> list[str]:
    """The names of :data:`NAMES` this PyTorch lacks (none on the tested versions)."""
    return [name for name in NAMES if lookup(name) is None]


_custom_op_def = lookup("torch._library.custom_ops:CustomOpDef")
_len_dispatch_stack = _bound("torch._C:_len_torch_dispatch_stack")
_functorch_active = _bound("torch._C:_are_functorch_transforms_active")
_profiler_enabled = _bound("torch.autograd:_profiler_enabled")
_rebuild_tensor_v2 = _bound("torch._utils:_rebuild_tensor_v2")
tree_leaves = _bound("torch.utils._pytree:tree_leaves")
"""The leaves of a pytree (nested lists, tuples, dicts) in PyTorch's order (``torch.utils._pytree``)."""


# ---- torch.library.custom_op internals ---------------------------------------------------------------------------

def custom_op_part(op, part: str):
    """``op``'s (a ``torch.library.custom_op``) private attribute ``part``: ``_init_fn`` (the implementation),
    ``_abstract_fn`` (the fake kernel, None until registered), ``_setup_context_fn``, ``_backward_fn`` (None without
    an autograd formula), ``_qualname``, ``_opoverload``."""
    if part not in _CUSTOM_OP_PARTS:
        raise ValueError(f"part: expected one of {_CUSTOM_OP_PARTS}, got {part!r}")
    if not hasattr(op, part):
        raise _missing_error(f"{part} of a torch.library custom op ({type(op).__name__})")
    return getattr(op, part)


def schema_arguments(op) -> list:
    """The schema arguments (``.name``, ``.default_value``) of a ``torch.library.custom_op`` or an ``OpOverload``."""
    is_custom = _custom_op_def is not None and isinstance(op, _custom_op_def)
    overload = custom_op_part(op, "_opoverload") if is_custom else op
    schema = getattr(overload, "_schema", None)
    if schema is None:
        raise _missing_error("OpOverload._schema")
    return schema.arguments


# ---- the dispatcher ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def autograd_keys_included():
    """The autograd dispatch keys no longer excluded on this thread (as above a custom op's kernel), for the body."""
    key_set, key = require("torch._C:DispatchKeySet"), require("torch._C:DispatchKey")
    keys = key_set(key.AutogradFunctionality) | key_set(key.AutogradOther) | key_set(key.AutogradNestedTensor)
    include = require("torch._C:_dispatch_tls_local_include_set")()
    exclude = require("torch._C:_dispatch_tls_local_exclude_set")()
    with require("torch._C:_ForceDispatchKeyGuard")(include, exclude - keys):
        yield


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (fake tensors, tracing, FLOP counters, ...) is on this thread's stack."""
    return _len_dispatch_stack() > 0


def functorch_transform_active() -> bool:
    """Whether a functorch transform (``vmap``, ``grad``, ...) is active."""
    return _functorch_active()


def profiler_enabled() -> bool:
    """Whether the autograd profiler records."""
    return _profiler_enabled()


def privateuse1_backend_name() -> str:
    """PyTorch's name for the PrivateUse1 device type (``"privateuseone"`` until renamed)."""
    return require("torch._C:_get_privateuse1_backend_name")()


def accelerator_hook_api():
    """``(torch._C._acc, the stand-in hook class, the stand-in device guard class)`` that give a renamed PrivateUse1
    type PyTorch's accelerator API, or None where this PyTorch lacks one of them (then ``torch.compile`` fails once
    the type is named, as the porting guide says)."""
    from torch.utils import backend_registration

    parts = (lookup("torch._C:_acc"), getattr(backend_registration, "_DummyPrivateUse1Hook", None),
             getattr(backend_registration, "_DummyDeviceGuard", None))
    return None if None in parts else parts


# ---- pickling, pytrees, dispatch modes, Dynamo -------------------------------------------------------------------

def rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks):
    """PyTorch's own unpickling of a tensor (``torch._utils._rebuild_tensor_v2``)."""
    return _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks)


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base class of a Python dispatch mode."""
    return require("torch.utils._python_dispatch:TorchDispatchMode")


def forget_dynamo_torch_functions() -> None:
    """Drop Dynamo's cached table of PyTorch functions, if Dynamo is loaded and caches one (a PyTorch without the
    cache has nothing to drop)."""
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    rule_map = getattr(trace_rules, "get_torch_obj_rule_map", None)
    if rule_map is not None and hasattr(rule_map, "cache_clear"):
        rule_map.cache_clear()
