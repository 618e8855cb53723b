"""``flash_attn_with_kvcache`` against the fp64 golden written from flash-attn's documented semantics
(``attnops.testing.golden_flash_attn_kvcache``), with FlashAttention's tolerance rule; the caches after the call;
the validation table; the GPU path with no host reads (dry run)."""
from __future__ import annotations

import itertools

import pytest
import torch

import attnops
from attnops.flash_attn import flash_attn_with_kvcache
from attnops.testing.compare import assert_close_to_golden
from attnops.testing.golden_flash_attn_kvcache import PAGE, kvcache_golden
from attnops.testing.golden_flash_attn_kvcache import kvcache_inputs as make_case
from tests.helpers import noncontig
from tests.triton_backend import DEVICE

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


TENSORS = ("q", "k_cache", "v_cache", "k", "v")


def goldens(kw: dict):
    """The fp64 golden and the low-precision baseline of a call's inputs (CPU copies; the inputs are unchanged)."""
    cpu = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    tensors = [cpu.get(name) for name in TENSORS]
    options = {name: x for name, x in cpu.items() if name not in TENSORS}
    return kvcache_golden(*tensors, **options), kvcache_golden(*tensors, **options, dtype=kw["q"].dtype)


def reduction(kw: dict) -> int:
    """The scores over the head dim, then ``P V`` over at most every cache slot a sequence can read."""
    table = kw.get("block_table")
    keys = kw["k_cache"].shape[1] if table is None else table.shape[1] * PAGE
    return kw["q"].shape[-1] + keys


def check_case(kw: dict) -> None:
    """Run the call on copies of the caches and judge out, lse and the caches against the golden."""
    inputs = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    out, lse = flash_attn_with_kvcache(**inputs, return_softmax_lse=True)
    want, base = goldens(kw)
    assert out.shape == kw["q"].shape and out.dtype == kw["q"].dtype
    assert lse.shape == (kw["q"].shape[0], kw["q"].shape[2], kw["q"].shape[1]) and lse.dtype == F32
    assert_close_to_golden("out", out, want.out, base.out, reduction=reduction(kw))
    assert_close_to_golden("softmax_lse", lse, want.lse, base.lse, reduction=reduction(kw))
    assert torch.equal(inputs["v_cache"], want.v_cache)
    if "rotary_cos" in kw:  # a rotated element sums two products
        assert_close_to_golden("k_cache", inputs["k_cache"], want.k_cache, base.k_cache, reduction=2)
    else:
        assert torch.equal(inputs["k_cache"], want.k_cache)


