"""The options of a FlashAttention call (every keyword argument of :func:`flash_attention` but ``return_stats``) and
their resolution into the custom ops' arguments."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..._core.checks import Described, check_same_device, check_tensor, fail, require, softmax_scale
from ..._core.dropout import check_seed_offset, draw_seed
from ..._core.layouts import normalize_layout
from ..common.npu_rounding import check_precision
from ..._core.masks import require_mask_for_mode, window_sparse_args
from ..._core.varlen import cumulative_pair_from_cu_seqlens
from ..common.problem import INT_MAX

Backend = Literal["auto", "reference", "triton"]
Precision = Literal["exact", "npu"]


@dataclass(frozen=True)
class Options:
    """The options of a FlashAttention call as given (the defaults are :func:`flash_attention`'s)."""

    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    layout: str = "BNSD"
    head_num: int | None = None
    scale: float | None = None
    pse: Tensor | None = None
    pse_type: int = 1
    atten_mask: Tensor | None = None
    sparse_mode: int = 0
    pre_tokens: int = INT_MAX
    next_tokens: int = INT_MAX
    prefix: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    actual_seq_qlen: object = None
    actual_seq_kvlen: object = None
    keep_prob: float = 1.0
    drop_mask: Tensor | None = None
    seed: int | None = None
    offset: int = 0
    q_start_idx: int = 0
    kv_start_idx: int = 0
    softmax_layout: str = ""
    softcap: float = 0.0
    pse_bottom_right: bool = False
    backend: Backend = "auto"
    precision: Precision = "exact"

    def op_args(self, query: Tensor, key: Tensor) -> dict:
        """The custom ops' arguments after the tensors (:func:`_resolve`) for ``query`` and ``key``."""
        return _resolve(query, key, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def _head_num(query: Tensor, layout: str, head_num: int | None) -> int:
    check_tensor("query", query, ndim=3 if layout in ("BSH", "SBH", "TND") else 4)
    if head_num is not None:
        return head_num
    if layout in ("BSH", "SBH"):
        fail("head_num", f"the number of query heads (required for layout {layout})", None)
    return query.shape[1] if layout in ("TND", "BNSD") else query.shape[2]


def _start(name: str, value) -> int:
    if type(value) is int:
        return value
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else 0
    require(isinstance(value, int) and not isinstance(value, bool), name, "an int (global start index)", value)
    return value


def _tokens(x) -> int | None:
    """The packed token count T of a TND tensor (None for anything else: validated later)."""
    return x.shape[0] if isinstance(x, Tensor) and x.dim() == 3 else None


def _seq_lengths(layout, query, key, cu_seqlens_q, cu_seqlens_k, actual_seq_qlen, actual_seq_kvlen):
    """``(actual_seq_qlen, actual_seq_kvlen, cu_seqlens_q, cu_seqlens_k)`` for the ops: host lists as cumulative lists,
    ``cu_seqlens`` tensors as they are (never read here: the op reads CPU tensors, the kernels device ones)."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        require(actual_seq_qlen is None and actual_seq_kvlen is None, "cu_seqlens_q",
                "either cu_seqlens_q/k (leading 0) or actual_seq_qlen/kvlen (cumulative), not both", Described("both"))
        require(cu_seqlens_q is not None and cu_seqlens_k is not None, "cu_seqlens_k",
                "cu_seqlens_q and cu_seqlens_k together", Described("only one of them"))
        require(layout == "TND", "cu_seqlens_q", "None for dense layouts (sequence lengths are for layout 'TND')",
                cu_seqlens_q)
        tensors = [isinstance(t, Tensor) for t in (cu_seqlens_q, cu_seqlens_k)]
        if all(tensors):
            for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
                require(t.device in (query.device, torch.device("cpu")), name,
                        f"a tensor on {query.device} (the device of query) or on the CPU", t)
            return None, None, cu_seqlens_q, cu_seqlens_k
        require(not any(tensors), "cu_seqlens_k", "cu_seqlens_q and cu_seqlens_k of one kind (tensors or lists)",
                Described("a tensor and a list"))
        actual_seq_qlen, actual_seq_kvlen = cumulative_pair_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k,
                                                                            _tokens(query), _tokens(key))
    if layout != "TND":
        require(actual_seq_qlen is None and actual_seq_kvlen is None, "actual_seq_qlen",
                "None for dense layouts (sequence lengths are for layout 'TND')", actual_seq_qlen)
    to_list = (lambda x: None if x is None else [int(v) for v in (x.tolist() if isinstance(x, Tensor) else x)])
    return to_list(actual_seq_qlen), to_list(actual_seq_kvlen), None, None


def _prefix_list(prefix):
    """``prefix`` as a host list: a list, or a CPU tensor (a device tensor would be read back, synchronising)."""
    if not isinstance(prefix, Tensor):
        return None if prefix is None else [int(v) for v in prefix]
    require(prefix.device.type == "cpu", "prefix", "a list of ints or a CPU tensor", prefix,
            "pass prefix.tolist() (reading a device tensor on every call would synchronise with the device)")
    return [int(v) for v in prefix.tolist()]


def _resolve(query: Tensor, key: Tensor, *, causal, window_size, layout, head_num, scale, pse, pse_type, atten_mask,
             sparse_mode, pre_tokens, next_tokens, prefix, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             actual_seq_qlen, actual_seq_kvlen, keep_prob, drop_mask, seed, offset, q_start_idx, kv_start_idx,
             softmax_layout, softcap, pse_bottom_right, backend, precision) -> dict:
    """Resolve the Pythonic defaults into the custom ops' argument list (after the tensors), in schema order: the
    one place every option is checked, for the forward, the backward and the probabilities of a forward."""
    if check_precision(precision) == "npu":  # the emulation is the reference's
        require(backend in ("auto", "reference"), "backend", "'auto' or 'reference' with precision='npu' (the NPU "
                "emulation runs the reference)", backend)
        backend = "reference"
    check_tensor("query", query)
    layout = normalize_layout("layout", layout)
    head_num = _head_num(query, layout, head_num)
    d = query.shape[-1] // head_num if layout in ("BSH", "SBH") and head_num > 0 else query.shape[-1]
    scale = softmax_scale(scale, query, d)
    sparse = window_sparse_args(causal, window_size, sparse_mode=sparse_mode, atten_mask=atten_mask,
                                pre_tokens=pre_tokens, next_tokens=next_tokens, device=query.device)
    if sparse is not None:
        sparse_mode, atten_mask, pre_tokens, next_tokens = sparse.values()
    require_mask_for_mode(sparse_mode, atten_mask)
    check_same_device("query", query, atten_mask=atten_mask, pse=pse, drop_mask=drop_mask)
    qlen, kvlen, cu_seqlens_q, cu_seqlens_k = _seq_lengths(layout, query, key, cu_seqlens_q, cu_seqlens_k,
                                                          actual_seq_qlen, actual_seq_kvlen)
    if keep_prob < 1.0 and drop_mask is None and seed is None:
        seed = draw_seed()
    seed, offset = check_seed_offset(0 if seed is None else seed, offset)
    return dict(pse=pse, atten_mask=atten_mask, drop_mask=drop_mask, head_num=head_num, layout=layout,
                scale=float(scale), keep_prob=float(keep_prob), pre_tokens=pre_tokens, next_tokens=next_tokens,
                prefix=_prefix_list(prefix), actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, sparse_mode=sparse_mode,
                pse_type=pse_type, q_start_idx=_start("q_start_idx", q_start_idx),
                kv_start_idx=_start("kv_start_idx", kv_start_idx), softmax_layout=softmax_layout,
                seed=seed, offset=offset, backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, precision=precision, softcap=softcap,
                pse_bottom_right=pse_bottom_right)
