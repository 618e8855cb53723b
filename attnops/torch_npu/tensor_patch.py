"""The shim's patch of PyTorch for unmodified Ascend scripts (on by default in :func:`attnops.torch_npu.install`).

Device patch: ``"npu"`` / ``"npu:N"`` strings and ``torch.device("npu")`` mean the stand-in device in the tensor
factories of :data:`FACTORIES`, the ``Tensor`` methods ``to``, ``npu``, ``new_*`` (:data:`TENSOR_NEW`) and
``is_npu``, and the ``nn.Module`` methods ``to`` and ``npu``. ``torch.device("npu")`` parses only once PrivateUse1 is
renamed ``"npu"`` (:func:`rename_device_type`), which is done only where no CUDA exists (see that function).

Pinned-memory patch, only where no CUDA exists (a CPU-only PyTorch refuses to pin): ``Tensor.pin_memory()`` returns
the tensor and ``pin_memory=True`` in the factories is ignored, as pinning only matters for copies to an accelerator.

Both change global PyTorch functions for the whole process (every library sees the wrapped functions); a ``"npu"``
device reaching any other PyTorch call still fails there. :func:`unpatch` restores every wrapped function.
"""
from __future__ import annotations

import functools

import torch

from .._core.dynamo import forget_traced_functions
from .._core.torch_compat import accelerator_hook_api, privateuse1_backend_name

FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange", "tensor",
             "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
             "randint_like", "empty_strided", "eye", "linspace", "logspace", "tril_indices", "triu_indices")
TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")

_ORIGINAL = "__attnops_wrapped__"


def _is_npu(device) -> bool:
    if isinstance(device, str):
        return device == "npu" or device.startswith("npu:")
    return isinstance(device, torch.device) and device.type == "npu"


def _map(device, stand_in: torch.device):
    return stand_in if _is_npu(device) else device


def rename_device_type() -> bool:
    """Name PyTorch's PrivateUse1 device type ``"npu"`` so that ``torch.device("npu")`` parses (once per process,
    PyTorch cannot undo it); the patched functions then map it to the stand-in. Only where no CUDA exists: a named
    PrivateUse1 type becomes PyTorch's accelerator ahead of CUDA (``torch.accelerator``, pinned memory), which would
    break CUDA code. Returns whether ``torch.device("npu")`` parses now."""
    name = privateuse1_backend_name()
    if name == "privateuseone" and not torch.cuda.is_available():
        torch.utils.rename_privateuse1_backend("npu")
        _register_accelerator_hooks()
        name = "npu"
    return name == "npu"


def _register_accelerator_hooks() -> None:
    """Give the renamed device type the Python hooks and device guard PyTorch's accelerator API calls into (PyTorch's
    own stand-ins for a Python backend): without them ``torch.accelerator.current_stream()`` fails, and with it
    ``torch.compile``, whose tracer asks for the current stream of an available accelerator."""
    api = accelerator_hook_api()
    if api is None:
        return  # an older PyTorch: torch.compile fails once "npu" is named (docs/porting.md)
    acc, hook, guard = api
    acc.register_python_privateuseone_hook(hook())
    acc.register_python_privateuseone_device_guard(guard())


def _wrap(owner, name: str, make) -> None:
    """Replace ``owner.name`` by ``make(original)``, remembering what :func:`unpatch` puts back."""
    original = getattr(owner, name)
    wrapper = make(original)
    setattr(wrapper, _ORIGINAL, (original, name in owner.__dict__))
    setattr(owner, name, wrapper)


def _factory(fn, stand_in: torch.device | None, drop_pin: bool):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if stand_in is not None and "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"], stand_in)
        if drop_pin and kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return factory


def _to(original, stand_in: torch.device):
    """``Tensor.to`` / ``Module.to`` with a leading device argument or ``device=`` mapped."""
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and _is_npu(args[0]):
            args = (stand_in,) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"], stand_in)
        return original(self, *args, **kwargs)

    return to


def _patch_devices(stand_in: torch.device) -> None:
    for name in TENSOR_NEW:
        _wrap(torch.Tensor, name, lambda fn: _factory(fn, stand_in, False))
    _wrap(torch.Tensor, "to", lambda fn: _to(fn, stand_in))
    _wrap(torch.nn.Module, "to", lambda fn: _to(fn, stand_in))

    def tensor_npu(self, device=None, non_blocking: bool = False, **kwargs):
        return self.to(stand_in, non_blocking=non_blocking, **kwargs)

    def module_npu(self, device=None):
        return self.to(stand_in)

    torch.Tensor.npu = tensor_npu
    torch.Tensor.is_npu = property(lambda self: self.device.type == stand_in.type)
    torch.nn.Module.npu = module_npu


def patched() -> bool:
    """Whether :func:`patch` is installed."""
    return hasattr(torch.zeros, _ORIGINAL)


def patch(stand_in: torch.device, *, devices: bool = True, pin_memory: bool = True) -> None:
    """Install the device patch (``devices``) and, where no CUDA exists, the pinned-memory patch (``pin_memory``).
    Idempotent: once installed, a second call changes nothing (:func:`unpatch` first to change the parts)."""
    drop_pin = pin_memory and not torch.cuda.is_available()
    if patched() or not (devices or drop_pin):
        return
    for name in FACTORIES:
        _wrap(torch, name, lambda fn: _factory(fn, stand_in if devices else None, drop_pin))
    if devices:
        rename_device_type()
        _patch_devices(stand_in)
    if drop_pin:
        _wrap(torch.Tensor, "pin_memory", lambda fn: functools.wraps(fn)(lambda self, device=None: self))


def _restore(owner, name: str) -> None:
    saved = getattr(owner.__dict__.get(name), _ORIGINAL, None)
    if saved is None:
        return
    original, own = saved
    if own:
        setattr(owner, name, original)
    else:
        delattr(owner, name)


def unpatch() -> None:
    """Undo :func:`patch` (tests use it). The ``"npu"`` name of PrivateUse1 stays (PyTorch cannot rename twice);
    without the patch a ``"npu"`` device fails again in every PyTorch call."""
    for name in FACTORIES:
        _restore(torch, name)
    for name in TENSOR_NEW + ("to", "pin_memory"):
        _restore(torch.Tensor, name)
    _restore(torch.nn.Module, "to")
    for owner, attr in ((torch.Tensor, "npu"), (torch.Tensor, "is_npu"), (torch.nn.Module, "npu")):
        if attr in owner.__dict__:
            delattr(owner, attr)
    forget_traced_functions()