CASES = {
    "decode_gqa_causal": dict(causal=True),
    "decode_no_new_kv": dict(new=0),
    "decode_int_seqlens_window": dict(seqlens="int", window=(5, -1)),
    "paged_append_rotary_interleaved": dict(paged=True, rotary="interleaved", causal=True, dtype=F16, new=2, sq=2),
    "paged_window_alibi": dict(paged=True, window=(4, 1), sq=3, new=3, alibi="heads"),
    "batch_idx_leftpad_rotary_neox": dict(batch_idx=True, leftpad=True, rotary="neox", rotary_dim=8, sq=3, new=2,
                                          dtype=F16),
    "leftpad_causal_alibi_batch": dict(leftpad=True, causal=True, sq=2, new=2, alibi="batch", dtype=BF16),
    "prefill_local_rotary": dict(sq=4, new=4, window=(2, 0), rotary="interleaved", h_k=1, dtype=BF16),
    "mha_whole_cache": dict(h_k=4, new=0, seqlens=None, sq=2),
    "softcap_paged_window_alibi": dict(paged=True, softcap=0.5, window=(4, 1), sq=3, new=3, alibi="heads", dtype=F16),
    "softcap_leftpad_causal_rotary": dict(softcap=0.7, leftpad=True, causal=True, sq=2, new=2, rotary="neox"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_the_golden(name):
    check_case(make_case(seed=len(name), **CASES[name]))


@pytest.mark.slow
@pytest.mark.parametrize("paged,new,rotary,leftpad_or_idx,mask,dtype,softcap", itertools.product(
    (False, True), (0, 3), (None, "interleaved", "neox"), (None, "leftpad", "batch_idx"),
    ("none", "causal", "window", "alibi"), (F32, F16, BF16), (0.0, 0.5)))
def test_kvcache_matrix(paged, new, rotary, leftpad_or_idx, mask, dtype, softcap):
    if rotary is not None and not new or paged and leftpad_or_idx is not None:
        pytest.skip("rotary needs new k/v; paged caches take neither cache_leftpad nor cache_batch_idx")
    check_case(make_case(seed=7, dtype=dtype, sq=3, new=new, paged=paged, rotary=rotary,
                         leftpad=leftpad_or_idx == "leftpad", batch_idx=leftpad_or_idx == "batch_idx",
                         causal=mask == "causal", window=(3, 1) if mask == "window" else (-1, -1),
                         alibi="heads" if mask == "alibi" else None, softcap=softcap))


def test_rows_that_see_no_key_are_zero_with_infinite_lse():
    kw = make_case(sq=4, new=1, seqlens=None, causal=True)
    kw["cache_seqlens"] = torch.tensor([1, 0], dtype=torch.int32)  # L = 2 and 1 keys for 4 queries
    out, lse = flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.equal(out[1, :3], torch.zeros_like(
        out[1, :3]))
    assert torch.isinf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all()


def test_the_append_is_in_place_at_cache_seqlens():
    kw = make_case(new=2, paged=True)
    k_cache, table = kw["k_cache"], kw["block_table"]
    flash_attn_with_kvcache(**kw)
    for b, n in enumerate(kw["cache_seqlens"].tolist()):
        for s in range(2):
            blk, off = int(table[b, (n + s) // PAGE]), (n + s) % PAGE
            assert torch.equal(k_cache[blk, off], kw["k"][b, s])
            assert torch.equal(kw["v_cache"][blk, off], kw["v"][b, s])


def test_num_splits_changes_nothing():
    kw = make_case(causal=True, new=0)
    assert torch.equal(flash_attn_with_kvcache(**kw, num_splits=1), flash_attn_with_kvcache(**kw, num_splits=0))


BAD = {
    "k_cache": (dict(k_cache=torch.zeros(3, 24, 3, 16)), r"k_cache: expected \[\*, \*, H_k, D=16\]"),
    "k_without_v": (dict(v=None), r"v: expected k and v together"),
    "k_without_seqlens": (dict(cache_seqlens=None), r"cache_seqlens: expected the cache lengths"),
    "rotary_without_k": (dict(k=None, v=None, rotary_cos=torch.ones(24, 8), rotary_sin=torch.ones(24, 8)),
                         r"rotary_cos: expected None without k and v"),
    "rotary_too_short": (dict(rotary_cos=torch.ones(8, 8), rotary_sin=torch.ones(8, 8)),
                         r"rotary_cos: expected \[seqlen_ro >= 24"),
    "overflow": (dict(cache_seqlens=24), r"cache_seqlens: expected cache_seqlens \+ seqlen_new in \[0, 24\]"),
    "batch_idx_range": (dict(cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32)),
                        r"cache_batch_idx: expected rows of the cache in \[0, 3\)"),
    "leftpad_past_end": (dict(cache_leftpad=torch.tensor([30, 0], dtype=torch.int32)),
                         r"cache_leftpad: expected values in \[0, cache_seqlens \+ seqlen_new\]"),
    "paged_leftpad": (dict(block_table=torch.zeros(2, 3, dtype=torch.int32), cache_leftpad=torch.zeros(
        2, dtype=torch.int32)), r"cache_leftpad: expected None with a paged"),
    "page_id": (dict(block_table=torch.full((2, 3), 10, dtype=torch.int32)),
                r"block_table: expected a block id in \[0, 3\) .*, got block_table\[0, 0\] = 10"),
    "alibi_shape": (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes: expected \[H=4\] or \[B=2, H=4\]"),
    "window": (dict(window_size=(-2, 0)), r"window_size: expected a pair \(left, right\) of ints >= -1"),
    "softcap": (dict(softcap=-1.0), r"softcap: expected a float >= 0"),
    "dtype": (dict(k=torch.zeros(2, 1, 2, 16, dtype=F16)), r"k: expected dtype in \['torch.float32'\]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_raise_naming_them(name):
    changes, message = BAD[name]
    kw = dict(make_case(), **changes)
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    with pytest.raises((attnops.ParamInvalidError, attnops.ParamDtypeError, attnops.ParamNullptrError),
                       match=message):
        flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])  # nothing written


def test_gpu_path_reads_nothing_back():
    meta = dict(device="meta", dtype=F16)
    q, k = torch.empty(2, 1, 8, 64, **meta), torch.empty(2, 1, 2, 64, **meta)
    cache = torch.empty(16, 16, 2, 64, **meta)
    table = torch.empty(2, 4, dtype=torch.int32, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    cos = torch.empty(64, 32, **meta)
    for options in (dict(causal=True), dict(window_size=(8, 0), rotary_cos=cos, rotary_sin=cos),
                    dict(alibi_slopes=torch.empty(8, device="meta")), dict(softcap=30.0, window_size=(4, 0))):
        with attnops.testing.gpu_dry_run() as launches:
            flash_attn_with_kvcache(q, cache, cache, k, k, cache_seqlens=lens, block_table=table, **options)
        assert launches, options
    from attnops.flash_attn import fa3

    cu = torch.empty(3, dtype=torch.int32, device="meta")
    with attnops.testing.gpu_dry_run() as launches:  # FA3's varlen queries
        fa3.flash_attn_with_kvcache(torch.empty(5, 8, 64, **meta), cache, cache, cache_seqlens=lens, page_table=table,
                                    cu_seqlens_q=cu, max_seqlen_q=4, causal=True)
    assert launches


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(paged=True, rotary="interleaved", causal=True),
                                     dict(leftpad=True, window=(3, 0), alibi="heads", softcap=0.5, new=2, sq=2)])
def test_compiles_with_fullgraph_and_matches_eager(options):
    kw = make_case(seed=5, **options)
    eager = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    want_out, want_lse = flash_attn_with_kvcache(**eager, return_softmax_lse=True)
    out, lse = torch.compile(flash_attn_with_kvcache, fullgraph=True)(**kw, return_softmax_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(kw["k_cache"], eager["k_cache"]) and torch.equal(kw["v_cache"], eager["v_cache"])


def test_fa3_name_takes_page_table_and_refuses_what_attnops_lacks():
    from attnops.flash_attn import fa3, flash_attn_interface

    assert flash_attn_interface.flash_attn_with_kvcache is flash_attn_with_kvcache
    kw = make_case(paged=True, new=0, causal=True)
    table = kw.pop("block_table")
    want = flash_attn_with_kvcache(**kw, block_table=table, return_softmax_lse=True)
    got = fa3.flash_attn_with_kvcache(**kw, page_table=table, scheduler_metadata=torch.zeros(4, dtype=torch.int32),
                                      pack_gqa=True, return_softmax_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(attnops.ParamInvalidError,
                       match=r"q_descale: expected its default \(not supported by attnops\)"):
        fa3.flash_attn_with_kvcache(**kw, page_table=table, q_descale=torch.ones(2, 2))


@pytest.mark.parametrize("options,kernel", [
    (dict(dtype=F16, paged=True, rotary="interleaved", causal=True, new=1), "split_kernel"),
    (dict(leftpad=True, window=(4, 0), alibi="heads", sq=2, new=2), "split_kernel"),
    (dict(dtype=F16, paged=True, softcap=0.5, window=(3, 1), sq=2, new=2), "fwd_kernel"),
], ids=["paged-rotary-decode", "leftpad-window-alibi", "softcap"])
def test_on_the_triton_kernels(options, kernel, triton_backend):
    kw = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in make_case(seed=9, **options).items()}
    want, base = goldens(kw)
    out, lse = flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert kernel in triton_backend
    assert_close_to_golden("out", out.cpu(), want.out, base.out, reduction=reduction(kw))
    assert_close_to_golden("softmax_lse", lse.cpu(), want.lse, base.lse, reduction=reduction(kw))


def test_non_contiguous_inputs_give_the_same_result():
    kw = make_case(paged=True, rotary="neox", new=2, sq=2, alibi="heads", causal=True)
    plain = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    strided = dict(plain, **{name: noncontig(kw[name]) for name in ("q", "k", "v", "rotary_cos", "rotary_sin")},
                   k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone())
    assert not strided["q"].is_contiguous()
    assert torch.equal(flash_attn_with_kvcache(**strided), flash_attn_with_kvcache(**plain))
    assert torch.equal(strided["k_cache"], plain["k_cache"]) and torch.equal(strided["v_cache"], plain["v_cache"])


@pytest.mark.parametrize("options", [
    dict(paged=True, causal=True, new=1, rotary="interleaved", dtype=F16),
    dict(window=(3, 0), new=0, softcap=0.5),
    dict(leftpad=True, causal=True, new=2),
], ids=["paged-causal-rotary", "window-softcap", "leftpad"])
def test_fa3_varlen_queries_align_each_batch_to_its_own_keys(options):
    from attnops.flash_attn import fa3

    lens, cu = [3, 1, 0], torch.tensor([0, 3, 4, 4], dtype=torch.int32)
    kw = make_case(seed=11, b=3, sq=max(lens), **options)
    table = kw.pop("block_table", None)
    packed = torch.cat([kw["q"][b, :n] for b, n in enumerate(lens)])
    caches = {name: kw[name].clone() for name in ("k_cache", "v_cache")}
    out, lse = fa3.flash_attn_with_kvcache(**dict(kw, q=packed, **caches), page_table=table, cu_seqlens_q=cu,
                                           max_seqlen_q=3, return_softmax_lse=True)
    assert out.shape == packed.shape and lse.shape == (packed.shape[1], packed.shape[0])
    for b, n in enumerate(lens):
        one = dict(kw, q=kw["q"][b:b + 1, :n], **{name: kw[name][b:b + 1] for name in (
            "k", "v", "cache_seqlens", "cache_leftpad") if name in kw})
        one.update(cache_batch_idx=torch.tensor([b]) if table is None else None,
                   block_table=None if table is None else table[b:b + 1])
        want, base = goldens(one)
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert_close_to_golden(f"out[{b}]", out[rows], want.out[0], base.out[0], reduction=reduction(one))
        assert_close_to_golden(f"lse[{b}]", lse[:, rows], want.lse[0], base.lse[0], reduction=reduction(one))
    dense = {name: kw[name].clone() for name in ("k_cache", "v_cache")}
    flash_attn_with_kvcache(**dict(kw, **dense), block_table=table)  # the same appends, padded queries
    assert torch.equal(caches["k_cache"], dense["k_cache"]) and torch.equal(caches["v_cache"], dense["v_cache"])


@pytest.mark.parametrize("bad", [-1, 5])
def test_unvalidated_page_outside_the_cache_is_neither_written_nor_attended(monkeypatch, bad):
    """``ATTNOPS_VALIDATE=0``: the appended tokens of a page id outside the cache are dropped (no other slot
    changes) and that page's keys are not attended; with validation on it is an error naming block_table."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 1, 2, 8, generator=g) for _ in range(3))
    k_cache, v_cache = torch.randn(4, 4, 2, 8, generator=g), torch.randn(4, 4, 2, 8, generator=g)
    table = torch.tensor([[0, 1], [2, bad]], dtype=torch.int32)
    seqlens = torch.tensor([2, 5], dtype=torch.int32)  # batch 1 appends at position 5: page 1 (the bad id)
    with pytest.raises(attnops.ParamInvalidError, match=r"^block_table: .*got block_table\[1, 1\] = "):
        flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens, block_table=table)
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, softmax_scale=0.5)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[0, 2], want_v[0, 2] = k[0, 0], v[0, 0]  # batch 0's token: page 0, row 2
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    keys, values = want_k[2].double(), want_v[2].double()  # batch 1 attends to its 4 keys of page 2 only
    p = torch.softmax(torch.einsum("hd,khd->hk", q[1, 0].double(), keys) * 0.5, -1)
    torch.testing.assert_close(out[1, 0].double(), torch.einsum("hk,khd->hd", p, values), atol=1e-5, rtol=1e-5)
