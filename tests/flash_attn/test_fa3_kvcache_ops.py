"""FlashAttention-3's ``flash_attn_with_kvcache`` additions (packed new keys ``cu_seqlens_k_new``,
``rotary_seqlens``, ``attention_chunk``, ``qv``, ``page_table`` rows chosen by ``cache_batch_idx``, left padding
of a paged cache) against the fp64
kv-cache golden and the FA3 reference; and ``torch.ops.flash_attn_3`` (FA3's schemas, ``fwd``/``bwd`` equal to
the Python functions and their autograd)."""
import pytest
import torch
from torch._C import parse_schema

from attnops.flash_attn import fa3, fa3_ops
from attnops.testing.compare import assert_close_to_golden
from attnops.testing.golden_flash_attn_kvcache import kvcache_golden, rotary_golden
from attnops.testing.golden_flash_attn_kvcache import kvcache_inputs as make_case
from tests.flash_attn.fa3_ref import fa3_ref

TENSORS = ("q", "k_cache", "v_cache", "k", "v")


def _split(kw: dict):
    return [kw.get(name) for name in TENSORS], {name: x for name, x in kw.items() if name not in TENSORS}


@pytest.mark.parametrize("paged", [False, True])
def test_packed_new_keys_with_their_own_rotary_positions(paged):
    lens, b = [3, 1, 2], 3
    kw = make_case(seed=21, b=b, sq=3, new=3, paged=paged, batch_idx=not paged, rotary="interleaved", causal=True)
    rotary_at = (kw["cache_seqlens"] // 2).to(torch.int32)
    packed_k, packed_v = (torch.cat([kw[name][i, :n] for i, n in enumerate(lens)]) for name in ("k", "v"))
    cu_new = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    caches = {name: kw[name].clone() for name in ("k_cache", "v_cache")}
    table = kw.pop("block_table", None)
    out, lse = fa3.flash_attn_with_kvcache(**dict(kw, k=packed_k, v=packed_v, **caches), page_table=table,
                                           cu_seqlens_k_new=cu_new, rotary_seqlens=rotary_at, return_softmax_lse=True)
    # the golden: batch by batch, q and k rotated beforehand at rotary_seqlens + s, no rotary in the call
    (q, k_cache, v_cache, k, v), options = _split(kw)
    cos, sin, interleaved = options.pop("rotary_cos"), options.pop("rotary_sin"), options.pop("rotary_interleaved")
    for i, n in enumerate(lens):
        positions = rotary_at[i] + torch.arange(3)
        q_rot, k_rot = (rotary_golden(x[i], cos, sin, positions, interleaved, torch.float64).float()[None]
                        for x in (q, k))
        one = dict(options, cache_seqlens=kw["cache_seqlens"][i:i + 1],
                   cache_batch_idx=None if paged else kw["cache_batch_idx"][i:i + 1],
                   block_table=None if table is None else table[i:i + 1])
        want = kvcache_golden(q_rot, k_cache, v_cache, k_rot[:, :n], v[i:i + 1, :n], **one)
        base = kvcache_golden(q_rot, k_cache, v_cache, k_rot[:, :n], v[i:i + 1, :n], **one, dtype=torch.float32)
        k_cache, v_cache = want.k_cache, want.v_cache
        assert_close_to_golden(f"out[{i}]", out[i:i + 1], want.out, base.out, reduction=16 + 64)
        assert_close_to_golden(f"lse[{i}]", lse[i:i + 1], want.lse, base.lse, reduction=16 + 64)
    assert torch.equal(caches["v_cache"], v_cache)  # each batch appended exactly its own tokens
    assert_close_to_golden("k_cache", caches["k_cache"], k_cache, None, reduction=2)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(5, 2)), dict(leftpad=True, causal=True)])
def test_attention_chunk_counts_from_the_left_padding(options):
    kw = make_case(seed=22, b=2, sq=3, new=2, **options)
    chunk = 4
    out, lse = fa3.flash_attn_with_kvcache(**{n: x.clone() if torch.is_tensor(x) else x for n, x in kw.items()},
                                           attention_chunk=chunk, return_softmax_lse=True)
    cache = kvcache_golden(*_split(kw)[0], **_split(kw)[1])  # the caches after the append
    for b in range(2):
        lo = 0 if "cache_leftpad" not in kw else int(kw["cache_leftpad"][b])
        end = int(kw["cache_seqlens"][b]) + 2
        keys, values = (c[b, lo:end][None] for c in (cache.k_cache, cache.v_cache))
        ref = dict(causal=kw["causal"], window_size=kw["window_size"], attention_chunk=chunk)
        want = fa3_ref(kw["q"][b:b + 1], keys, values, **ref)
        base = fa3_ref(kw["q"][b:b + 1], keys, values, **ref, dtype=torch.float32)
        assert_close_to_golden("out", out[b:b + 1], want[0], base[0], reduction=16 + end)
        finite = torch.isfinite(want[1])
        assert torch.equal(torch.isfinite(lse[b:b + 1]), finite)
        assert_close_to_golden("lse", lse[b:b + 1][finite], want[1][finite], None, reduction=16 + end)


