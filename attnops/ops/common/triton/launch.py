"""Host side of the Triton FlashAttention kernels: allocation, per-batch metadata, tile sizes, grids, autotuning.

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

import functools
from collections.abc import Callable

import torch

from ...._core import staging
from ...._core.layouts import token_strides, tokens_view, with_head_dim
from ...._core.masks import INF
from ...._core.pse import ALIBI_ROWS
from ...._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES, stats_dtype, stats_shape
from ...._core.triton.launch import KernelFamily, Launch, cdiv, fold_grid, placeholder, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ..problem import FAProblem
from .verify import MAX_GRID_Y

INTERPRET_BLOCK = 16
_PSE_KINDS = {"full": 1, "row": 2, "alibi": 3}  # common.PSE_FULL / PSE_ROW / PSE_ALIBI; slopes: 4 + (type 3)
MASK_STRIDED_CAUSAL = 2  # common.MASK_STRIDED_CAUSAL: HAS_EXPLICIT of a masks.StridedCausal rule
_TUNE_KEY = ["head_d", "head_dv", "group", "PSE", "HAS_EXPLICIT", "DROPOUT"]


# Autotuning candidates (BLOCK_M, BLOCK_N, warps, stages) per (kernel kind, operand bytes, D > 128), chosen from the
# compiler's figures (AOT compile, docs/triton.md): each fits sm_80's 163 KB and sm_90's 227 KB of shared memory per
# block and spills little (tests/ops/flash_attention/triton/test_gpu_compile.py asserts both for every candidate).
# fp32 dots are IEEE (FMA, no tensor cores): their operands take twice the bytes, hence fewer, smaller tiles. The
# third width class, ``WIDEST`` (:func:`_class_key`): the backward's 64-key blocks of D <= 192 / Dv <= 128 (wgmma)
# and the forward's 64-row tiles with every feature do not fit the registers with D = Dv = 256. The backward above
# D=128 takes 32-key blocks (mma.sync but the dQ product): 64-key blocks (wgmma) spill 4 words at D=192/Dv=128
# (Triton 3.9; 10 with 3.6), 32-key blocks none.
WIDEST = 2
_TILES = {
    ("fwd", 2, False): [(64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    ("fwd", 2, True): [(64, 32, 8, 2), (64, 16, 8, 2)],
    ("fwd", 2, WIDEST): [(64, 32, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, False): [(16, 32, 8, 2), (32, 32, 8, 2)],
    ("fwd", 4, True): [(16, 32, 8, 1), (32, 16, 8, 1)],
    ("fwd", 4, WIDEST): [(16, 32, 8, 1), (32, 16, 8, 1)],
    ("bwd", 2, False): [(32, 64, 8, 2), (64, 64, 8, 2), (32, 128, 8, 2)],
    ("bwd", 2, True): [(32, 32, 8, 2), (16, 64, 8, 2)],
    ("bwd", 2, WIDEST): [(32, 32, 8, 2), (16, 64, 8, 2)],
    ("bwd", 4, False): [(32, 32, 8, 1)],
    ("bwd", 4, True): [(16, 32, 8, 1)],
    ("bwd", 4, WIDEST): [(16, 32, 8, 1)],
}
# The candidates with a pse, an explicit mask or dropout (per-element tiles: more registers and shared memory). The
# forward's: 64 rows (wgmma) x 32 keys at D <= 128, x 16 keys above, spill-free on sm_80 and sm_90 for every feature
# up to D=192/Dv=128, NSA's compressed attention (an explicit mask of odd width) included, where 128 x 32 spills 36-38
# words (Triton 3.6 and 3.9; docs/triton.md has the figures); fp32 16 x 16 (NSA's fp32 compressed attention spills
# 2 words on sm_80 with 32 x 16). The backward's take 16 query rows per step at D <= 128 (the key block stays the
# products' M = 64); above, 16-key blocks (mma.sync): with a mask, a pse and dropout 64-key blocks spill 118 words at
# D=192/Dv=128, 32-key blocks 6 (D=192) and 18 (D=256) with two stages, none with one (the second candidate). The
# forward at D=Dv=256 with every feature spills 8 words with 64-row tiles (wgmma), none with 32 x 16 (mma.sync).
_FEATURE_TILES = {
    ("fwd", 2, False): [(64, 32, 8, 2), (64, 16, 8, 2)],
    ("fwd", 2, True): [(64, 16, 8, 2), (32, 32, 4, 2)],
    ("fwd", 2, WIDEST): [(32, 16, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, False): [(16, 16, 4, 1)],
    ("fwd", 4, True): [(16, 32, 8, 1), (32, 16, 8, 1)],
    ("bwd", 2, False): [(16, 64, 8, 2), (32, 64, 8, 2)],
    ("bwd", 2, True): [(16, 16, 8, 2), (16, 32, 8, 1)],
    ("bwd", 2, WIDEST): [(16, 16, 8, 2), (16, 32, 8, 1)],
}
# The dK/dV pass of GPUs before sm_90 (no dQ in the pass, ``DQ`` False: mma.sync, operands in registers) with
# per-element features: its 64-key blocks spill 4-20 words at D <= 128 (sm_80), 32-key blocks none.
_SPLIT_FEATURE_TILES = {("bwd", 2, False): [(16, 32, 8, 2), (32, 32, 8, 2)]}
# Triton 3.6 pipelines the dK/dV pass with every feature at D <= 128 differently from 3.9: two stages spill 6 words
# on sm_90 with 3.6, one stage none (one stage spills 18 with 3.9, two none). Under Triton before 3.7 (3.6 is what the
# GPU machines carry; 3.7 and 3.8 were not compiled) these replace the ``_FEATURE_TILES`` entries.
_FEATURE_TILES_BEFORE_TRITON_3_7 = {("bwd", 2, False): [(16, 64, 8, 1), (16, 64, 8, 2)]}
PREPROCESS_ELEMENTS = 64 * 128  # rows x Dv of one preprocess program: two fp32 tiles within the register file
PREPARE_BATCHES = 256  # batches per step of the prepare kernel (one program)
TAIL_BLOCK, TAIL_PROGRAMS = 1024, 1024  # elements per step and programs of the tail and grad-sum kernels (grid-stride)
# The backward's dK/dV pass splits each query head's key blocks over programs (dQ partials, :func:`dq_splits`)
TARGET_PROGRAMS = 2 * 132  # programs wanted without a CUDA device to ask: two waves of an H100's 132 SMs
MIN_BLOCK_N = 64  # the backward's smallest key block on 16-bit inputs: at most one split per 64 keys
MAX_DQ_SPLITS = 16  # bound of the dQ partials' memory: at most 16 fp32 copies of dQ


def _config(tiles: tuple[int, int, int, int], pre_hook: Callable | None = None):
    import triton

    m, n, warps, stages = tiles
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages, pre_hook=pre_hook)


def _zero_dq_partials(args: dict) -> None:
    """The autotuner's hook before each run of the dK/dV pass: its dQ partials start at zero (it adds into them)."""
    args["dqp_ptr"].zero_()


