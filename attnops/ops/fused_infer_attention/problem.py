"""Validation of a FusedInferAttentionScore call and its normal form (:class:`FIAProblem`), shared by the aclnn and
the Pythonic dialects.

Normal form, per batch: the valid query rows ``[Sq_b, N1, D]`` (views) and the effective KV as runs read in place
(:class:`KVSegment`): the shared prefix first, then the keys after left padding, actual lengths or the page gather;
one :class:`MaskSpec` and one pse over these effective coordinates; the antiquant of K and V, the int8 chain and the
int8 output parameters. Every seed constraint is checked here before any compute; ``strict`` (the aclnn dialect)
adds the seed's dtype lists and the NPU's size, alignment and block-size envelope.

The per-batch parts (query rows, KV runs, mask and pse windows) are built on first use: the Triton decode kernels
never need them (they address the tensors as given, :class:`CallSource`), so a call on the GPU costs the checks
alone. Values that live on a device (``actual_seq_lengths_kv``, ``query_padding_size``/``kv_padding_size`` and
``block_table`` tensors off the CPU, masks on a device) are never read here: their shapes and dtypes are checked,
lengths are bounded by the capacity of the call (a paged batch: ``block_table`` columns x block size; dense: the
KV S), and only the kernels, which read them on the device, can run such a problem (:attr:`FIAProblem.device_values`).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import (Described, check_int, check_scale, check_tensor, describe, fail, int_list, require,
                             require_not_none)
from ..._core.errors import ParamDtypeError, PrecisionNotEmulatedError
from ..._core.indices import check_block_table, validation_enabled
from ..._core.layouts import bsnd_dims, io_layouts, tokens_view
from ..common.npu_rounding import NpuRounding, check_precision, npu_rounding
from ..._core.masks import MaskRule, MaskSpec, build_infer_mask_spec, check_infer_mask
from ..._core.pse import PseSpec
from ..._core.varlen import SeqInfo, batch_windows, lengths_from_cumulative, seq_info_varlen
from .paged import (KVSegment, dense_segment, nz_width, page_segments, unaddressable_columns,
                    with_masked_columns)
from .quant import (Antiquant, AntiquantGeometry, Int8Chain, OutputQuant, build_int8_chain, build_kv_antiquant,
                    build_output_quant)

INT_MAX = 2147483647
LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND")
F16, BF16, F32, I8, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32
MAX_GROUP = 64
MAX_S = 20 << 20


def _built_once(build):
    """A property built on first use and kept (``functools.cached_property`` without its lock, which
    ``torch.compile`` cannot trace on Python 3.11)."""
    name = build.__name__

    def get(self):
        built = self._parts.built
        if name not in built:
            built[name] = build(self)
        return built[name]

    return property(get, doc=build.__doc__)


@dataclass(frozen=True)
class CallSource:
    """The call's tensors and lengths as given, which kernels read in place.

    ``kind``: "dense" (``key``/``value`` in the query's layout), "list" (per-batch tensors) or "paged" (a cache
    and ``block_table``). ``q_s``: the query S (TND: T); ``kv_s``: the dense key S (TND: T; 0 for the other kinds).
    ``q_lens_given``: per-batch query lengths are in use (``actual_seq_lengths`` with Q_S > 1, or TND).
    ``kv_lengths``: ``actual_seq_lengths_kv`` as a device tensor (not read on the host; ``seq.kv_lens`` then hold
    the capacities). ``query_padding``/``kv_padding``: the left padding in use (an int, or a device tensor).
    """

    query: Tensor
    key: Tensor | list
    value: Tensor | list
    in_layout: str
    kind: str
    q_s: int
    kv_s: int
    q_lens_given: bool
    kv_lengths: Tensor | None
    query_padding: int | Tensor | None
    kv_padding: int | Tensor | None
    block_table: Tensor | None
    block_size: int


@dataclass(frozen=True)
class FIAProblem:
    """A validated FIA call. ``seq``: actual query lengths and effective KV lengths (prefix included).

    ``rule`` and ``pse_shift`` are the mask and pse as kernels take them (read at each batch's left-padding
    offsets); ``queries``, ``kv``, ``mask`` and ``pse`` are the per-batch normal form, built on first use and
    available only when no value lives on a device (``device_values`` empty).
    """

    n1: int
    n2: int
    d: int
    dv: int  # value (and output) head dim
    seq: SeqInfo
    key_quant: Antiquant | None
    value_quant: Antiquant | None
    rule: MaskRule
    pse_shift: Tensor | None  # [B|1, N1, >= Q_S, >= KV_S], added after the scale
    scale: float
    int8: Int8Chain | None
    out_quant: OutputQuant | None
    out_dtype: torch.dtype
    out_layout: str
    out_shape: tuple[int, ...]
    row_starts: tuple[int, ...]  # first output row of each batch (the token index for TND)
    lse_shape: tuple[int, ...]
    device: torch.device
    kv_starts: tuple[int, ...]  # per batch, the row of its first key in its key tensor (left padding, TND offset)
    prefix_len: int  # columns of the shared prefix, the first effective columns of every batch
    source: CallSource
    device_values: tuple[str, ...]  # arguments whose values live on a device and were not read
    _parts: "_Deferred" = dataclasses.field(repr=False, compare=False)
    rounding: NpuRounding | None = None  # precision="npu": the kernels' rounding (None: exact)

    @property
    def group(self) -> int:
        return self.n1 // self.n2

    @property
    def batch(self) -> int:
        return self.seq.batch

    @property
    def q_rows(self) -> int:
        """The longest query of a batch (rows)."""
        return self.seq.max_q

    @_built_once
    def queries(self) -> tuple[Tensor, ...]:
        """Per batch, the valid query rows ``[Sq_b, N1, D]`` (views)."""
        return _query_rows(self.source.query, self._host_parts("queries").g, self._parts.lens)

    @_built_once
    def kv(self) -> tuple[tuple[KVSegment, ...], ...]:
        """Per batch, the effective KV runs in column order (the shared prefix first)."""
        d = self._host_parts("kv")
        return _segments(d.g, d.lens, d.kv_tokens, d.value_tokens, d.prefix, self.source.block_table,
                         self.source.block_size)

    @_built_once
    def mask(self) -> MaskSpec:
        """The mask in the one normal form over effective coordinates (left-padding windows applied)."""
        d = self._host_parts("mask")
        spec = build_infer_mask_spec(**d.mask_args, seq=self.seq, q_offsets=d.q_offsets, kv_offsets=d.kv_offsets,
                                     left_padding=d.lens.left_padding is not None)
        src = self.source
        if src.kind != "paged" or src.block_table.device.type != "cpu":  # a device table: the kernels mask its ids
            return spec
        unaddressable = unaddressable_columns(src.block_table, d.lens.kv_lens, src.block_size, src.key.shape[0],
                                              self.prefix_len)
        return spec if unaddressable is None else with_masked_columns(spec, unaddressable, self.seq.max_q)

    @_built_once
    def pse(self) -> PseSpec | None:
        """The pse over effective coordinates (left-padding windows applied), or None."""
        if self.pse_shift is None:
            return None
        d = self._host_parts("pse")
        t = self.pse_shift
        if d.q_offsets is not None and (any(d.q_offsets) or any(d.kv_offsets)):
            t = batch_windows(t, d.q_offsets, d.kv_offsets, self.seq, 0.0)
        return PseSpec(0, "full", t)

    def _host_parts(self, what: str) -> "_Deferred":
        if self.device_values:
            raise RuntimeError(f"FIAProblem.{what} needs the host values of {', '.join(self.device_values)} (given "
                               "as device tensors: only the Triton decode kernels read them)")
        return self._parts


@dataclass(frozen=True)
class _Inputs:
    """Geometry of the call: layouts, sizes, and how K/V are given (tensor, per-batch list or pages)."""

    in_layout: str
    out_layout: str
    batch: int
    q_s: int  # query S (TND: T)
    n1: int
    n2: int
    d: int
    dv: int  # value head dim (the output's)
    keys: list  # dense: [key]; tensor list: per-batch tensors; paged: [key cache]
    values: list
    kind: str  # "dense", "list" or "paged"
    int4: bool

    @property
    def decode(self) -> bool:
        return self.in_layout != "TND" and self.q_s == 1


def _float_dtypes(strict: bool) -> tuple[torch.dtype, ...]:
    return (F16, BF16) if strict else (F16, BF16, F32)


def _as_tensors(name: str, x) -> list:
    """A tensor or a list of per-batch tensors (aclnn TensorList) -> list of tensors."""
    require_not_none(x, name)
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    require(len(items) > 0, name, "a tensor or a non-empty list of tensors", x)
    for i, t in enumerate(items):
        check_tensor(name if len(items) == 1 else f"{name}[{i}]", t)
    return items


def _inputs(query, key, value, *, num_heads, num_key_value_heads, input_layout, block_table, strict) -> _Inputs:
    in_layout, out_layout = io_layouts("input_layout", input_layout, LAYOUTS)
    floats = _float_dtypes(strict)
    check_tensor("query", query, ndim=3 if in_layout in ("BSH", "TND") else 4, dtypes=floats + (I8,))
    keys, values = _as_tensors("key", key), _as_tensors("value", value)
    require(len(keys) == len(values), "value", f"as many tensors as key ({len(keys)})",
            Described(f"{len(values)} tensors"))
    for k, v in zip(keys, values):
        require(k.dtype == v.dtype and k.dim() == v.dim() and _outside_head_dim(k) == _outside_head_dim(v), "value",
                "the dtype of key and its shape but for the head dim", v, f"key is {describe(k)}")
        check_tensor("key", k, dtypes=floats + (I8, I32))
        require(k.device == query.device, "key", f"a tensor on {query.device} like query", k)
    kdt = keys[0].dtype
    if query.dtype == I8:
        require(kdt == I8, "key", "int8 key/value with an int8 query (full quantization)", keys[0])
    elif kdt not in (query.dtype, I8, I32):
        fail("key", f"dtype {query.dtype} (as query), int8 or int4 packed in int32 (antiquant)", keys[0],
             error=ParamDtypeError)
    n1 = check_int("num_heads", num_heads, lo=1)
    n2 = check_int("num_key_value_heads", num_key_value_heads, lo=0) or n1
    require(n1 % n2 == 0 and n1 // n2 <= MAX_GROUP, "num_key_value_heads",
            f"a divisor of num_heads={n1} with num_heads / num_key_value_heads <= {MAX_GROUP}", n2)
    if in_layout == "BSH":
        require(query.shape[-1] % n1 == 0, "num_heads", f"a divisor of the query's H={query.shape[-1]}", n1)
        d = query.shape[-1] // n1
    else:
        heads = query.shape[1] if in_layout == "TND" else bsnd_dims(query, in_layout, None)[2]
        require(heads == n1, "num_heads", f"the N of the query shape ({heads})", n1)
        d = query.shape[-1]
    if in_layout == "TND":
        batch, q_s = 0, query.shape[0]
    else:
        batch, q_s, _, _ = bsnd_dims(query, in_layout, n1)
    int4 = kdt == I32
    require(not int4 or d % 8 == 0, "query", "a head dim D that is a multiple of 8 with int4 (int32-packed) KV",
            Described(f"D={d}"))
    kind = "paged" if block_table is not None else ("list" if len(keys) > 1 else "dense")
    dv = _value_head_dim(values[0], in_layout, kind == "paged", n2, int4)
    require(kind != "paged" or len(keys) == 1, "key", "one cache tensor with block_table (paged attention does not "
            "take a tensor list)", Described(f"{len(keys)} tensors"))
    require(kind != "list" or in_layout != "TND", "key", "one tensor for layout TND", Described(f"{len(keys)} tensors"))
    require(out_layout == in_layout or q_s > 1, "input_layout", "BSH, BSND or BNSD when Q_S = 1 (BNSD_BSND needs "
            "Q_S > 1)", input_layout)
    return _Inputs(in_layout, out_layout, batch, q_s, n1, n2, d, dv, keys, values, kind, int4)


def _outside_head_dim(x: Tensor) -> tuple[int, ...]:
    """The sizes of ``x`` that key and value share: all but the last (NZ cache: all but ``D/x``)."""
    return tuple(x.shape[:2]) + tuple(x.shape[3:]) if x.dim() == 5 else tuple(x.shape[:-1])


def _value_head_dim(value: Tensor, in_layout: str, paged: bool, n2: int, int4: bool) -> int:
    """Dv, the value's head dim (the output takes it): ``H / N2`` of a BSH value or ``(blocknum, blocksize, H)``
    cache, ``D/x * x`` of an NZ cache, else the last dim (int4: 8 values per int32 word)."""
    if value.dim() == 5:
        return value.shape[2] * value.shape[4]
    width = value.shape[-1]
    if value.dim() == 3 and (paged or in_layout == "BSH"):
        require(width % n2 == 0, "value", f"H = N2*Dv with N2={n2} (num_key_value_heads)", value)
        width //= n2
    return width * 8 if int4 else width


def output_head_dim(value: Tensor, in_layout: str, paged: bool, n2: int) -> int:
    """The output's head dim (Dv) for a shape-only caller (the fake kernel); no validation."""
    if value.dim() == 5:
        return value.shape[2] * value.shape[4]
    width = value.shape[-1] // n2 if value.dim() == 3 and (paged or in_layout == "BSH") else value.shape[-1]
    return width * 8 if value.dtype == I32 else width


