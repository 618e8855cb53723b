"""The per-batch query and KV lengths of an FIA call and their starts: actual lengths, cumulative TND lengths and
left padding; values on a device are kept unread."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import Described, check_int, check_tensor, fail, int_list, require
from ..._core.varlen import lengths_from_cumulative
from .inputs import Inputs


@dataclass(frozen=True)
class Lengths:
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


def on_device(x) -> bool:
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
        if on_device(value):
            return value
        value = int(value.reshape(-1)[0])
    return max(0, check_int(name, value))


def _device_kv_lengths(g: Inputs, value: Tensor, batch: int) -> Tensor:
    """``actual_seq_lengths_kv`` as a device tensor: int32/int64 ``[1]`` (shared) or ``[>= B]``; not read."""
    require(g.in_layout != "TND" and g.kind != "list", "actual_seq_lengths_kv", "a list or a CPU tensor for layout "
            "TND and for key/value tensor lists (a device tensor is read by the paged and dense decode kernels)",
            value)
    check_tensor("actual_seq_lengths_kv", value, ndim=1, dtypes=(torch.int32, torch.int64))
    require(value.numel() == 1 or value.numel() >= batch, "actual_seq_lengths_kv", f"1 value or at least B={batch} "
            "values", value)
    return value


def read_lengths(g: Inputs, kv_tokens: list[Tensor], *, actual_seq_lengths, actual_seq_lengths_kv, query_padding_size,
             kv_padding_size, strict) -> tuple[Lengths, int]:
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
    if q_left and not on_device(qpad):
        q_starts = [g.q_s - qpad - n for n in q_lens]
        for b, s in enumerate(q_starts):
            require(s >= 0, "query_padding_size", f"Q_S - query_padding_size - actual_seq_lengths[{b}] >= 0 "
                    "(left padding)", Described(f"Q_S={g.q_s}, query_padding_size={qpad}, length {q_lens[b]}"))
    device_lens = _device_kv_lengths(g, actual_seq_lengths_kv, batch) if on_device(actual_seq_lengths_kv) else None
    pads = dict(kv_lengths=device_lens, query_padding=qpad if q_left else None)
    if g.kind == "paged":
        require(actual_seq_lengths_kv is not None, "actual_seq_lengths_kv", "the per-batch KV lengths (required "
                "with block_table)", None)
        kv_lens = [0] * batch if device_lens is not None else _per_batch("actual_seq_lengths_kv",
                                                                          actual_seq_lengths_kv, batch, [])
        return Lengths(q_lens, q_starts, kv_lens, [0] * batch, 0, _left_padding(q_left, kvpad is not None),
                        **pads), batch
    if g.in_layout == "TND":
        require(actual_seq_lengths_kv is not None, "actual_seq_lengths_kv", "cumulative KV lengths for layout TND",
                None)
        kv_lens = lengths_from_cumulative("actual_seq_lengths_kv", actual_seq_lengths_kv, kv_tokens[0].shape[0])
        require(len(kv_lens) == batch, "actual_seq_lengths_kv", f"B={batch} cumulative values like "
                "actual_seq_lengths", kv_lens)
        starts = [sum(kv_lens[:b]) for b in range(batch)]
        return Lengths(q_lens, q_starts, kv_lens, starts, max(kv_lens, default=0), None), batch
    phys = [t.shape[1] for t in kv_tokens] if g.kind == "list" else [kv_tokens[0].shape[1]] * batch
    kv_lens = phys if device_lens is not None else _per_batch("actual_seq_lengths_kv", actual_seq_lengths_kv, batch,
                                                              phys)
    for b, (n, s) in enumerate(zip(kv_lens, phys)):
        require(n <= s, f"actual_seq_lengths_kv[{b}]", f"at most the key/value S={s} of batch {b}", n)
    kv_starts = [0] * batch
    kv_left = kvpad is not None and actual_seq_lengths_kv is not None
    pads["kv_padding"] = kvpad if kv_left else None
    if kv_left and not (on_device(kvpad) or device_lens is not None):  # else the kernels compute the starts
        kv_starts = [s - kvpad - n for s, n in zip(phys, kv_lens)]
        for b, s in enumerate(kv_starts):
            # Q_S = 1: a start before 0 gives an all-zero batch (seed); Q_S > 1: undefined on the NPU, rejected
            require(s >= 0 or g.decode, "kv_padding_size", f"KV_S - kv_padding_size - actual_seq_lengths_kv[{b}] "
                    ">= 0 (left padding)", Described(f"KV_S={phys[b]}, kv_padding_size={kvpad}, length {kv_lens[b]}"))
        kv_lens = [0 if s < 0 else n for s, n in zip(kv_starts, kv_lens)]
        kv_starts = [max(s, 0) for s in kv_starts]
    return Lengths(q_lens, q_starts, kv_lens, kv_starts, max(phys, default=0), _left_padding(q_left, kv_left),
                    **pads), batch


def check_leading_zero(actual_seq_lengths, actual_seq_lengths_kv, block_table) -> None:
    """TND: a leading 0 in the cumulative ``actual_seq_lengths`` is an empty first batch (B is the list's length).
    Where the KV lengths or the block table count one batch fewer, that 0 is the mistake (flash-attn's
    ``cu_seqlens`` passed whole): ``actual_seq_lengths`` is named, not the argument that disagrees with it."""
    values = int_list("actual_seq_lengths", actual_seq_lengths)
    if values is None or len(values) < 2 or values[0] != 0:
        return
    others = {}
    if isinstance(block_table, Tensor) and block_table.dim() == 2:
        others["block_table"] = block_table.shape[0]
    if not on_device(actual_seq_lengths_kv):
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