def _kind(kernel_name: str) -> str:
    return "fwd" if kernel_name == "fwd_kernel" else "bwd"


@functools.cache
def _configs(kind: str) -> tuple:
    """Every candidate of a kernel kind (the autotuner's list; :func:`_prune` keeps those of the problem's class)."""
    tiles = {t: None for table in (_TILES, _feature_tiles(), _SPLIT_FEATURE_TILES) for key, ts in table.items()
             if key[0] == kind for t in ts}
    return tuple(_config(t, _zero_dq_partials if kind == "bwd" else None) for t in tiles)


def _class_key(kind: str, named_args: dict) -> tuple:
    """The tile class of a call: kernel kind, operand bytes and head dims (D and Dv <= 128: False; above: True;
    ``WIDEST`` when the padded head dims together exceed 256 + 128)."""
    d, dv = named_args["head_d"], named_args["head_dv"]
    width = max(d, dv) > 128
    if pow2(d) + pow2(dv) > 384:
        width = WIDEST
    return kind, named_args["q_ptr"].element_size(), width


def _class_tiles(key: tuple, constexprs: dict) -> list:
    """The tiles of a call's class (:func:`_class_key`) in the table's order: ``_FEATURE_TILES`` when a pse, an
    explicit mask or dropout adds per-element tiles (registers and shared memory, docs/triton.md) and the class has
    some (``_SPLIT_FEATURE_TILES`` for the dK/dV pass without dQ), else ``_TILES``."""
    if not (constexprs["PSE"] or constexprs["HAS_EXPLICIT"] is True or constexprs["DROPOUT"]):
        return _TILES[key]
    if constexprs.get("DQ", True) is False and key in _SPLIT_FEATURE_TILES:
        return _SPLIT_FEATURE_TILES[key]
    return _feature_tiles().get(key, _TILES[key])