@pytest.mark.parametrize("varlen", [False, True])
def test_qv_scores_with_the_cache_values(varlen):
    kw = make_case(seed=25, b=2, sq=3, new=1, causal=True)
    qv = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(26))
    call = {n: x.clone() if torch.is_tensor(x) else x for n, x in kw.items()}
    if varlen:  # rows 3 and 1 of the two batches, packed
        call.update(q=torch.cat([kw["q"][0], kw["q"][1, :1]]), cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
                    max_seqlen_q=3)
        qv_call = torch.cat([qv[0], qv[1, :1]])
    out = fa3.flash_attn_with_kvcache(**call, qv=qv_call if varlen else qv)
    cache = kvcache_golden(*_split(kw)[0], **_split(kw)[1])
    for b, (rows, first) in enumerate(((3, 0), (1, 3) if varlen else (3, 3))):
        end = int(kw["cache_seqlens"][b]) + 1
        keys, values = (c[b, :end][None] for c in (cache.k_cache, cache.v_cache))
        q_b, qv_b = kw["q"][b:b + 1, :rows], qv[b:b + 1, :rows]
        want = fa3_ref(q_b, keys, values, qv=qv_b, causal=True)[0]
        base = fa3_ref(q_b, keys, values, qv=qv_b, causal=True, dtype=torch.float32)[0]
        got = out[first:first + rows][None] if varlen else out[b:b + 1]
        assert_close_to_golden(f"out[{b}]", got, want, base, reduction=32 + end)


def test_page_table_rows_chosen_by_cache_batch_idx():
    kw = make_case(seed=23, b=2, paged=True, new=1, causal=True)
    table = torch.cat([kw.pop("block_table")] * 2)[[2, 0, 3, 1]]  # 4 rows; the batches use rows 1 and 3
    idx = torch.tensor([1, 3], dtype=torch.int32)
    caches = [{name: kw[name].clone() for name in ("k_cache", "v_cache")} for _ in range(2)]
    got = fa3.flash_attn_with_kvcache(**dict(kw, **caches[0]), page_table=table, cache_batch_idx=idx)
    want = fa3.flash_attn_with_kvcache(**dict(kw, **caches[1]), page_table=table[[1, 3]])
    assert torch.equal(got, want) and torch.equal(caches[0]["k_cache"], caches[1]["k_cache"])


def test_left_padding_of_a_paged_cache_equals_that_of_its_dense_copy():
    kw = make_case(seed=27, b=2, sq=2, new=2, paged=True, causal=True)
    table = kw.pop("block_table")
    kw["cache_leftpad"] = torch.tensor([3, 1], dtype=torch.int32)
    pages = {n: kw[n].clone() for n in ("k_cache", "v_cache")}
    dense = {n: kw[n][table.long()].flatten(1, 2) for n in ("k_cache", "v_cache")}  # [B, capacity, H_k, D] copies
    got = fa3.flash_attn_with_kvcache(**dict(kw, **pages), page_table=table, return_softmax_lse=True)
    want = fa3.flash_attn_with_kvcache(**dict(kw, **dense), return_softmax_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(pages["k_cache"][table.long()].flatten(1, 2), dense["k_cache"])


def test_torch_ops_flash_attn_3_have_fa3_schemas_and_equal_the_functions():
    fa3_ops.register()
    ops = torch.ops.flash_attn_3
    for name, schema in fa3_ops._SCHEMAS.items():
        assert getattr(ops, name).default._schema.is_backward_compatible_with(parse_schema("flash_attn_3::" + schema))
    g = torch.Generator().manual_seed(24)
    q, k, v = (torch.randn(2, s, h, d, generator=g) for s, h, d in ((7, 4, 16), (9, 2, 16), (9, 2, 24)))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fa3.flash_attn_func(*leaves, causal=True, window_size=(4, -1), return_attn_probs=True)
    op_out, op_lse, out_accum, _ = ops.fwd(q, k, v, is_causal=True, window_size_left=4)
    assert torch.equal(op_out, out) and torch.equal(op_lse, lse) and out_accum.numel() == 0
    dout = torch.randn(out.shape, generator=g)
    dq = torch.empty_like(q)
    grads = ops.bwd(dout, q, k, v, out.detach(), lse, dq=dq, is_causal=True, window_size_left=4)
    assert grads[0] is dq
    for name, a, b in zip(("dq", "dk", "dv"), grads[:3], torch.autograd.grad(out, leaves, dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(grads[3], (dout * out).sum(-1).transpose(1, 2))
    combined, combined_lse = ops.fwd_combine(out[None], lse.transpose(1, 2)[None])
    torch.testing.assert_close(combined, out.detach())
    assert ops.get_scheduler_metadata(2, 7, 9, 4, 2, 16, 24, torch.bfloat16,
                                      torch.tensor([9, 9], dtype=torch.int32)).numel() == 0