def _dense_kv_tokens(g: _Inputs) -> tuple[list[Tensor], list[Tensor]]:
    """Token views of a dense key and value or of each tensor of their lists (none for a paged cache)."""
    if g.kind == "paged":
        return [], []
    names = ["key"] if g.kind == "dense" else [f"key[{i}]" for i in range(len(g.keys))]
    tokens = [_kv_tokens(g, k, name) for k, name in zip(g.keys, names)]
    values = [_kv_tokens(g, v, name.replace("key", "value"), value=True) for v, name in zip(g.values, names)]
    if g.kind == "list":
        require(len(g.keys) == g.batch, "key", f"a list of B={g.batch} tensors (one per batch)",
                Described(f"{len(g.keys)} tensors"))
        for i, t in enumerate(tokens):
            require(t.shape[0] == 1, f"key[{i}]", "batch size 1 (tensor list)", g.keys[i])
    elif g.in_layout != "TND":
        require(tokens[0].shape[0] == g.batch, "key", f"batch size B={g.batch} like query", g.keys[0])
    return tokens, values


def _kv_width(g: _Inputs, value: bool = False) -> int:
    """Last dim of a K (or V) head: Dk (Dv), or a eighth of it for int4 packed in int32."""
    d = g.dv if value else g.d
    return d // 8 if g.int4 else d


