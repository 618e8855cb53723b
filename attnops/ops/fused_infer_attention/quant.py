"""FIA quantization: int8 rounding, CAST_ROUND casts, UINT64 deq-scale decoding, int4 packing, KV antiquant and the
parameters of the int8 full-quant chain and of the int8 output (``cann_semantics.md`` §6.6, §6.7, §6.10).

Rounding (``DECISIONS.md``): quantization to int8 rounds half to even and saturates to ``[-128, 127]``; casts the
NPU does with CAST_ROUND (the fp16/bf16 attention output) round half away from zero.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import Described, check_int, check_tensor, describe, require
from ..common.npu_rounding import NpuRounding, cast_round, cast_round_int8

_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def quantize_int8(x: Tensor) -> Tensor:
    """``sat_int8(round_half_even(x))`` (AscendQuant), with the NPU's float-to-integer conversion of non-finite
    values: NaN gives 0, +-inf saturate to 127 / -128."""
    return torch.round(x).nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)


def decode_deq_scale(t: Tensor) -> float:
    """A per-tensor deq scale as a float: FLOAT32 as given; UINT64 (or the same bits in INT64) decoded from the
    ``npu_trans_quant_param`` encoding, i.e. the fp32 bits in the low 32 bits truncated to 19 bits."""
    value = t.reshape(-1)[:1].tolist()[0]
    if t.dtype.is_floating_point:
        return float(value)
    return struct.unpack("<f", struct.pack("<I", int(value) & 0xFFFFE000))[0]


def unpack_int4(x: Tensor) -> Tensor:
    """int32 ``[..., K]`` of 8 two's-complement nibbles each (element 0 in bits 0-3) -> int8 ``[..., 8K]``."""
    v = (x.unsqueeze(-1) >> _NIBBLE_SHIFTS.to(x.device)) & 0xF
    return ((v ^ 8) - 8).to(torch.int8).flatten(-2)


def pack_int4(x: Tensor) -> Tensor:
    """Integer values in ``[-8, 7]``, last dim a multiple of 8 -> int32 ``[..., K/8]`` (inverse of unpack_int4)."""
    nibbles = (x.to(torch.int64) & 0xF).unflatten(-1, (-1, 8)) << _NIBBLE_SHIFTS.to(x.device, torch.int64)
    words = nibbles.sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@dataclass(frozen=True)
class Antiquant:
    """Dequantization ``x = (x_q + offset) * scale`` of the key or the value (offset None: symmetric).

    ``kind`` and the normalized fp32 parameter shapes: ``static`` ``[1, N2|1, 1, D|1]`` (per-tensor, per-channel,
    per-tensor+head), ``token`` ``[B, N2|1, S]`` (per-token, per-token+head; S = per-token position),
    ``page`` ``[blocknum, N2|1, blocksize]`` (page-managed per-token, per-token+head).
    """

    kind: str
    scale: Tensor
    offset: Tensor | None = None

    def factors(self, b: int, pos: int, block: int | None, runs: int, length: int):
        """``(scale, offset)`` broadcastable to a KV run ``[R, N2, L, D]`` of batch ``b`` whose tokens have per-token
        positions ``pos .. pos + R*L`` and live in physical blocks ``block .. block + R`` (page kinds)."""
        return tuple(None if t is None else self._slice(t, b, pos, block, runs, length)
                     for t in (self.scale, self.offset))

    def _slice(self, t: Tensor, b: int, pos: int, block: int | None, runs: int, length: int) -> Tensor:
        if self.kind == "static":
            return t
        if self.kind == "token":
            x = t[b, :, pos:pos + runs * length].unflatten(-1, (runs, length)).transpose(0, 1)
        else:
            x = t[block:block + runs, :, :length]
        return x.unsqueeze(-1)

    def apply(self, x: Tensor, b: int, pos: int, block: int | None, rounding: NpuRounding | None = None) -> Tensor:
        """Dequantize a run ``[R, N2, L, D]`` (int8, or int32-packed int4 ``[R, N2, L, D/8]``) to fp32. Under an
        NPU ``rounding`` as PFA's AscendAntiQuant: fp16 rounds after the offset and after the scale, bf16 once at
        the end."""
        if x.dtype == torch.int32:
            x = unpack_int4(x)
        scale, offset = self.factors(b, pos, block, x.shape[0], x.shape[2])
        y = x.to(torch.float32)
        half = rounding is not None and rounding.dtype == torch.float16
        if offset is not None:
            y = y.add_(offset)
            if half:
                rounding.grid_(y)
        y = y.mul_(scale)
        return y if rounding is None else rounding.grid_(y)


