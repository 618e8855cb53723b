"""Valid parameter sets for the six aclnn FlashAttention operators, in each operator's parameter order, so that a
test can change one argument and expect one error."""
from __future__ import annotations

import inspect

import torch

from attnops import aclnn
from tests.helpers import INT_MAX, cum, make_qkv

OPS = {
    # name: (operator, phase-1 function, layout family, is backward, is V2)
    "score": (aclnn.flash_attention_score, aclnn.flash_attention_score_get_workspace_size, "dense", False, False),
    "var_len": (aclnn.flash_attention_var_len_score, aclnn.flash_attention_var_len_score_get_workspace_size, "TND",
                False, False),
    "var_len_v2": (aclnn.flash_attention_var_len_score_v2,
                   aclnn.flash_attention_var_len_score_v2_get_workspace_size, "TND", False, True),
    "score_grad": (aclnn.flash_attention_score_grad, aclnn.flash_attention_score_grad_get_workspace_size, "dense",
                   True, False),
    "unpad_grad": (aclnn.flash_attention_unpadding_score_grad,
                   aclnn.flash_attention_unpadding_score_grad_get_workspace_size, "TND", True, False),
    "unpad_grad_v2": (aclnn.flash_attention_unpadding_score_grad_v2,
                      aclnn.flash_attention_unpadding_score_grad_v2_get_workspace_size, "TND", True, True),
}
FORWARD_OPS = [name for name, o in OPS.items() if not o[3]]
BACKWARD_OPS = [name for name, o in OPS.items() if o[3]]
TND_OPS = [name for name, o in OPS.items() if o[2] == "TND"]
DENSE_OPS = [name for name, o in OPS.items() if o[2] == "dense"]
V2_OPS = ["var_len_v2", "unpad_grad_v2"]

# the same argument has different names in the forward (key, real_shift) and backward (key_in, pse_shift) seeds
ALIASES = {"key": ("key", "key_in"), "pse": ("real_shift", "pse_shift")}


def param_names(op: str) -> list[str]:
    return list(inspect.signature(OPS[op][1]).parameters)


def set_param(params: dict, name: str, value) -> None:
    """Set ``name`` (or its alias for this operator) in ``params``."""
    for n in ALIASES.get(name, (name,)):
        if n in params:
            params[n] = value
            return
    raise KeyError(name)


def get_param(params: dict, name: str):
    for n in ALIASES.get(name, (name,)):
        if n in params:
            return params[n]
    raise KeyError(name)


def positional(op: str, params: dict) -> list:
    return [params[n] for n in param_names(op)]


def base_params(op: str, *, dtype=torch.float32, q_lens=(3, 4), kv_lens=(4, 4), b=2, sq=4, skv=5, n1=2, n2=1,
                d=8, dv=None, seed=0, **overrides) -> dict:
    """A valid call of ``op`` (plain attention), with ``overrides`` applied (aliases allowed).

    Backward operators get a dy and placeholder forward results of the right shapes and dtypes.
    """
    _, _, family, backward, _ = OPS[op]
    if family == "TND":
        q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, d=d, dv=dv, q_lens=list(q_lens), kv_lens=list(kv_lens),
                               dtype=dtype, seed=seed)
        layout = "TND"
    else:
        q, k, v, dy = make_qkv("BNSD", b=b, n1=n1, n2=n2, sq=sq, skv=skv, d=d, dv=dv, dtype=dtype, seed=seed)
        layout = "BNSD"
    p = dict(query=q, key=k, value=v, dy=dy, pse=None, drop_mask=None, padding_mask=None, atten_mask=None,
             softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, prefix=None,
             actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), q_start_idx=None, kv_start_idx=None,
             scale_value=d ** -0.5 if d else 1.0, keep_prob=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, head_num=n1,
             input_layout=layout, inner_precise=0, sparse_mode=0, pse_type=1)

    def for_op(name):
        return {n: p[next((g for g, al in ALIASES.items() if n in al), n)] for n in param_names(name)}

    params = for_op(op)
    if backward:  # forward results with valid shapes (max 0, sum 1: finite probabilities); values are tested elsewhere
        n_q = q.shape[0] if family == "TND" else None
        stat_shape = (n_q, n1, 8) if family == "TND" else (b, n1, sq, 8)
        params.update(softmax_max=torch.zeros(stat_shape), softmax_sum=torch.ones(stat_shape),
                      attention_in=torch.zeros_like(dy))
    for name, value in overrides.items():
        set_param(params, name, value)
    return params


def call(op: str, params: dict):
    return OPS[op][0](*positional(op, params))


def validate(op: str, params: dict):
    """Phase 1 only: validation without compute."""
    return OPS[op][1](*positional(op, params))
