"""The validation table of aclnnFusedInferAttentionScoreV2: one case per documented constraint and combination rule
of the seed (parameter table, "约束与限制", Q_S > 1 and Q_S = 1 sections).

aclnn reports these errors from phase 1 (``GetWorkspaceSize``): every rejected call must raise the status-coded
exception from ``fused_infer_attention_score_v2_get_workspace_size`` and from the one-call form:
ParamNullptrError (161001) for a missing query/key/value, ParamInvalidError / ParamDtypeError (161002) otherwise,
with a message that starts with the name of (one of) the argument(s) involved.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import attnops
import attnops.aclnn
from attnops import AclnnError, ParamDtypeError, ParamInvalidError, ParamNullptrError
from attnops.testing.golden_fia import encode_deq_scale, pack_int4
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, aclnn_args, layout_of, make_inputs, rand_mask,
                                                         randint4, randint8, to_paged)

NULL, INVALID, DTYPE = ParamNullptrError, ParamInvalidError, ParamDtypeError
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ------------------------------------------------------------------------------------------- base configurations
def _common(**kw):
    p = dict(num_heads=2, scale_value=0.25, input_layout="BSH")
    p.update(kw)
    return p


def base(kind: str) -> dict:
    """A valid call of each kind (query, key, value and the seed keywords)."""
    if kind in ("prefill", "decode"):
        q, k, v = make_inputs("BSH", b=2, n=2, sq=4 if kind == "prefill" else 1, skv=6, d=16, dtype=F16)
        return _common(query=q, key=k, value=v)
    if kind in ("bnsd_prefill", "bnsd_decode"):
        q, k, v = make_inputs("BNSD", b=2, n=2, sq=4 if kind == "bnsd_prefill" else 1, skv=6, d=16, dtype=F16)
        return _common(query=q, key=k, value=v, input_layout="BNSD")
    if kind == "int8":
        q, k, v = (randint8(2, s, 64, seed=i) for i, s in enumerate((4, 6, 6)))
        return _common(query=q, key=k, value=v, deq_scale1=encode_deq_scale(1e-4),
                       quant_scale1=torch.tensor([127.0]), deq_scale2=encode_deq_scale(1 / 127))
    if kind == "int8out":
        q, k, v = make_inputs("BSH", b=2, n=2, sq=4, skv=6, d=32, dtype=F16)
        return _common(query=q, key=k, value=v, quant_scale2=torch.tensor([20.0]))
    if kind in ("paged_prefill", "paged_decode"):
        pre = kind == "paged_prefill"
        bs, lens = (128, [130, 60]) if pre else (16, [40, 7])
        q, _, _ = make_inputs("BNSD", b=2, n=2, sq=4 if pre else 1, skv=1, d=16, dtype=F16)
        k, v = randn(2, 2, max(lens), 16, dtype=F16, seed=1), randn(2, 2, max(lens), 16, dtype=F16, seed=2)
        kc, bt = to_paged(k, lens, bs, cache_layout="BSH" if pre else "BNSD", seed=3)
        vc, _ = to_paged(v, lens, bs, cache_layout="BSH" if pre else "BNSD", seed=3)
        return _common(query=q, key=kc, value=vc, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens,
                       input_layout="BNSD")
    if kind == "anti_decode":
        q = make_inputs("BSH", b=2, n=2, sq=1, d=32, dtype=F16)[0]
        return _common(query=q, key=randint8(2, 6, 64, seed=1), value=randint8(2, 6, 64, seed=2),
                       antiquant_scale=torch.full((2, 64), 0.01, dtype=F16),
                       antiquant_offset=torch.zeros(2, 64, dtype=F16))
    if kind == "anti_prefill":
        q = make_inputs("BSH", b=2, n=2, sq=4, d=32, dtype=F16)[0]
        return _common(query=q, key=randint8(2, 6, 64, seed=1), value=randint8(2, 6, 64, seed=2),
                       antiquant_scale=torch.full((2, 64), 0.01, dtype=F16))
    if kind == "sep_prefill":
        q = make_inputs("BSH", b=2, n=2, sq=4, d=32, dtype=BF16)[0]
        return _common(query=q, key=randint8(2, 6, 64, seed=1), value=randint8(2, 6, 64, seed=2),
                       key_antiquant_scale=torch.full((2, 32), 0.01, dtype=BF16),
                       value_antiquant_scale=torch.full((2, 32), 0.02, dtype=BF16),
                       key_antiquant_offset=torch.zeros(2, 32, dtype=BF16),
                       value_antiquant_offset=torch.zeros(2, 32, dtype=BF16))
    if kind == "sep_decode":
        q = make_inputs("BSH", b=2, n=2, sq=1, d=32, dtype=F16)[0]
        return _common(query=q, key=randint8(2, 6, 64, seed=1), value=randint8(2, 6, 64, seed=2),
                       key_antiquant_scale=torch.full((1, 2, 1, 32), 0.01, dtype=F16),
                       value_antiquant_scale=torch.full((1, 2, 1, 32), 0.02, dtype=F16),
                       key_antiquant_offset=torch.zeros(1, 2, 1, 32, dtype=F16),
                       value_antiquant_offset=torch.zeros(1, 2, 1, 32, dtype=F16))
    if kind == "int4_decode":
        q = make_inputs("BSH", b=2, n=2, sq=1, d=64, dtype=F16)[0]
        return _common(query=q, key=pack_int4(randint4(2, 6, 128, seed=1)),
                       value=pack_int4(randint4(2, 6, 128, seed=2)),
                       key_antiquant_scale=torch.full((1, 2, 1, 64), 0.1, dtype=F16),
                       value_antiquant_scale=torch.full((1, 2, 1, 64), 0.1, dtype=F16))
    if kind == "prefix":
        q, k, v = make_inputs("BSH", b=2, n=2, sq=4, skv=6, d=16, dtype=F16)
        kp, vp, _ = make_inputs("BSH", b=1, n=2, sq=3, skv=3, d=16, dtype=F16, seed=5)
        return _common(query=q, key=k, value=v, key_shared_prefix=kp, value_shared_prefix=vp,
                       actual_shared_prefix_len=[3])
    if kind == "list":
        q = make_inputs("BSH", b=2, n=2, sq=4, d=16, dtype=F16)[0]
        ks = [randn(1, s, 32, dtype=F16, seed=s) for s in (5, 3)]
        vs = [randn(1, s, 32, dtype=F16, seed=10 + s) for s in (5, 3)]
        return _common(query=q, key=ks, value=vs)
    if kind == "leftpad":
        q, k, v = make_inputs("BSH", b=2, n=2, sq=5, skv=8, d=16, dtype=F16)
        return _common(query=q, key=k, value=v, actual_seq_lengths=[3, 4], actual_seq_lengths_kv=[5, 6],
                       query_padding_size=torch.tensor([1]), kv_padding_size=torch.tensor([2]))
    if kind == "leftpad_decode":
        q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=8, d=16, dtype=F16)
        return _common(query=q, key=k, value=v, actual_seq_lengths_kv=[5, 6], kv_padding_size=torch.tensor([2]))
    raise ValueError(kind)


KINDS = ["prefill", "decode", "bnsd_prefill", "bnsd_decode", "int8", "int8out", "paged_prefill", "paged_decode",
         "anti_decode", "anti_prefill", "sep_prefill", "sep_decode", "int4_decode", "prefix", "list", "leftpad",
         "leftpad_decode"]


# ------------------------------------------------------------------------------------------- the table
@dataclass
class Case:
    kind: str
    id: str
    mutate: Callable[[dict], None]  # edits the parameter dict in place
    exc: type
    names: tuple[str, ...]


CASES: list[Case] = []


def case(kind, id_, mutate, exc, names):
    CASES.append(Case(kind, id_, mutate, exc, (names,) if isinstance(names, str) else tuple(names)))


def setp(**changes):
    def f(p):
        for k_, v_ in changes.items():
            p[k_] = v_(p) if callable(v_) else v_
    return f


def fp16_to(dtype, name):
    return setp(**{name: lambda p: p[name].to(dtype)})


# --- required inputs and dtypes (seed: 161001 for null query/key/value; 161002 for dtypes)
for nm in ("query", "key", "value"):
    case("prefill", f"{nm}-none", setp(**{nm: None}), NULL, nm)
case("prefill", "query-fp32", fp16_to(F32, "query"), DTYPE, "query")
case("prefill", "key-value-fp32", setp(key=lambda p: p["key"].float(), value=lambda p: p["value"].float()), DTYPE,
     ("key", "value"))
case("prefill", "key-value-int64", setp(key=lambda p: p["key"].long(), value=lambda p: p["value"].long()), DTYPE,
     ("key", "value"))
case("prefill", "value-dtype-differs-from-key", fp16_to(BF16, "value"), INVALID, ("value", "key"))
case("prefill", "atten_mask-fp16", setp(atten_mask=lambda p: torch.zeros(4, 6, dtype=F16), sparse_mode=1), DTYPE,
     "atten_mask")
case("prefill", "pse_shift-fp32", setp(pse_shift=lambda p: torch.zeros(1, 2, 4, 6)), DTYPE, "pse_shift")
case("int8", "deq_scale1-fp16", setp(deq_scale1=torch.tensor([1e-4], dtype=F16)), DTYPE, "deq_scale1")
case("int8", "quant_scale1-fp16", setp(quant_scale1=torch.tensor([127.0], dtype=F16)), DTYPE, "quant_scale1")
case("int8", "deq_scale2-int32", setp(deq_scale2=torch.tensor([1], dtype=torch.int32)), DTYPE, "deq_scale2")
case("int8out", "quant_scale2-fp16", setp(quant_scale2=torch.tensor([20.0], dtype=F16)), DTYPE, "quant_scale2")
case("int8out", "quant_offset2-int8", setp(quant_offset2=torch.tensor([1], dtype=torch.int8)), INVALID,
     "quant_offset2")
case("anti_decode", "antiquant_scale-int8", setp(antiquant_scale=lambda p: p["antiquant_scale"].to(torch.int8)),
     DTYPE, "antiquant_scale")
case("paged_decode", "block_table-int64", setp(block_table=lambda p: p["block_table"].long()), DTYPE, "block_table")
case("leftpad", "query_padding_size-int32", setp(query_padding_size=torch.tensor([1], dtype=torch.int32)), DTYPE,
     "query_padding_size")
case("leftpad", "kv_padding_size-fp32", setp(kv_padding_size=torch.tensor([1.0])), DTYPE, "kv_padding_size")
case("sep_decode", "key_antiquant_scale-int32",
     setp(key_antiquant_scale=lambda p: p["key_antiquant_scale"].to(torch.int32)), DTYPE, "key_antiquant_scale")
case("prefix", "key_shared_prefix-fp32", setp(key_shared_prefix=lambda p: p["key_shared_prefix"].float(),
                                              value_shared_prefix=lambda p: p["value_shared_prefix"].float()),
     INVALID, ("key_shared_prefix", "value_shared_prefix"))

# --- pse dtype rules
case("prefill", "pse-bf16-with-fp16-query", setp(pse_shift=torch.zeros(1, 2, 4, 6, dtype=BF16)), INVALID,
     "pse_shift")
case("prefill", "pse-fp16-with-bf16-query", setp(query=lambda p: p["query"].bfloat16(),
                                                 key=lambda p: p["key"].bfloat16(),
                                                 value=lambda p: p["value"].bfloat16(),
                                                 pse_shift=torch.zeros(1, 2, 4, 6, dtype=F16)), INVALID, "pse_shift")
case("decode", "decode-pse-bf16-with-fp16-query", setp(pse_shift=torch.zeros(2, 2, 1, 6, dtype=BF16)), INVALID,
     "pse_shift")
case("prefill", "pse-wrong-N", setp(pse_shift=torch.zeros(2, 3, 4, 6, dtype=F16)), INVALID, "pse_shift")
case("prefill", "pse-wrong-B", setp(pse_shift=torch.zeros(3, 2, 4, 6, dtype=F16)), INVALID, "pse_shift")
case("prefill", "pse-3d", setp(pse_shift=torch.zeros(2, 4, 6, dtype=F16)), INVALID, "pse_shift")
case("prefill", "pse-rows-below-Q_S", setp(pse_shift=torch.zeros(2, 2, 3, 6, dtype=F16)), INVALID, "pse_shift")
case("prefill", "pse-cols-below-KV_S", setp(pse_shift=torch.zeros(2, 2, 4, 5, dtype=F16)), INVALID, "pse_shift")
case("decode", "decode-pse-cols-below-KV_S", setp(pse_shift=torch.zeros(2, 2, 1, 5, dtype=F16)), INVALID,
     "pse_shift")
case("decode", "decode-pse-D-not-16-aligned",
     setp(query=lambda p: p["query"][..., :16].contiguous(), key=lambda p: p["key"][..., :16].contiguous(),
          value=lambda p: p["value"][..., :16].contiguous(), pse_shift=torch.zeros(2, 2, 1, 6, dtype=F16)),
     INVALID, ("pse_shift", "query"))
case("prefix", "pse-cols-below-prefix-plus-KV_S", setp(pse_shift=torch.zeros(2, 2, 4, 8, dtype=F16)), INVALID,
     "pse_shift")

# --- layouts, heads, sizes
case("prefill", "input_layout-SBH", setp(input_layout="SBH"), INVALID, "input_layout")
case("bnsd_decode", "BNSD_BSND-with-Q_S-1", setp(input_layout="BNSD_BSND"), INVALID, "input_layout")
case("bnsd_prefill", "num_heads-differs-from-N", setp(num_heads=4), INVALID, "num_heads")
case("prefill", "H-not-multiple-of-num_heads", setp(num_heads=3), INVALID, ("num_heads", "query"))
case("prefill", "num_heads-0", setp(num_heads=0), INVALID, "num_heads")
case("bnsd_prefill", "num_heads-not-multiple-of-kv-heads",
     setp(query=lambda p: randn(2, 3, 4, 16, dtype=F16), num_heads=3, num_key_value_heads=2), INVALID,
     "num_key_value_heads")
case("bnsd_prefill", "kv-heads-differ-from-key-N", setp(num_key_value_heads=1), INVALID,
     ("num_key_value_heads", "key"))
case("bnsd_prefill", "gqa-ratio-over-64",
     setp(query=lambda p: randn(1, 128, 2, 16, dtype=F16), key=lambda p: randn(1, 1, 3, 16, dtype=F16),
          value=lambda p: randn(1, 1, 3, 16, dtype=F16), num_heads=128, num_key_value_heads=1), INVALID,
     ("num_key_value_heads", "num_heads"))
case("prefill", "key-value-shapes-differ", setp(value=lambda p: p["value"][:, :5].contiguous()), INVALID,
     ("value", "key"))
case("prefill", "key-D-differs", setp(key=lambda p: randn(2, 6, 64, dtype=F16), value=lambda p: randn(
    2, 6, 64, dtype=F16), num_key_value_heads=2), INVALID, ("key", "value", "num_key_value_heads"))
case("bnsd_prefill", "N-over-256",
     setp(query=lambda p: randn(1, 257, 2, 16, dtype=F16), key=lambda p: randn(1, 257, 2, 16, dtype=F16),
          value=lambda p: randn(1, 257, 2, 16, dtype=F16), num_heads=257), INVALID, ("query", "num_heads"))
case("bnsd_decode", "decode-N-over-256",
     setp(query=lambda p: randn(1, 257, 1, 16, dtype=F16), key=lambda p: randn(1, 257, 2, 16, dtype=F16),
          value=lambda p: randn(1, 257, 2, 16, dtype=F16), num_heads=257), INVALID, ("query", "num_heads"))
case("bnsd_prefill", "D-over-512",
     setp(query=lambda p: randn(1, 1, 2, 528, dtype=F16), key=lambda p: randn(1, 1, 2, 528, dtype=F16),
          value=lambda p: randn(1, 1, 2, 528, dtype=F16), num_heads=1), INVALID, "query")
case("bnsd_decode", "decode-D-over-512",
     setp(query=lambda p: randn(1, 1, 1, 528, dtype=F16), key=lambda p: randn(1, 1, 2, 528, dtype=F16),
          value=lambda p: randn(1, 1, 2, 528, dtype=F16), num_heads=1), INVALID, "query")
case("prefill", "BSH-N*D-65535-or-more",
     setp(query=lambda p: torch.zeros(1, 2, 256 * 256, dtype=F16), key=lambda p: torch.zeros(1, 2, 4 * 256,
                                                                                            dtype=F16),
          value=lambda p: torch.zeros(1, 2, 4 * 256, dtype=F16), num_heads=256, num_key_value_heads=4), INVALID,
     ("query", "num_heads"))
case("prefill", "fp16-D-not-16-aligned",
     setp(query=lambda p: randn(2, 4, 48, dtype=F16), key=lambda p: randn(2, 6, 48, dtype=F16),
          value=lambda p: randn(2, 6, 48, dtype=F16)), INVALID, ("query", "key", "value"))
case("int8", "int8-D-not-32-aligned",
     setp(query=lambda p: randint8(2, 4, 32), key=lambda p: randint8(2, 6, 32), value=lambda p: randint8(2, 6, 32)),
     INVALID, ("query", "key", "value"))
case("int8out", "int8-out-D-not-32-aligned",
     setp(query=lambda p: randn(2, 4, 32, dtype=F16), key=lambda p: randn(2, 6, 32, dtype=F16),
          value=lambda p: randn(2, 6, 32, dtype=F16)), INVALID, ("query", "quant_scale2", "attention_out"))
case("int4_decode", "int4-D-not-64-aligned",
     setp(query=lambda p: randn(2, 1, 64, dtype=F16), key=lambda p: pack_int4(randint4(2, 6, 64)),
          value=lambda p: pack_int4(randint4(2, 6, 64)), key_antiquant_scale=torch.full((1, 2, 1, 32), 0.1,
                                                                                        dtype=F16),
          value_antiquant_scale=torch.full((1, 2, 1, 32), 0.1, dtype=F16)), INVALID, ("key", "query", "value"))
case("prefill", "B-over-65536",
     setp(query=lambda p: torch.zeros(65537, 2, 32, dtype=F16), key=lambda p: torch.zeros(65537, 1, 32, dtype=F16),
          value=lambda p: torch.zeros(65537, 1, 32, dtype=F16)), INVALID, "query")
case("decode", "decode-B-over-65536",
     setp(query=lambda p: torch.zeros(65537, 1, 32, dtype=F16), key=lambda p: torch.zeros(65537, 1, 32, dtype=F16),
          value=lambda p: torch.zeros(65537, 1, 32, dtype=F16)), INVALID, "query")
case("decode", "all-int8-qkv-decode",
     setp(query=lambda p: randint8(2, 1, 64), key=lambda p: randint8(2, 6, 64), value=lambda p: randint8(2, 6, 64),
          deq_scale1=encode_deq_scale(1e-4), quant_scale1=torch.tensor([127.0]),
          deq_scale2=encode_deq_scale(1e-2)), INVALID, ("query", "key", "value"))

# --- sparse modes and masks
case("prefill", "sparse_mode-5", setp(sparse_mode=5, atten_mask=TRIU2048), INVALID, "sparse_mode")
case("prefill", "sparse_mode-minus-1", setp(sparse_mode=-1), INVALID, "sparse_mode")
for mode in (2, 3, 4):
    case("prefill", f"sparse_mode-{mode}-without-mask", setp(sparse_mode=mode), INVALID, ("atten_mask", "sparse_mode"))
    case("prefill", f"sparse_mode-{mode}-mask-not-2048", setp(sparse_mode=mode, atten_mask=torch.ones(
        4, 6, dtype=torch.bool).triu(1)), INVALID, "atten_mask")
    case("prefill", f"sparse_mode-{mode}-mask-2048-batched", setp(sparse_mode=mode, atten_mask=TRIU2048.expand(
        2, 2048, 2048)), INVALID, "atten_mask")
case("prefill", "sparse_mode-1-without-mask", setp(sparse_mode=1), INVALID, ("atten_mask", "sparse_mode"))
case("prefill", "mask-4d-with-N-2", setp(atten_mask=torch.zeros(2, 2, 4, 6, dtype=torch.bool)), INVALID,
     "atten_mask")
case("prefill", "mask-wrong-B", setp(atten_mask=torch.zeros(3, 4, 6, dtype=torch.bool)), INVALID, "atten_mask")
case("prefill", "mask-rows-below-Q_S", setp(atten_mask=torch.zeros(3, 6, dtype=torch.bool)), INVALID,
     "atten_mask")
case("prefill", "mask-cols-below-KV_S", setp(atten_mask=torch.zeros(4, 5, dtype=torch.bool)), INVALID,
     "atten_mask")
case("prefill", "mask-1d", setp(atten_mask=torch.zeros(6, dtype=torch.bool)), INVALID, "atten_mask")
case("decode", "decode-mask-wrong-B", setp(atten_mask=torch.zeros(3, 6, dtype=torch.bool)), INVALID, "atten_mask")
case("decode", "decode-mask-cols-below-KV_S", setp(atten_mask=torch.zeros(2, 5, dtype=torch.bool)), INVALID,
     "atten_mask")
case("decode", "decode-mask-B-2-KV_S", setp(atten_mask=torch.zeros(2, 2, 6, dtype=torch.bool)), INVALID,
     "atten_mask")
case("prefix", "prefix-mask-cols-below-prefix-plus-KV_S", setp(atten_mask=torch.zeros(4, 8, dtype=torch.bool)),
     INVALID, "atten_mask")

# --- actual lengths
case("prefill", "actual_seq_lengths-length-between-1-and-B",
     setp(query=lambda p: randn(3, 4, 32, dtype=F16), key=lambda p: randn(3, 6, 32, dtype=F16),
          value=lambda p: randn(3, 6, 32, dtype=F16), actual_seq_lengths=[4, 4]), INVALID, "actual_seq_lengths")
case("prefill", "actual_seq_lengths-over-Q_S", setp(actual_seq_lengths=[5, 2]), INVALID, "actual_seq_lengths")
case("prefill", "actual_seq_lengths-negative", setp(actual_seq_lengths=[-1, 2]), INVALID, "actual_seq_lengths")
case("prefill", "actual_seq_lengths_kv-length-between-1-and-B",
     setp(query=lambda p: randn(3, 4, 32, dtype=F16), key=lambda p: randn(3, 6, 32, dtype=F16),
          value=lambda p: randn(3, 6, 32, dtype=F16), actual_seq_lengths_kv=[4, 4]), INVALID,
     "actual_seq_lengths_kv")
case("prefill", "actual_seq_lengths_kv-over-KV_S", setp(actual_seq_lengths_kv=[7]), INVALID,
     "actual_seq_lengths_kv")
case("decode", "decode-actual_seq_lengths_kv-over-KV_S", setp(actual_seq_lengths_kv=[2, 7]), INVALID,
     "actual_seq_lengths_kv")
case("list", "list-actual_seq_lengths_kv-over-tensor-S", setp(actual_seq_lengths_kv=[5, 4]), INVALID,
     "actual_seq_lengths_kv")

# --- attributes
case("prefill", "inner_precise-4", setp(inner_precise=4), INVALID, "inner_precise")
case("decode", "decode-inner_precise-2", setp(inner_precise=2), INVALID, "inner_precise")
case("anti_decode", "antiquant_mode-2", setp(antiquant_mode=2), INVALID, "antiquant_mode")
case("sep_decode", "key_antiquant_mode-6", setp(key_antiquant_mode=6, value_antiquant_mode=6), INVALID,
     ("key_antiquant_mode", "value_antiquant_mode"))
case("sep_prefill", "prefill-key_antiquant_mode-2", setp(key_antiquant_mode=2, value_antiquant_mode=2), INVALID,
     ("key_antiquant_mode", "value_antiquant_mode"))
case("sep_decode", "kv-antiquant-modes-differ", setp(key_antiquant_mode=1, value_antiquant_mode=0), INVALID,
     ("key_antiquant_mode", "value_antiquant_mode"))
case("sep_prefill", "prefill-kv-antiquant-modes-0-1", setp(value_antiquant_mode=1), INVALID,
     ("key_antiquant_mode", "value_antiquant_mode", "value_antiquant_scale"))

# --- paged attention
case("paged_prefill", "prefill-block_size-64", setp(block_size=64), INVALID, "block_size")
case("paged_prefill", "prefill-block_size-640", setp(block_size=640), INVALID, "block_size")
case("paged_prefill", "prefill-block_size-192", setp(block_size=192), INVALID, "block_size")
case("paged_decode", "decode-block_size-0", setp(block_size=0), INVALID, "block_size")
case("paged_decode", "decode-block_size-528", setp(block_size=528), INVALID, "block_size")
case("paged_decode", "decode-block_size-24-fp16", setp(block_size=24), INVALID, "block_size")
case("paged_decode", "decode-block_size-48-int8",
     setp(query=lambda p: randn(2, 2, 1, 32, dtype=F16), key=lambda p: torch.zeros(6, 2, 48, 32, dtype=torch.int8),
          value=lambda p: torch.zeros(6, 2, 48, 32, dtype=torch.int8), block_size=48,
          antiquant_scale=torch.full((2, 2, 1, 32), 0.01, dtype=F16)), INVALID, "block_size")
case("paged_decode", "paged-without-actual_seq_lengths_kv", setp(actual_seq_lengths_kv=None), INVALID,
     ("actual_seq_lengths_kv", "block_table"))
case("paged_decode", "block_table-1d", setp(block_table=lambda p: p["block_table"][0].contiguous()), INVALID,
     "block_table")
case("paged_decode", "block_table-rows-not-B", setp(block_table=lambda p: p["block_table"][:1].contiguous()),
     INVALID, "block_table")
case("paged_decode", "block_table-too-few-columns", setp(block_table=lambda p: p["block_table"][:, :2].contiguous()),
     INVALID, ("block_table", "actual_seq_lengths_kv"))
case("paged_decode", "blocknum-below-needed", setp(key=lambda p: p["key"][:3].contiguous(),
                                                   value=lambda p: p["value"][:3].contiguous()),
     INVALID, ("key", "block_table", "value"))
case("paged_decode", "paged-k-v-shapes-differ", setp(value=lambda p: p["value"][:-1].contiguous()), INVALID,
     ("value", "key"))
case("paged_prefill", "paged-BSH-query-with-4d-cache",
     setp(query=lambda p: p["query"].permute(0, 2, 1, 3).reshape(2, 4, 32).contiguous(), input_layout="BSH",
          key=lambda p: p["key"].reshape(p["key"].shape[0], 128, 2, 16).permute(0, 2, 1, 3).contiguous(),
          value=lambda p: p["value"].reshape(p["value"].shape[0], 128, 2, 16).permute(0, 2, 1, 3).contiguous()),
     INVALID, ("key", "input_layout"))
case("paged_decode", "paged-with-kv-left-padding", setp(kv_padding_size=torch.tensor([1])), INVALID,
     ("kv_padding_size", "block_table"))
case("paged_prefill", "paged-with-query-left-padding",
     setp(query_padding_size=torch.tensor([0]), actual_seq_lengths=[4, 3]), INVALID,
     ("query_padding_size", "block_table"))
case("paged_prefill", "paged-prefill-with-antiquant",
     setp(key=lambda p: p["key"].to(torch.int8), value=lambda p: p["value"].to(torch.int8),
          antiquant_scale=torch.full((2, 32), 0.01, dtype=F16)), INVALID,
     ("antiquant_scale", "block_table", "key"))
case("paged_prefill", "paged-int8-query",
     setp(query=lambda p: randint8(2, 2, 4, 32), key=lambda p: torch.zeros(4, 128, 64, dtype=torch.int8),
          value=lambda p: torch.zeros(4, 128, 64, dtype=torch.int8), deq_scale1=torch.tensor([1e-4]),
          quant_scale1=torch.tensor([127.0]), deq_scale2=torch.tensor([1e-2])), INVALID,
     ("query", "block_table"))
case("paged_decode", "paged-int4-kv",
     setp(query=lambda p: randn(2, 2, 1, 64, dtype=F16), key=lambda p: torch.zeros(6, 2, 16, 8, dtype=torch.int32),
          value=lambda p: torch.zeros(6, 2, 16, 8, dtype=torch.int32),
          key_antiquant_scale=torch.full((1, 2, 1, 64), 0.1, dtype=F16),
          value_antiquant_scale=torch.full((1, 2, 1, 64), 0.1, dtype=F16)), INVALID,
     ("key", "block_table"))
case("paged_decode", "paged-mask-cols-below-blocks", setp(atten_mask=torch.zeros(2, 40, dtype=torch.bool)),
     INVALID, "atten_mask")
case("paged_decode", "paged-pse-cols-below-blocks", setp(pse_shift=torch.zeros(2, 2, 1, 40, dtype=F16)), INVALID,
     "pse_shift")
case("paged_decode", "paged-BnBsH-KV_N*D-over-65535",
     setp(query=lambda p: torch.zeros(1, 128, 1, 512, dtype=F16), num_heads=128,
          key=lambda p: torch.zeros(2, 16, 128 * 512, dtype=F16),
          value=lambda p: torch.zeros(2, 16, 128 * 512, dtype=F16),
          block_table=torch.tensor([[0, 1]], dtype=torch.int32), actual_seq_lengths_kv=[20]), INVALID,
     ("key", "value"))
case("paged_decode", "paged-with-tensor-list", setp(key=lambda p: [p["key"], p["key"]],
                                                    value=lambda p: [p["value"], p["value"]]), INVALID,
     ("key", "block_table", "value"))

case("paged_decode", "paged-per-token-antiquant-S-below-blocks",
     setp(query=lambda p: randn(2, 2, 1, 32, dtype=F16), key=lambda p: randint8(6, 2, 32, 32, seed=1),
          value=lambda p: randint8(6, 2, 32, 32, seed=2), block_size=32,
          antiquant_scale=torch.full((2, 2, 40), 0.01), antiquant_mode=1), INVALID, "antiquant_scale")


def _paged_int8(mode, shape):
    return setp(query=lambda p: randn(2, 2, 1, 32, dtype=F16), key=lambda p: randint8(6, 2, 32, 32, seed=1),
                value=lambda p: randint8(6, 2, 32, 32, seed=2), block_size=32,
                key_antiquant_scale=torch.full(shape, 0.01), value_antiquant_scale=torch.full(shape, 0.01),
                key_antiquant_mode=mode, value_antiquant_mode=mode)


case("paged_decode", "page-managed-mode-4-wrong-shape", _paged_int8(4, (6, 16)), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("paged_decode", "page-managed-mode-5-wrong-shape", _paged_int8(5, (6, 1, 32)), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("prefill", "KV-S-over-20M", setp(key=lambda p: torch.zeros(1, 1, 32, dtype=F16).expand(2, 20971521, 32),
                                      value=lambda p: torch.zeros(1, 1, 32, dtype=F16).expand(2, 20971521, 32)),
     INVALID, ("key", "value"))

case("decode", "query-S-over-20M", setp(query=lambda p: torch.zeros(1, 1, 32, dtype=F16).expand(2, 20971521, 32)),
     INVALID, "query")
# Too expensive for the one-call form when the check is missing (the call then computes); phase 1 only.
PHASE_1_ONLY = {"KV-S-over-20M", "query-S-over-20M"}

# --- int8 quantization combinations
for nm in ("deq_scale1", "quant_scale1", "deq_scale2"):
    case("int8", f"int8-in-without-{nm}", setp(**{nm: None}), INVALID, nm)
case("int8", "int8-in-fp16-out-with-quant_offset2-only", setp(quant_offset2=torch.tensor([1.0])), INVALID,
     ("quant_offset2", "quant_scale2"))
for nm, val in (("deq_scale1", encode_deq_scale(1e-4)), ("quant_scale1", torch.tensor([127.0])),
                ("deq_scale2", encode_deq_scale(1e-2))):
    case("int8out", f"float-in-int8-out-with-{nm}", setp(**{nm: val}), INVALID, nm)
case("prefill", "quant_offset2-without-quant_scale2", setp(quant_offset2=torch.tensor([1.0])), INVALID,
     ("quant_offset2", "quant_scale2"))
case("int8out", "quant_offset2-shape-differs", setp(quant_offset2=torch.zeros(64)), INVALID, "quant_offset2")
case("int8out", "quant_offset2-dtype-differs", setp(quant_scale2=torch.tensor([20.0], dtype=BF16),
                                                    query=lambda p: p["query"].bfloat16(),
                                                    key=lambda p: p["key"].bfloat16(),
                                                    value=lambda p: p["value"].bfloat16(),
                                                    quant_offset2=torch.tensor([1.0])), INVALID, "quant_offset2")
case("int8out", "bf16-quant_scale2-with-fp16-input", setp(quant_scale2=torch.tensor([20.0], dtype=BF16)), INVALID,
     "quant_scale2")
case("int8out", "per-channel-quant_scale2-wrong-numel", setp(quant_scale2=torch.ones(32)), INVALID, "quant_scale2")
case("int8out", "per-channel-quant_scale2-wrong-numel-BNSD",
     setp(query=lambda p: p["query"].reshape(2, 4, 2, 32).transpose(1, 2).contiguous(),
          key=lambda p: p["key"].reshape(2, 6, 2, 32).transpose(1, 2).contiguous(),
          value=lambda p: p["value"].reshape(2, 6, 2, 32).transpose(1, 2).contiguous(), input_layout="BNSD",
          quant_scale2=torch.ones(1, 2, 1, 16)), INVALID, "quant_scale2")
case("int8out", "per-channel-quant_scale2-with-left-padding",
     setp(quant_scale2=torch.ones(1, 1, 64), actual_seq_lengths=[3, 3], actual_seq_lengths_kv=[5, 6],
          query_padding_size=torch.tensor([1]), kv_padding_size=torch.tensor([0])), INVALID,
     ("quant_scale2", "query_padding_size", "kv_padding_size"))
case("int8out", "int8-out-band-negative-pre", setp(sparse_mode=4, atten_mask=TRIU2048, pre_tokens=-1,
                                                   next_tokens=3), INVALID,
     ("sparse_mode", "pre_tokens", "next_tokens", "quant_scale2"))
case("int8out", "int8-out-band-negative-next", setp(sparse_mode=4, atten_mask=TRIU2048, pre_tokens=3,
                                                    next_tokens=-1), INVALID,
     ("sparse_mode", "pre_tokens", "next_tokens", "quant_scale2"))
# quant_offset2 with rows that take part in no computation (seed: intercepted)
case("int8out", "qo2-mode0-pre-too-small", setp(quant_offset2=torch.tensor([1.0]), atten_mask=torch.zeros(
    4, 6, dtype=torch.bool), actual_seq_lengths_kv=[2], pre_tokens=1), INVALID,
     ("quant_offset2", "pre_tokens", "sparse_mode", "next_tokens"))
case("int8out", "qo2-mode0-negative-next", setp(quant_offset2=torch.tensor([1.0]), atten_mask=torch.zeros(
    4, 6, dtype=torch.bool), next_tokens=-1), INVALID, ("quant_offset2", "pre_tokens", "sparse_mode", "next_tokens"))
case("int8out", "qo2-mode3-sq-over-skv", setp(quant_offset2=torch.tensor([1.0]), atten_mask=TRIU2048,
                                              sparse_mode=3, actual_seq_lengths_kv=[3]), INVALID,
     ("quant_offset2", "sparse_mode", "actual_seq_lengths_kv"))
case("int8out", "qo2-mode4-negative-pre", setp(quant_offset2=torch.tensor([1.0]), atten_mask=TRIU2048,
                                               sparse_mode=4, pre_tokens=-1, next_tokens=5), INVALID,
     ("quant_offset2", "sparse_mode", "pre_tokens", "next_tokens"))
case("int8out", "qo2-mode4-next-plus-skv-below-sq", setp(quant_offset2=torch.tensor([1.0]), atten_mask=TRIU2048,
                                                         sparse_mode=4, pre_tokens=5, next_tokens=0,
                                                         actual_seq_lengths_kv=[3]), INVALID,
     ("quant_offset2", "sparse_mode", "next_tokens", "actual_seq_lengths_kv"))
case("int4_decode", "int4-with-quant_scale2", setp(quant_scale2=torch.tensor([1.0])), INVALID,
     ("quant_scale2", "key"))
case("decode", "int8-kv-without-antiquant-scale",
     setp(query=lambda p: randn(2, 1, 64, dtype=F16), key=lambda p: randint8(2, 6, 64),
          value=lambda p: randint8(2, 6, 64)), INVALID, ("antiquant_scale", "key", "key_antiquant_scale"))
case("prefill", "int8-query-fp16-kv", setp(query=lambda p: randint8(2, 4, 32), deq_scale1=torch.tensor([1e-4]),
                                           quant_scale1=torch.tensor([127.0]), deq_scale2=torch.tensor([1e-2])),
     INVALID, ("key", "query", "value"))

# --- antiquant (combined parameters)
case("anti_decode", "antiquant-per-channel-wrong-shape", setp(antiquant_scale=torch.full((2, 48), 0.01,
                                                                                         dtype=F16),
                                                              antiquant_offset=None), INVALID, "antiquant_scale")
case("anti_decode", "antiquant-first-dim-not-2", setp(antiquant_scale=torch.full((3, 64), 0.01, dtype=F16),
                                                      antiquant_offset=None), INVALID, "antiquant_scale")
case("anti_decode", "antiquant-per-token-wrong-shape", setp(antiquant_scale=torch.full((2, 2, 5), 0.01),
                                                            antiquant_offset=None, antiquant_mode=1), INVALID,
     "antiquant_scale")
case("anti_decode", "antiquant-per-token-fp16", setp(antiquant_scale=torch.full((2, 2, 6), 0.01, dtype=F16),
                                                     antiquant_offset=None, antiquant_mode=1), INVALID,
     "antiquant_scale")
case("anti_decode", "antiquant-offset-without-scale", setp(antiquant_scale=None), INVALID,
     ("antiquant_scale", "antiquant_offset"))
case("anti_decode", "antiquant-offset-shape-differs", setp(antiquant_offset=torch.zeros(2, dtype=F16)), INVALID,
     "antiquant_offset")
case("anti_decode", "antiquant-per-channel-dtype-differs",
     setp(antiquant_scale=lambda p: p["antiquant_scale"].float(), antiquant_offset=lambda p: p[
         "antiquant_offset"].float()), INVALID, ("antiquant_scale", "antiquant_offset"))
case("anti_prefill", "prefill-antiquant-bf16-query",
     setp(query=lambda p: p["query"].bfloat16(), antiquant_scale=lambda p: p["antiquant_scale"].bfloat16()),
     INVALID, ("query", "antiquant_scale"))
case("anti_prefill", "prefill-antiquant-scale-fp32", setp(antiquant_scale=lambda p: p["antiquant_scale"].float()),
     INVALID, "antiquant_scale")

# --- antiquant (separate key/value parameters)
case("sep_decode", "key-scale-without-value-scale", setp(value_antiquant_scale=None), INVALID,
     ("value_antiquant_scale", "key_antiquant_scale"))
case("sep_decode", "key-offset-without-value-offset", setp(value_antiquant_offset=None), INVALID,
     ("value_antiquant_offset", "key_antiquant_offset"))
case("sep_decode", "kv-scale-shapes-differ", setp(value_antiquant_scale=torch.full((1, 2, 32), 0.02, dtype=F16)),
     INVALID, ("value_antiquant_scale", "key_antiquant_scale"))
case("sep_decode", "kv-offset-shapes-differ", setp(value_antiquant_offset=torch.zeros(1, 2, 32, dtype=F16)),
     INVALID, ("value_antiquant_offset", "key_antiquant_offset"))
case("sep_decode", "per-token-bf16", setp(key_antiquant_scale=torch.full((1, 2, 6), 0.01, dtype=BF16),
                                          value_antiquant_scale=torch.full((1, 2, 6), 0.01, dtype=BF16),
                                          key_antiquant_offset=None, value_antiquant_offset=None,
                                          key_antiquant_mode=1, value_antiquant_mode=1), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_decode", "per-token-wrong-shape", setp(key_antiquant_scale=torch.full((1, 2, 5), 0.01),
                                                 value_antiquant_scale=torch.full((1, 2, 5), 0.01),
                                                 key_antiquant_offset=None, value_antiquant_offset=None,
                                                 key_antiquant_mode=1, value_antiquant_mode=1), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_decode", "per-head-wrong-shape", setp(key_antiquant_scale=torch.full((3,), 0.01, dtype=F16),
                                                value_antiquant_scale=torch.full((3,), 0.01, dtype=F16),
                                                key_antiquant_offset=None, value_antiquant_offset=None,
                                                key_antiquant_mode=2, value_antiquant_mode=2), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_decode", "page-managed-mode-without-block-table",
     setp(key_antiquant_scale=torch.full((4, 16), 0.01), value_antiquant_scale=torch.full((4, 16), 0.01),
          key_antiquant_offset=None, value_antiquant_offset=None, key_antiquant_mode=4, value_antiquant_mode=4),
     INVALID, ("key_antiquant_mode", "block_table", "key_antiquant_scale", "value_antiquant_mode"))
case("sep_decode", "kv-per-channel-per-token-with-bf16-query",
     setp(query=lambda p: p["query"].bfloat16(), key_antiquant_scale=lambda p: p["key_antiquant_scale"].bfloat16(),
          key_antiquant_offset=None, value_antiquant_offset=None,
          value_antiquant_scale=torch.full((1, 2, 6), 0.01), value_antiquant_mode=1), INVALID,
     ("query", "key_antiquant_mode", "value_antiquant_mode", "key", "key_antiquant_scale"))
case("sep_prefill", "prefill-separate-with-fp16-query",
     setp(query=lambda p: p["query"].half(), key_antiquant_scale=lambda p: p["key_antiquant_scale"].half(),
          value_antiquant_scale=lambda p: p["value_antiquant_scale"].half(),
          key_antiquant_offset=lambda p: p["key_antiquant_offset"].half(),
          value_antiquant_offset=lambda p: p["value_antiquant_offset"].half()), INVALID,
     ("query", "key_antiquant_scale"))
case("sep_prefill", "prefill-separate-int8-output", setp(quant_scale2=torch.tensor([1.0])), INVALID,
     ("quant_scale2", "key_antiquant_scale", "query"))
case("sep_decode", "per-channel-wrong-shape", setp(key_antiquant_scale=torch.full((1, 2, 1, 16), 0.01, dtype=F16),
                                                   value_antiquant_scale=torch.full((1, 2, 1, 16), 0.01, dtype=F16),
                                                   key_antiquant_offset=None, value_antiquant_offset=None), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_decode", "per-token-head-wrong-shape", setp(key_antiquant_scale=torch.full((2, 3, 6), 0.01),
                                                      value_antiquant_scale=torch.full((2, 3, 6), 0.01),
                                                      key_antiquant_offset=None, value_antiquant_offset=None,
                                                      key_antiquant_mode=3, value_antiquant_mode=3), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_prefill", "prefill-separate-query-S-over-16", setp(query=lambda p: randn(2, 17, 64, dtype=BF16)),
     INVALID, ("query", "key_antiquant_scale"))
case("sep_prefill", "prefill-separate-per-channel-fp32",
     setp(key_antiquant_scale=lambda p: p["key_antiquant_scale"].float(),
          value_antiquant_scale=lambda p: p["value_antiquant_scale"].float(),
          key_antiquant_offset=lambda p: p["key_antiquant_offset"].float(),
          value_antiquant_offset=lambda p: p["value_antiquant_offset"].float()), INVALID,
     ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_prefill", "prefill-separate-per-token-wrong-shape",
     setp(key_antiquant_scale=torch.full((2, 5), 0.01), value_antiquant_scale=torch.full((2, 5), 0.01),
          key_antiquant_offset=None, value_antiquant_offset=None, key_antiquant_mode=1, value_antiquant_mode=1),
     INVALID, ("key_antiquant_scale", "value_antiquant_scale"))
case("sep_prefill", "prefill-separate-with-tensor-list",
     setp(key=lambda p: [p["key"][:1], p["key"][1:]], value=lambda p: [p["value"][:1], p["value"][1:]]), INVALID,
     ("key", "key_antiquant_scale", "value"))
case("sep_prefill", "prefill-separate-with-left-padding",
     setp(actual_seq_lengths_kv=[4, 5], kv_padding_size=torch.tensor([1])), INVALID,
     ("kv_padding_size", "key_antiquant_scale", "key"))
case("int4_decode", "int4-per-tensor-per-head-mode", setp(key_antiquant_scale=torch.full((2,), 0.1, dtype=F16),
                                                          value_antiquant_scale=torch.full((2,), 0.1, dtype=F16),
                                                          key_antiquant_mode=2, value_antiquant_mode=2), INVALID,
     ("key_antiquant_mode", "value_antiquant_mode", "key"))
case("int4_decode", "int4-combined-antiquant",
     setp(key_antiquant_scale=None, value_antiquant_scale=None, antiquant_scale=torch.full((2, 128), 0.1,
                                                                                           dtype=F16)),
     INVALID, ("antiquant_scale", "key", "key_antiquant_scale"))
case("int4_decode", "int4-kv-left-padding-fp16-query",
     setp(actual_seq_lengths_kv=[4, 5], kv_padding_size=torch.tensor([1])), INVALID, ("kv_padding_size", "key"))

# --- left padding
case("leftpad", "query-left-padding-start-below-0", setp(query_padding_size=torch.tensor([3])), INVALID,
     ("query_padding_size", "actual_seq_lengths"))
case("leftpad", "kv-left-padding-start-below-0", setp(kv_padding_size=torch.tensor([4])), INVALID,
     ("kv_padding_size", "actual_seq_lengths_kv"))
case("leftpad", "padding-size-shape-2", setp(query_padding_size=torch.tensor([1, 1])), INVALID,
     "query_padding_size")

# --- shared prefix
case("prefix", "key-prefix-only", setp(value_shared_prefix=None), INVALID, ("value_shared_prefix",
                                                                            "key_shared_prefix"))
case("prefix", "value-prefix-only", setp(key_shared_prefix=None), INVALID, ("key_shared_prefix",
                                                                            "value_shared_prefix"))
case("prefix", "prefix-ndim-differs", setp(key_shared_prefix=lambda p: p["key_shared_prefix"].reshape(1, 3, 2, 16),
                                           value_shared_prefix=lambda p: p["value_shared_prefix"].reshape(1, 3, 2,
                                                                                                          16)),
     INVALID, ("key_shared_prefix", "value_shared_prefix"))
case("prefix", "prefix-dtype-differs", setp(key_shared_prefix=lambda p: p["key_shared_prefix"].bfloat16(),
                                            value_shared_prefix=lambda p: p["value_shared_prefix"].bfloat16()),
     INVALID, ("key_shared_prefix", "value_shared_prefix"))
case("prefix", "prefix-batch-2", setp(key_shared_prefix=lambda p: p["key_shared_prefix"].expand(2, -1, -1).clone(),
                                      value_shared_prefix=lambda p: p["value_shared_prefix"].expand(2, -1, -1).clone()),
     INVALID, ("key_shared_prefix", "value_shared_prefix"))
case("prefix", "prefix-H-differs", setp(key_shared_prefix=lambda p: randn(1, 3, 48, dtype=F16),
                                        value_shared_prefix=lambda p: randn(1, 3, 48, dtype=F16)), INVALID,
     ("key_shared_prefix", "value_shared_prefix"))
case("prefix", "prefix-k-v-S-differ", setp(value_shared_prefix=lambda p: randn(1, 2, 32, dtype=F16)), INVALID,
     ("value_shared_prefix", "key_shared_prefix"))
case("prefix", "actual_shared_prefix_len-over-S", setp(actual_shared_prefix_len=[4]), INVALID,
     "actual_shared_prefix_len")
case("prefix", "actual_shared_prefix_len-length-2", setp(actual_shared_prefix_len=[2, 2]), INVALID,
     "actual_shared_prefix_len")
case("prefix", "prefix-with-left-padding", setp(actual_seq_lengths_kv=[4, 5], kv_padding_size=torch.tensor([1])),
     INVALID, ("key_shared_prefix", "kv_padding_size"))
case("prefix", "prefix-with-tensor-list", setp(key=lambda p: [p["key"][:1], p["key"][1:]],
                                               value=lambda p: [p["value"][:1], p["value"][1:]]), INVALID,
     ("key_shared_prefix", "key"))
case("paged_decode", "prefix-with-paged", setp(key_shared_prefix=randn(1, 2, 3, 16, dtype=F16),
                                               value_shared_prefix=randn(1, 2, 3, 16, dtype=F16)), INVALID,
     ("key_shared_prefix", "block_table"))
case("int8", "prefix-with-all-int8-qkv", setp(key_shared_prefix=randint8(1, 3, 64), value_shared_prefix=randint8(
    1, 3, 64)), INVALID, ("key_shared_prefix", "query"))

# --- tensor lists
case("list", "list-length-not-B", setp(key=lambda p: p["key"][:1], value=lambda p: p["value"][:1]), INVALID,
     ("key", "value"))
case("list", "list-element-batch-2", setp(key=lambda p: [randn(2, 5, 32, dtype=F16)] * 2,
                                          value=lambda p: [randn(2, 5, 32, dtype=F16)] * 2), INVALID,
     ("key", "value"))
case("list", "list-elements-H-differ", setp(key=lambda p: [p["key"][0], randn(1, 3, 48, dtype=F16)],
                                            value=lambda p: [p["value"][0], randn(1, 3, 48, dtype=F16)]), INVALID,
     ("key", "value"))
case("list", "list-k-v-shapes-differ", setp(value=lambda p: [p["value"][0], randn(1, 4, 32, dtype=F16)]), INVALID,
     ("value", "key"))
case("list", "list-k-v-lengths-differ", setp(value=lambda p: p["value"] + [p["value"][0]]), INVALID,
     ("value", "key"))
case("list", "list-B-over-256",
     setp(query=lambda p: randn(257, 4, 32, dtype=F16), key=lambda p: [randn(1, 2, 32, dtype=F16)] * 257,
          value=lambda p: [randn(1, 2, 32, dtype=F16)] * 257), INVALID, ("key", "query", "value"))


# ------------------------------------------------------------------------------------------- running the table
def _params(c: Case) -> dict:
    p = base(c.kind)
    c.mutate(p)
    return p


def _call(p: dict, two_phase: bool):
    p = dict(p)
    q, k, v = p.pop("query"), p.pop("key"), p.pop("value")
    args = aclnn_args(q, k, v, **p)
    if q is None:
        args[0] = None
    if k is None:
        args[1] = None
    if v is None:
        args[2] = None
    if two_phase:
        return attnops.aclnn.fused_infer_attention_score_v2_get_workspace_size(*args)
    return attnops.aclnn.fused_infer_attention_score_v2(*args)


def _check(err, c: Case):
    assert isinstance(err, AclnnError)
    assert err.status == (161001 if c.exc is ParamNullptrError else 161002)
    names = "|".join(re.escape(n) for n in c.names)
    assert re.match(rf"^({names})(\[\d+\])?: ", str(err)), f"message should start with one of {c.names}: {err}"


IDS = [c.id for c in CASES]
assert len(IDS) == len(set(IDS)), [i for i in IDS if IDS.count(i) > 1]


@pytest.mark.parametrize("c", [c for c in CASES if c.id not in PHASE_1_ONLY],
                         ids=[i for i in IDS if i not in PHASE_1_ONLY])
def test_fia_rejected_by_direct_call(c):
    with pytest.raises(c.exc) as info:
        _call(_params(c), two_phase=False)
    _check(info.value, c)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_fia_rejected_in_phase_1(c):
    with pytest.raises(c.exc) as info:
        _call(_params(c), two_phase=True)
    _check(info.value, c)


@pytest.mark.parametrize("kind", KINDS)
def test_fia_base_parameters_are_valid(kind):
    ws, executor = _call(base(kind), two_phase=True)
    assert isinstance(ws, int) and ws >= 0
    out, lse = executor()
    assert out.shape[0] == base(kind)["query"].shape[0]


# Combinations the seed allows (they must NOT be rejected).
ALLOWED = {
    "pse-fp16-with-int8-query": ("int8", setp(pse_shift=torch.zeros(2, 2, 4, 6, dtype=F16))),
    "kv-antiquant-modes-0-1-decode": ("sep_decode", setp(value_antiquant_scale=torch.full((1, 2, 6), 0.01),
                                                          value_antiquant_offset=torch.zeros(1, 2, 6),
                                                          value_antiquant_mode=1)),
    "decode-D-8-without-pse": ("decode", setp(query=lambda p: randn(2, 1, 16, dtype=F16),
                                              key=lambda p: randn(2, 6, 16, dtype=F16),
                                              value=lambda p: randn(2, 6, 16, dtype=F16))),
    "negative-padding-size-clamped": ("leftpad", setp(query_padding_size=torch.tensor([-2]),
                                                      kv_padding_size=torch.tensor([-1]))),
    "mask-larger-than-S": ("prefill", setp(atten_mask=torch.zeros(16, 16, dtype=torch.uint8), sparse_mode=1)),
    "actual-lengths-longer-than-B": ("prefill", setp(actual_seq_lengths=[4, 3, 9], actual_seq_lengths_kv=[6, 1, 0,
                                                                                                        99])),
    "paged-BNSD-query-BnBsH-cache": ("paged_decode", setp(key=lambda p: p["key"].permute(0, 2, 1, 3).reshape(
        p["key"].shape[0], 16, 32).contiguous(), value=lambda p: p["value"].permute(0, 2, 1, 3).reshape(
        p["value"].shape[0], 16, 32).contiguous())),
    "empty-query": ("prefill", setp(query=lambda p: p["query"][:, :0].contiguous())),
    "empty-kv": ("prefill", setp(key=lambda p: p["key"][:, :0].contiguous(),
                                 value=lambda p: p["value"][:, :0].contiguous())),
    "deq-scales-float32": ("int8", setp(deq_scale1=torch.tensor([1e-4]), deq_scale2=torch.tensor([1e-2]))),
    "int8-in-int8-out": ("int8", setp(quant_scale2=torch.tensor([2.0]), quant_offset2=torch.tensor([1.0]))),
    "bf16-qs2-with-bf16-input": ("int8out", setp(query=lambda p: p["query"].bfloat16(),
                                                 key=lambda p: p["key"].bfloat16(),
                                                 value=lambda p: p["value"].bfloat16(),
                                                 quant_scale2=torch.full((2, 32), 20.0, dtype=BF16),
                                                 quant_offset2=torch.zeros(2, 32, dtype=BF16))),
    "int4-key-channel-value-token": ("int4_decode", setp(value_antiquant_scale=torch.full((1, 2, 6), 0.1),
                                                         value_antiquant_mode=1)),
    "page-managed-mode-4": ("paged_decode", _paged_int8(4, (6, 32))),
    "page-managed-mode-5": ("paged_decode", _paged_int8(5, (6, 2, 32))),
    "sparse-mode-ignored-for-decode": ("decode", setp(sparse_mode=7, pre_tokens=-5, next_tokens=-5)),
    "mode-0-with-mask-and-negative-next": ("prefill", setp(atten_mask=torch.zeros(4, 6, dtype=torch.bool),
                                                           pre_tokens=5, next_tokens=-1)),
}


@pytest.mark.parametrize("name", list(ALLOWED))
def test_fia_allowed_combinations(name):
    kind, mutate = ALLOWED[name]
    p = base(kind)
    mutate(p)
    ws, executor = _call(p, two_phase=True)
    out, lse = executor()
    assert out.shape[0] == p["query"].shape[0]
