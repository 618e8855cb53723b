"""The FIA kernels in the shared AOT machinery: small problems whose plans give the call sites ``python -m attnops aot``
compiles. Decode (fp16/bf16/fp32; dense, paged ND ``[blocknum, blocksize, H]`` and ``[blocknum, N2, blocksize, D]`` and
NZ KV; head dims 64, 128 and 192/128; GQA groups 4 to 64 with up to 4 query rows (16 to 128 rows per program); int8
and int4 antiquant on dense and paged K/V; masks and pse; KV left padding; int8 output) and prefill (the same dtypes
and head dims; dense, paged ND (both layouts) and NZ caches at D=64 and 128; int8 NZ caches with page-managed scales,
int8 K/V with the shared prefix, int4 K/V; a few query rows after the shared prefix; masks and pse; int8 output)."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from ..problem import build_problem
from . import launch, prefill
from .decode_plan import make_plan
from .family import KERNELS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _launches(query, key, value, **options) -> list:
    p = build_problem(query, key, value, **options)
    _, launches = launch.run_launches(make_plan(p, interpret=False), query, key, value, options.get("block_table"))
    return [KERNELS.aot_launch(x) for x in launches]


def _prefill_launches(query, key, value, **options) -> list:
    p = build_problem(query, key, value, **options)
    _, plan = prefill.prefill_plan(p, query, key, value, options, interpret=False)
    return [KERNELS.aot_launch(x) for x in plan]


def _qkv(dtype: str, q_shape: tuple, k_shape: tuple, v_shape: tuple | None = None) -> tuple:
    """``(query, key, value, generator)``: random tensors of ``dtype`` (the value of ``k_shape`` unless given) and
    the generator for the case's other inputs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen).to(DTYPES[dtype]) for s in (q_shape, k_shape, v_shape or k_shape))
    return q, k, v, gen