def _kv_tokens(g: _Inputs, x: Tensor, name: str, value: bool = False) -> Tensor:
    """Validate one dense K (or V) tensor (or a list item / prefix) and return its ``[B, S, N2, D]`` (TND
    ``[T, N2, D]``) token view."""
    w = _kv_width(g, value)
    if g.in_layout == "TND":
        check_tensor(name, x, ndim=3)
        require(tuple(x.shape[1:]) == (g.n2, w), name, f"[T, N2={g.n2}, D={w}]", x)
        return x
    check_tensor(name, x, ndim=3 if g.in_layout == "BSH" else 4)
    ok = x.shape[-1] == g.n2 * w if g.in_layout == "BSH" else bsnd_dims(x, g.in_layout, None)[2:] == (g.n2, w)
    want = f"H = N2*D = {g.n2}*{w}" if g.in_layout == "BSH" else f"N2={g.n2} heads of D={w}"
    require(ok, name, f"a {g.in_layout} tensor with {want}" + (" (int4: D/8 int32 words)" if g.int4 else ""), x)
    return tokens_view(x, g.in_layout, g.n2)


@dataclass(frozen=True)
class _Lengths:
    q_lens: list[int]
    q_starts: list[int]  # first valid query row (left padding; TND token offset)
    kv_lens: list[int]  # keys only, prefix excluded (capacities with kv_lengths)
    kv_starts: list[int]  # first valid key row (left padding; TND token offset)
    kv_cols: int  # least KV_S of masks, pse and per-token antiquant parameters
    left_padding: str | None  # the padding argument in use (left padding), if any
    kv_lengths: Tensor | None = None  # actual_seq_lengths_kv as a device tensor
    query_padding: int | Tensor | None = None  # the paddings in use
    kv_padding: int | Tensor | None = None

    @property
    def device_values(self) -> tuple[str, ...]:
        """The arguments in use whose values live on a device (starts and lengths above are placeholders)."""
        given = (("actual_seq_lengths_kv", self.kv_lengths), ("query_padding_size", self.query_padding),
                 ("kv_padding_size", self.kv_padding))
        return tuple(name for name, v in given if isinstance(v, Tensor))


def _on_device(x) -> bool:
    """A tensor whose values live off the CPU (reading them would synchronise)."""
    return isinstance(x, Tensor) and x.device.type != "cpu"


def _per_batch(name: str, value, batch: int, default: list[int]) -> list[int]:
    """The seed's rule for per-batch lengths: None = shape S; length 1 = shared; length >= B = the first B."""
    values = int_list(name, value)
    if values is None:
        return list(default)
    require(len(values) == 1 or len(values) >= batch, name, f"1 value or at least B={batch} values", values)
    values = values * batch if len(values) == 1 else values[:batch]
    for b, v in enumerate(values):
        require(v >= 0, f"{name}[{b}]", "a non-negative length", v)
    return values


def _padding(name: str, value, strict: bool) -> int | Tensor | None:
    """query/kv_padding_size: int64 shape (1); negative values count as 0. A device tensor is returned unread (the
    kernels read it)."""
    if value is None:
        return None
    if strict or isinstance(value, Tensor):
        check_tensor(name, value, dtypes=(torch.int64,) if strict else (torch.int64, torch.int32))
        require(value.numel() == 1, name, "shape [1]", value)
        if _on_device(value):
            return value
        value = int(value.reshape(-1)[0])
    return max(0, check_int(name, value))


def _device_kv_lengths(g: _Inputs, value: Tensor, batch: int) -> Tensor:
    """``actual_seq_lengths_kv`` as a device tensor: int32/int64 ``[1]`` (shared) or ``[>= B]``; not read."""
    require(g.in_layout != "TND" and g.kind != "list", "actual_seq_lengths_kv", "a list or a CPU tensor for layout "
            "TND and for key/value tensor lists (a device tensor is read by the paged and dense decode kernels)",
            value)
    check_tensor("actual_seq_lengths_kv", value, ndim=1, dtypes=(torch.int32, torch.int64))
    require(value.numel() == 1 or value.numel() >= batch, "actual_seq_lengths_kv", f"1 value or at least B={batch} "
            "values", value)
    return value


