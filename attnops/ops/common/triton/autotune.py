"""Tiles of the Triton FlashAttention kernels: the candidate tables per kernel kind, operand bytes and head-dim
class, the interpreter's fixed tiles, autotuning keys and pruning, and the kernel family (:data:`KERNELS`)."""
from __future__ import annotations

import functools
from collections.abc import Callable

from ...._core.triton.launch import KernelFamily, Launch, pow2

INTERPRET_BLOCK = 16
_TUNE_KEY = ["head_d", "head_dv", "group", "PSE", "HAS_EXPLICIT", "DROPOUT", "SOFTCAP"]


# Autotuning candidates (BLOCK_M, BLOCK_N, warps, stages) per (kernel kind, operand bytes, D > 128), chosen from the
# compiler's figures (AOT compile, docs/triton.md): each fits sm_80's 163 KB and sm_90's 227 KB of shared memory per
# block and spills little (tests/ops/flash_attention/triton/test_gpu_compile.py asserts both for every candidate).
# fp32 dots are IEEE (FMA, no tensor cores): their operands take twice the bytes, hence fewer, smaller tiles. The
# third width class, ``WIDEST`` (:func:`_class_key`): the backward's 64-key blocks of D <= 192 / Dv <= 128 (wgmma)
# and the forward's 64-row tiles with every feature do not fit the registers with D = Dv = 256. The backward above
# D=128 takes 32-key blocks (mma.sync but the dQ product) in the pass of GPUs before sm_90 (no dQ in it); the pass
# with dQ in it splits its head-dim columns instead (``_SPLIT_GRAD_TILES``: 64-key blocks unsplit spill 4 words at
# D=192/Dv=128 with Triton 3.9, 10 with 3.6, 40-134 at D=256). The fp32 pass (dQ in it) steps 16 query rows over 32
# keys, 16 keys above D=128: 32 x 32 spilled 2 words at D=128 and 16 x 32 4 words at D=256 on sm_90 with Triton 3.9
# (with per-element features 32 x 32 stays: 16 x 32 spills 6 words with 3.6). The fp32 forward at D <= 128 takes
# 16 x 16 tiles: 16 x 32 spilled 2-4 words in NSA's compressed attention (its causal-block rule) under ptxas's
# 80-register choice at 8 warps (sm_90 with Triton 3.6 in two stages, sm_80 with 3.9 in one). At D = Dv = 256 it
# takes 16 x 16 tiles at 4 warps: 16 x 32 at 8 warps spills 6-8 words on sm_80 (128 registers), 32 x 16 6 with 3.6.
WIDEST = 2
_TILES = {
    ("fwd", 2, False): [(64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    ("fwd", 2, True): [(64, 32, 8, 2), (64, 16, 8, 2)],
    ("fwd", 2, WIDEST): [(64, 32, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, False): [(16, 16, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2)],
    ("fwd", 4, True): [(16, 32, 8, 1), (32, 16, 8, 1)],
    ("fwd", 4, WIDEST): [(16, 16, 4, 1), (16, 32, 8, 1), (32, 16, 8, 1)],
    ("bwd", 2, False): [(32, 64, 8, 2), (64, 64, 8, 2)],
    ("bwd", 2, True): [(32, 32, 8, 2), (16, 64, 8, 2)],
    ("bwd", 2, WIDEST): [(32, 32, 8, 2), (16, 64, 8, 2)],
    ("bwd", 4, False): [(16, 32, 8, 1), (32, 32, 8, 1)],
    ("bwd", 4, True): [(16, 16, 8, 1), (16, 32, 8, 1)],
    ("bwd", 4, WIDEST): [(16, 16, 8, 1), (16, 32, 8, 1)],
}
# No 16-bit tiles of 128 columns at D <= 128: the forward's 128 x 128 with 8 warps in two stages spill on sm_90 (248
# words at D=128 with Triton 3.6; 146 at D=64 and 210 at D=128 with 3.9), the dK/dV pass's 32 x 128 on sm_80
# (686-824 words at D=128).
# Triton 3.6 allocates the 16-bit forward differently from 3.9: at D <= 128 its 64x64 tiles spill 2 words on sm_90
# in three stages (255 registers), none in two; at D = Dv = 256 64x32 tiles spill 6 words on sm_80 (mma.sync),
# 64x16 none on either target (66 wgmma on sm_90). 3.9 compiles the ``_TILES`` defaults spill-free. Under Triton
# before 3.7 these replace the ``_TILES`` entries.
_TILES_BEFORE_TRITON_3_7 = {("fwd", 2, False): [(64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
                            ("fwd", 2, WIDEST): [(64, 16, 8, 2), (64, 32, 8, 2)]}
# With a softcap (``SOFTCAP``, no per-element feature) Triton 3.6's 64x64 forward tiles at D <= 128 spill 2 words on
# sm_90 in two or three stages (4 in one), 64x32 none (190 registers, 36 wgmma); 3.9 compiles the 64x64 ones
# spill-free. Before Triton 3.7 these replace the class's tiles for softcapped calls.
_SOFTCAP_TILES_BEFORE_TRITON_3_7 = {("fwd", 2, False): [(64, 32, 8, 2), (64, 64, 8, 2)]}
# The fp32 dQ kernel (the backward's form before sm_90) without per-element features: 16 query rows x 32 keys spill
# 2 words on sm_80 (80 registers, Triton 3.6 and 3.9), 32 x 32 none (108).
_DQ_KERNEL_TILES = {("bwd", 4, False): [(32, 32, 8, 1), (16, 32, 8, 1)]}
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
    ("bwd", 4, False): [(32, 32, 8, 1)],
    ("fwd", 4, True): [(16, 32, 8, 1), (32, 16, 8, 1)],
    ("bwd", 2, False): [(16, 64, 8, 2), (32, 64, 8, 2)],
    ("bwd", 2, True): [(16, 16, 8, 2), (16, 32, 8, 1)],
    ("bwd", 2, WIDEST): [(16, 16, 8, 2), (16, 32, 8, 1)],
}
# The dK/dV pass of GPUs before sm_90 (no dQ in the pass, ``DQ`` False: mma.sync, operands in registers) with
# per-element features: its 64-key blocks spill 4-20 words at D <= 128 (sm_80), 32-key blocks none.
_SPLIT_FEATURE_TILES = {("bwd", 2, False): [(16, 32, 8, 2), (32, 32, 8, 2)]}
# Triton 3.6 pipelines the dK/dV pass with every feature at D=128 differently from 3.9: two stages spill 14 words
# on sm_90 with 3.6, one stage none; with 3.9 two stages spill 4 words, one 20, and no other wgmma tile fits (the
# fast-path rules exempt it). Under Triton before 3.7 (3.6 is what the GPU machines carry; 3.7 and 3.8 were not
# compiled) these replace the ``_FEATURE_TILES`` entries.
_FEATURE_TILES_BEFORE_TRITON_3_7 = {("bwd", 2, False): [(16, 64, 8, 1), (16, 64, 8, 2)]}
# The dK/dV pass with dQ in it (sm_90) above D=128 without per-element features, 16-bit inputs: the head-dim columns
# of dK, dV and dQ in two programs per key block (``GRAD_PARTS``, :func:`grad_parts`), whose 64-key blocks (wgmma)
# fit the registers: 16 query rows x 64 keys, 8 warps. Without the split any 64-key block spills (40-134 words at
# D=256); split in two, two stages spill none with Triton 3.9 (254 registers at D=256 and at D=192/Dv=128) but 8
# words with 3.6, one stage none with 3.6 and 4-34 with 3.9, 32 query rows up to 30 words. With a pse, an explicit
# mask or dropout the split 64-key blocks spill with one of the two Tritons (4-82 words; 20-60 in four parts).
_SPLIT_GRAD_TILES = {("bwd", 2, True): [(16, 64, 8, 2), (16, 64, 8, 1)],
                     ("bwd", 2, WIDEST): [(16, 64, 8, 2), (16, 64, 8, 1)]}
_SPLIT_GRAD_TILES_BEFORE_TRITON_3_7 = {key: [(16, 64, 8, 1), (16, 64, 8, 2)] for key in _SPLIT_GRAD_TILES}
SPLIT_GRAD_PARTS = 2
PREPROCESS_ELEMENTS = 64 * 128  # rows x Dv of one preprocess program: two fp32 tiles within the register file
PREPARE_BATCHES = 256  # batches per step of the prepare kernel (one program)
TAIL_BLOCK, TAIL_PROGRAMS = 1024, 1024  # elements per step and programs of the tail and grad-sum kernels (grid-stride)



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
    tiles = {t: None for table in (_tiles(), _feature_tiles(), _SPLIT_FEATURE_TILES, _split_grad_tiles(),
                                   _DQ_KERNEL_TILES, _SOFTCAP_TILES_BEFORE_TRITON_3_7)
             for key, ts in table.items()
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


def per_element_features(constexprs: dict) -> bool:
    """Whether a pse, an explicit mask or dropout adds per-element tiles (registers and shared memory)."""
    return bool(constexprs["PSE"] or constexprs["HAS_EXPLICIT"] is True or constexprs["DROPOUT"])


def grad_parts(d: int, dv: int, element_size: int, dq_in_pass: bool, constexprs: dict) -> int:
    """``GRAD_PARTS`` of the dK/dV pass (programs per key block, each with its part of the head-dim columns):
    ``SPLIT_GRAD_PARTS`` for 16-bit inputs above D=128 or Dv=128 with dQ in the pass and no per-element features
    (``_SPLIT_GRAD_TILES``), else 1."""
    split = dq_in_pass and element_size == 2 and max(d, dv) > 128 and not per_element_features(constexprs)
    return SPLIT_GRAD_PARTS if split else 1


def _class_tiles(key: tuple, constexprs: dict) -> list:
    """The tiles of a call's class (:func:`_class_key`) in the table's order: ``_FEATURE_TILES`` when a pse, an
    explicit mask or dropout adds per-element tiles (registers and shared memory, docs/triton.md; with 16-bit
    operands NSA's strided causal rule too: the plain 64 x 64 tiles spill 2-4 words with it on sm_90, while fp32's
    plain tiles do not and its feature tile spills 4 words on sm_80) and the class has some
    (``_SPLIT_FEATURE_TILES`` for the dK/dV pass without dQ), the split pass's ``_SPLIT_GRAD_TILES``
    (``GRAD_PARTS`` > 1), ``_DQ_KERNEL_TILES`` for the dQ kernel (no ``DQ`` flag) and before Triton 3.7
    ``_SOFTCAP_TILES_BEFORE_TRITON_3_7`` for a softcap where the class has some, else ``_TILES``."""
    if constexprs.get("GRAD_PARTS", 1) > 1:
        return _split_grad_tiles()[key]
    explicit = constexprs["HAS_EXPLICIT"] is True or (constexprs["HAS_EXPLICIT"] and key[1] == 2)
    if not (constexprs["PSE"] or explicit or constexprs["DROPOUT"]):
        if "DQ" not in constexprs and key[0] == "bwd" and key in _DQ_KERNEL_TILES:
            return _DQ_KERNEL_TILES[key]
        if constexprs.get("SOFTCAP") and _before_triton_3_7() and key in _SOFTCAP_TILES_BEFORE_TRITON_3_7:
            return _SOFTCAP_TILES_BEFORE_TRITON_3_7[key]
        return _tiles()[key]
    if constexprs.get("DQ", True) is False and key in _SPLIT_FEATURE_TILES:
        return _SPLIT_FEATURE_TILES[key]
    return _feature_tiles().get(key, _tiles()[key])


@functools.cache
def _before_triton_3_7() -> bool:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)


@functools.cache
def _tiles() -> dict:
    """``_TILES`` for the installed Triton (``_TILES_BEFORE_TRITON_3_7`` over it before 3.7)."""
    return {**_TILES, **_TILES_BEFORE_TRITON_3_7} if _before_triton_3_7() else _TILES


@functools.cache
def _feature_tiles() -> dict:
    """``_FEATURE_TILES`` for the installed Triton (``_FEATURE_TILES_BEFORE_TRITON_3_7`` over it before 3.7)."""
    return {**_FEATURE_TILES, **_FEATURE_TILES_BEFORE_TRITON_3_7} if _before_triton_3_7() else _FEATURE_TILES


@functools.cache
def _split_grad_tiles() -> dict:
    """``_SPLIT_GRAD_TILES`` for the installed Triton (``_SPLIT_GRAD_TILES_BEFORE_TRITON_3_7`` before 3.7)."""
    return _SPLIT_GRAD_TILES_BEFORE_TRITON_3_7 if _before_triton_3_7() else _SPLIT_GRAD_TILES


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

