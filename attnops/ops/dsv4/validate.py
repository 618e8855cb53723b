"""Validation of a ``sparse_flash_mla`` call, before any compute.

:func:`check_operands` checks what needs no tensor values (ranks, shapes, dtypes, devices, attributes);
:func:`build_problem` reads the lengths, block tables and indices on the host, checks their values and returns the
call's :class:`~.problem.Problem`. Layout pairs: BSND/BSND, TND/TND, BSND/PA_BBND, TND/PA_BBND.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import (Described, check_choice, check_int, check_same_device, check_scale, check_tensor, fail,
                             int_list, require)
from ..._core.varlen import segments
from .problem import (CMP_MASK_MODES, INDEX_DTYPES, KV_LAYOUTS, MAX_CMP_RATIO, ORI_MASK_MODES, QUERY_LAYOUTS, Batch,
                      KeyStore, Masks, Problem, compute_dtype, lse_shape)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SINK_DTYPES = (torch.float32, torch.float64)
# host metadata: read on the host, so it may stay on the CPU whatever q's device
METADATA = ("cmp_sparse_indices", "ori_block_table", "cmp_block_table", "cu_seqlens_q", "cu_seqlens_ori_kv",
            "cu_seqlens_cmp_kv", "seqused_q", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv")


@dataclass(frozen=True)
class Args:
    """A call's tensors and attributes, by the Pythonic API's names."""
    q: Tensor
    ori_kv: Tensor
    cmp_kv: Tensor | None = None
    cmp_sparse_indices: Tensor | None = None
    ori_block_table: Tensor | None = None
    cmp_block_table: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_ori_kv: Tensor | None = None
    cu_seqlens_cmp_kv: Tensor | None = None
    seqused_q: Tensor | None = None
    seqused_ori_kv: Tensor | None = None
    seqused_cmp_kv: Tensor | None = None
    cmp_residual_kv: Tensor | None = None
    sinks: Tensor | None = None
    scale: float = 1.0
    cmp_ratio: int = 1
    ori_mask_mode: int = 4
    cmp_mask_mode: int = 3
    ori_win_left: int = 127
    ori_win_right: int = 0
    layout_q: str = "BSND"
    layout_kv: str = "BSND"


def check_operands(a: Args) -> None:
    """Everything that needs no tensor values."""
    check_same_device("q", a.q, ori_kv=a.ori_kv, cmp_kv=a.cmp_kv, sinks=a.sinks)
    for name in METADATA:
        x = getattr(a, name)
        if x is not None:
            check_tensor(name, x)
            require(x.device.type == "cpu" or x.device == a.q.device, name,
                    f"a tensor on the CPU or on {a.q.device} (the device of q)", x)
    check_choice("layout_q", a.layout_q, QUERY_LAYOUTS)
    check_choice("layout_kv", a.layout_kv, KV_LAYOUTS)
    if a.layout_kv != "PA_BBND":
        require(a.layout_kv == a.layout_q, "layout_kv", f"{a.layout_q!r} like layout_q, or 'PA_BBND'", a.layout_kv)
    check_scale("scale", a.scale)
    check_int("cmp_ratio", a.cmp_ratio, lo=1, hi=MAX_CMP_RATIO)
    check_choice("ori_mask_mode", a.ori_mask_mode, ORI_MASK_MODES)
    check_choice("cmp_mask_mode", a.cmp_mask_mode, CMP_MASK_MODES)
    check_int("ori_win_left", a.ori_win_left, lo=-1)
    check_int("ori_win_right", a.ori_win_right, lo=-1)
    check_tensor("q", a.q, ndim=4 if a.layout_q == "BSND" else 3, dtypes=FLOAT_DTYPES)
    require(a.q.shape[-1] >= 1 and a.q.shape[-2] >= 1, "q", "at least one head and a head dim D >= 1", a.q)
    _check_kv("ori_kv", a.ori_kv, a)
    if a.cmp_kv is None:
        for name in ("cmp_sparse_indices", "cmp_block_table", "cu_seqlens_cmp_kv", "seqused_cmp_kv"):
            require(getattr(a, name) is None, name, "None without cmp_kv (sliding-window attention only)",
                    getattr(a, name))
    else:
        _check_kv("cmp_kv", a.cmp_kv, a)
    batch = _batch_count(a)
    for name in ("ori_block_table", "cmp_block_table"):
        table = getattr(a, name)
        kv = a.ori_kv if name == "ori_block_table" else a.cmp_kv
        if a.layout_kv != "PA_BBND" or kv is None:
            require(table is None, name, f"None unless layout_kv is 'PA_BBND' with {name[:3]}_kv", table)
            continue
        check_tensor(name, table, ndim=2, dtypes=INDEX_DTYPES)
        require(table.shape[0] == batch and table.shape[1] >= 1, name, f"[B={batch}, blocks >= 1]", table)
    for name in ("cu_seqlens_ori_kv", "cu_seqlens_cmp_kv"):
        if a.layout_kv != "TND":
            require(getattr(a, name) is None, name, f"None with layout_kv {a.layout_kv!r} (TND only)",
                    getattr(a, name))
    if a.layout_q == "BSND":
        require(a.cu_seqlens_q is None, "cu_seqlens_q", "None with layout_q 'BSND' (TND only)", a.cu_seqlens_q)
    if a.layout_kv == "PA_BBND":
        require(a.seqused_ori_kv is not None, "seqused_ori_kv", "the ori lengths (required with layout_kv PA_BBND)",
                None)
    for name in ("seqused_q", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv"):
        x = getattr(a, name)
        if x is not None:
            check_tensor(name, x, ndim=1, dtypes=INDEX_DTYPES)
            require(x.shape[0] == batch, name, f"[B={batch}] (one value per batch)", x)
    if a.cmp_sparse_indices is not None:
        x = a.cmp_sparse_indices
        check_tensor("cmp_sparse_indices", x, ndim=a.q.dim(), dtypes=INDEX_DTYPES)
        lead = list(a.q.shape[:-2])
        require(list(x.shape[:-2]) == lead and x.shape[-2] == 1 and x.shape[-1] >= 1, "cmp_sparse_indices",
                f"[{', '.join(map(str, lead))}, 1, K >= 1] (q's rows, one kv head)", x)
    if a.sinks is not None:
        check_tensor("sinks", a.sinks, shape=(a.q.shape[-2],), dtypes=SINK_DTYPES)


def _check_kv(name: str, kv: Tensor, a: Args) -> None:
    check_tensor(name, kv, ndim=3 if a.layout_kv == "TND" else 4, dtypes=(a.q.dtype,))
    require(kv.shape[-2] == 1 and kv.shape[-1] == a.q.shape[-1], name,
            f"one kv head and q's head dim: [..., 1, {a.q.shape[-1]}]", kv)
    if a.layout_kv == "BSND" and a.layout_q == "BSND":
        require(kv.shape[0] == a.q.shape[0], name, f"batch B={a.q.shape[0]} like q", kv)


def _batch_count(a: Args) -> int:
    if a.layout_q == "BSND":
        return a.q.shape[0]
    check_tensor("cu_seqlens_q", a.cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES)
    require(a.cu_seqlens_q.shape[0] >= 2, "cu_seqlens_q", "[B + 1] prefix sums with a leading 0 (B >= 1)",
            a.cu_seqlens_q)
    return a.cu_seqlens_q.shape[0] - 1


def _cu_lengths(name: str, cu: Tensor | None, batch: int, total: int) -> tuple[list[int], list[int]]:
    """(starts, lengths) of a ``[B + 1]`` cu_seqlens tensor (:func:`~attnops._core.varlen.segments`) of ``batch``
    batches."""
    starts, lengths = segments(name, cu, total)
    require(len(lengths) == batch, name, f"{batch + 1} prefix sums (one more than the {batch} batches)", cu)
    return starts, lengths


def _used(name: str, x: Tensor | None, stored: list[int]) -> list[int]:
    """Per-batch lengths: ``x``'s values (each within the stored length) or the stored lengths."""
    if x is None:
        return stored
    v = int_list(name, x)
    require(all(0 <= u <= s for u, s in zip(v, stored)), name, f"per-batch lengths in [0, {stored}]", v)
    return v


