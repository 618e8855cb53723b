"""Validation of the NSA selected attention's backward inputs against the forward's spec
(:func:`.selected.build_selected_spec` validates the forward's): used by the custom ops and by the aclnn backward."""
from __future__ import annotations

from ..._core.checks import check_tensor, require_not_none
from ..._core.softmax_stats import STAT_LANES, stats_dtype
from .selected import SelectedSpec


def check_selected_backward_inputs(spec: SelectedSpec, query, grad, attention_out, softmax_max, softmax_sum):
    shape_out = (spec.total_q, spec.n1, spec.dv)
    for name, t in (("attention_out_grad", grad), ("attention_out", attention_out)):
        require_not_none(t, name)
        check_tensor(name, t, dtypes=(query.dtype,), shape=shape_out)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        require_not_none(t, name)
        check_tensor(name, t, dtypes=(stats_dtype(query.dtype),), shape=(spec.total_q, spec.n1, STAT_LANES))
