"""The FIA prefill kernel (one launch over every batch, K/V read where they lie) vs the fp64 golden
(``attnops.testing.golden_fia``) with the project's tolerance rule: dense layouts and TND, GQA, Dv != D, actual
lengths with empty batches and lengths off the tiles, every sparse mode, explicit masks, pse, left padding, paged
caches (ND and NZ, shuffled pages, chunked prefill), int8/int4 K/V dequantized in the kernel, the shared prefix, int8
output, key/value tensor lists (one launch per batch), the grid fold of batch x heads; the kernel's CAST_ROUND and
int8 rounding against the reference's; block-table values out of range never read outside the cache. Every test
forces ``ATTNOPS_BACKEND=triton`` and checks which kernels ran."""
from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after the skip)

from attnops.ops.fused_infer_attention import quant
from attnops.ops.fused_infer_attention.problem import build_problem
from attnops.ops.fused_infer_attention.triton import prefill, verify
from attnops.ops.fused_infer_attention.triton.rounding import output_tile
from attnops.ops.fused_infer_attention.triton.verify import kernel_route
from attnops.testing.golden_fia import pack_int4
from tests.helpers import cum, noncontig, randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, check_fia, int8_output_params, make_inputs,
                                                         rand_mask, randint4, randint8, to_paged)
from tests.triton_backend import DEVICE

F16, F32 = torch.float16, torch.float32
PREFILL = "prefill_kernel"


def _dev(x):
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
        return [t.to(DEVICE) for t in x]
    return x


def run(launched, q, k, v, *, via="api", launches=1, **kw):
    """check_fia on the kernel device, then check that the prefill kernel (alone) ran ``launches`` times."""
    r = check_fia(_dev(q), _dev(k), _dev(v), via=via, **{name: _dev(x) for name, x in kw.items()})
    assert launched == [PREFILL] * launches, launched
    return r


@pytest.fixture
def prefill_route(monkeypatch):
    """Calls the decode kernels could take (one query row) go to the prefill kernel: these tests are about it."""
    monkeypatch.setattr(verify, "decode_reason", lambda *args: "the prefill kernel is under test")


def _param(shape, dtype, seed, offset=False):
    g = torch.Generator().manual_seed(seed)
    if offset:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return (torch.rand(shape, generator=g) * 0.02 + 0.005).to(dtype)


def nz(cache: torch.Tensor) -> torch.Tensor:
    """``(blocknum, KV_N, blocksize, D)`` -> NZ ``(blocknum, KV_N, D/x, blocksize, x)``."""
    x = 32 // cache.dtype.itemsize
    return cache.unflatten(-1, (-1, x)).permute(0, 1, 3, 2, 4).contiguous()


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
@pytest.mark.parametrize("full", [True, False])
def test_dense_layouts(triton_backend, layout, full):
    """GQA over three row blocks; ``full=False``: actual lengths with an empty query and an empty KV batch (a
    third batch, which the full case does without)."""
    q, k, v = make_inputs(layout, b=2 if full else 3, n=4, nkv=2, sq=40, skv=37, d=16, dtype=F16)
    lens = {} if full else dict(actual_seq_lengths=[40, 23, 0], actual_seq_lengths_kv=[37, 0, 20])
    r = run(triton_backend, q, k, v, num_heads=4, num_key_value_heads=2, input_layout=layout, scale_value=0.25,
            softmax_lse_flag=True, **lens)
    if not full:
        assert bool((r["out"][1] == 0).all()) and bool(torch.isposinf(r["lse"][1]).all())


@pytest.mark.parametrize("dtype", [F16, F32])
def test_value_head_dim_and_fp32(triton_backend, dtype):
    q, k, v = make_inputs("BSND", b=2, n=4, nkv=1, sq=20, skv=45, d=24, dv=8, dtype=dtype)
    run(triton_backend, q, k, v, num_heads=4, num_key_value_heads=1, input_layout="BSND", scale_value=0.2,
        atten_mask=TRIU2048, sparse_mode=3, softmax_lse_flag=True)


