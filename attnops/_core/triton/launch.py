"""The one launch layer of every operator's Triton kernels: a plan's launches (:class:`Launch`), the kernels of an
operator (:class:`KernelFamily`: imported once per mode, their tile configurations, autotuning on CUDA) and the
AOT call site of a launch (:meth:`KernelFamily.aot_launch`).

Tile choice is deterministic: a launch runs with the first of its tile configurations (the fixed choice for its
shape class; on CUDA the one a tuned table of this GPU and Triton version chose, :mod:`.tuned`), so two processes
pick the same tiles and give bitwise equal results. ``ATTNOPS_AUTOTUNE=1`` lets
Triton's autotuner time every candidate on CUDA instead (the fastest tiles, at the price of run-to-run bitwise
differences). Inside :func:`attnops.testing.gpu_dry_run` a launch is recorded (:mod:`.dry_run`), not run.

An operator's launcher builds a plan, ``(outputs, [Launch, ...])``, from a problem, and runs it with
:meth:`KernelFamily.run_all`; ``python -m attnops aot`` compiles the same plans. Tile constexprs never sit in a
launch's ``kwargs``: they come from the family's ``tile_configs`` (one fixed configuration in Triton's interpreter
or for a kernel that is not tuned, the autotuner's candidates on CUDA).
"""
from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import dry_run, tuned, tuning
from .support import interpreting


