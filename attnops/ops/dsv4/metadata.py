"""``sparse_flash_mla_metadata`` / ``sparse_flash_mla_grad_metadata``: on the NPU, the per-core task split the
attention kernels read; here the arguments are validated and the documented int32 ``[1024]`` tensor of zeros is
returned. Length values are read only where that costs nothing: on the CPU and outside ``torch.compile`` (so the
functions trace whole and never synchronise a device). The attention functions
need no metadata: it carries no math."""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import Described, check_choice, check_int, check_same_device, check_tensor, fail, require
from .problem import CMP_MASK_MODES, INDEX_DTYPES, KV_LAYOUTS, MAX_CMP_RATIO, ORI_MASK_MODES, QUERY_LAYOUTS

METADATA_SIZE = 1024


def _optional_int(name: str, value, default: int, lo: int, hi: int | None = None) -> int:
    return default if value is None else check_int(name, value, lo=lo, hi=hi)


def _batch(tensors: dict[str, Tensor | None], batch_size: int | None) -> int | None:
    """The batch count the length tensors agree on (``[B + 1]`` cu_seqlens, ``[B]`` others) and ``batch_size``."""
    batch = batch_size
    for name, x in tensors.items():
        if x is None:
            continue
        check_tensor(name, x, ndim=1, dtypes=INDEX_DTYPES)
        b = x.shape[0] - 1 if name.startswith("cu_seqlens") else x.shape[0]
        if batch is None:
            batch = b
        require(b == batch and b >= 0, name, f"{'B + 1' if name.startswith('cu_seqlens') else 'B'} entries with "
                f"B = {batch} (as batch_size and the other lengths)", x)
    return batch


def _check_values(tensors: dict[str, Tensor | None], max_seqlens: dict[str, int | None], cmp_ratio: int) -> None:
    """The length tensors on one device; on the CPU outside ``torch.compile`` their values too: ``cu_seqlens_*``
    non-decreasing from 0, others >= 0, each batch's valid length (``seqused_*`` where given, else the
    ``cu_seqlens_*`` segment) at most its ``max_seqlen_*`` hint (when > 0), residuals below ``cmp_ratio``."""
    given = {n: x for n, x in tensors.items() if x is not None}
    if not given:
        return
    first = next(iter(given))
    check_same_device(first, given[first], **given)
    if given[first].device.type != "cpu" or torch.compiler.is_compiling():
        return
    for name, x in given.items():
        values = [int(v) for v in x.tolist()]
        lengths = [b - a for a, b in zip(values, values[1:])] if name.startswith("cu_seqlens") else values
        if name.startswith("cu_seqlens"):
            require(values[:1] == [0] and min(lengths, default=0) >= 0, name,
                    "non-decreasing prefix sums starting at 0", values)
        require(min(values) >= 0, name, "values >= 0", values)
        if name.startswith("cmp_residual"):
            require(max(values) < cmp_ratio, name, f"values in [0, cmp_ratio={cmp_ratio})", values)
            continue
        which = name.removeprefix("cu_seqlens_").removeprefix("seqused_")
        if name.startswith("cu_seqlens") and given.get("seqused_" + which) is not None:
            continue  # the hint bounds the valid lengths: seqused_* where given (a segment may hold more)
        hint_name = "max_seqlen_" + which
        hint = max_seqlens.get(hint_name) or 0
        require(hint <= 0 or max(lengths, default=0) <= hint, name, f"per-batch lengths <= {hint_name}={hint}",
                lengths)


def _validated(num_heads_q, num_heads_kv, head_dim, tensors, batch_size, max_seqlens, ori_topk, cmp_topk, cmp_ratio,
               ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv, has_ori_kv,
               has_cmp_kv) -> torch.device:
    """Checks every argument; returns the device of the result (the length tensors', else the CPU)."""
    heads = check_int("num_heads_q", num_heads_q, lo=1)
    check_int("num_heads_kv", num_heads_kv, lo=1, hi=1)
    require(heads % num_heads_kv == 0, "num_heads_q", f"a multiple of num_heads_kv ({num_heads_kv})", heads)
    check_int("head_dim", head_dim, lo=1)
    for name in ("ori_topk_length", "cmp_topk_length"):
        require(tensors.pop(name) is None, name, "None (reserved, not supported)", Described("a tensor"))
    _batch(tensors, None if batch_size is None else check_int("batch_size", batch_size, lo=0))
    for name, value in max_seqlens.items():
        _optional_int(name, value, 0, 0)
    _optional_int("ori_topk", ori_topk, 0, 0)
    _optional_int("cmp_topk", cmp_topk, 0, 0)
    _check_values(tensors, max_seqlens, _optional_int("cmp_ratio", cmp_ratio, 1, 1, MAX_CMP_RATIO))
    check_choice("ori_mask_mode", 0 if ori_mask_mode is None else ori_mask_mode, ORI_MASK_MODES)
    check_choice("cmp_mask_mode", 0 if cmp_mask_mode is None else cmp_mask_mode, CMP_MASK_MODES)
    _optional_int("ori_win_left", ori_win_left, -1, -1)
    _optional_int("ori_win_right", ori_win_right, -1, -1)
    check_choice("layout_q", "BSND" if layout_q is None else layout_q, QUERY_LAYOUTS)
    check_choice("layout_kv", "BSND" if layout_kv is None else layout_kv, KV_LAYOUTS)
    for name, flag in (("has_ori_kv", has_ori_kv), ("has_cmp_kv", has_cmp_kv)):
        if flag is not None and not isinstance(flag, bool):
            fail(name, "a bool or None", flag)
    return next((x.device for x in tensors.values() if x is not None), torch.device("cpu"))