def test_non_unit_strides(triton_backend):
    """Query, key and value whose last dim is strided (every other element) are read through their strides."""
    q, k, v = (noncontig(x, "strided") for x in make_inputs("BSND", b=2, n=2, sq=18, skv=29, d=16, dtype=F16))
    run(triton_backend, q, k, v, num_heads=2, input_layout="BSND", scale_value=0.25, softmax_lse_flag=True,
        actual_seq_lengths_kv=[29, 11])


@pytest.mark.parametrize("tail", [0, 5])
def test_tnd(triton_backend, tail):
    """Cumulative lengths with an empty batch, a left-top band with an explicit mask; ``tail`` tokens after the last
    cumulative length keep output 0."""
    n, lens_q, lens_kv = 2, [20, 0, 17], [33, 12, 40]
    q = randn(sum(lens_q) + tail, n, 16, dtype=F16, seed=1)
    k, v = randn(sum(lens_kv), n, 16, dtype=F16, seed=2), randn(sum(lens_kv), n, 16, dtype=F16, seed=3)
    run(triton_backend, q, k, v, actual_seq_lengths=cum(lens_q), actual_seq_lengths_kv=cum(lens_kv),
        atten_mask=rand_mask(20, 40, seed=4), sparse_mode=0, pre_tokens=12, next_tokens=9, num_heads=n,
        scale_value=0.25, input_layout="TND", softmax_lse_flag=True)


