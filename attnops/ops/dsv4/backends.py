"""Runs ``sparse_flash_mla`` on its backend: the custom ops (``op.py``) call these functions and nothing else.

The forward runs the Triton kernels where :func:`choose_backend` picks them (CUDA tensors the kernels can serve; CPU
tensors through the interpreter when asked), reading no metadata value on the host unless index validation is on
for the device (:func:`~attnops._core.indices.validation_enabled`: by default on the CPU only). Everything else, the
backward included, runs the CPU reference, on CPU copies for tensors on another device (with a
:class:`~attnops.PerformanceWarning` on a GPU; inside :func:`attnops.testing.gpu_dry_run` the call raises saying so).
The checks that need no tensor values run first, so a bad call fails the same way everywhere.
"""
from __future__ import annotations

from dataclasses import fields, replace

from ..._core.devices import on_cpu, to_cpu
from ..._core.dispatch import choose_backend
from ..._core.indices import validation_enabled
from .reference import sparse_flash_mla_backward, sparse_flash_mla_forward
from .triton import sparse_flash_mla_family, sparse_flash_mla_launch
from .validate import METADATA, Args, build_problem, check_operands


def _on_reference(a: Args, fn, *extra):
    """``fn(problem, args, *extra)`` on the reference (CPU copies of every tensor; results back on ``q``'s device)."""
    values = {f.name: getattr(a, f.name) for f in fields(a)}

    def run(values, *extra):
        cpu_args = Args(**values)
        return fn(build_problem(cpu_args), cpu_args, *extra)

    return on_cpu(run, values, *extra)


def forward(a: Args):
    """``(out [R, N, D], lse [R, N])`` over the flat query rows."""
    check_operands(a)
    if choose_backend("auto", a.q.device, lambda: sparse_flash_mla_family.forward_reason(a.q)) == "triton":
        if validation_enabled(a.q.device):  # the metadata's values, as the reference checks them
            build_problem(replace(a, **{name: to_cpu(getattr(a, name)) for name in METADATA}))
        return sparse_flash_mla_launch.forward(a)
    return _on_reference(a, lambda problem, a: sparse_flash_mla_forward(
        problem, a.q, a.ori_kv, a.cmp_kv, a.cmp_sparse_indices, a.sinks, a.scale))


def backward(a: Args, dout, dlse, out, lse):
    """``(dq, d_ori_kv, d_cmp_kv, d_sinks, cmp_softmax_l1_norm)`` (None where the input is absent); ``lse`` and
    ``dlse`` flat ``[R, N]``."""
    check_operands(a)
    choose_backend("auto", a.q.device, None)
    return _on_reference(a, lambda problem, a, dout, dlse, out, lse: sparse_flash_mla_backward(
        problem, dout, dlse, a.q, a.ori_kv, a.cmp_kv, a.cmp_sparse_indices, a.sinks, out, lse, a.scale),
        dout, dlse, out, lse)
