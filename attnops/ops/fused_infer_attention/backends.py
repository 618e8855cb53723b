"""Runs an FIA call on the backend :func:`~attnops._core.dispatch.choose_backend` picks for it: the Triton kernels
(``triton/``: the decode kernels for a few query rows per batch, else the prefill kernel over every batch) when
their verifier accepts the call, else the reference (on CPU copies for tensors elsewhere).

``auto`` on CUDA runs the kernels when the verifier accepts (a PerformanceWarning names the reason when it does not); an explicit
``backend="triton"`` (or ``ATTNOPS_BACKEND=triton``) that cannot serve the call raises with the reason. The Pythonic
API and the custom op call :func:`forward` and nothing else.
"""
from __future__ import annotations

from torch import Tensor

from ..._core.devices import origin_device, to_cpu, to_device
from ..._core.dispatch import choose_backend
from ..._core.triton.support import interpreting
from . import reference
from .paged import flash_attn_cache_views
from .problem import build_problem
from .triton import launch, plan_cache
from .triton.decode_plan import make_plan
from .triton.verify import kernel_route


def forward(query: Tensor, key, value, options: dict, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """``(attention_out, softmax_lse)`` of the call (``options``: :func:`build_problem`'s keywords), on the query's
    device."""
    key, value = flash_attn_cache_views(_single(key), _single(value), options)
    call = plan_cache.call_key(query, key, value, options, backend)
    plan = plan_cache.lookup(call)
    if plan is not None:  # the same decode as a recent call: launch only
        return launch.run(plan, query, key, value, options.get("block_table"))
    built = {}

    def verify() -> str | None:
        built["p"] = build_problem(query, key, value, **options)
        built["route"], reason = kernel_route(built["p"], query, key, value, options)
        return reason

    if choose_backend(backend, query.device, verify) == "triton":
        from .triton import prefill

        if built["route"] == "decode":
            plan = make_plan(built["p"], interpreting(query.device))
            plan_cache.store(call, plan)
            return launch.run(plan, query, key, value, options.get("block_table"))
        return prefill.forward(built["p"], query, key, value, options)
    device = origin_device(query, key, value, options)
    return to_device(reference.forward(build_problem(*to_cpu((query, key, value)), **to_cpu(options))), device)


def _single(x):
    """A one-tensor list (an aclnn TensorList of one) as the tensor itself."""
    return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x
