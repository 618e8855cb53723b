"""The benchmark suites ``gpu-report`` runs: each GPU suite (``attnops.bench`` registry) with the tiny suite that
stands in for it in ``--interpret`` mode, the case filter of ``--quick``, and whether its cases are compute-bound
(reported in TFLOP/s and % of the bf16 peak) or memory-bound (GB/s and % of the HBM bandwidth).

Adding an operator's GPU suite (``nsa-gpu``, ``fia-gpu``) is one :func:`register_gpu_suite` call here."""
from __future__ import annotations

from dataclasses import dataclass

BASELINES = ("sdpa-flash", "sdpa-cudnn", "flex")  # SDPA's flash and cuDNN backends, FlexAttention (compiled)


@dataclass(frozen=True)
class GpuSuite:
    suite: str  # name in ``attnops.bench.SUITES`` (device cuda)
    smoke_suite: str  # tiny suite run on the CPU by ``--interpret``
    quick_filter: str  # regular expression on case names: the subset ``--quick`` runs
    bound: str = "compute"  # "compute" | "memory"
    impls: tuple[str, ...] = ("attnops", *BASELINES)
    smoke_impls: tuple[str, ...] = ("attnops", "sdpa")  # the CPU has no SDPA flash/cuDNN; FlexAttention compiles long
    smoke_quick_filter: str = "fwd-causal"  # regular expression: the smoke cases ``--interpret --quick`` runs


GPU_SUITES: dict[str, GpuSuite] = {}


def register_gpu_suite(suite: GpuSuite) -> GpuSuite:
    if suite.bound not in ("compute", "memory"):
        raise ValueError(f"bound must be 'compute' or 'memory', got {suite.bound!r}")
    if suite.suite in GPU_SUITES:
        raise ValueError(f"GPU suite {suite.suite!r} is already registered")
    GPU_SUITES[suite.suite] = suite
    return suite


register_gpu_suite(GpuSuite("fa-gpu", smoke_suite="fa-smoke", quick_filter=r"bfloat16-(fwd|bwd)-causal"))
register_gpu_suite(GpuSuite("nsa-gpu", smoke_suite="nsa-smoke", quick_filter=r"t16384-n64-kv4-d128-.*-(fwd|fwd\+bwd)-",
                            impls=("attnops", "attnops-dense", "sdpa-flash")))
register_gpu_suite(GpuSuite("fia-gpu", smoke_suite="fia-smoke", quick_filter=r"b(1-kv32768|64-kv8192)-.*-shuffled",
                            bound="memory", impls=("attnops", "read-bandwidth", "sdpa-gathered"),
                            smoke_impls=("attnops", "sdpa-gathered"), smoke_quick_filter="float32-dense"))
register_gpu_suite(GpuSuite("dsa-gpu", smoke_suite="dsa-smoke", quick_filter=r"t(8192|32768)-|decode-b64",
                            impls=("attnops", "attnops-dense-mha"), smoke_impls=("attnops",),
                            smoke_quick_filter="prefill"))
register_gpu_suite(GpuSuite("dsv4-kernels-gpu", smoke_suite="dsv4-kernels-smoke", quick_filter=r"t8192-",
                            impls=("attnops",), smoke_impls=("attnops",), smoke_quick_filter="compressor"))
register_gpu_suite(GpuSuite("dsv4-gpu", smoke_suite="dsv4-smoke", quick_filter=r"t32768-|decode-csa",
                            impls=("attnops", "sdpa-dense-folded"), smoke_impls=("attnops",),
                            smoke_quick_filter="prefill"))