def _lengths(g: _Inputs, kv_tokens: list[Tensor], *, actual_seq_lengths, actual_seq_lengths_kv, query_padding_size,
             kv_padding_size, strict) -> tuple[_Lengths, int]:
    """Per-batch lengths and starts; returns them and the batch size."""
    if g.in_layout == "TND":
        require(actual_seq_lengths is not None, "actual_seq_lengths", "cumulative query lengths for layout TND", None)
        q_lens = lengths_from_cumulative("actual_seq_lengths", actual_seq_lengths, g.q_s)
        batch = len(q_lens)
        q_starts = [sum(q_lens[:b]) for b in range(batch)]
    else:
        batch = g.batch
        q_lens = [1] * batch if g.decode else _per_batch("actual_seq_lengths", actual_seq_lengths, batch,
                                                        [g.q_s] * batch)
        for b, n in enumerate(q_lens):
            require(n <= g.q_s, f"actual_seq_lengths[{b}]", f"at most the query S={g.q_s}", n)
        q_starts = [0] * batch
    if g.in_layout == "TND":
        for name, v in (("query_padding_size", query_padding_size), ("kv_padding_size", kv_padding_size)):
            require(v is None, name, "None for layout TND (lengths are cumulative)", v)
    qpad = None if g.decode else _padding("query_padding_size", query_padding_size, strict)  # Q_S = 1: ignored
    kvpad = _padding("kv_padding_size", kv_padding_size, strict)
    q_left = qpad is not None and actual_seq_lengths is not None
    if q_left and not _on_device(qpad):
        q_starts = [g.q_s - qpad - n for n in q_lens]
        for b, s in enumerate(q_starts):
            require(s >= 0, "query_padding_size", f"Q_S - query_padding_size - actual_seq_lengths[{b}] >= 0 "
                    "(left padding)", Described(f"Q_S={g.q_s}, query_padding_size={qpad}, length {q_lens[b]}"))
    device_lens = _device_kv_lengths(g, actual_seq_lengths_kv, batch) if _on_device(actual_seq_lengths_kv) else None
    pads = dict(kv_lengths=device_lens, query_padding=qpad if q_left else None)
    if g.kind == "paged":
        require(actual_seq_lengths_kv is not None, "actual_seq_lengths_kv", "the per-batch KV lengths (required "
                "with block_table)", None)
        kv_lens = [0] * batch if device_lens is not None else _per_batch("actual_seq_lengths_kv",
                                                                          actual_seq_lengths_kv, batch, [])
        return _Lengths(q_lens, q_starts, kv_lens, [0] * batch, 0, _left_padding(q_left, kvpad is not None),
                        **pads), batch
    if g.in_layout == "TND":
        require(actual_seq_lengths_kv is not None, "actual_seq_lengths_kv", "cumulative KV lengths for layout TND",
                None)
        kv_lens = lengths_from_cumulative("actual_seq_lengths_kv", actual_seq_lengths_kv, kv_tokens[0].shape[0])
        require(len(kv_lens) == batch, "actual_seq_lengths_kv", f"B={batch} cumulative values like "
                "actual_seq_lengths", kv_lens)
        starts = [sum(kv_lens[:b]) for b in range(batch)]
        return _Lengths(q_lens, q_starts, kv_lens, starts, max(kv_lens, default=0), None), batch
    phys = [t.shape[1] for t in kv_tokens] if g.kind == "list" else [kv_tokens[0].shape[1]] * batch
    kv_lens = phys if device_lens is not None else _per_batch("actual_seq_lengths_kv", actual_seq_lengths_kv, batch,
                                                              phys)
    for b, (n, s) in enumerate(zip(kv_lens, phys)):
        require(n <= s, f"actual_seq_lengths_kv[{b}]", f"at most the key/value S={s} of batch {b}", n)
    kv_starts = [0] * batch
    kv_left = kvpad is not None and actual_seq_lengths_kv is not None
    pads["kv_padding"] = kvpad if kv_left else None
    if kv_left and not (_on_device(kvpad) or device_lens is not None):  # else the kernels compute the starts
        kv_starts = [s - kvpad - n for s, n in zip(phys, kv_lens)]
        for b, s in enumerate(kv_starts):
            # Q_S = 1: a start before 0 gives an all-zero batch (seed); Q_S > 1: undefined on the NPU, rejected
            require(s >= 0 or g.decode, "kv_padding_size", f"KV_S - kv_padding_size - actual_seq_lengths_kv[{b}] "
                    ">= 0 (left padding)", Described(f"KV_S={phys[b]}, kv_padding_size={kvpad}, length {kv_lens[b]}"))
        kv_lens = [0 if s < 0 else n for s, n in zip(kv_starts, kv_lens)]
        kv_starts = [max(s, 0) for s in kv_starts]
    return _Lengths(q_lens, q_starts, kv_lens, kv_starts, max(phys, default=0), _left_padding(q_left, kv_left),
                    **pads), batch


def _check_leading_zero(actual_seq_lengths, actual_seq_lengths_kv, block_table) -> None:
    """TND: a leading 0 in the cumulative ``actual_seq_lengths`` is an empty first batch (B is the list's length).
    Where the KV lengths or the block table count one batch fewer, that 0 is the mistake (flash-attn's
    ``cu_seqlens`` passed whole): ``actual_seq_lengths`` is named, not the argument that disagrees with it."""
    values = int_list("actual_seq_lengths", actual_seq_lengths)
    if values is None or len(values) < 2 or values[0] != 0:
        return
    others = {}
    if isinstance(block_table, Tensor) and block_table.dim() == 2:
        others["block_table"] = block_table.shape[0]
    if not _on_device(actual_seq_lengths_kv):
        kv = int_list("actual_seq_lengths_kv", actual_seq_lengths_kv)
        if kv is not None and len(kv) > 1:
            others["actual_seq_lengths_kv"] = len(kv)
    batch = len(values) - 1
    named = [name for name, count in others.items() if count == batch]
    if named:
        fail("actual_seq_lengths", f"B={batch} cumulative query lengths like {' and '.join(named)}, without a "
             "leading 0 (a leading 0 is an empty first batch)", values,
             "Pass flash-attn/vLLM's cu_seqlens (query_start_loc) without its first element: cu_seqlens[1:]")