@dataclass(frozen=True)
class Int8Chain:
    """Per-tensor parameters of the int8 full-quant chain (§6.7): ``S = (Q_i8 K_i8^T) * deq_scale1`` (then scale,
    pse, mask), ``P_i8 = sat_int8(round(exp(S - rowmax) * quant_scale1))``,
    ``O = (P_i8 V_i8) * deq_scale2 / rowsum(exp(S - rowmax))``. The validated ``[1]`` tensors are kept as given
    and read when a value is asked for (a device tensor is not read while a call is only being checked)."""

    deq_scale1_tensor: Tensor
    quant_scale1_tensor: Tensor
    deq_scale2_tensor: Tensor

    @property
    def deq_scale1(self) -> float:
        return decode_deq_scale(self.deq_scale1_tensor)

    @property
    def quant_scale1(self) -> float:
        return float(self.quant_scale1_tensor.reshape(-1)[0])

    @property
    def deq_scale2(self) -> float:
        return decode_deq_scale(self.deq_scale2_tensor)


@dataclass(frozen=True)
class OutputQuant:
    """Int8 output ``sat_int8(round_half_even(O * scale + offset))``; ``scale``/``offset`` fp32 ``[1, 1]``
    (per-tensor) or ``[N1, Dv]`` (per-channel), broadcast over ``[S, N1, Dv]`` rows."""

    scale: Tensor
    offset: Tensor | None

    def apply(self, o: Tensor, rounding: NpuRounding | None = None) -> Tensor:
        """The int8 output of fp32 ``o``; under an NPU ``rounding`` through fp16 as the kernel does (fp32 -> fp16
        CAST_ROUND -> int8 CAST_ROUND, saturating)."""
        y = o * self.scale
        y = y if self.offset is None else y.add_(self.offset)
        return quantize_int8(y) if rounding is None else cast_round_int8(cast_round(y, torch.float16).float())


def _scalar_param(name: str, t, dtypes) -> Tensor:
    require(t is not None, name, "a per-tensor [1] tensor (required by this quantization scenario)", None)
    check_tensor(name, t, dtypes=dtypes)
    require(t.numel() == 1, name, "a per-tensor scale of shape [1]", t)
    return t


def build_int8_chain(deq_scale1, quant_scale1, deq_scale2) -> Int8Chain:
    """Validate the int8 full-quant parameters (all three required, per-tensor; deq scales UINT64 or FLOAT32)."""
    deq = (torch.uint64, torch.int64, torch.float32)
    return Int8Chain(_scalar_param("deq_scale1", deq_scale1, deq),
                     _scalar_param("quant_scale1", quant_scale1, (torch.float32,)),
                     _scalar_param("deq_scale2", deq_scale2, deq))


def build_output_quant(quant_scale2, quant_offset2, *, n1: int, dv: int, query_dtype: torch.dtype
                       ) -> OutputQuant | None:
    """Validate ``quant_scale2``/``quant_offset2``: per-tensor (one element) or per-channel (``N1*Dv`` elements,
    any shape, e.g. ``[1, 1, H]``, ``[1, N, 1, D]``, ``[N, D]``); FLOAT32, or BFLOAT16 with a bf16 query; the offset
    optional, of the scale's shape and dtype."""
    if quant_scale2 is None:
        require(quant_offset2 is None, "quant_offset2", "None without quant_scale2", quant_offset2)
        return None
    dtypes = (torch.float32, torch.bfloat16) if query_dtype == torch.bfloat16 else (torch.float32,)
    check_tensor("quant_scale2", quant_scale2, dtypes=dtypes)
    require(quant_scale2.numel() in (1, n1 * dv), "quant_scale2",
            f"1 element (per-tensor) or N*D = {n1}*{dv} elements (per-channel)", quant_scale2)
    if quant_offset2 is not None:
        check_tensor("quant_offset2", quant_offset2, dtypes=(quant_scale2.dtype,), shape=tuple(quant_scale2.shape))
    shape = (1, 1) if quant_scale2.numel() == 1 else (n1, dv)
    return OutputQuant(quant_scale2.reshape(shape).float(),
                       None if quant_offset2 is None else quant_offset2.reshape(shape).float())