def _kv_ints(quant: str, shape: tuple, gen: torch.Generator) -> tuple:
    """Random int8 K/V of ``shape`` (int4: its last dim / 8 int32 words of packed nibbles)."""
    if quant == "int4":
        shape = (*shape[:-1], shape[-1] // 8)
    dtype = torch.int32 if quant == "int4" else torch.int8
    return tuple(torch.randint(-100, 100, shape, generator=gen, dtype=dtype) for _ in range(2))


def _per_token(batch: int, tokens: int, gen: torch.Generator) -> dict:
    """Per-token K and V antiquant scales and offsets (mode 1)."""
    scales = {f"{x}_antiquant_{y}": torch.rand(batch, tokens, generator=gen) for x in ("key", "value")
              for y in ("scale", "offset")}
    return dict(scales, key_antiquant_mode=1, value_antiquant_mode=1)


def _dense(dtype: str, d: int, dv: int, group: int) -> list:
    q, k, v, _ = _qkv(dtype, (2, 4 * group, 1, d), (2, 4, 300, d), (2, 4, 300, dv))
    return _launches(q, k, v, num_heads=4 * group, num_key_value_heads=4, input_layout="BNSD", scale=d ** -0.5)


def _dense_quant(dtype: str, quant: str) -> list:
    """int8 K/V with a per-channel antiquant (mode 0) or int4 K/V with per-token scales (mode 1), BSND."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 32, 128, generator=gen).to(t)
    k, v = _kv_ints(quant, (2, 300, 8, 128), gen)
    if quant == "int8":
        options = dict(antiquant_scale=torch.rand(2, 8, 1, 128, generator=gen).to(t),
                       antiquant_offset=torch.rand(2, 8, 1, 128, generator=gen).to(t))
    else:
        options = _per_token(2, 300, gen)
    return _launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BSND", scale=128 ** -0.5,
                     **options)


def _paged(dtype: str, d: int, quant: str | None, cache: str = "bsh") -> list:
    """Two requests over a ``[blocknum, 128, N2*D]`` (``bsh``) or ``[blocknum, N2, 128, D]`` (``bnsd``) cache;
    int8/int4 with per-token scales and offsets."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    layout = "BSH" if cache == "bsh" else "BNSD"
    q = torch.randn(2, 1, 32 * d, generator=gen).to(t)
    if layout == "BNSD":
        q = q.reshape(2, 1, 32, d).transpose(1, 2).contiguous()
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    options = dict(num_heads=32, num_key_value_heads=8, input_layout=layout, scale=d ** -0.5, block_table=table,
                   block_size=128, actual_seq_lengths_kv=[512, 300])
    shape = (8, 128, 8 * d) if cache == "bsh" else (8, 8, 128, d)
    if quant is None:
        k, v = (torch.randn(shape, generator=gen).to(t) for _ in range(2))
    else:
        k, v = _kv_ints(quant, shape, gen)
        options.update(_per_token(2, 512, gen))
    return _launches(q, k, v, **options)


def _nz(dtype: str, quant: str | None, d: int = 128) -> list:
    """Two requests over NZ caches ``[blocknum, 8, D/x, 128, x]``; int8 with page-managed per-token scales."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 32, 1, d, generator=gen).to(t)
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    options = dict(num_heads=32, num_key_value_heads=8, input_layout="BNSD", scale=d ** -0.5, block_table=table,
                   block_size=128, actual_seq_lengths_kv=[512, 300])
    store = torch.int8 if quant == "int8" else t
    x = 32 // store.itemsize
    k, v = (torch.randint(-100, 100, (8, 8, d // x, 128, x), generator=gen).to(store) for _ in range(2))
    if quant == "int8":
        options.update({f"{n}_antiquant_scale": torch.rand(8, 8, 128, generator=gen) for n in ("key", "value")},
                       key_antiquant_mode=5, value_antiquant_mode=5)
    return _launches(q, k, v, **options)


def _left_padded(dtype: str) -> list:
    """Dense BSND K/V with actual lengths after a left padding (the first key row read on the device)."""
    q, k, v, _ = _qkv(dtype, (2, 1, 32, 128), (2, 512, 8, 128))
    return _launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BSND", scale=128 ** -0.5,
                     actual_seq_lengths_kv=[300, 500], kv_padding_size=torch.tensor([7]))


def _int8_out(dtype: str) -> list:
    """Dense GQA decode quantized to int8 per channel on output (the merge kernel's int8 store)."""
    q, k, v, gen = _qkv(dtype, (2, 1, 16, 128), (2, 300, 4, 128))
    return _launches(q, k, v, num_heads=16, num_key_value_heads=4, input_layout="BSND", scale=128 ** -0.5,
                     quant_scale2=torch.rand(16 * 128, generator=gen), quant_offset2=torch.rand(16 * 128, generator=gen))


def _masked(dtype: str, group: int = 16) -> list:
    """Four query rows of a GQA group of 16 (64 rows per program) or 32 (128 rows), bottom-right causal, pse."""
    q, k, v, gen = _qkv(dtype, (2, 4, 2 * group, 128), (2, 512, 2, 128))
    return _launches(q, k, v, num_heads=2 * group, num_key_value_heads=2, input_layout="BSND", scale=128 ** -0.5,
                     pse_shift=torch.randn(2, 2 * group, 4, 512, generator=gen).to(q.dtype), sparse_mode=3,
                     atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))


def _prefill_dense(dtype: str, d: int, dv: int) -> list:
    """Causal GQA prefill (group 4) over a dense BSND K/V with actual lengths."""
    q, k, v, _ = _qkv(dtype, (2, 300, 16, d), (2, 300, 4, d), (2, 300, 4, dv))
    return _prefill_launches(q, k, v, num_heads=16, num_key_value_heads=4, input_layout="BSND", scale=d ** -0.5,
                             sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
                             actual_seq_lengths_kv=[300, 211])


def _prefill_paged(dtype: str, cache: str, d: int = 128) -> list:
    """Chunked prefill: 256 new rows of 32 heads over two requests in a ``[blocknum, 128, N2*D]`` (``nd``),
    ``[blocknum, N2, 128, D]`` (``bnsd``) or NZ cache."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 256, 32 * d, generator=gen).to(t)
    layout = "BNSD" if cache == "bnsd" else "BSH"
    if layout == "BNSD":
        q = q.reshape(2, 256, 32, d).transpose(1, 2).contiguous()
    x = 32 // t.itemsize
    shape = {"nd": (8, 128, 8 * d), "bnsd": (8, 8, 128, d), "nz": (8, 8, d // x, 128, x)}[cache]
    k, v = (torch.randn(shape, generator=gen).to(t) for _ in range(2))
    return _prefill_launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout=layout, scale=d ** -0.5,
                             block_table=torch.arange(8, dtype=torch.int32).reshape(2, 4), block_size=128,
                             actual_seq_lengths_kv=[512, 300], sparse_mode=3,
                             atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))


def _prefill_masked(dtype: str) -> list:
    """An explicit mask and a pse (fp16/bf16 pse of the query's dtype)."""
    q, k, v, gen = _qkv(dtype, (2, 32, 200, 128), (2, 8, 300, 128))
    return _prefill_launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BNSD", scale=128 ** -0.5,
                             pse_shift=torch.randn(2, 32, 200, 300, generator=gen).to(q.dtype), sparse_mode=1,
                             atten_mask=torch.rand(2, 1, 200, 300, generator=gen) < 0.3)


def _prefill_nz_int8(dtype: str) -> list:
    """One query row over an int8 NZ cache with page-managed per-token + head scales and offsets."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 32, 1, 128, generator=gen).to(t)
    k, v = (torch.randint(-100, 100, (8, 8, 4, 128, 32), generator=gen, dtype=torch.int8) for _ in range(2))
    scales = {f"{x}_antiquant_{y}": torch.rand(8, 8, 128, generator=gen) for x in ("key", "value")
              for y in ("scale", "offset")}
    return _prefill_launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BNSD", scale=128 ** -0.5,
                             block_table=torch.arange(8, dtype=torch.int32).reshape(2, 4), block_size=128,
                             actual_seq_lengths_kv=[512, 300], key_antiquant_mode=5, value_antiquant_mode=5, **scales)


def _prefill_prefix_int8() -> list:
    """int8 K/V and shared prefix with the combined per-channel antiquant, fp16 queries, int8 output."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 32, 200, 128, generator=gen).half()
    k, v = (torch.randint(-100, 100, (2, 8, 300, 128), generator=gen, dtype=torch.int8) for _ in range(2))
    kp, vp = (torch.randint(-100, 100, (1, 8, 100, 128), generator=gen, dtype=torch.int8) for _ in range(2))
    return _prefill_launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BNSD", scale=128 ** -0.5,
                             antiquant_scale=torch.rand(2, 8, 1, 128, generator=gen).half(),
                             antiquant_offset=torch.rand(2, 8, 1, 128, generator=gen).half(),
                             key_shared_prefix=kp, value_shared_prefix=vp, sparse_mode=3,
                             atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
                             quant_scale2=torch.rand(1, generator=gen) + 1)