def sparse_flash_mla_metadata(num_heads_q: int, num_heads_kv: int, head_dim: int, *,
                              cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None,
                              cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
                              seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None,
                              cmp_residual_kv: Tensor | None = None, ori_topk_length: Tensor | None = None,
                              cmp_topk_length: Tensor | None = None, batch_size: int | None = None,
                              max_seqlen_q: int | None = None, max_seqlen_ori_kv: int | None = None,
                              max_seqlen_cmp_kv: int | None = None, ori_topk: int | None = None,
                              cmp_topk: int | None = None, cmp_ratio: int | None = None,
                              ori_mask_mode: int | None = None, cmp_mask_mode: int | None = None,
                              ori_win_left: int | None = None, ori_win_right: int | None = None,
                              layout_q: str | None = None, layout_kv: str | None = None,
                              has_ori_kv: bool | None = None, has_cmp_kv: bool | None = None) -> Tensor:
    """The metadata tensor of :func:`sparse_flash_mla`'s NPU kernel: int32 ``[1024]`` zeros on the length tensors'
    device (the CPU without them), after checking the arguments (``None`` takes CANN's defaults: 0, ``cmp_ratio``
    1, mask modes 0, windows -1, layouts ``"BSND"``). ``num_heads_kv`` must be 1; the length tensors must agree on
    the batch (``cu_seqlens_* [B + 1]``, the others ``[B]``, and ``batch_size``); ``ori/cmp_topk_length`` are
    reserved (None).

    >>> sparse_flash_mla_metadata(64, 1, 512, cu_seqlens_q=torch.tensor([0, 5, 9]), cmp_ratio=4).shape
    torch.Size([1024])
    """
    device = _validated(
        num_heads_q, num_heads_kv, head_dim,
        {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_ori_kv": cu_seqlens_ori_kv, "cu_seqlens_cmp_kv": cu_seqlens_cmp_kv,
         "seqused_q": seqused_q, "seqused_ori_kv": seqused_ori_kv, "seqused_cmp_kv": seqused_cmp_kv,
         "cmp_residual_kv": cmp_residual_kv, "ori_topk_length": ori_topk_length, "cmp_topk_length": cmp_topk_length},
        batch_size, {"max_seqlen_q": max_seqlen_q, "max_seqlen_ori_kv": max_seqlen_ori_kv,
                     "max_seqlen_cmp_kv": max_seqlen_cmp_kv}, ori_topk, cmp_topk, cmp_ratio, ori_mask_mode,
        cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv, has_ori_kv, has_cmp_kv)
    return torch.zeros(METADATA_SIZE, dtype=torch.int32, device=device)


# The grad kernel's metadata: the same arguments, checks and result (the NPU op has the same signature and role).
sparse_flash_mla_grad_metadata = sparse_flash_mla_metadata


def lightning_indexer_v2_metadata(num_heads_q: int, num_heads_k: int, head_dim: int, topk: int, *,
                                  cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                                  seqused_q: Tensor | None = None, seqused_k: Tensor | None = None,
                                  cmp_residual_k: Tensor | None = None, batch_size: int | None = None,
                                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                                  layout_q: str | None = None, layout_k: str | None = None,
                                  mask_mode: int | None = None, cmp_ratio: int | None = None) -> Tensor:
    """The metadata tensor of the lightning indexer v2's NPU kernel: int32 ``[1024]`` zeros on the length tensors'
    device (the CPU without them), after checking the arguments as :func:`sparse_flash_mla_metadata` does
    (``num_heads_k`` 1, lengths agreeing on the batch, ``None`` for CANN's defaults).

    >>> lightning_indexer_v2_metadata(64, 1, 128, 512, cu_seqlens_q=torch.tensor([0, 3])).shape
    torch.Size([1024])
    """
    check_int("num_heads_q", num_heads_q, lo=1)
    check_int("num_heads_k", num_heads_k, lo=1, hi=1)
    check_int("head_dim", head_dim, lo=1)
    check_int("topk", topk, lo=1)
    tensors = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seqused_q": seqused_q,
               "seqused_k": seqused_k, "cmp_residual_k": cmp_residual_k}
    _batch(tensors, None if batch_size is None else check_int("batch_size", batch_size, lo=0))
    _optional_int("max_seqlen_q", max_seqlen_q, -1, -1)
    _optional_int("max_seqlen_k", max_seqlen_k, -1, -1)
    check_choice("layout_q", "BSND" if layout_q is None else layout_q, QUERY_LAYOUTS)
    check_choice("layout_k", "BSND" if layout_k is None else layout_k, (*KV_LAYOUTS, "PA_BSND"))
    check_choice("mask_mode", 0 if mask_mode is None else mask_mode, (0, 3))
    _check_values(tensors, {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k},
                  _optional_int("cmp_ratio", cmp_ratio, 1, 1, MAX_CMP_RATIO))
    device = next((x.device for x in tensors.values() if x is not None), torch.device("cpu"))
    return torch.zeros(METADATA_SIZE, dtype=torch.int32, device=device)