@dataclass(frozen=True)
class AntiquantGeometry:
    """What antiquant parameter shapes are checked against."""

    n2: int
    d: int  # key head dim
    dv: int  # value head dim
    batch: int
    positions: int  # least S of per-token parameters
    pages: tuple[int, int] | None  # (blocknum, blocksize) of a paged cache
    param_dtype: torch.dtype  # dtype of per-channel / per-tensor / per-head parameters (the query's)
    decode: bool


def _per_token_s(name: str, t: Tensor, shape_ok: bool, want: str, geo: AntiquantGeometry) -> None:
    require(shape_ok and t.shape[-1] >= geo.positions, name, f"{want} with S >= {geo.positions} (per-token)", t)


def _normalize(name: str, t: Tensor, mode: int, geo: AntiquantGeometry, combined: bool, d: int
               ) -> tuple[str, Tensor]:
    """Validate one antiquant parameter of ``mode`` for head dim ``d`` and return ``(kind, fp32 tensor in the
    kind's shape)``."""
    n, b = geo.n2, geo.batch
    if mode in (0, 2):
        check_tensor(name, t, dtypes=(geo.param_dtype,))
        if mode == 2:
            require(tuple(t.shape) == (n,), name, f"shape (N={n}) (per-tensor + per-head)", t)
            return "static", t.float().reshape(1, n, 1, 1)
        channel = [(n, 1, d), (n, d), (n * d,)] + ([] if combined else [(1, n, 1, d), (1, n, d), (1, n * d)])
        if tuple(t.shape) in channel:
            return "static", t.float().reshape(1, n, 1, d)
        tensor_ok = tuple(t.shape) == (() if combined else (1,)) and (combined or geo.decode)
        want = ", ".join(str(s) for s in channel) + (" or () per-tensor" if combined else
                                                     " or (1) per-tensor (Q_S = 1)" if geo.decode else "")
        require(tensor_ok, name, f"a per-channel shape (N={n}, D={d}: {want})", t)
        return "static", t.float().reshape(1, 1, 1, 1)
    check_tensor(name, t, dtypes=(torch.float32,))
    shape = tuple(t.shape)
    if mode == 1:
        ok = (len(shape) == 2 and shape[0] == b) or (not combined and len(shape) == 3 and shape[:2] == (1, b))
        _per_token_s(name, t, ok, f"(B={b}, S)" + ("" if combined else f" or (1, B={b}, S)"), geo)
        return "token", t.reshape(b, 1, shape[-1])
    if mode == 3:
        _per_token_s(name, t, len(shape) == 3 and shape[:2] == (b, n), f"(B={b}, N={n}, S)", geo)
        return "token", t
    require(geo.pages is not None, name, f"page-managed scales (mode {mode}) only with block_table", t)
    blocks, bs = geo.pages
    want = (blocks, bs) if mode == 4 else (blocks, n, bs)
    require(shape == want, name, f"shape {want} (blocknum, {'' if mode == 4 else 'N, '}blocksize)", t)
    return "page", t.reshape(blocks, -1, bs)


def _antiquant(names: tuple[str, str], scale: Tensor, offset: Tensor | None, mode: int, geo: AntiquantGeometry,
               combined: bool, d: int) -> Antiquant:
    kind, s = _normalize(names[0], scale, mode, geo, combined, d)
    if offset is None:
        return Antiquant(kind, s)
    check_tensor(names[1], offset)
    require(offset.shape == scale.shape, names[1], f"the shape of {names[0]} {list(scale.shape)}", offset)
    return Antiquant(kind, s, _normalize(names[1], offset, mode, geo, combined, d)[1])


