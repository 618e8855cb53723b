"""``torch.npu.NPUGraph`` and ``torch.npu.graph`` on the stand-in device: capture records every operator call made
inside ``with torch.npu.graph(g):`` (a TorchDispatchMode, so the captured code also runs once, as torch_npu's eager
warm-up would), and ``g.replay()`` runs the recorded calls again, writing each result into the tensor the capture
produced, as replaying an NPU graph rewrites its output buffers. Random operators draw again on replay (set the RNG
state first to repeat a capture). Shapes and values read on the host during capture stay fixed, as on the NPU.

aclgraph task groups: ``graph_task_group_begin/end`` mark the calls of a task group, and the calls made between
``graph_task_update_begin(stream, handle)`` and ``graph_task_update_end`` replace that group's calls for later
replays (vllm-ascend updates attention arguments such as sequence lengths this way)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from .._core.checks import Described, require


@dataclass
class _Call:
    op: object
    args: tuple
    kwargs: dict
    outputs: list  # the tensors the call returned at capture, rewritten on replay


@dataclass
class TaskGroupHandle:
    """What ``graph_task_group_end`` returns: the graph and the span of its calls that form the group (no graph for
    a group made outside a capture: nothing to update)."""
    graph: "NPUGraph | None"
    start: int
    stop: int


class _Recorder(TorchDispatchMode):
    """Runs and records every operator call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.record(func, args, kwargs, result)
        return result

    def record(self, func, args, kwargs, result) -> None:
        self.calls.append(_Call(func, args, kwargs, [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]))


_active: list = []  # the graph being captured and the task-group update in progress, innermost last


def recorded(fn):
    """``fn`` (a torch_npu operator) recorded during a capture as one call, not as the operator calls it makes: its
    kernels may write their outputs without going through PyTorch's dispatcher."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _active:
            return fn(*args, **kwargs)
        active = _active[-1]
        recorder = active._recorder if isinstance(active, NPUGraph) else active.recorder
        with _disable_current_modes():
            result = fn(*args, **kwargs)
        recorder.record(fn, args, kwargs, result)
        return result
    return call


class NPUGraph:
    """A recorded sequence of operator calls (``capture_begin``/``capture_end``, or ``torch.npu.graph(g)``)."""

    def __init__(self, *args, **kwargs) -> None:
        self._calls: list[_Call] = []
        self._recorder: _Recorder | None = None
        self._group_start = 0

    def capture_begin(self, *args, **kwargs) -> None:
        require(self._recorder is None, "graph", "a graph that is not capturing", Described("a capture in progress"))
        self._recorder = _Recorder()
        self._recorder.__enter__()
        _active.append(self)

    def capture_end(self) -> None:
        require(self._recorder is not None, "graph", "a graph that is capturing", Described("no capture in progress"))
        self._recorder.__exit__(None, None, None)
        _active.remove(self)
        self._calls, self._recorder = self._recorder.calls, None

    def replay(self) -> None:
        """Run the recorded calls again; each result is written into the tensor its call returned at capture."""
        with torch.no_grad():
            for call in self._calls:
                result = call.op(*call.args, **call.kwargs)
                fresh = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
                for captured, new in zip(call.outputs, fresh):
                    if captured is not new and captured.shape == new.shape:
                        captured.copy_(new)

    def reset(self) -> None:
        self._calls = []

    def pool(self) -> tuple:
        return (id(self), 0)

    def _recorded(self) -> list:
        return self._recorder.calls if self._recorder is not None else self._calls


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None, capture_error_mode: str = "global"):
    """``torch.npu.graph``: capture the block into ``npu_graph``."""
    npu_graph.capture_begin()
    try:
        yield npu_graph
    finally:
        npu_graph.capture_end()


def _capturing() -> NPUGraph | None:
    return next((g for g in reversed(_active) if isinstance(g, NPUGraph)), None)


def graph_task_group_begin(stream=None) -> None:
    """Mark the start of a task group in the graph being captured (nothing to mark outside a capture)."""
    g = _capturing()
    if g is not None:
        g._group_start = len(g._recorded())


def graph_task_group_end(stream=None) -> TaskGroupHandle:
    """The handle of the task group begun last."""
    g = _capturing()
    if g is None:
        return TaskGroupHandle(None, 0, 0)
    return TaskGroupHandle(g, g._group_start, len(g._recorded()))


class _GroupUpdate:
    def __init__(self, handle: TaskGroupHandle) -> None:
        self.handle = handle
        self.recorder = _Recorder()


def graph_task_update_begin(stream=None, handle: TaskGroupHandle | None = None) -> None:
    """Record the calls that follow as the new calls of ``handle``'s task group."""
    if handle is None or handle.graph is None:
        return
    update = _GroupUpdate(handle)
    update.recorder.__enter__()
    _active.append(update)


def graph_task_update_end(stream=None) -> None:
    """Replace the task group's calls by those made since ``graph_task_update_begin``."""
    update = next((u for u in reversed(_active) if isinstance(u, _GroupUpdate)), None)
    if update is None:
        return
    update.recorder.__exit__(None, None, None)
    _active.remove(update)
    h = update.handle
    calls = h.graph._recorded()
    calls[h.start:h.stop] = update.recorder.calls
    h.stop = h.start + len(update.recorder.calls)
