"""The geometry of an FIA call: layouts, head counts and dims, how key and value are given (a tensor, per-batch
tensors or a paged cache) and their token views."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import Described, check_int, check_tensor, describe, fail, require, require_not_none
from ..._core.errors import ParamDtypeError
from ..._core.layouts import bsnd_dims, io_layouts, tokens_view

LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND")
F16, BF16, F32, I8, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32
MAX_GROUP = 64


@dataclass(frozen=True)
class Inputs:
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


def float_dtypes(strict: bool) -> tuple[torch.dtype, ...]:
    return (F16, BF16) if strict else (F16, BF16, F32)


def _as_tensors(name: str, x) -> list:
    """A tensor or a list of per-batch tensors (aclnn TensorList) -> list of tensors."""
    require_not_none(x, name)
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    require(len(items) > 0, name, "a tensor or a non-empty list of tensors", x)
    for i, t in enumerate(items):
        check_tensor(name if len(items) == 1 else f"{name}[{i}]", t)
    return items


def read_inputs(query, key, value, *, num_heads, num_key_value_heads, input_layout, block_table, strict) -> Inputs:
    in_layout, out_layout = io_layouts("input_layout", input_layout, LAYOUTS)
    floats = float_dtypes(strict)
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
    return Inputs(in_layout, out_layout, batch, q_s, n1, n2, d, dv, keys, values, kind, int4)


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


def dense_kv_tokens(g: Inputs) -> tuple[list[Tensor], list[Tensor]]:
    """Token views of a dense key and value or of each tensor of their lists (none for a paged cache)."""
    if g.kind == "paged":
        return [], []
    names = ["key"] if g.kind == "dense" else [f"key[{i}]" for i in range(len(g.keys))]
    tokens = [kv_token_view(g, k, name) for k, name in zip(g.keys, names)]
    values = [kv_token_view(g, v, name.replace("key", "value"), value=True) for v, name in zip(g.values, names)]
    if g.kind == "list":
        require(len(g.keys) == g.batch, "key", f"a list of B={g.batch} tensors (one per batch)",
                Described(f"{len(g.keys)} tensors"))
        for i, t in enumerate(tokens):
            require(t.shape[0] == 1, f"key[{i}]", "batch size 1 (tensor list)", g.keys[i])
    elif g.in_layout != "TND":
        require(tokens[0].shape[0] == g.batch, "key", f"batch size B={g.batch} like query", g.keys[0])
    return tokens, values


def kv_width(g: Inputs, value: bool = False) -> int:
    """Last dim of a K (or V) head: Dk (Dv), or a eighth of it for int4 packed in int32."""
    d = g.dv if value else g.d
    return d // 8 if g.int4 else d


def kv_token_view(g: Inputs, x: Tensor, name: str, value: bool = False) -> Tensor:
    """Validate one dense K (or V) tensor (or a list item / prefix) and return its ``[B, S, N2, D]`` (TND
    ``[T, N2, D]``) token view."""
    w = kv_width(g, value)
    if g.in_layout == "TND":
        check_tensor(name, x, ndim=3)
        require(tuple(x.shape[1:]) == (g.n2, w), name, f"[T, N2={g.n2}, D={w}]", x)
        return x
    check_tensor(name, x, ndim=3 if g.in_layout == "BSH" else 4)
    ok = x.shape[-1] == g.n2 * w if g.in_layout == "BSH" else bsnd_dims(x, g.in_layout, None)[2:] == (g.n2, w)
    want = f"H = N2*D = {g.n2}*{w}" if g.in_layout == "BSH" else f"N2={g.n2} heads of D={w}"
    require(ok, name, f"a {g.in_layout} tensor with {want}" + (" (int4: D/8 int32 words)" if g.int4 else ""), x)
    return tokens_view(x, g.in_layout, g.n2)