def build_kv_antiquant(*, antiquant_scale, antiquant_offset, antiquant_mode, key_antiquant_scale,
                       key_antiquant_offset, value_antiquant_scale, value_antiquant_offset, key_antiquant_mode,
                       value_antiquant_mode, geo: AntiquantGeometry, int4: bool
                       ) -> tuple[Antiquant, Antiquant, bool]:
    """The key and value dequantization of an int8/int4 KV, and whether the separate K/V parameters were used.

    Separate parameters (key/value_antiquant_*, modes 0-5) win over the combined ``antiquant_scale``/``offset``
    (first dim 2: key, value; ``antiquant_mode`` 0 per-channel/per-tensor, 1 per-token; Q_S > 1 ignores the mode).
    """
    check_int("antiquant_mode", antiquant_mode, lo=0, hi=1)
    kmode = check_int("key_antiquant_mode", key_antiquant_mode, lo=0, hi=5)
    vmode = check_int("value_antiquant_mode", value_antiquant_mode, lo=0, hi=5)
    separate = key_antiquant_scale is not None or value_antiquant_scale is not None
    for name, a, other in (("key_antiquant_scale", key_antiquant_scale, value_antiquant_scale),
                           ("key_antiquant_offset", key_antiquant_offset, value_antiquant_offset)):
        require((a is None) == (other is None), name.replace("key", "value"), f"given together with {name}",
                Described("only one of them"))
    require(separate or key_antiquant_offset is None, "key_antiquant_offset", "None without key_antiquant_scale",
            key_antiquant_offset)
    if not separate:
        require(not int4, "key_antiquant_scale", "the separate K/V antiquant parameters for int4 key/value", None)
        require(antiquant_scale is not None, "antiquant_scale", "scales for int8/int4 key and value with a "
                "float query (antiquant)", None)
        check_tensor("antiquant_scale", antiquant_scale)
        require(antiquant_scale.dim() >= 1 and antiquant_scale.shape[0] == 2, "antiquant_scale",
                "a first dim of 2 (key, value)", antiquant_scale)
        if antiquant_offset is not None:
            check_tensor("antiquant_offset", antiquant_offset)
            require(antiquant_offset.shape == antiquant_scale.shape, "antiquant_offset",
                    f"the shape of antiquant_scale {list(antiquant_scale.shape)}", antiquant_offset)
        mode = antiquant_mode if geo.decode else 0
        names = ("antiquant_scale", "antiquant_offset")
        return tuple(_antiquant(names, antiquant_scale[i], None if antiquant_offset is None else antiquant_offset[i],
                                mode, geo, combined=True, d=(geo.d, geo.dv)[i]) for i in (0, 1)) + (False,)
    if geo.decode:
        require(kmode == vmode or (kmode, vmode) == (0, 1), "value_antiquant_mode",
                f"key_antiquant_mode ({kmode}), or 1 with key_antiquant_mode 0", vmode)
    else:
        require(kmode in (0, 1) and vmode == kmode, "value_antiquant_mode",
                f"equal to key_antiquant_mode, 0 or 1 when Q_S > 1 (got key {kmode})", vmode)
    if int4:  # page-managed scales (4, 5) with int4 only through the Pythonic paged extension
        paged = ((4, 4), (5, 5)) if geo.pages is not None else ()
        require((kmode, vmode) in ((0, 0), (1, 1), (3, 3), (0, 1)) + paged, "key_antiquant_mode", "per-channel (0), "
                "per-token (1), per-token+head (3) or key 0 + value 1 for int4 key/value", (kmode, vmode))
    if kmode == vmode and (kmode != 0 or geo.d == geo.dv):  # per-channel shapes follow each head dim
        for name, a, other in (("value_antiquant_scale", value_antiquant_scale, key_antiquant_scale),
                               ("value_antiquant_offset", value_antiquant_offset, key_antiquant_offset)):
            if a is not None:
                check_tensor(name.replace("value", "key"), other)
                check_tensor(name, a)
                require(a.shape == other.shape, name, f"the shape of {name.replace('value', 'key')}", a,
                        f"key's is {describe(other)}")
    key = _antiquant(("key_antiquant_scale", "key_antiquant_offset"), key_antiquant_scale, key_antiquant_offset,
                     kmode, geo, combined=False, d=geo.d)
    value = _antiquant(("value_antiquant_scale", "value_antiquant_offset"), value_antiquant_scale,
                       value_antiquant_offset, vmode, geo, combined=False, d=geo.dv)
    return key, value, True