def _left_padding(query: bool, kv: bool) -> str | None:
    return "query_padding_size" if query else "kv_padding_size" if kv else None


def _paged_kv(g: _Inputs, lens: _Lengths, block_table, block_size, strict) -> tuple[_Lengths, int, int]:
    """Validate the caches and block table; returns the lengths with ``kv_cols`` set, the block size and blocknum."""
    cache = g.keys[0]
    w = _kv_width(g)
    check_tensor("key", cache, ndim=(3, 4, 5))
    bs_dim = cache.shape[1] if cache.dim() == 3 else cache.shape[cache.dim() - 2]
    forms = (f"a paged cache (blocknum, blocksize, H={g.n2}*{w}), NZ (blocknum, KV_N={g.n2}, D/x, blocksize, x) or, "
             f"with a BNSD/TND query, (blocknum, KV_N={g.n2}, blocksize, D={w})")
    if not strict:
        forms += f", or flash-attn/vLLM's (blocknum, blocksize, KV_N={g.n2}, D={w})"
    hint = ("a flash-attn/vLLM cache (blocknum, blocksize, KV_N, D) is the (blocknum, blocksize, H) cache "
            ".flatten(2) gives")
    if cache.dim() == 3:
        require(cache.shape[2] == g.n2 * w, "key", forms, cache, hint)
    elif cache.dim() == 5:
        _check_nz(g, cache, "key", g.d)
        _check_nz(g, g.values[0], "value", g.dv)
    else:
        require(cache.shape[1] == g.n2 and cache.shape[3] == w and g.in_layout in ("BNSD", "TND"), "key", forms,
                cache, hint)
    if strict or block_size not in (None, 0):
        check_int("block_size", block_size, lo=1)
        require(block_size == bs_dim, "block_size", f"the cache's block size ({bs_dim})", block_size)
    block_size = bs_dim
    require(block_size > 0, "key", "a cache with a non-zero block size", cache)
    check_tensor("block_table", block_table, ndim=2, dtypes=(I32,) if strict else (I32, torch.int64))
    require(block_table.shape[0] == len(lens.kv_lens), "block_table", f"[B={len(lens.kv_lens)}, maxBlocks]",
            block_table)
    num_blocks = cache.shape[0]
    if lens.kv_lengths is not None:  # device lengths: every batch may use the whole table
        capacity = block_table.shape[1] * block_size
        return (dataclasses.replace(lens, kv_lens=[capacity] * len(lens.kv_lens), kv_cols=capacity), block_size,
                num_blocks)
    need = [math.ceil(n / block_size) for n in lens.kv_lens]
    max_blocks = max(need, default=0)
    require(block_table.shape[1] >= max_blocks, "block_table", f"at least maxBlockNumPerSeq={max_blocks} columns "
            f"(blocks of the longest actual_seq_lengths_kv)", block_table)
    require(sum(need) <= num_blocks, "key", f"at least {sum(need)} blocks (sum over batches of the blocks of "
            "actual_seq_lengths_kv)", cache)
    if validation_enabled(block_table.device):  # else ids outside the cache mask their keys out
        check_block_table(block_table, lens.kv_lens, block_size, num_blocks, lengths_name="actual_seq_lengths_kv")
    return dataclasses.replace(lens, kv_cols=max_blocks * block_size), block_size, num_blocks


def _check_nz(g: _Inputs, cache: Tensor, name: str, d: int) -> None:
    """An NZ cache ``(blocknum, KV_N, D/x, blocksize, x)``, x = 32 bytes of the dtype (16 fp16/bf16, 32 int8)."""
    require(not g.int4, name, "an fp16/bf16/int8 NZ cache (int4 NZ caches are not supported)", cache)
    x = nz_width(cache.dtype)
    require(cache.shape[1] == g.n2 and cache.shape[4] == x and cache.shape[2] * x == d, name,
            f"an NZ (blocknum, KV_N={g.n2}, D/{x}, blocksize, {x}) cache with D={d} (a multiple of {x})", cache)


def _prefix(g: _Inputs, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len):
    """Validated prefix token views ``[P, N2, Dk]`` and the used length L (or None)."""
    if key_shared_prefix is None and value_shared_prefix is None:
        require(actual_shared_prefix_len is None, "actual_shared_prefix_len", "None without a shared prefix",
                actual_shared_prefix_len)
        return None
    require(key_shared_prefix is not None and value_shared_prefix is not None, "value_shared_prefix",
            "key_shared_prefix and value_shared_prefix together", Described("only one of them"))
    require(g.in_layout != "TND", "key_shared_prefix", "None for layout TND", key_shared_prefix)
    views = []
    for name, x in (("key_shared_prefix", key_shared_prefix), ("value_shared_prefix", value_shared_prefix)):
        check_tensor(name, x, dtypes=(g.keys[0].dtype,), ndim=g.keys[0].dim())
        tokens = _kv_tokens(g, x, name, value=name.startswith("value"))
        require(tokens.shape[0] == 1, name, "batch size 1", x)
        views.append(tokens[0])
    kp, vp = views
    require(kp.shape[0] == vp.shape[0], "value_shared_prefix", f"the S of key_shared_prefix ({kp.shape[0]})",
            value_shared_prefix)
    lens = int_list("actual_shared_prefix_len", actual_shared_prefix_len)
    if lens is None:
        return kp, vp, kp.shape[0]
    require(len(lens) == 1 and 0 <= lens[0] <= kp.shape[0], "actual_shared_prefix_len",
            f"one value in [0, {kp.shape[0]}] (the prefix S)", lens)
    return kp, vp, lens[0]


def _segments(g: _Inputs, lens: _Lengths, kv_tokens, value_tokens, prefix, block_table, block_size) -> tuple:
    """Per batch, the effective KV runs: prefix rows, then the batch's keys."""
    out = []
    plen = 0 if prefix is None else prefix[2]
    table = block_table.tolist() if g.kind == "paged" else None
    for b, n in enumerate(lens.kv_lens):
        segs = [] if not plen else [dense_segment(prefix[0], prefix[1], 0, 0, plen, 0)]
        if g.kind == "paged" and n:
            blocks = table[b][:math.ceil(n / block_size)]
            segs += page_segments(g.keys[0], g.values[0], blocks, n, block_size, g.n2)
        elif n:
            if g.in_layout == "TND":
                kt, vt = kv_tokens[0], value_tokens[0]
            else:
                i = b if g.kind == "list" else 0
                kt = kv_tokens[i][0 if g.kind == "list" else b]
                vt = value_tokens[i][0 if g.kind == "list" else b]
            # per-token position: prefix first, then the physical (left-padded) key row; TND: the batch-local row
            pos = plen + (0 if g.in_layout == "TND" else lens.kv_starts[b])
            segs.append(dense_segment(kt, vt, plen, lens.kv_starts[b], n, pos))
        out.append(tuple(segs))
    return tuple(out)


