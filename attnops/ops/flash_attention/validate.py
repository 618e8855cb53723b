"""Validation of FlashAttention's backward inputs against the forward's problem (:mod:`attnops.ops.common.problem`
validates the forward's): used by the custom ops and by the aclnn backward."""
from __future__ import annotations

from torch import Tensor

from ..._core.checks import check_same_device, check_tensor, require, require_not_none
from ..._core.layouts import with_head_dim
from ..._core.softmax_stats import check_stats
from ..common.problem import FAProblem


def check_backward_inputs(p: FAProblem, query: Tensor, dy, attention_in, softmax_max, softmax_sum):
    """Validate the backward's forward results; returns them (statistics made contiguous)."""
    g = p.geom
    out_shape = with_head_dim(query.shape, g.layout, g.n1, g.dv)
    for name, t in (("dy", dy), ("attention_in", attention_in)):
        if type(t) is Tensor and t.dtype == query.dtype and t.shape == out_shape and t.device == query.device:
            continue  # the common case, checked at once
        require_not_none(t, name)
        check_tensor(name, t, dtypes=(query.dtype,))
        require(tuple(t.shape) == out_shape, name, f"shape {list(out_shape)} (the forward output's)", t)
        check_same_device("query", query, **{name: t})
    stats = []
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        require_not_none(t, name)
        check_same_device("query", query, **{name: t})
        stats.append(check_stats(name, t, p.seq, g.n1, p.total_q, query.dtype))
    return attention_in, stats[0], stats[1]