def _store(name: str, kv: Tensor, a: Args, table_name: str, cu_name: str, batch: int
           ) -> tuple[KeyStore, list[int]]:
    """A key store and its stored per-batch lengths (the capacity of the batch's blocks when paged)."""
    if a.layout_kv == "PA_BBND":
        table = getattr(a, table_name)
        values = table.to(torch.int64)
        block_size = kv.shape[1]
        require(bool(((values >= -1) & (values < kv.shape[0])).all()), table_name,
                f"block ids in [0, {kv.shape[0]}) (-1 for unused entries)", table)
        return KeyStore(None, values, block_size), [table.shape[1] * block_size] * batch
    if a.layout_kv == "BSND":
        s = kv.shape[1]
        return KeyStore(tuple(b * s for b in range(batch)), None, 0), [s] * batch
    starts, lens = _cu_lengths(cu_name, getattr(a, cu_name), batch, kv.shape[0])
    return KeyStore(tuple(starts), None, 0), lens


def _check_blocks(name: str, store: KeyStore, lens: list[int]) -> None:
    """Every block a batch's keys use is a real block (not -1)."""
    if store.table is None:
        return
    for b, n in enumerate(lens):
        used = store.table[b, :-(-n // store.block_size)]
        require(bool((used >= 0).all()), name, f"valid block ids for the {n} keys of batch {b}",
                Described(f"{used.tolist()[:8]}"))


def build_problem(a: Args) -> Problem:
    """The normal form of a call that passed :func:`check_operands`, its host values read and checked."""
    batch = _batch_count(a)
    if a.layout_q == "BSND":
        s1 = a.q.shape[1]
        q_starts, q_stored = [b * s1 for b in range(batch)], [s1] * batch
    else:
        q_starts, q_stored = _cu_lengths("cu_seqlens_q", a.cu_seqlens_q, batch, a.q.shape[0])
    q_lens = _used("seqused_q", a.seqused_q, q_stored)
    ori, ori_stored = _store("ori_kv", a.ori_kv, a, "ori_block_table", "cu_seqlens_ori_kv", batch)
    ori_lens = _used("seqused_ori_kv", a.seqused_ori_kv, ori_stored)
    _check_blocks("ori_block_table", ori, ori_lens)
    r = a.cmp_ratio
    residual = None if a.cmp_residual_kv is None else int_list("cmp_residual_kv", a.cmp_residual_kv)
    if residual is not None:
        require(all(0 <= x < r for x in residual), "cmp_residual_kv", f"values in [0, cmp_ratio={r})", residual)
    cmp, cmp_lens = None, [0] * batch
    if a.cmp_kv is not None:
        cmp, cmp_stored = _store("cmp_kv", a.cmp_kv, a, "cmp_block_table", "cu_seqlens_cmp_kv", batch)
        if a.layout_kv == "PA_BBND" and a.seqused_cmp_kv is None:
            derived = [(n - (0 if residual is None else residual[b])) // r for b, n in enumerate(ori_lens)]
            require(all(0 <= d <= s for d, s in zip(derived, cmp_stored)), "cmp_block_table",
                    f"room for the derived compressed lengths {derived}", a.cmp_block_table)
            cmp_lens = derived
        else:
            cmp_lens = _used("seqused_cmp_kv", a.seqused_cmp_kv, cmp_stored)
        _check_blocks("cmp_block_table", cmp, cmp_lens)
    batches = tuple(Batch(q_starts[b], q_lens[b], ori_lens[b], cmp_lens[b],
                          ori_lens[b] if residual is None else cmp_lens[b] * r + residual[b]) for b in range(batch))
    problem = Problem(a.q.shape[0] * a.q.shape[1] if a.layout_q == "BSND" else a.q.shape[0], batches, ori, cmp,
                      a.cmp_sparse_indices is not None,
                      Masks(a.ori_mask_mode, a.ori_win_left, a.ori_win_right, a.cmp_mask_mode, r), a.layout_q,
                      a.layout_kv)
    if problem.sparse:
        _check_indices(a.cmp_sparse_indices, problem)
    return problem


def _check_indices(indices: Tensor, problem: Problem) -> None:
    """Entries of real query rows are -1 or compressed positions of the batch (``[0, Lcmp)``)."""
    flat = indices.reshape(-1, indices.shape[-1])
    for b in problem.batches:
        rows = flat[b.q_start:b.q_start + b.q_len].to(torch.int64)
        bad = (rows < -1) | (rows >= b.cmp_len)
        if bool(bad.any()):
            fail("cmp_sparse_indices", f"-1 or compressed positions in [0, {b.cmp_len}) for the batch at query row "
                 f"{b.q_start}", int(rows[bad][0]))


def check_grad_inputs(d_out: Tensor, d_lse: Tensor | None, attn_out: Tensor, lse: Tensor, a: Args) -> None:
    """The forward's operands (:func:`check_operands`), then the backward's own inputs, by the Pythonic API's names:
    ``d_out`` and ``attn_out`` like ``q``; ``softmax_lse`` (and its gradient ``d_softmax_lse``, when given) in the
    forward's lse shape and dtype; all on q's device."""
    check_operands(a)
    check_same_device("q", a.q, d_out=d_out, attn_out=attn_out, softmax_lse=lse, d_softmax_lse=d_lse)
    for name, x in (("d_out", d_out), ("attn_out", attn_out)):
        check_tensor(name, x, dtypes=(a.q.dtype,))
        require(x.shape == a.q.shape, name, f"q's shape {list(a.q.shape)}", x)
    for name, x in (("softmax_lse", lse), ("d_softmax_lse", d_lse)):
        if x is not None or name == "softmax_lse":
            check_tensor(name, x, dtypes=(compute_dtype(a.q),), shape=lse_shape(a.q, a.layout_q))