def _check_pse(pse_shift, g: _Inputs, seq: SeqInfo, kv_cols: int, query_dtype) -> Tensor | None:
    """pse_shift ``(B|1, N1, >=Q_S, >=KV_S)``, added after the scale (read at the left-padding offsets)."""
    if pse_shift is None:
        return None
    check_tensor("pse_shift", pse_shift, ndim=4, dtypes=(F16 if query_dtype == I8 else query_dtype,))
    rows = max(seq.q_lens, default=0) if g.in_layout == "TND" else g.q_s
    ok = pse_shift.shape[0] in (1, seq.batch) and pse_shift.shape[1] == g.n1 and pse_shift.shape[2] >= rows and \
        pse_shift.shape[3] >= kv_cols
    require(ok, "pse_shift", f"shape (B={seq.batch} or 1, N={g.n1}, Q_S >= {rows}, KV_S >= {kv_cols})", pse_shift)
    return pse_shift


def _check_int8_output_rows(mask_mode: int, has_mask: bool, pre: int, nxt: int, offset: bool, seq: SeqInfo) -> None:
    """Int8 output (Q_S > 1): no band with negative tokens; with quant_offset2, reject the sparse configurations in
    which some rows attend to nothing (seed list; the KV lengths include the shared prefix)."""
    require(not (mask_mode == 4 and (pre < 0 or nxt < 0)), "pre_tokens", "non-negative pre_tokens and next_tokens "
            "for sparse_mode 4 with an int8 output", Described(f"pre_tokens={pre}, next_tokens={nxt}"))
    for q, kv in zip(seq.q_lens, seq.kv_lens) if offset else ():
        bad = {0: has_mask and (q - kv - pre > 0 or nxt < 0), 3: kv - q < 0, 4: pre < 0 or nxt + kv - q < 0}
        require(not bad.get(mask_mode, False), "quant_offset2", f"None for sparse_mode {mask_mode} with rows that "
                "attend to nothing (int8 output; apply the offset outside the operator)",
                Described(f"Sq={q}, Skv={kv} (prefix included), pre_tokens={pre}, next_tokens={nxt}"))


def _check_envelope(g: _Inputs, lens: _Lengths, kv_cols: int, out_quant, pse_shift, block_size) -> None:
    """The NPU's size and alignment limits (aclnn dialect only)."""
    dts = {g.keys[0].dtype, g.values[0].dtype}
    require(len(lens.q_lens) <= 65536, "query", "a batch size B <= 65536", Described(f"B={len(lens.q_lens)}"))
    require(g.n1 <= 256, "num_heads", "at most 256", g.n1)
    require(g.d <= 512, "query", "a head dim D <= 512", Described(f"D={g.d}"))
    require(g.dv <= 512, "value", "a head dim Dv <= 512", Described(f"Dv={g.dv}"))
    if g.kind == "list":
        require(len(g.keys) <= 256, "key", "at most 256 tensors in a tensor list", Described(f"{len(g.keys)} tensors"))
    if g.decode:
        require(not g.int4 or (g.d % 64 == 0 and g.dv % 64 == 0), "key", "D (and Dv) a multiple of 64 with int4 "
                "key/value", Described(f"D={g.d}, Dv={g.dv}"))
        require(pse_shift is None or g.d % 16 == 0, "pse_shift", "D a multiple of 16 with pse_shift (Q_S = 1)",
                Described(f"D={g.d}"))
    else:
        if g.in_layout in ("BSH", "BSND"):
            require(g.n1 * max(g.d, g.dv) < 65535, "query", "N*D < 65535 (and N*Dv) for layouts BSH/BSND",
                    Described(f"N*D={g.n1 * g.d}, N*Dv={g.n1 * g.dv}"))
        require(g.q_s <= MAX_S, "query", f"S <= {MAX_S} (20M)", Described(f"S={g.q_s}"))
        require(kv_cols <= MAX_S, "key", f"a KV S (shared prefix included) <= {MAX_S} (20M)", Described(f"S={kv_cols}"))
        align = 64 if g.int4 else 32 if I8 in dts or out_quant is not None else 16
        require(g.d % align == 0 and g.dv % align == 0, "query", f"D and Dv multiples of {align} for these dtypes "
                "(Q_S > 1)", Described(f"D={g.d}, Dv={g.dv}"))
    if out_quant is not None and out_quant.scale.numel() > 1:
        require(g.dv % 32 == 0, "quant_scale2", "Dv a multiple of 32 with per-channel int8 output",
                Described(f"Dv={g.dv}"))
    if g.kind == "paged":
        cache = g.keys[0]
        if cache.dim() == 3:
            for name, c in (("key", cache), ("value", g.values[0])):
                require(c.shape[-1] <= 65535, name, "KV_N*D <= 65535 for a (blocknum, blocksize, H) cache", c,
                        "use GQA or the (blocknum, KV_N, blocksize, D) layout")
        if g.decode:
            align = 32 if I8 in dts else 16
            require(block_size <= 512 and block_size % align == 0, "block_size",
                    f"a multiple of {align} up to 512 (Q_S = 1)", block_size)
        else:
            require(128 <= block_size <= 512 and block_size % 128 == 0, "block_size",
                    "128, 256, 384 or 512 (Q_S > 1)", block_size)