def _prefill_prefix_rows(dtype: str) -> list:
    """Four query rows after a shared prefix (the decode kernels take no prefix), causal."""
    q, k, v, gen = _qkv(dtype, (2, 32, 4, 128), (2, 8, 300, 128))
    kp, vp = (torch.randn(1, 8, 100, 128, generator=gen).to(q.dtype) for _ in range(2))
    return _prefill_launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BNSD", scale=128 ** -0.5,
                             key_shared_prefix=kp, value_shared_prefix=vp, sparse_mode=3,
                             atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))


def _prefill_int4_list(dtype: str) -> list:
    """int4 K/V (packed in int32) as a per-batch tensor list with per-token scales and offsets, one query row."""
    t, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 32, 128, generator=gen).to(t)
    k, v = ([torch.randint(-2 ** 31, 2 ** 31 - 1, (1, s, 8, 16), generator=gen, dtype=torch.int32)
             for s in (300, 200)] for _ in range(2))
    scales = {f"{x}_antiquant_{y}": torch.rand(2, 300, generator=gen) for x in ("key", "value")
              for y in ("scale", "offset")}
    return _prefill_launches(q, k, v, num_heads=32, num_key_value_heads=8, input_layout="BSND", scale=128 ** -0.5,
                             key_antiquant_mode=1, value_antiquant_mode=1, **scales)