@dataclass(frozen=True)
class Launch:
    """One kernel launch: kernel name, grid extents, arguments and non-tile constexprs. With ``block_axis``, the
    first grid extent counts rows that the kernel tiles by that constexpr (the grid holds ``cdiv(rows, tile)``
    programs there); without, the grid is used as given."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    block_axis: str | None = None

    def grid_for(self, tiles: dict) -> tuple[int, ...]:
        """The program grid under tile constexprs ``tiles``."""
        if self.block_axis is None:
            return self.grid
        return (cdiv(self.grid[0], tiles[self.block_axis]), *self.grid[1:])


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``, at least 1 (a grid extent)."""
    return max(1, -(-a // b))


def fold_grid(rows: int, pairs: int, limit: int) -> tuple[tuple[int, int, int], dict]:
    """``(grid, constexprs)`` of a kernel over ``rows`` (axis 0) x ``pairs`` (batch x heads, axis 1): with more pairs
    than ``limit`` (CUDA allows 65535 programs along axes 1 and 2), axis 1 holds ``limit`` of them and axis 2 counts
    the folds; the kernel's ``FOLD`` constexpr says which (``program_batch_head`` of the FlashAttention kernels'
    ``common.py`` reads it back, with ``limit`` as its ``bh_fold``; without a fold the kernels compile without the
    fold's arithmetic)."""
    return (rows, min(pairs, limit), cdiv(pairs, limit)), dict(FOLD=pairs > limit)


def pow2(n: int, least: int = 16) -> int:
    """The smallest power of two >= ``n`` and >= ``least`` (a tile extent covering ``n``)."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit last stride, copied only when it has none (kernels address the last dim contiguously)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache(maxsize=16)
def placeholder(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A one-element tensor for the pointer arguments a launch does not use (one per device and dtype, never read
    nor written)."""
    return torch.zeros(1, dtype=dtype, device=device)


TileConfigs = Callable[[Launch, dict, bool], list]  # (launch, argument values by name, interpret) -> [Config]
Autotuning = Callable[[str], tuple[list, list, Callable | None]]  # kernel -> (configs, key, early prune)


@dataclass(frozen=True)
class KernelFamily:
    """An operator's Triton kernels. ``modules`` (absolute names) define the ``@triton.jit`` functions and are
    imported on first use (``dispatch.triton_unavailable_reason`` has set the interpreter mode by then);
    ``tile_configs`` gives a launch's tile configurations (one: launched with it; several: the autotuner picks
    among them on CUDA, through ``autotuning`` which gives a kernel's full candidate list, key and pruning)."""

    name: str
    modules: tuple[str, ...]
    tile_configs: TileConfigs
    autotuning: Autotuning | None = None

    def function(self, kernel: str, interpret: bool):
        """The ``@triton.jit`` function ``kernel`` (interpreted or compiled); raises when this process imported
        the kernels for the other mode (CPU-interpreted and CUDA calls cannot be mixed in one process)."""
        return _function(self.modules, self.name, kernel, interpret)

    def configs(self, launch: Launch, interpret: bool) -> list:
        """The ``triton.Config`` candidates of ``launch`` (exactly those the autotuner would try on CUDA); the first
        is the one it runs with unless ``ATTNOPS_AUTOTUNE=1``."""
        names = _arg_names(self.modules, self.name, launch.kernel)
        return self.tile_configs(launch, dict(zip(names, launch.args)), interpret)

    def run(self, launch: Launch, device: torch.device) -> None:
        """Launch on ``device`` with the launch's first tile configuration (on CUDA: the tuned table's, :mod:`.tuned`),
        or through the kernel's autotuner on CUDA when ``ATTNOPS_AUTOTUNE=1`` and it has several; inside a dry run,
        record it instead; inside a tuning session (:mod:`.tuning`), time its candidates."""
        interpret = interpreting(device)
        configs = self.configs(launch, interpret)
        recording = dry_run.active()
        if recording is not None:
            if recording.checks_host_reads:
                self._check_devices(launch, device)
            config = configs[0]
            recording.launches.append(dry_run.LaunchRecord(
                self.name, launch.kernel, launch.grid_for(config.kwargs), {**launch.kwargs, **config.kwargs},
                config.num_warps, config.num_stages))
            return
        if len(configs) > 1 and autotune_requested() and not interpret and self.autotuning is not None:
            _autotuned(self, launch.kernel)[launch.grid_for](*launch.args, **launch.kwargs)
            return
        session = tuning.active()
        if session is not None:
            session.measure(self, launch, configs, device, interpret)
            return
        self.launch_with(launch, tuned.choose(self.name, launch, configs, device), interpret)

    def launch_with(self, launch: Launch, config, interpret: bool):
        """Launch with the tile configuration ``config``; returns Triton's compiled kernel (None when interpreted)."""
        return self.function(launch.kernel, interpret)[launch.grid_for(config.kwargs)](
            *launch.args, **launch.kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)

    def _check_devices(self, launch: Launch, device: torch.device) -> None:
        """Raise when a tensor argument of ``launch`` lives on another device than the call's (built on the host)."""
        for name, arg in zip(_arg_names(self.modules, self.name, launch.kernel), launch.args):
            if isinstance(arg, torch.Tensor) and arg.device != device:
                raise dry_run.HostSyncError(f"gpu_dry_run: {self.name} kernel {launch.kernel} gets {name} on "
                                            f"{arg.device}, not on the call's device {device} (a tensor built on "
                                            "the host)")

    def run_all(self, launches: list[Launch], device: torch.device) -> None:
        for launch in launches:
            self.run(launch, device)

    def aot_launch(self, launch: Launch):
        """The compiled call site of ``launch`` for ``python -m attnops aot`` (every tile configuration)."""
        from .aot import KernelLaunch

        function = self.function(launch.kernel, interpret=False)
        values = dict(zip(function.arg_names, launch.args), **launch.kwargs)
        return KernelLaunch(launch.kernel, function, values, self.configs(launch, interpret=False))


def autotune_requested() -> bool:
    """``ATTNOPS_AUTOTUNE=1``: time every tile candidate on CUDA instead of running the first (fixed) one."""
    return os.environ.get("ATTNOPS_AUTOTUNE") == "1"


@functools.cache
def _arg_names(modules: tuple[str, ...], family: str, kernel: str) -> tuple[str, ...]:
    """The argument names of ``kernel`` (whichever mode this process imported the kernels in)."""
    return tuple(_function(modules, family, kernel, os.environ.get("TRITON_INTERPRET") == "1").arg_names)


@functools.cache
def _module_functions(modules: tuple[str, ...], interpret: bool) -> dict:
    """Every ``@triton.jit`` function of ``modules`` by name, after checking the import mode."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    functions = {}
    for name in modules:
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, (JITFunction, InterpretedFunction)) and not attr.startswith("_"):
                functions[attr] = value
    if any(isinstance(f, InterpretedFunction) != interpret for f in functions.values()):
        raise RuntimeError(f"Triton kernels of {modules[0].rsplit('.', 1)[0]} were imported for the "
                           f"{'GPU' if interpret else 'interpreter'} in this process; CPU (interpreted) and CUDA "
                           "calls cannot be mixed in one process")
    return functions


def _function(modules: tuple[str, ...], family: str, kernel: str, interpret: bool):
    functions = _module_functions(modules, interpret)
    if kernel not in functions:
        raise KeyError(f"{family} has no Triton kernel {kernel!r} (kernels: {sorted(functions)})")
    return functions[kernel]


@functools.cache
def _autotuned(family: KernelFamily, kernel: str):
    """The autotuned CUDA variant of ``kernel`` (once per process)."""
    import triton

    configs, key, prune = family.autotuning(kernel)
    return triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune} if prune else None)(
        family.function(kernel, interpret=False))
