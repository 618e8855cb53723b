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
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import check_int, check_scale, fail
from ..._core.errors import PrecisionNotEmulatedError
from ..._core.layouts import tokens_view
from ..common.npu_rounding import NpuRounding, check_precision, npu_rounding
from ..._core.masks import MaskRule, MaskSpec, build_infer_mask_spec, check_infer_mask
from ..._core.pse import PseSpec
from ..._core.varlen import SeqInfo, batch_windows, seq_info_varlen
from .paged import KVSegment, unaddressable_columns, with_masked_columns
from .quant import Antiquant, AntiquantGeometry, Int8Chain, OutputQuant
from .inputs import F16, I8, Inputs, dense_kv_tokens, read_inputs
from .lengths import Lengths, check_leading_zero, read_lengths
from .kv_runs import kv_segments, paged_kv, shared_prefix
from .constraints import check_envelope, check_features, check_int8_output_rows, check_pse, quantization

INT_MAX = 2147483647


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
        return kv_segments(d.g, d.lens, d.kv_tokens, d.value_tokens, d.prefix, self.source.block_table,
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
    g = read_inputs(query, key, value, num_heads=num_heads, num_key_value_heads=num_key_value_heads,
                input_layout=input_layout, block_table=block_table, strict=strict)
    check_scale("scale_value", scale)
    for name, v in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens), ("sparse_mode", sparse_mode)):
        check_int(name, v)
    check_int("inner_precise", inner_precise, lo=0, hi=1 if g.decode else 3)
    kv_tokens, value_tokens = dense_kv_tokens(g)
    if g.in_layout == "TND":
        check_leading_zero(actual_seq_lengths, actual_seq_lengths_kv, block_table)
    lens, batch = read_lengths(g, kv_tokens, actual_seq_lengths=actual_seq_lengths,
                           actual_seq_lengths_kv=actual_seq_lengths_kv, query_padding_size=query_padding_size,
                           kv_padding_size=kv_padding_size, strict=strict)
    pages = None
    if g.kind == "paged":
        lens, block_size, num_blocks = paged_kv(g, lens, block_table, block_size, strict)
        pages = (num_blocks, block_size)
    prefix = shared_prefix(g, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len)
    plen = 0 if prefix is None else prefix[2]
    check_features(g, lens, prefix, query, block_table, strict)
    seq = seq_info_varlen(lens.q_lens, [plen + n for n in lens.kv_lens])
    kv_cols = lens.kv_cols + plen
    int8, out_quant, key_quant, value_quant = quantization(
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
        check_int8_output_rows(sparse_mode, atten_mask is not None, pre_tokens, next_tokens,
                                quant_offset2 is not None, seq)
    pse_shift = check_pse(pse_shift, g, seq, kv_cols, query.dtype)
    rounding = npu_rounding_of(precision, query.dtype, inner_precise, g.decode)
    if rounding is not None and g.decode:
        if g.int4 or any(q is not None and q.kind != "static" for q in (key_quant, value_quant)):
            fail("precision", "'exact' for int4 or per-token antiquant KV in decode (the NPU emulation covers float KV "
                 "and per-tensor/per-channel int8 KV)", precision, error=PrecisionNotEmulatedError)
    if strict:
        check_envelope(g, lens, kv_cols, out_quant, pse_shift, block_size)
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

    g: Inputs
    lens: Lengths
    kv_tokens: list
    value_tokens: list
    prefix: tuple | None
    mask_args: dict
    q_offsets: list[int] | None  # left-padding starts at which masks and pse are read (None for TND)
    kv_offsets: list[int] | None
    built: dict = dataclasses.field(default_factory=dict)  # the parts built so far, by name


def _query_rows(query: Tensor, g: Inputs, lens: Lengths) -> tuple[Tensor, ...]:
    view = tokens_view(query, g.in_layout, g.n1)
    if g.in_layout == "TND":
        return tuple(view[s:s + n] for s, n in zip(lens.q_starts, lens.q_lens))
    return tuple(view[b, s:s + n] for b, (s, n) in enumerate(zip(lens.q_starts, lens.q_lens)))


OPTION_NAMES = tuple(name for name, param in inspect.signature(build_problem).parameters.items()
                     if param.kind is inspect.Parameter.KEYWORD_ONLY and name != "strict")
"""The keyword options of :func:`build_problem` (the aclnn parameter names), for callers that forward theirs."""
