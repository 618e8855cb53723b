"""Host side of the Triton FlashAttention kernels: the forward and backward plans (allocation, grids, dQ splits,
launch lists); their arguments come from :mod:`.launch_args`, their tiles from :mod:`.autotune`.

Tensors are read in place through strides: dense layouts as ``[B, S, N, D]`` views (batch stride, token offset 0),
TND as ``[T, N, D]`` (batch stride 0, per-batch token offsets), the strides of ``attnops._core.layouts.tokens_view``.
Per-batch metadata is built on the host from host lengths and uploaded once per batch composition
(:func:`batch_meta`, :mod:`attnops._core.staging`), or derived on the device from ``cu_seqlens`` tensors by the
prepare kernel (``prepare.py``), so no call reads a device value back. Grid axes 1 and 2 fold batch x heads. Tiles
are the first candidate of the call's class (deterministic); ``ATTNOPS_AUTOTUNE=1`` times every candidate on CUDA,
with keys that hold head dims and features only (never sequence lengths, so a new length does not recompile or
re-tune); under ``ATTNOPS_TRITON_INTERPRET=1`` CPU tensors run through Triton's interpreter with fixed 16 x 16 tiles.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...._core.layouts import with_head_dim
from ...._core.pse import ALIBI_ROWS
from ...._core.softmax_stats import FLT_LOWEST, FLT_MAX, stats_dtype, stats_shape
from ...._core.triton.launch import Launch, cdiv, fold_grid, placeholder, pow2
from ...._core.triton.support import interpreting
from ..problem import FAProblem
from .autotune import KERNELS, TAIL_BLOCK, TAIL_PROGRAMS, grad_parts
from .launch_args import (PSE_ALIBI_COPIES, PSE_KINDS, alibi_copies, batch_meta, device_metadata, dropout_args,
                          explicit_cols, mask_args, operand, pse_args, stat_row, tails)
from .verify import MAX_GRID_Y

# The backward's dK/dV pass splits each query head's key blocks over programs (dQ partials, :func:`dq_splits`)
TARGET_PROGRAMS = 2 * 132  # programs wanted without a CUDA device to ask: two waves of an H100's 132 SMs
MIN_BLOCK_N = 64  # the backward's smallest key block on 16-bit inputs: at most one split per 64 keys
MAX_DQ_SPLITS = 16  # bound of the dQ partials' memory: at most 16 fp32 copies of dQ


def _grid(rows: int, batch: int, heads: int) -> tuple[tuple[int, int, int], dict]:
    """Rows along axis 0, ``batch x heads`` along axis 1, folded into axes 1 and 2 (at most ``MAX_GRID_Y`` programs
    each) when there are more pairs (``FOLD``: the kernels compile without the fold's arithmetic otherwise)."""
    return fold_grid(rows, batch * heads, MAX_GRID_Y)


def _common(p: FAProblem, query: torch.Tensor, interpret: bool):
    """Arguments shared by the score-computing kernels: pse, explicit mask, dropout and compile-time flags."""
    device = query.device
    dummy = placeholder(device, torch.uint8)
    pse, pse_flags = pse_args(p, device, dummy)
    mask, mask_flags = mask_args(p, device, dummy)
    drop, drop_flags = dropout_args(p, device, dummy)
    upcast = interpret or query.dtype == torch.float32
    flags = dict(**pse_flags, **mask_flags, **drop_flags, SOFTCAP=p.softcap > 0, UPCAST=upcast,
                 PRECISION="ieee" if upcast else "tf32",
                 BLOCK_D=pow2(p.geom.d), BLOCK_DV=pow2(p.geom.dv))
    return pse, mask, drop, flags


def _templates(p: FAProblem, key: tuple | None, build: Callable[[], list]) -> list:
    """``build()``: a plan's launch templates ``(kernel, grid, args after the call's own tensors, constexprs, block
    axis)``, remembered in the problem's ``plans`` under ``key`` (kernels, strides of the given tensors, interpreter
    mode, grid fold): a repeated call (the same problem from :func:`~..problem.build_problem`'s memo) only allocates
    and launches. ``key`` None: built for this call only."""
    if key is None:
        return build()
    found = p.plans.get(key)
    if found is None:
        found = p.plans[key] = build()
    return found


def _static_key(kind: str, interpret: bool, *tensors: torch.Tensor) -> tuple | None:
    """The key of :func:`_templates` for a plan ``kind`` and the given tensors (None when one must be copied to a unit
    last stride)."""
    strides = tuple(t.stride() for t in tensors)
    return None if any(s[-1] != 1 for s in strides) else (kind, interpret, MAX_GRID_Y, strides)


def _launches(templates: list, *fronts: tuple) -> list[Launch]:
    """The launches of ``templates`` with each one's own tensors (``fronts``) in front of its remembered arguments."""
    return [Launch(kernel, grid, (*front, *rest), kwargs, axis)
            for (kernel, grid, rest, kwargs, axis), front in zip(templates, fronts)]


def forward_plan(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, interpret: bool):
    """``((attention_out, softmax_max, softmax_sum), launches)``: the allocated outputs and the kernel launches
    that fill them (none for an empty problem). ``interpret`` selects the interpreter's flags (fp32 math).
    The kernels write every row of every sequence (fully-masked rows and batches without keys included); the rows
    of TND tokens past every sequence get output 0 and the invalid-row statistics."""
    g, seq, device = p.geom, p.seq, query.device
    out = torch.empty(with_head_dim(query.shape, g.layout, g.n1, g.dv), dtype=query.dtype, device=device)
    stats = stats_shape(seq, g.n1, p.total_q)
    smax, ssum = (torch.empty(stats, dtype=stats_dtype(query.dtype), device=device) for _ in range(2))
    if p.total_q == 0:
        return (out, smax, ssum), []
    meta, launches = device_metadata(p, device)
    launches += tails(p, meta, 0, ((out, 0.0), (smax, FLT_LOWEST), (ssum, FLT_MAX)))
    if seq.batch == 0:
        return (out, smax, ssum), launches
    (q, qs), (k, ks), (v, vs) = operand(p, query), operand(p, key, kv=True), operand(p, value, kv=True)

    def build():
        table = batch_meta(p, device) if meta is None else meta
        pse, mask, drop, flags = _common(p, query, interpret)
        if flags["PSE"] == PSE_KINDS["alibi"]:
            pse, flags["PSE"] = alibi_copies(p, device), PSE_ALIBI_COPIES
        grid, fold = _grid(seq.max_q, seq.batch, g.n1)
        return [("fwd_kernel", grid,
                 (table, *qs, *ks, *vs, *operand(p, out)[1], stat_row(p), *pse, *mask, explicit_cols(p), *drop,
                  p.scale, p.softcap, g.n1, g.group, g.d, g.dv, seq.batch, MAX_GRID_Y),
                 dict(**flags, **fold, NEGATIVE_SCALE=p.scale < 0), "BLOCK_M")]

    static = None if p.device_lengths else _static_key("fwd", interpret, query, key, value)
    launches += _launches(_templates(p, static, build), (q, k, v, out, smax, ssum))
    return (out, smax, ssum), launches


def forward(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """``(attention_out, softmax_max, softmax_sum)`` of problem ``p`` from the forward kernel."""
    outputs, launches = forward_plan(p, query, key, value, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs


def _dpse_buffer(p: FAProblem, device: torch.device) -> torch.Tensor | None:
    """The fp32 per-batch buffer of the pse gradient (zeros: the kernels write the band's entries only): the score
    gradient ``[B, N1, R, C]`` for the full and ALiBi pse, its column sums ``[B, N1, 1, C]`` for the row pse."""
    if p.pse is None or not p.pse.has_grad:
        return None
    seq, t = p.seq, p.pse.tensor
    cols = seq.max_kv if p.pse.flattened or p.pse.kind == "alibi" else t.shape[3]
    rows = {"full": seq.max_q if p.pse.flattened else t.shape[2], "row": 1, "alibi": seq.max_q}[p.pse.kind]
    return torch.zeros((seq.batch, p.geom.n1, rows, cols), dtype=torch.float32, device=device)


def _target_programs(device: torch.device) -> int:
    """Programs that fill the device twice (two waves of its SMs)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return TARGET_PROGRAMS


def dq_splits(p: FAProblem, device: torch.device) -> int:
    """Programs per (batch, query head) of the backward's dK/dV pass, each with its own fp32 dQ partial: enough for
    two waves of the device's SMs, at most one per ``MIN_BLOCK_N`` keys and ``MAX_DQ_SPLITS`` (the partials'
    memory: ``splits x`` dQ's elements in fp32)."""
    pairs = max(1, p.seq.batch * p.geom.n1)
    return max(1, min(cdiv(_target_programs(device), pairs), cdiv(p.seq.max_kv, MIN_BLOCK_N), MAX_DQ_SPLITS))


def _grad_sum(count: int, numel: int, scale: float) -> tuple:
    """The template of a grad-sum launch: ``count`` fp32 partials of ``numel`` elements summed in order, scaled."""
    return ("grad_sum_kernel", (min(cdiv(numel, TAIL_BLOCK), TAIL_PROGRAMS),), (numel, count, scale), {}, None)


def dq_in_pass(device: torch.device) -> bool:
    """Whether the backward's dK/dV pass computes dQ too (five products per tile pair): on every device but CUDA GPUs
    older than sm_90, whose products hold their operands in registers; these run the dQ kernel instead."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def backward_plan(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum, interpret: bool,
                  fused: bool | None = None):
    """``((dq, dk, dv, dpse_buffer), launches)``: the allocated gradients (the pse gradient as its fp32 per-batch
    buffer, or None) and the launches that fill them (none for an empty problem): the preprocess, the dK/dV pass
    (with GQA dK/dV into one fp32 partial per query head of a group) computing dQ into ``dq_splits`` fp32 partials
    (``fused``, default :func:`dq_in_pass`) or else followed by the dQ kernel, the ordered sums of the partials.
    Every query row and key row of a sequence is written (0 where no score reaches it); the rows of TND tokens past
    every sequence get 0."""
    g, seq, device = p.geom, p.seq, query.device
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=device) for t in (query, key, value))  # unit last stride
    dpse_buf = _dpse_buffer(p, device)
    if p.total_q == 0:
        return (dq, dk.zero_(), dv.zero_(), dpse_buf), []
    meta, launches = device_metadata(p, device)
    launches += tails(p, meta, 0, ((dq, 0.0),)) + tails(p, meta, 1, ((dk, 0.0), (dv, 0.0)))
    if seq.batch == 0:
        return (dq, dk, dv, dpse_buf), launches
    (q, qs), (k, ks), (v, vs) = operand(p, query), operand(p, key, kv=True), operand(p, value, kv=True)
    (do, dos), (o, os_) = operand(p, dy), operand(p, attention_in)
    delta = torch.empty((p.total_q, g.n1), dtype=torch.float32, device=device)
    fused = dq_in_pass(device) if fused is None else fused
    splits = dq_splits(p, device) if fused else cdiv(seq.max_kv, MIN_BLOCK_N)  # without partials: one per key block
    dq_part = (torch.zeros((splits, *dq.shape), dtype=torch.float32, device=device) if fused
               else placeholder(device, torch.float32))
    gqa = g.group > 1
    dk_part, dv_part = ((torch.zeros((g.group, *t.shape), dtype=torch.float32, device=device) for t in (dk, dv))
                        if gqa else (dk, dv))

    def build():
        table = batch_meta(p, device) if meta is None else meta
        dqs, dks, dvs = operand(p, dq)[1], operand(p, dk, kv=True)[1], operand(p, dv, kv=True)[1]
        delta_sb = 0 if seq.packed else seq.max_q
        q_grid, q_fold = _grid(seq.max_q, seq.batch, g.n1)
        pse, mask, drop, flags = _common(p, query, interpret)
        parts = grad_parts(g.d, g.dv, query.element_size(), fused, flags)
        kv_grid, kv_fold = _grid(splits * parts, seq.batch, g.n1)
        dummy = placeholder(device, torch.float32)
        full = dpse_buf is not None and p.pse.kind in ("full", "alibi")
        row = dpse_buf is not None and p.pse.kind == "row"
        dpse = [dpse_buf, *dpse_buf.stride()[:3]] if dpse_buf is not None else [dummy, 0, 0, 0]
        kv_parts = (dk.numel(), dv.numel()) if gqa else (0, 0)
        scores = (*pse, *mask, *drop)
        templates = [("preprocess_kernel", q_grid, (table, *os_, *dos, delta_sb, g.n1, g.dv, seq.batch, MAX_GRID_Y),
                      dict(BLOCK_DV=pow2(g.dv), **q_fold), "BLOCK_M"),
                     ("dkdv_kernel", kv_grid,
                      (table, *qs, *ks, *vs, *dos, *dqs, dq.numel() if fused else 0, *dks, kv_parts[0], *dvs,
                       kv_parts[1], stat_row(p), delta_sb, *scores, *dpse, p.scale, p.softcap, g.n1, g.group, splits,
                       g.d, g.dv, seq.batch, MAX_GRID_Y),
                      dict(DPSE_FULL=full, DPSE_ROW=row, DQ=fused, GRAD_PARTS=parts, **flags, **kv_fold), None)]
        if fused:
            templates.append(_grad_sum(splits, dq.numel(), p.scale))
        else:
            templates.append(("dq_kernel", q_grid,
                              (table, *qs, *ks, *vs, *dos, *dqs, stat_row(p), delta_sb, *scores, p.scale,
                               p.softcap, g.n1, g.group, g.d, g.dv, seq.batch, MAX_GRID_Y), dict(**flags, **q_fold),
                              "BLOCK_M"))
        if gqa:
            templates += [_grad_sum(g.group, dk.numel(), 1.0), _grad_sum(g.group, dv.numel(), 1.0)]
        return templates

    static = None if p.device_lengths or dpse_buf is not None else _static_key(
        "bwd" if fused else "bwd-dq", interpret, query, key, value, dy, attention_in)
    dq_front = (dq_part, dq) if fused else (q, k, v, do, dq, delta, softmax_max, softmax_sum)
    launches += _launches(_templates(p, static, build), (o, do, delta),
                          (q, k, v, do, dq_part, dk_part, dv_part, delta, softmax_max, softmax_sum), dq_front,
                          (dk_part, dk), (dv_part, dv))
    return (dq, dk, dv, dpse_buf), launches


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum):
    """``(dq, dk, dv, dpse)`` of problem ``p`` from the backward kernels."""
    (dq, dk, dv, dpse_buf), launches = backward_plan(p, query, key, value, dy, attention_in, softmax_max,
                                                     softmax_sum, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return dq, dk, dv, _reduce_dpse(p, dpse_buf)


def _reduce_dpse(p: FAProblem, dpse_buf: torch.Tensor | None) -> torch.Tensor | None:
    """The pse gradient in the pse's shape and dtype (summed over batches for a batch-broadcast pse)."""
    if dpse_buf is None:
        return None
    t = p.pse.tensor
    if p.pse.flattened:
        return p.pse.flatten_grad(dpse_buf).to(t.dtype)
    if p.pse.kind == "alibi":
        dpse_buf = _alibi_grad(p, dpse_buf)
    grad = dpse_buf.sum(0, keepdim=True) if t.shape[0] == 1 else dpse_buf
    return grad.to(t.dtype)


def _alibi_grad(p: FAProblem, score_grad: torch.Tensor) -> torch.Tensor:
    """Per-batch gradient ``[B, N1, 1024, W]`` of the ALiBi-compressed pse from the score gradient
    ``[B, N1, R, C]`` (0 outside each batch's ``[Sq_b, Skv_b]`` and outside the causal band): its row 1023, column
    ``W - 1 - d``, is the sum of diagonal ``d = i - j``, ``0 <= d < R``. The diagonals of every batch and head at
    once are summed as columns of the skewed matrix (each row shifted right by its index through a flat view), a
    plain reduction on the device: deterministic, no atomics, no host loop."""
    b, n1, r, c = score_grad.shape
    w = p.pse.tensor.shape[-1]
    out = torch.zeros((b, n1, ALIBI_ROWS, w), dtype=torch.float32, device=score_grad.device)
    if r == 0 or c == 0:
        return out
    g = torch.nn.functional.pad(score_grad.flip(-1), (0, r))  # [B, N1, R, C + R]
    skewed = g.reshape(b, n1, -1)[..., :r * (c + r - 1)].reshape(b, n1, r, c + r - 1)  # [.., i, C-1+i-j]
    diag = skewed.sum(2)[..., c - 1:c - 1 + r]  # [B, N1, R]: d = 0 .. R-1
    out[:, :, ALIBI_ROWS - 1, w - r:] = diag.flip(-1)
    return out