@functools.cache
def _feature_tiles() -> dict:
    """``_FEATURE_TILES`` for the installed Triton (``_FEATURE_TILES_BEFORE_TRITON_3_7`` over it before 3.7)."""
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return {**_FEATURE_TILES, **_FEATURE_TILES_BEFORE_TRITON_3_7} if (major, minor) < (3, 7) else _FEATURE_TILES


@functools.cache
def _class_configs(key: tuple, tiles: tuple) -> list:
    """The candidates of one class (:func:`_prune`), in the table's order: the first is the fixed choice."""
    configs = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in _configs(key[0])}
    return [configs[t] for t in tiles]


def _prune(kind: str, configs, named_args, **kwargs):
    """The candidates of the call's class (:func:`_class_tiles`)."""
    wanted = set(_class_tiles(_class_key(kind, named_args), kwargs))
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]


@functools.cache
def _fixed_config(kernel: str, interpret: bool, block_dv: int = 0) -> list:
    """The one configuration of a kernel that is not tuned (preprocess, prepare, tail), and of every kernel in the
    interpreter."""
    import triton

    if kernel == "preprocess_kernel":
        return [triton.Config({"BLOCK_M": INTERPRET_BLOCK if interpret else max(16, PREPROCESS_ELEMENTS // block_dv)})]
    if kernel == "prepare_kernel":
        return [triton.Config({"BLOCK_B": INTERPRET_BLOCK if interpret else PREPARE_BATCHES}, num_warps=4)]
    if kernel in ("tail_kernel", "grad_sum_kernel"):
        return [triton.Config({"BLOCK": TAIL_BLOCK}, num_warps=4)]
    return [triton.Config({"BLOCK_M": INTERPRET_BLOCK, "BLOCK_N": INTERPRET_BLOCK})]


def _tile_configs(launch: Launch, named_args: dict, interpret: bool) -> list:
    """The ``triton.Config`` candidates of ``launch``: one fixed config for the preprocess, prepare and tail kernels
    and in the interpreter, the class's configurations on CUDA (exactly those the autotuner would try)."""
    if launch.kernel in ("preprocess_kernel", "prepare_kernel", "tail_kernel", "grad_sum_kernel") or interpret:
        return _fixed_config(launch.kernel, interpret, launch.kwargs.get("BLOCK_DV", 0))
    key = _class_key(_kind(launch.kernel), named_args)
    return _class_configs(key, tuple(_class_tiles(key, launch.kwargs)))


def _autotuning(kernel_name: str):
    """A kernel's autotuning: every candidate of its kind, the key (head dims and features, never sequence
    lengths: a new length neither recompiles nor re-tunes) and the pruning to the call's class."""
    kind = _kind(kernel_name)
    return list(_configs(kind)), _TUNE_KEY, functools.partial(_prune, kind)


KERNELS = KernelFamily("flash_attention", ("attnops.ops.common.triton.fwd",
                                           "attnops.ops.common.triton.bwd",
                                           "attnops.ops.common.triton.prepare"), _tile_configs, _autotuning)


def token_view(x: torch.Tensor, p: FAProblem, heads: int) -> torch.Tensor:
    """``x`` as ``[B, S, N, D]`` / ``[T, N, D]`` with a unit last stride (copied only when it has none)."""
    return tokens_view(unit_last_stride(x), p.layout, heads)


def _operand(p: FAProblem, x: torch.Tensor, kv: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``x`` (copied only without a unit last stride) and the (batch, token, head) strides at which the kernels
    address it, with the query's heads or the key's (``kv``): those of :func:`token_view` (TND: batch stride 0,
    tokens addressed by offsets), without making the view."""
    x = unit_last_stride(x)
    return x, token_strides(x, p.layout, p.geom.n2 if kv else p.geom.n1)


def _stat_row(p: FAProblem) -> int:
    """Elements between consecutive rows of a head in the statistics buffers (8 lanes per row)."""
    return p.geom.n1 * STAT_LANES if p.seq.packed and p.softmax_layout == "TND" else STAT_LANES


def stats_geometry(p: FAProblem) -> tuple[list[int], list[int], int]:
    """Per-batch (element offset, head stride) and the row stride of the statistics buffers (8 lanes per row), for
    host lengths."""
    seq, n1 = p.seq, p.geom.n1
    if not seq.packed:
        return ([b * n1 * seq.max_q * STAT_LANES for b in range(seq.batch)], [seq.max_q * STAT_LANES] * seq.batch,
                STAT_LANES)
    base = [s * n1 * STAT_LANES for s in seq.q_starts]
    if p.softmax_layout == "TND":
        return base, [STAT_LANES] * seq.batch, _stat_row(p)
    return base, [sq * STAT_LANES for sq in seq.q_lens], STAT_LANES


def _slopes(p) -> bool:
    return p.pse is not None and p.pse.kind == "slopes"


def _meta_rows(p: FAProblem) -> torch.Tensor:
    """The metadata rows of host lengths, on the host."""
    seq, mask = p.seq, p.mask
    stat_base, stat_head, _ = stats_geometry(p)
    slopes = _slopes(p)
    rows = []
    for b in range(seq.batch):
        qs, ks = (seq.q_starts[b], seq.kv_starts[b]) if seq.packed else (0, 0)
        rows.append([qs, ks, seq.q_lens[b], seq.kv_lens[b], max(mask.lo[b], -INF), min(mask.hi[b], INF),
                     mask.prefix[b] if mask.prefix is not None else 0,
                     p.dropout.block_offsets[b] if p.dropout is not None else 0,
                     p.pse.q_start[b] if slopes else 0, p.pse.kv_start[b] if slopes else 0,
                     stat_base[b], stat_head[b]])
    return torch.tensor(rows, dtype=torch.int64).reshape(seq.batch, 12)


def batch_meta(p: FAProblem, device: torch.device) -> torch.Tensor:
    """The int64 ``[B, 12]`` per-batch metadata (columns ``common.META_FIELDS``) of a problem with host lengths,
    built and uploaded (pinned, non-blocking) once per batch composition: a repeated call reuses the same device
    tensor (never written to)."""
    seq, mask = p.seq, p.mask
    slopes = _slopes(p)
    key = ("flash_attention.meta", seq, mask.lo, mask.hi, mask.prefix,
           p.dropout.block_offsets if p.dropout is not None else None,
           (p.pse.q_start, p.pse.kv_start) if slopes else None, p.softmax_layout, p.geom.n1)
    return staging.cached_upload(key, lambda: _meta_rows(p), torch.int64, device)


_SPECIAL = {None: 0, "last": 1, "first": 2}  # prepare.SPECIAL_*


def _prepare_launch(p: FAProblem, meta: torch.Tensor) -> Launch:
    """The prepare kernel's launch filling ``meta`` (``[B + 1, 12]``) from the ``cu_seqlens`` tensors."""
    seq, band, device = p.seq, p.mask.band, meta.device
    prefix = p.mask.prefix
    prefix_t = placeholder(device, torch.int64) if prefix is None else staging.cached_upload(
        ("flash_attention.prefix", prefix), lambda: list(prefix), torch.int64, device)
    slopes = _slopes(p)
    q_start, kv_start = p.pse.start_idx if slopes else (0, 0)
    return Launch("prepare_kernel", (1,),
                  (meta, seq.cu_q, seq.cu_kv, prefix_t, seq.batch, p.total_q, p.total_kv, seq.max_q, seq.max_kv,
                   p.geom.n1, band.lo, band.hi, band.special_lo, band.special_hi, q_start, kv_start, INF),
                  dict(LO_DELTA=band.lo_delta, HI_DELTA=band.hi_delta, SPECIAL=_SPECIAL[band.special],
                       HAS_PREFIX=prefix is not None, SLOPES=_slopes_mode(p.pse) if slopes else 0,
                       STATS_TND=p.softmax_layout == "TND"))


def _slopes_mode(pse) -> int:
    """The prepare kernel's ``SLOPES`` for ALiBi slopes ``pse`` (prepare.SLOPES_*)."""
    return 3 if pse.bottom_right else 2 if pse.first_batch_only else 1


def _device_metadata(p: FAProblem, device: torch.device) -> tuple[torch.Tensor | None, list[Launch]]:
    """For device lengths, the per-batch metadata to fill and the prepare kernel's launch filling it (its extra last
    row holds the ends of the sequences); ``(None, [])`` for host lengths (:func:`batch_meta`)."""
    if not p.device_lengths:
        return None, []
    meta = torch.empty((p.seq.batch + 1, 12), dtype=torch.int64, device=device)
    return meta, [_prepare_launch(p, meta)]


def _tails(p: FAProblem, meta: torch.Tensor, side: int, fills) -> list[Launch]:
    """Fill the rows of the TND tokens past every sequence (``side`` 0: query tokens, 1: key/value tokens) of the
    contiguous buffers in ``fills`` (``(buffer, value)`` pairs): in place for host lengths, else as tail kernel
    launches that read the ends the prepare kernel wrote."""
    if not p.seq.packed:
        return []
    if not p.device_lengths:
        end = sum(p.seq.kv_lens if side else p.seq.q_lens)
        for buf, value in fills:
            if end < buf.shape[0]:
                buf[end:].fill_(value)
        return []
    end_col = side  # the metadata row past the last batch holds the query end in column 0, the key end in 1
    return [Launch("tail_kernel", (min(cdiv(buf.numel(), TAIL_BLOCK), TAIL_PROGRAMS),),
                   (buf, meta, end_col, p.seq.batch, buf.numel(), buf.numel() // buf.shape[0], value), {})
            for buf, value in fills if buf.numel() > 0]


def _grid(rows: int, batch: int, heads: int) -> tuple[tuple[int, int, int], dict]:
    """Rows along axis 0, ``batch x heads`` along axis 1, folded into axes 1 and 2 (at most ``MAX_GRID_Y`` programs
    each) when there are more pairs (``FOLD``: the kernels compile without the fold's arithmetic otherwise)."""
    return fold_grid(rows, batch * heads, MAX_GRID_Y)


def pse_args(p: FAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/strides of the pse source and its kernel flags (``p``: any problem with a ``PseSpec`` ``pse``, the
    FusedInferAttention one too)."""
    pse = p.pse
    if pse is None:
        return [dummy, 0, 0, 0, 0], dict(PSE=0, PSE_BEFORE_SCALE=False)
    t = (pse.padded() if pse.flattened else pse.tensor).to(device)
    if pse.kind == "slopes":
        t = t.contiguous()
        sb = t.stride(0) if t.dim() == 2 else 0
        return [t, sb, t.stride(-1), 0, 0], dict(PSE=4 + (pse.pse_type == 3), PSE_BEFORE_SCALE=False)
    t = t if t.stride(-1) == 1 else t.contiguous()
    return ([t, t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2), t.shape[-1]],
            dict(PSE=_PSE_KINDS[pse.kind], PSE_BEFORE_SCALE=pse.add_before_scale))


ALIBI_COPIES = 8  # shifted copies of the ALiBi-compressed pse's row 1023: 16 bytes of fp16/bf16
PSE_ALIBI_COPIES = 6  # common.PSE_ALIBI_COPIES


def alibi_copies(p: FAProblem, device: torch.device) -> list:
    """The forward's pse arguments for the ALiBi-compressed pse: its row 1023 (``[Bp, N1, W]``) as
    ``[Bp, N1, 8, L]`` copies, copy ``k`` shifted right by ``k`` elements and zero elsewhere, so that the kernel
    reads each score row's diagonal run ``W - 1 - r + c0 ..`` from the copy where it starts 16-byte aligned (a
    vector load; the tensor itself gives every row another alignment). ``L`` covers the largest aligned start
    plus a tile of 128 columns, so the reads need no column mask."""
    row = p.pse.tensor.to(device)[:, :, ALIBI_ROWS - 1, :]
    w = row.shape[-1]
    length = -(-(w + ALIBI_COPIES + 128) // 16) * 16
    copies = row.new_zeros((row.shape[0], row.shape[1], ALIBI_COPIES, length))
    for k in range(ALIBI_COPIES):
        copies[:, :, k, k:k + w] = row
    return [copies, copies.stride(0) if copies.shape[0] > 1 else 0, copies.stride(1), copies.stride(2), w]


def mask_args(p: FAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/strides of the explicit mask (bool read as uint8, broadcast dims at stride 0) and its kernel flag
    (``p``: any problem with a ``MaskSpec`` ``mask``, the FusedInferAttention one too); a formula mask
    (``masks.StridedCausal``) passes its stride and shift in the stride slots instead, and reads no tensor."""
    strided, e = p.mask.strided, p.mask.explicit
    if strided is not None:
        return [dummy, 0, strided.shift, strided.stride], dict(HAS_EXPLICIT=MASK_STRIDED_CAUSAL)
    if e is None:
        return [dummy, 0, 0, 0], dict(HAS_EXPLICIT=False)
    e = e.to(device)
    e = (e if e.stride(-1) == 1 else e.contiguous()).view(torch.uint8)
    return ([e, e.stride(0) if e.shape[0] > 1 else 0, e.stride(1) if e.shape[1] > 1 else 0, e.stride(2)],
            dict(HAS_EXPLICIT=True))


def packed_words(packed: torch.Tensor) -> torch.Tensor:
    """A packed dropout mask (uint8, LSB first) as the int32 words the kernels read (``common.dropout_scale``): a
    view when it is contiguous and whole words long and aligned, else a zero-padded copy (zero bits drop, as the
    bytes past the mask do)."""
    flat = packed.reshape(-1)
    if flat.numel() % 4 == 0 and flat.storage_offset() % 4 == 0:
        return flat.view(torch.int32)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % 4)]).view(torch.int32)


def _explicit_cols(p: FAProblem) -> int:
    """The columns of the explicit mask tensor (0 without one): the forward's load bound for it."""
    return 0 if p.mask.explicit is None else p.mask.explicit.shape[-1]


def _dropout_args(p: FAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Dropout pointer and scalars: Philox ``(seed, offset)``, or a packed mask as int32 words with their number (the
    kernels read no word past them)."""
    d = p.dropout
    if d is None:
        return [dummy, 1.0, 0, 0], dict(DROPOUT=0)
    if d.packed is not None:
        words = packed_words(d.packed.to(device))
        return [words, d.keep_prob, 0, words.numel()], dict(DROPOUT=2)
    return [dummy, d.keep_prob, d.seed, d.offset], dict(DROPOUT=1)


def _common(p: FAProblem, query: torch.Tensor, interpret: bool):
    """Arguments shared by the score-computing kernels: pse, explicit mask, dropout and compile-time flags."""
    device = query.device
    dummy = placeholder(device, torch.uint8)
    pse, pse_flags = pse_args(p, device, dummy)
    mask, mask_flags = mask_args(p, device, dummy)
    drop, drop_flags = _dropout_args(p, device, dummy)
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
    meta, launches = _device_metadata(p, device)
    launches += _tails(p, meta, 0, ((out, 0.0), (smax, FLT_LOWEST), (ssum, FLT_MAX)))
    if seq.batch == 0:
        return (out, smax, ssum), launches
    (q, qs), (k, ks), (v, vs) = _operand(p, query), _operand(p, key, kv=True), _operand(p, value, kv=True)

    def build():
        table = batch_meta(p, device) if meta is None else meta
        pse, mask, drop, flags = _common(p, query, interpret)
        if flags["PSE"] == _PSE_KINDS["alibi"]:
            pse, flags["PSE"] = alibi_copies(p, device), PSE_ALIBI_COPIES
        grid, fold = _grid(seq.max_q, seq.batch, g.n1)
        return [("fwd_kernel", grid,
                 (table, *qs, *ks, *vs, *_operand(p, out)[1], _stat_row(p), *pse, *mask, _explicit_cols(p), *drop,
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
    meta, launches = _device_metadata(p, device)
    launches += _tails(p, meta, 0, ((dq, 0.0),)) + _tails(p, meta, 1, ((dk, 0.0), (dv, 0.0)))
    if seq.batch == 0:
        return (dq, dk, dv, dpse_buf), launches
    (q, qs), (k, ks), (v, vs) = _operand(p, query), _operand(p, key, kv=True), _operand(p, value, kv=True)
    (do, dos), (o, os_) = _operand(p, dy), _operand(p, attention_in)
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
        dqs, dks, dvs = _operand(p, dq)[1], _operand(p, dk, kv=True)[1], _operand(p, dv, kv=True)[1]
        delta_sb = 0 if seq.packed else seq.max_q
        q_grid, q_fold = _grid(seq.max_q, seq.batch, g.n1)
        kv_grid, kv_fold = _grid(splits, seq.batch, g.n1)
        pse, mask, drop, flags = _common(p, query, interpret)
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
                       kv_parts[1], _stat_row(p), delta_sb, *scores, *dpse, p.scale, p.softcap, g.n1, g.group, splits,
                       g.d, g.dv,
                       seq.batch, MAX_GRID_Y), dict(DPSE_FULL=full, DPSE_ROW=row, DQ=fused, **flags, **kv_fold),
                      None)]
        if fused:
            templates.append(_grad_sum(splits, dq.numel(), p.scale))
        else:
            templates.append(("dq_kernel", q_grid,
                              (table, *qs, *ks, *vs, *dos, *dqs, _stat_row(p), delta_sb, *scores, p.scale,
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