@pytest.mark.parametrize("sparse_mode", [0, 1, 2, 3, 4])
def test_sparse_modes_and_pse(triton_backend, sparse_mode):
    b, n, sq, skv = 2, 2, 33, 50
    q, k, v = make_inputs("BSND", b=b, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    mask = rand_mask(b, 1, sq, skv, seed=3) if sparse_mode in (0, 1) else TRIU2048
    run(triton_backend, q, k, v, atten_mask=mask, sparse_mode=sparse_mode, pre_tokens=20, next_tokens=4,
        actual_seq_lengths_kv=[50, 41], pse_shift=randn(b, n, sq, skv, dtype=F16, seed=4), num_heads=n,
        scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


def test_left_padding(triton_backend):
    """Query and KV left padding: rows and keys start late, masks and pse read at the padded offsets."""
    b, n, sq, skv = 2, 2, 30, 40
    q, k, v = make_inputs("BNSD", b=b, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    run(triton_backend, q, k, v, actual_seq_lengths=[21, 17], actual_seq_lengths_kv=[31, 25],
        query_padding_size=torch.tensor([4]), kv_padding_size=torch.tensor([6]),
        atten_mask=rand_mask(b, 1, sq, skv, seed=5), pse_shift=randn(b, n, sq, skv, dtype=F16, seed=6),
        num_heads=n, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


def _paged_inputs(layout, cache_layout, *, lens, sq, bs, n=4, nkv=2, d=32, int8=False, seed=0):
    """Query in ``layout`` and K/V caches (``BSH``, ``BNSD`` or ``NZ``) over shuffled blocks with garbage around."""
    b = len(lens)
    q = make_inputs(layout, b=b, n=n, nkv=nkv, sq=sq, skv=1, d=d, dtype=F16, seed=seed)[0]
    if int8:
        k, v = randint8(b, nkv, max(lens), d, seed=seed + 1), randint8(b, nkv, max(lens), d, seed=seed + 2)
    else:
        k, v = (randn(b, nkv, max(lens), d, dtype=F16, seed=seed + i) for i in (1, 2))
    nd = "BNSD" if cache_layout == "NZ" else cache_layout
    kc, bt = to_paged(k, lens, bs, cache_layout=nd, seed=seed + 3)
    vc, _ = to_paged(v, lens, bs, cache_layout=nd, seed=seed + 3)
    return (q, nz(kc), nz(vc), bt) if cache_layout == "NZ" else (q, kc, vc, bt)


@pytest.mark.parametrize("layout,cache_layout", [("BSH", "BSH"), ("BSND", "BSH"), ("BNSD", "BNSD"), ("BNSD", "NZ"),
                                                 ("BSH", "NZ")])
def test_paged_chunked_prefill(triton_backend, layout, cache_layout):
    """20 new query rows over 70 / 45 cached tokens (bottom-right causal) through shuffled 16-token pages."""
    lens = [70, 45]
    q, kc, vc, bt = _paged_inputs(layout, cache_layout, lens=lens, sq=20, bs=16)
    run(triton_backend, q, kc, vc, block_table=bt.to(torch.int64) if layout == "BSH" else bt, block_size=16,
        actual_seq_lengths_kv=lens, actual_seq_lengths=[20, 13], atten_mask=TRIU2048, sparse_mode=3, num_heads=4,
        num_key_value_heads=2, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("mode", [0, 1, 4, 5])
def test_nz_int8_antiquant(triton_backend, prefill_route, mode):
    """One query row over an int8 NZ cache: scales and offsets per channel, per token, page-managed per token and per
    token + head."""
    bs, lens, d, nkv, b = 32, [70, 33], 64, 2, 2
    q, kc, vc, bt = _paged_inputs("BNSD", "NZ", lens=lens, sq=1, bs=bs, nkv=nkv, d=d, int8=True)
    shape, dtype = {0: ((1, nkv, 1, d), F16), 1: ((b, 96), F32), 4: ((kc.shape[0], bs), F32),
                    5: ((kc.shape[0], nkv, bs), F32)}[mode]
    params = {f"{x}_antiquant_{y}": _param(shape, dtype, seed, y == "offset")
              for seed, (x, y) in enumerate((x, y) for x in ("key", "value") for y in ("scale", "offset"))}
    run(triton_backend, q, kc, vc, **params, key_antiquant_mode=mode, value_antiquant_mode=mode, block_table=bt,
        block_size=bs, actual_seq_lengths_kv=lens, num_heads=4, num_key_value_heads=nkv, scale_value=0.25,
        input_layout="BNSD", softmax_lse_flag=True)


def test_dense_int8_antiquant(triton_backend):
    """int8 K/V with the combined per-channel ``antiquant_scale``/``offset`` (Q_S > 1, fp16 query)."""
    b, n, nkv, d = 2, 4, 2, 32
    q = make_inputs("BSND", b=b, n=n, sq=24, d=d, dtype=F16)[0]
    k, v = randint8(b, 41, nkv, d, seed=1), randint8(b, 41, nkv, d, seed=2)
    run(triton_backend, q, k, v, antiquant_scale=_param((2, nkv, 1, d), F16, 3),
        antiquant_offset=_param((2, nkv, 1, d), F16, 4, offset=True), actual_seq_lengths_kv=[41, 19],
        atten_mask=TRIU2048, sparse_mode=3, num_heads=n, num_key_value_heads=nkv, scale_value=0.25,
        input_layout="BSND", softmax_lse_flag=True)


def test_int4_tensor_list(triton_backend, prefill_route):
    """int4 K/V (packed in int32) as a per-batch tensor list, one query row: one launch per batch."""
    n, nkv, d, lens = 4, 2, 64, [40, 23]
    q = make_inputs("BSND", b=2, n=n, sq=1, d=d, dtype=F16)[0]
    k = [pack_int4(randint4(1, s, nkv, d, seed=1 + i)) for i, s in enumerate(lens)]
    v = [pack_int4(randint4(1, s, nkv, d, seed=3 + i)) for i, s in enumerate(lens)]
    run(triton_backend, q, k, v, via="aclnn", launches=2, key_antiquant_scale=_param((1, 2, 40), F32, 5) * 10,
        value_antiquant_scale=_param((1, 2, 40), F32, 6) * 10, key_antiquant_offset=_param((1, 2, 40), F32, 7, True),
        value_antiquant_offset=_param((1, 2, 40), F32, 8, True), key_antiquant_mode=1, value_antiquant_mode=1,
        num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


def test_float_tensor_list(triton_backend):
    n, lens = 2, [37, 20, 0]
    q = make_inputs("BSND", b=3, n=n, sq=18, d=16, dtype=F16)[0]
    k = [randn(1, s, n, 16, dtype=F16, seed=1 + i) for i, s in enumerate(lens)]
    v = [randn(1, s, n, 16, dtype=F16, seed=5 + i) for i, s in enumerate(lens)]
    run(triton_backend, q, k, v, via="aclnn", launches=3, atten_mask=TRIU2048, sparse_mode=3, num_heads=n,
        scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


@pytest.mark.parametrize("int8,sq", [(False, 20), (False, 3), (True, 20)])
def test_shared_prefix(triton_backend, prefill_route, int8, sq):
    """The prefix's first 19 of 23 tokens before each batch's keys (a batch without keys of its own), causal; int8:
    prefix and K/V dequantized with the combined per-channel parameters."""
    b, n, d = 2, 2, 32
    q = make_inputs("BNSD", b=b, n=n, sq=sq, d=d, dtype=F16)[0]
    if int8:
        k, v = randint8(b, n, 30, d, seed=1), randint8(b, n, 30, d, seed=2)
        kp, vp = randint8(1, n, 23, d, seed=3), randint8(1, n, 23, d, seed=4)
        extra = dict(antiquant_scale=_param((2, n, 1, d), F16, 5), antiquant_offset=_param((2, n, 1, d), F16, 6, True))
    else:
        k, v = randn(b, n, 30, d, dtype=F16, seed=1), randn(b, n, 30, d, dtype=F16, seed=2)
        kp, vp = randn(1, n, 23, d, dtype=F16, seed=3), randn(1, n, 23, d, dtype=F16, seed=4)
        extra = {}
    run(triton_backend, q, k, v, key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[19],
        actual_seq_lengths_kv=[30, 0], atten_mask=TRIU2048, sparse_mode=3, num_heads=n, scale_value=0.25,
        input_layout="BNSD", softmax_lse_flag=True, **extra)


@pytest.mark.parametrize("shape", [(1,), (1, 1, 2 * 32)])
def test_int8_output(triton_backend, shape):
    q, k, v = make_inputs("BSH", b=2, n=2, sq=20, skv=40, d=32, dtype=F16)
    run(triton_backend, q, k, v, **int8_output_params(shape), actual_seq_lengths_kv=[40, 31], num_heads=2,
        scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


def test_grid_fold(triton_backend, monkeypatch):
    """Batch x heads beyond the grid's axis-1 limit continue on axis 2 (the limit made 3 here)."""
    monkeypatch.setattr(prefill, "GRID_FOLD", 3)
    q, k, v = make_inputs("BSND", b=3, n=4, nkv=2, sq=17, skv=21, d=16, dtype=F16)
    run(triton_backend, q, k, v, num_heads=4, num_key_value_heads=2, scale_value=0.25, input_layout="BSND",
        softmax_lse_flag=True)


def _launches(q, k, v, **options):
    options = dict(dict(num_heads=q.shape[2], scale=0.25, input_layout="BSND"), **options)
    p = build_problem(q, k, v, **options)
    assert kernel_route(p, q, k, v, options) == ("prefill", None)
    return prefill.prefill_plan(p, q, k, v, options, interpret=DEVICE == "cpu")


def test_block_table_values_outside_the_cache_are_masked(triton_backend):
    """Block ids a device table may hold (never checked on the host there) cannot address outside the cache: their
    keys are masked out (batch 1 keeps none: output 0, lse +inf)."""
    lens = [40, 21]
    q, kc, vc, bt = (_dev(x) for x in _paged_inputs("BSND", "BSH", lens=lens, sq=20, bs=16, n=2, nkv=2))
    (out, lse), launches = _launches(q, kc, vc, block_table=bt, block_size=16, actual_seq_lengths_kv=lens)
    bt.copy_(torch.tensor([[1 << 30, -7, 2, 0], [-1, 1 << 20, 3, 9]], dtype=bt.dtype))
    prefill.KERNELS.run_all(launches, q.device)
    assert bool(out.isfinite().all()) and bool(lse[0].isfinite().all())
    assert bool((out[1] == 0).all()) and bool(torch.isposinf(lse[1]).all())


def test_host_constants_mirror_the_kernels():
    from attnops.ops.common.triton import common

    assert prefill.META_FIELDS == common.META_FIELDS


def test_outputs_empty_only_when_every_row_is_written(triton_backend):
    q, k, v = make_inputs("BSND", b=2, n=2, sq=20, skv=30, d=16, dtype=F16)
    (out, _), _ = _launches(_dev(q), _dev(k), _dev(v))
    assert prefill._writes_every_row(build_problem(q, k, v, num_heads=2, scale=0.25, input_layout="BSND"))
    p = build_problem(q, k, v, num_heads=2, scale=0.25, input_layout="BSND", actual_seq_lengths=[20, 3])
    assert not prefill._writes_every_row(p)
    (out, lse), _ = prefill.prefill_plan(p, q, k, v, dict(input_layout="BSND"), interpret=True)
    assert bool((out == 0).all()) and bool(torch.isposinf(lse).all())


# ------------------------------------------------------------------------------------------------ rounding helpers
@triton.jit
def _rounding_kernel(x_ptr, o_ptr, one_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """``rounding.output_tile`` of a vector: CAST_ROUND to the output dtype (MODE 1) or int8 with scale 1 (MODE 2)."""
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0)[:, None]
    y = output_tile(x, ok[:, None], one_ptr, one_ptr, i[:, None] * 0, ok[:, None], MODE, False, o_ptr.dtype.element_ty)
    tl.store(o_ptr + i[:, None], y, mask=ok[:, None])


def _ties() -> torch.Tensor:
    """fp32 values on, and one fp32 step either side of, fp16 rounding ties (normal, subnormal, the fp16 maximum's
    neighbourhood), int8 ties, zeros; both signs."""
    h = torch.tensor([1.0, 1.0009765625, 2.5, 3.5, 1000.5, 2 ** -14, 2 ** -24, 3 * 2 ** -24, 65472.0], dtype=F16)
    tie = (h.float() + torch.nextafter(h, torch.tensor(float("inf"), dtype=F16)).float()) / 2
    x = torch.cat([h.float(), tie, torch.nextafter(tie, torch.zeros(())), torch.nextafter(tie, tie * 2),
                   torch.tensor([0.5, 1.5, 126.5, 127.6, 128.5, 0.0, 65519.0, 65520.0])])
    return torch.cat([x, -x])


def test_cast_round_matches_the_reference():
    x = _ties().to(DEVICE)
    out = torch.empty(x.shape, dtype=F16, device=DEVICE)
    # 65520 must become inf (the next bit pattern, NaN): the interpreter's NumPy reports that overflow, on purpose here
    with np.errstate(over="ignore", invalid="ignore"):
        _rounding_kernel[(1,)](x, out, torch.ones(1, device=DEVICE), x.numel(), MODE=1, BLOCK=128)
    want = quant.cast_round(x, F16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (x[out != want], out[out != want])


def test_int8_rounding_matches_the_reference():
    x = torch.cat([_ties(), torch.arange(-130, 130, 0.25)]).to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.int8, device=DEVICE)
    _rounding_kernel[(1,)](x, out, torch.ones(1, device=DEVICE), x.numel(), MODE=2, BLOCK=2048)
    assert torch.equal(out, quant.quantize_int8(x))