def build_problem(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                  actual_seq_lengths_kv=None, deq_scale1=None, quant_scale1=None, deq_scale2=None, quant_scale2=None,
                  quant_offset2=None, antiquant_scale=None, antiquant_offset=None, block_table=None,
                  query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
                  value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
                  value_shared_prefix=None, actual_shared_prefix_len=None, num_heads: int = 1, scale: float = 1.0,
                  pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH",
                  num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size=0,
                  antiquant_mode: int = 0, key_antiquant_mode: int = 0, value_antiquant_mode: int = 0,
                  precision: str = "exact", strict: bool = False) -> FIAProblem:
    """Validate an FIA call (aclnn parameter names) and convert it to an :class:`FIAProblem`.

    ``key``/``value``: a tensor in the query's layout, a list of per-batch tensors (batch 1 each), or with
    ``block_table`` a paged cache. ``strict``: the aclnn dialect (the seed's dtypes and the NPU envelope).
    ``precision="npu"``: :func:`npu_rounding_of` sets the problem's rounding.
    """
    check_precision(precision)
    g = _inputs(query, key, value, num_heads=num_heads, num_key_value_heads=num_key_value_heads,
                input_layout=input_layout, block_table=block_table, strict=strict)
    check_scale("scale_value", scale)
    for name, v in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens), ("sparse_mode", sparse_mode)):
        check_int(name, v)
    check_int("inner_precise", inner_precise, lo=0, hi=1 if g.decode else 3)
    kv_tokens, value_tokens = _dense_kv_tokens(g)
    if g.in_layout == "TND":
        _check_leading_zero(actual_seq_lengths, actual_seq_lengths_kv, block_table)
    lens, batch = _lengths(g, kv_tokens, actual_seq_lengths=actual_seq_lengths,
                           actual_seq_lengths_kv=actual_seq_lengths_kv, query_padding_size=query_padding_size,
                           kv_padding_size=kv_padding_size, strict=strict)
    pages = None
    if g.kind == "paged":
        lens, block_size, num_blocks = _paged_kv(g, lens, block_table, block_size, strict)
        pages = (num_blocks, block_size)
    prefix = _prefix(g, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len)
    plen = 0 if prefix is None else prefix[2]
    _check_features(g, lens, prefix, query, block_table, strict)
    seq = seq_info_varlen(lens.q_lens, [plen + n for n in lens.kv_lens])
    kv_cols = lens.kv_cols + plen
    int8, out_quant, key_quant, value_quant = _quantization(
        g, lens, query.dtype, AntiquantGeometry(g.n2, g.d, g.dv, batch, kv_cols, pages, query.dtype, g.decode), strict,
        deq_scale1=deq_scale1, quant_scale1=quant_scale1, deq_scale2=deq_scale2, quant_scale2=quant_scale2,
        quant_offset2=quant_offset2, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        antiquant_mode=antiquant_mode, key_antiquant_scale=key_antiquant_scale,
        key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
        value_antiquant_offset=value_antiquant_offset, key_antiquant_mode=key_antiquant_mode,
        value_antiquant_mode=value_antiquant_mode)
    rows = max(seq.q_lens, default=0) if g.in_layout == "TND" else g.q_s
    mask_args = dict(sparse_mode=sparse_mode, atten_mask=atten_mask, pre_tokens=pre_tokens, next_tokens=next_tokens,
                     decode=g.decode, rows=rows, cols=kv_cols)
    rule = check_infer_mask(**mask_args, batch=batch, left_padding=lens.left_padding is not None)
    if out_quant is not None and not g.decode and not lens.device_values:
        _check_int8_output_rows(sparse_mode, atten_mask is not None, pre_tokens, next_tokens,
                                quant_offset2 is not None, seq)
    pse_shift = _check_pse(pse_shift, g, seq, kv_cols, query.dtype)
    rounding = npu_rounding_of(precision, query.dtype, inner_precise, g.decode)
    if rounding is not None and g.decode:
        if g.int4 or any(q is not None and q.kind != "static" for q in (key_quant, value_quant)):
            fail("precision", "'exact' for int4 or per-token antiquant KV in decode (the NPU emulation covers float KV "
                 "and per-tensor/per-channel int8 KV)", precision, error=PrecisionNotEmulatedError)
    if strict:
        _check_envelope(g, lens, kv_cols, out_quant, pse_shift, block_size)
    out_shape = (*query.shape[:-1], g.n1 * g.dv if g.in_layout == "BSH" else g.dv) if g.out_layout == g.in_layout \
        else (g.batch, g.q_s, g.n1, g.dv)
    tnd = g.in_layout == "TND"
    source = CallSource(query, key, value, g.in_layout, g.kind, g.q_s, kv_tokens[0].shape[0 if tnd else 1]
                        if g.kind == "dense" else 0, tnd or (not g.decode and actual_seq_lengths is not None),
                        lens.kv_lengths, lens.query_padding, lens.kv_padding, block_table,
                        block_size if g.kind == "paged" else 0)
    parts = _Deferred(g, lens, kv_tokens, value_tokens, prefix, mask_args,
                      None if tnd else lens.q_starts, None if tnd else lens.kv_starts)
    return FIAProblem(
        n1=g.n1, n2=g.n2, d=g.d, dv=g.dv, seq=seq, key_quant=key_quant, value_quant=value_quant, rule=rule,
        pse_shift=pse_shift, scale=float(scale), int8=int8, out_quant=out_quant,
        out_dtype=I8 if out_quant is not None else F16 if int8 is not None else query.dtype, out_layout=g.out_layout,
        out_shape=out_shape, row_starts=tuple(lens.q_starts), device=query.device,
        lse_shape=(query.shape[0], g.n1, 1) if tnd else (g.batch, g.n1, g.q_s, 1), kv_starts=tuple(lens.kv_starts),
        prefix_len=plen, source=source,
        device_values=lens.device_values, _parts=parts, rounding=rounding)


def npu_rounding_of(precision: str, query_dtype: torch.dtype, inner_precise: int, decode: bool
                    ) -> NpuRounding | None:
    """The NPU rounding of an FIA call (docs/precision.md): P and the output in the query's dtype; bf16 outputs of
    decode (the IFA kernels) ties to even; fp16 prefill with ``inner_precise`` bit 0 set (high performance) scores
    and softmax in fp16. None for "exact" and for fp32 and int8 queries (fp32 runs fp32 end to end; the int8
    chain is emulated as it is)."""
    dtype = F16 if query_dtype == I8 else query_dtype  # int8 queries: fp16 output
    return npu_rounding(precision, dtype, even_output=decode and dtype == torch.bfloat16,
                        half_softmax=not decode and query_dtype == F16 and inner_precise & 1 == 1,
                        query_planes=(2 if inner_precise & 1 else 3) if decode else 0)


