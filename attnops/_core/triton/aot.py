"""Ahead-of-time compilation of Triton kernels for a GPU target, down to cubin, without a GPU or a driver: the
check that the kernels compile for real NVIDIA GPUs, their resource usage (registers, spills, shared memory) and
the instruction mix of their PTX (:class:`PtxCounts`: tensor-core products, asynchronous copies, narrow loads).

A :class:`KernelLaunch` is one call site: the ``@triton.jit`` function, the argument values the launcher passes
and the tile configurations it would run with (every autotuning candidate on CUDA). It compiles once per
configuration with the signature and specialization the JIT derives from those values (``mangle``-style: ints
equal to 1 become constexprs, 16-divisible ints and pointers get the divisibility hint). Needs the compiled
kernels: a process where Triton runs without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass

TARGETS = {"sm_90": ("cuda", 90, 32), "sm_80": ("cuda", 80, 32)}  # H100 / H200, A100
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # bytes of shared memory per block (opt-in maximum)


@dataclass(frozen=True)
class KernelLaunch:
    """One call site of a kernel: ``function`` (``@triton.jit``), its argument values by name (tiles excluded), the
    ``triton.Config`` candidates (tiles, warps, stages) it runs with and the ``targets`` whose launcher runs it (a
    form for GPUs before sm_90 names ``("sm_80",)``)."""

    kernel: str
    function: object
    values: dict
    configs: list
    targets: tuple = tuple(TARGETS)


@dataclass(frozen=True)
class PtxCounts:
    """What a kernel's PTX says about the hardware paths it takes: ``wgmma`` (Hopper's asynchronous warpgroup
    products, ``wgmma.mma_async``), ``mma_sync`` (the older per-warp ``mma.sync``), ``cp_async`` (asynchronous
    global-to-shared copies, ``cp.async.ca/cg``), ``tma`` (tensor-memory-accelerator copies, ``cp.async.bulk``) and
    ``ld_global_narrow`` (scalar global loads of 2 bytes or fewer, e.g. ``ld.global.b16``: one element per thread
    and instruction where a 16-byte vector would serve)."""

    wgmma: int
    mma_sync: int
    cp_async: int
    tma: int
    ld_global_narrow: int

    @staticmethod
    def of(ptx: str) -> "PtxCounts":
        return PtxCounts(len(_WGMMA.findall(ptx)), len(_MMA_SYNC.findall(ptx)), len(_CP_ASYNC.findall(ptx)),
                         len(_TMA.findall(ptx)), sum(_narrow_load(m) for m in _LD_GLOBAL.findall(ptx)))

    def describe(self) -> str:
        return f"{self.wgmma}/{self.mma_sync}/{self.cp_async}/{self.tma}/{self.ld_global_narrow}"


_WGMMA = re.compile(r"\bwgmma\.mma_async\b")
_MMA_SYNC = re.compile(r"\bmma\.sync\b")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\b")
_TMA = re.compile(r"\bcp\.async\.bulk\b")
_LD_GLOBAL = re.compile(r"\bld\.global((?:\.[\w:]+)+)")
_NARROW_TYPES = {"b8", "u8", "s8", "b16", "u16", "s16", "f16", "bf16"}


def _narrow_load(qualifiers: str) -> bool:
    """Whether an ``ld.global`` with these qualifiers (``.nc.b16``, ``.v4.b32``, ...) is a scalar load of 2 bytes
    or fewer."""
    parts = qualifiers.strip(".").split(".")
    return not any(re.fullmatch(r"v\d+", p) for p in parts) and parts[-1] in _NARROW_TYPES


@dataclass(frozen=True)
class CompiledVariant:
    """One compiled (launch, tile configuration): its tiles, warps/stages, the compiler's resource figures, the PTX's
    instruction mix, and whether it is the configuration the launcher runs (the launch's first)."""

    kernel: str
    tiles: dict
    num_warps: int
    num_stages: int
    n_regs: int
    n_spills: int  # local memory (spills) in 4-byte words, as ``CompiledKernel.n_spills`` on a device
    shared: int  # bytes of shared memory per block
    ptx: PtxCounts
    default: bool

    def describe(self) -> str:
        tiles = " ".join(f"{k}={v}" for k, v in sorted(self.tiles.items()))
        return (f"{self.kernel} [{tiles} warps={self.num_warps} stages={self.num_stages}]: regs={self.n_regs} "
                f"spills={self.n_spills} shared={self.shared}")


def _registers_and_spills(cubin: bytes) -> tuple[int, int]:
    """``(registers per thread, local memory / 4)`` of a cubin, from ``cuobjdump -res-usage``: the figures the
    driver reports as ``n_regs`` / ``n_spills`` (Triton divides the per-thread local size by 4), read without a
    driver. Register spills live in the stack frame (``STACK``), so local memory is ``STACK + LOCAL``."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage!r}")
    return int(found.group(1)), (int(found.group(2)) + int(found.group(3))) // 4


def _source(kernel, values: dict):
    """The ``ASTSource`` the JIT would build for ``kernel`` called with ``values`` (argument name -> value)."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    return ASTSource(kernel, signature, constexprs, attrs)


def compile_launch(launch: KernelLaunch, target: tuple[str, int, int]) -> list[CompiledVariant]:
    """Compile ``launch`` for ``target`` (``TARGETS["sm_90"]``, ...) in each of its configurations; raises the
    compiler's error (``triton.compiler.errors.CompilationError`` and friends) on the first that fails."""
    import triton
    from triton.backends.compiler import GPUTarget

    variants = []
    for i, config in enumerate(launch.configs):
        src = _source(launch.function, dict(launch.values, **config.kwargs))
        compiled = triton.compile(src, target=GPUTarget(*target),
                                  options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
        regs, spills = _registers_and_spills(compiled.asm["cubin"])
        variants.append(CompiledVariant(launch.kernel, dict(config.kwargs), config.num_warps, config.num_stages,
                                        regs, spills, compiled.metadata.shared, PtxCounts.of(compiled.asm["ptx"]),
                                        default=i == 0))
    return variants
