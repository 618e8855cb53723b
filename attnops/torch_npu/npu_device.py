"""The ``torch.npu`` stand-in module of the shim: device, stream, event and graph-capture calls of Ascend scripts,
mapped to CUDA on a CUDA device and to harmless CPU equivalents otherwise (``docs/porting.md`` lists them)."""
from __future__ import annotations

import contextlib
import time
import types

import torch

from .._core.checks import Described, require
from . import npu_generator, npu_graph, npu_utils, soc

GRAPH_NAMES = ("NPUGraph", "graph", "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
               "graph_task_update_end")
_compile_mode = {"jit_compile": True}


def set_compile_mode(jit_compile: bool = True) -> None:
    """``torch.npu.set_compile_mode``: chooses between online-compiled and prebuilt NPU kernels; the stand-in has one
    implementation either way and only keeps the choice (``torch.npu.is_jit_compile_false()``)."""
    _compile_mode["jit_compile"] = bool(jit_compile)


class _DeviceProperties:
    """``torch.npu.get_device_properties()`` on the CPU: the SoC name, and no device memory."""

    total_memory = 0

    def __init__(self, name: str) -> None:
        self.name = name


class DeviceIndex(str):
    """What ``torch.npu.current_device()`` returns on the CPU: the device index 0 to code that formats it, compares
    it or converts it to an int (``f"npu:{i}"``, ``i == 0``, ``int(i)``), and the string ``"cpu"`` to PyTorch, so that
    ``torch.ones(2, device=torch.npu.current_device())`` works on the CPU stand-in."""

    def __new__(cls) -> "DeviceIndex":
        return super().__new__(cls, "cpu")

    def __int__(self) -> int:
        return 0

    def __index__(self) -> int:
        return 0

    def __str__(self) -> str:
        return "0"

    def __repr__(self) -> str:
        return "0"

    def __format__(self, spec: str) -> str:
        return format(0, spec)

    def __eq__(self, other) -> bool:
        if isinstance(other, torch.device):
            return other.type == "cpu"
        return other == 0 or other == "cpu"

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(0)


class CpuEvent:
    """``torch.npu.Event`` on the CPU: work is synchronous, so an event is complete once recorded; it keeps the
    record time for ``elapsed_time``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def reset(self, stream=None) -> None:
        self._time = None

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        require(self._time is not None and end_event._time is not None, "event", "two recorded events",
                Described("an event that was not recorded"))
        return (end_event._time - self._time) * 1000.0


class CpuStream:
    """``torch.npu.Stream`` on the CPU: one in-order stream; every wait is already satisfied."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __eq__(self, other) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return hash(CpuStream)


_CPU_STREAM = CpuStream()


def _cpu_names() -> dict:
    def set_device(index) -> None:
        index = torch.device(index).index if isinstance(index, torch.device) else index
        require(index in (None, 0, "cpu") or str(index) in ("cpu", "npu", "npu:0", "0"), "device",
                "device 0 (the CPU stands in for one NPU)", index)

    return dict(
        device_count=lambda: 1, current_device=lambda: DeviceIndex(), set_device=set_device,
        synchronize=lambda device=None: None, empty_cache=lambda: None,
        Event=CpuEvent, ExternalEvent=CpuEvent, Stream=CpuStream,
        stream=lambda stream=None: contextlib.nullcontext(stream),
        current_stream=lambda device=None: _CPU_STREAM, default_stream=lambda device=None: _CPU_STREAM,
        set_stream=lambda stream: None, get_device_name=lambda device=None: soc.soc_name(),
        mem_get_info=lambda device=None: (0, 0), memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0, reset_peak_memory_stats=lambda device=None: None,
        get_rng_state=lambda device="npu": npu_generator.with_state(torch.get_rng_state()),
        set_rng_state=lambda new_state, device="npu": torch.set_rng_state(npu_generator.restore(new_state)),
        is_bf16_supported=lambda including_emulation=True: True,
        get_device_properties=lambda device=None: _DeviceProperties(soc.soc_name()),
    )


def _cuda_names() -> dict:
    cuda = torch.cuda
    return dict(
        device_count=cuda.device_count, current_device=cuda.current_device, set_device=cuda.set_device,
        synchronize=cuda.synchronize, empty_cache=cuda.empty_cache,
        Event=cuda.Event, ExternalEvent=cuda.Event, Stream=cuda.Stream, stream=cuda.stream,
        current_stream=cuda.current_stream, default_stream=cuda.default_stream, set_stream=cuda.set_stream,
        get_device_name=cuda.get_device_name,
        mem_get_info=cuda.mem_get_info,
        memory_allocated=cuda.memory_allocated, max_memory_allocated=cuda.max_memory_allocated,
        reset_peak_memory_stats=cuda.reset_peak_memory_stats,
        get_rng_state=lambda device="cuda": npu_generator.with_state(cuda.get_rng_state(device)),
        set_rng_state=lambda new_state, device="cuda": cuda.set_rng_state(npu_generator.restore(new_state), device),
        is_bf16_supported=cuda.is_bf16_supported,
        get_device_properties=cuda.get_device_properties,
    )


def npu_device_module(device: torch.device) -> types.ModuleType:
    """``torch.npu`` backed by ``device`` (CUDA calls on a CUDA device, stand-ins on the CPU)."""
    mod = types.ModuleType("torch.npu", f"attnops stand-in for torch.npu, backed by {device}")
    names = _cuda_names() if device.type == "cuda" else _cpu_names()
    for name, value in names.items():
        setattr(mod, name, value)

    def manual_seed(seed: int) -> None:
        """Seed the stand-in's generators (the CPU's, where attnops draws dropout seeds, and CUDA's). Not through
        ``torch.manual_seed``: with ``torch.device("npu")`` parsing, that one calls ``torch.npu.manual_seed_all``."""
        torch.default_generator.manual_seed(int(seed))
        npu_generator.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(int(seed))

    mod.is_available = lambda: True
    mod.manual_seed = manual_seed
    mod.manual_seed_all = manual_seed
    mod._is_in_bad_fork = lambda: False  # with manual_seed_all: what torch.manual_seed asks of a named PrivateUse1
    for name in GRAPH_NAMES:  # graph capture and aclgraph task groups (vllm-ascend's graph capture)
        setattr(mod, name, getattr(npu_graph, name))
    mod.set_compile_mode = set_compile_mode
    mod.is_jit_compile_false = lambda: not _compile_mode["jit_compile"]
    mod.config = types.SimpleNamespace(allow_internal_format=False)
    mod.utils = npu_utils.utils_module(mod)
    mod.device = device
    return mod


NPU_NAMES = tuple(sorted(set(_cpu_names()) | set(GRAPH_NAMES) | {
    "is_available", "manual_seed", "manual_seed_all", "_is_in_bad_fork", "device", "set_compile_mode",
    "is_jit_compile_false", "config", "utils"}))