PREFILL_CASES = {**{f"prefill-dense-{t}-d128": lambda t=t: _prefill_dense(t, 128, 128) for t in DTYPES},
                 **{f"prefill-dense-{t}-d192-dv128": lambda t=t: _prefill_dense(t, 192, 128) for t in DTYPES},
                 **{f"prefill-masked-pse-{t}-d128": lambda t=t: _prefill_masked(t) for t in DTYPES},
                 **{f"prefill-dense-{t}-d64": lambda t=t: _prefill_dense(t, 64, 64) for t in ("fp16", "bf16")},
                 **{f"prefill-paged-{c}-{t}-d{d}": lambda t=t, c=c, d=d: _prefill_paged(t, c, d)
                    for t in ("fp16", "bf16") for c in ("nd", "bnsd", "nz") for d in (64, 128)},
                 **{f"prefill-nz-int8-{t}-d128": lambda t=t: _prefill_nz_int8(t) for t in ("fp16", "bf16")},
                 **{f"prefill-list-int4-{t}-d128": lambda t=t: _prefill_int4_list(t) for t in ("fp16", "bf16")},
                 **{f"prefill-prefix-{t}-d128-sq4": lambda t=t: _prefill_prefix_rows(t) for t in DTYPES},
                 "prefill-prefix-int8-out-int8-fp16-d128": _prefill_prefix_int8}
"""The prefill kernel's AOT cases by name (``tests/ops/fused_infer_attention/triton/test_gpu_compile.py``)."""

for _name, _case in PREFILL_CASES.items():
    register_aot("fused_infer_attention", _name, _case)
for _dtype in DTYPES:
    register_aot("fused_infer_attention", f"decode-dense-{_dtype}-d128-g4", lambda t=_dtype: _dense(t, 128, 128, 4))
    register_aot("fused_infer_attention", f"decode-dense-{_dtype}-d192-dv128-g8",
                 lambda t=_dtype: _dense(t, 192, 128, 8))
    register_aot("fused_infer_attention", f"decode-paged-{_dtype}-d128", lambda t=_dtype: _paged(t, 128, None))
    register_aot("fused_infer_attention", f"decode-masked-pse-{_dtype}-g16-sq4", lambda t=_dtype: _masked(t))
for _dtype in ("fp16", "bf16"):
    register_aot("fused_infer_attention", f"decode-dense-{_dtype}-d64-g4", lambda t=_dtype: _dense(t, 64, 64, 4))
    for _d in (64, 128):
        register_aot("fused_infer_attention", f"decode-dense-{_dtype}-d{_d}-g64",
                     lambda t=_dtype, d=_d: _dense(t, d, d, 64))
    register_aot("fused_infer_attention", f"decode-masked-pse-{_dtype}-g32-sq4", lambda t=_dtype: _masked(t, 32))
    register_aot("fused_infer_attention", f"decode-paged-{_dtype}-d64", lambda t=_dtype: _paged(t, 64, None))
    for _d in (64, 128):
        register_aot("fused_infer_attention", f"decode-paged-bnsd-{_dtype}-d{_d}",
                     lambda t=_dtype, d=_d: _paged(t, d, None, "bnsd"))
        register_aot("fused_infer_attention", f"decode-nz-{_dtype}-d{_d}", lambda t=_dtype, d=_d: _nz(t, None, d))
    register_aot("fused_infer_attention", f"decode-nz-int8-{_dtype}-d128", lambda t=_dtype: _nz(t, "int8"))
    register_aot("fused_infer_attention", f"decode-int8-out-{_dtype}-d128", lambda t=_dtype: _int8_out(t))
    register_aot("fused_infer_attention", f"decode-left-padded-{_dtype}-d128", lambda t=_dtype: _left_padded(t))
    for _quant in ("int8", "int4"):
        register_aot("fused_infer_attention", f"decode-dense-{_quant}-{_dtype}-d128",
                     lambda t=_dtype, quant=_quant: _dense_quant(t, quant))
        for _d in (64, 128):
            register_aot("fused_infer_attention", f"decode-paged-{_quant}-{_dtype}-d{_d}",
                         lambda t=_dtype, quant=_quant, d=_d: _paged(t, d, quant))
        register_aot("fused_infer_attention", f"decode-paged-bnsd-{_quant}-{_dtype}-d128",
                     lambda t=_dtype, quant=_quant: _paged(t, 128, quant, "bnsd"))
