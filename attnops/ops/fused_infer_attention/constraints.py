"""Which FIA features combine and the NPU envelope (seed constraints): feature combinations, quantization,
pse_shift, int8 output rows and the aclnn size and alignment limits."""
from __future__ import annotations

from torch import Tensor

from ..._core.checks import Described, check_tensor, describe, fail, require
from ..._core.varlen import SeqInfo
from .quant import AntiquantGeometry, build_int8_chain, build_kv_antiquant, build_output_quant
from .inputs import BF16, F16, I8, I32, Inputs, float_dtypes
from .lengths import Lengths

MAX_S = 20 << 20


def check_features(g: Inputs, lens: Lengths, prefix, query: Tensor, block_table, strict: bool) -> None:
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


def quantization(g: Inputs, lens: Lengths, query_dtype, geo: AntiquantGeometry, strict: bool, *, deq_scale1,
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


def _check_antiquant_use(g: Inputs, lens: Lengths, separate: bool, out_quant, query_dtype, kmode, vmode,
                         strict) -> None:
    """Which queries, outputs and features each antiquant style combines with (seed constraints)."""
    floats = float_dtypes(strict)
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


def check_pse(pse_shift, g: Inputs, seq: SeqInfo, kv_cols: int, query_dtype) -> Tensor | None:
    """pse_shift ``(B|1, N1, >=Q_S, >=KV_S)``, added after the scale (read at the left-padding offsets)."""
    if pse_shift is None:
        return None
    check_tensor("pse_shift", pse_shift, ndim=4, dtypes=(F16 if query_dtype == I8 else query_dtype,))
    rows = max(seq.q_lens, default=0) if g.in_layout == "TND" else g.q_s
    ok = pse_shift.shape[0] in (1, seq.batch) and pse_shift.shape[1] == g.n1 and pse_shift.shape[2] >= rows and \
        pse_shift.shape[3] >= kv_cols
    require(ok, "pse_shift", f"shape (B={seq.batch} or 1, N={g.n1}, Q_S >= {rows}, KV_S >= {kv_cols})", pse_shift)
    return pse_shift


def check_int8_output_rows(mask_mode: int, has_mask: bool, pre: int, nxt: int, offset: bool, seq: SeqInfo) -> None:
    """Int8 output (Q_S > 1): no band with negative tokens; with quant_offset2, reject the sparse configurations in
    which some rows attend to nothing (seed list; the KV lengths include the shared prefix)."""
    require(not (mask_mode == 4 and (pre < 0 or nxt < 0)), "pre_tokens", "non-negative pre_tokens and next_tokens "
            "for sparse_mode 4 with an int8 output", Described(f"pre_tokens={pre}, next_tokens={nxt}"))
    for q, kv in zip(seq.q_lens, seq.kv_lens) if offset else ():
        bad = {0: has_mask and (q - kv - pre > 0 or nxt < 0), 3: kv - q < 0, 4: pre < 0 or nxt + kv - q < 0}
        require(not bad.get(mask_mode, False), "quant_offset2", f"None for sparse_mode {mask_mode} with rows that "
                "attend to nothing (int8 output; apply the offset outside the operator)",
                Described(f"Sq={q}, Skv={kv} (prefix included), pre_tokens={pre}, next_tokens={nxt}"))


def check_envelope(g: Inputs, lens: Lengths, kv_cols: int, out_quant, pse_shift, block_size) -> None:
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