@dataclass(frozen=True)
class _Deferred:
    """What the per-batch normal form of a problem is built from, on first use."""

    g: _Inputs
    lens: _Lengths
    kv_tokens: list
    value_tokens: list
    prefix: tuple | None
    mask_args: dict
    q_offsets: list[int] | None  # left-padding starts at which masks and pse are read (None for TND)
    kv_offsets: list[int] | None
    built: dict = dataclasses.field(default_factory=dict)  # the parts built so far, by name


def _check_features(g: _Inputs, lens: _Lengths, prefix, query: Tensor, block_table, strict: bool) -> None:
    """Which features combine (seed): left padding, paged KV, tensor lists, shared prefix, int8 Q/K/V, int4 KV."""
    for feature, used in (("block_table (paged attention)", g.kind == "paged"), ("a tensor list", g.kind == "list"),
                          ("key_shared_prefix", prefix is not None)):
        if used and lens.left_padding:
            fail(lens.left_padding, f"None with {feature} (no left padding)",
                 Described("left padding (a padding size with "
                 "the actual lengths)"))
    full_quant = query.dtype == I8
    if prefix is not None:
        require(g.kind == "dense", "key_shared_prefix", "None with block_table or a tensor list", Described("a prefix"))
        require(not full_quant, "key_shared_prefix", "None when query, key and value are all int8",
                Described("a prefix"))
    require(not full_quant or not g.decode, "query", "a float query when Q_S = 1 (int8 query, key and value are "
            "supported for Q_S > 1)", query)
    require(not full_quant or g.kind != "paged", "query", "a float query with block_table (paged attention)", query)
    require(not (g.int4 and (not g.decode or lens.left_padding is not None)), "key", "int4 key/value only for "
            "Q_S = 1 without left padding", g.keys[0])
    # the Pythonic API extends int4 to paged caches (PagedKVCache(quant="int4")); the seed rejects it
    require(not (g.int4 and g.kind == "paged" and strict), "block_table", "None with int4 key/value (aclnn)",
            block_table)


def _quantization(g: _Inputs, lens: _Lengths, query_dtype, geo: AntiquantGeometry, strict: bool, *, deq_scale1,
                  quant_scale1, deq_scale2, quant_scale2, quant_offset2, antiquant_mode, key_antiquant_mode,
                  value_antiquant_mode, **antiquant):
    """``(int8 chain, int8 output, key antiquant, value antiquant)``, each None when unused, with their rules."""
    out_quant = build_output_quant(quant_scale2, quant_offset2, n1=g.n1, dv=g.dv, query_dtype=query_dtype)
    if out_quant is not None:
        require(not g.int4, "quant_scale2", "None with int4 key/value (no int8 output)", quant_scale2)
        require(out_quant.scale.numel() == 1 or lens.left_padding is None, "quant_scale2",
                "a per-tensor scale with left padding", quant_scale2)
    int8 = None
    if query_dtype == I8:
        int8 = build_int8_chain(deq_scale1, quant_scale1, deq_scale2)
    else:
        _reject("the int8 full-quant parameters need an int8 query", deq_scale1=deq_scale1,
                quant_scale1=quant_scale1, deq_scale2=deq_scale2)
    if query_dtype == I8 or g.keys[0].dtype not in (I8, I32):
        _reject("antiquant parameters need int8 or int4 (int32) key/value with a float query", **antiquant)
        return int8, out_quant, None, None
    key_quant, value_quant, separate = build_kv_antiquant(
        **antiquant, antiquant_mode=antiquant_mode, key_antiquant_mode=key_antiquant_mode,
        value_antiquant_mode=value_antiquant_mode, geo=geo, int4=g.int4)
    _check_antiquant_use(g, lens, separate, out_quant, query_dtype, key_antiquant_mode, value_antiquant_mode, strict)
    return int8, out_quant, key_quant, value_quant


def _reject(why: str, **params) -> None:
    for name, t in params.items():
        if t is not None:
            fail(name, f"None ({why})", t)


def _query_rows(query: Tensor, g: _Inputs, lens: _Lengths) -> tuple[Tensor, ...]:
    view = tokens_view(query, g.in_layout, g.n1)
    if g.in_layout == "TND":
        return tuple(view[s:s + n] for s, n in zip(lens.q_starts, lens.q_lens))
    return tuple(view[b, s:s + n] for b, (s, n) in enumerate(zip(lens.q_starts, lens.q_lens)))


def _check_antiquant_use(g: _Inputs, lens: _Lengths, separate: bool, out_quant, query_dtype, kmode, vmode,
                         strict) -> None:
    """Which queries, outputs and features each antiquant style combines with (seed constraints)."""
    floats = _float_dtypes(strict)
    if not g.decode:
        require(g.kind != "paged", "block_table", "None with int8 key/value when Q_S > 1 (paged attention has no "
                "antiquant there)", Described("a block table"))
        if separate:
            require(query_dtype in (BF16,) + floats[2:] and out_quant is None and g.q_s <= 16, "query",
                    "a bfloat16 query with Q_S <= 16 and a bfloat16 output for the separate K/V antiquant "
                    "parameters (Q_S > 1)", Described(f"{describe(query_dtype)}, Q_S={g.q_s}, "
                    f"{'int8' if out_quant is not None else 'float'} output"))
            require(g.kind == "dense" and lens.left_padding is None, "key", "a dense key without left padding for the "
                    "separate K/V antiquant parameters (Q_S > 1)", Described(f"{g.kind} key/value"))
            require(g.keys[0].dtype == I8, "key", "int8 for the separate antiquant parameters (Q_S > 1)", g.keys[0])
        else:
            require(query_dtype in (F16,) + floats[2:], "query", "a float16 query for the combined antiquant_scale "
                    "(Q_S > 1)", query_dtype)
    elif separate and (kmode, vmode) == (0, 1) and g.keys[0].dtype == I8:
        require(query_dtype in (F16,) + floats[2:] and out_quant is None, "query", "a float16 query and output for "
                "key per-channel + value per-token with int8 key/value", query_dtype)


OPTION_NAMES = tuple(name for name, param in inspect.signature(build_problem).parameters.items()
                     if param.kind is inspect.Parameter.KEYWORD_ONLY and name != "strict")
"""The keyword options of :func:`build_problem` (the aclnn parameter names), for callers that forward theirs."""

