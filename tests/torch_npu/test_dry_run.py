"""The torch_npu helper layer on the GPU path, on ``meta`` tensors inside ``gpu_dry_run()``: the KV-cache ops, the
ATB wrappers and the rope / sink / attention-update helpers read no device value on the host and make no blocking
upload (``HostSyncError`` otherwise); each cache write or read records its one kernel launch, the wrappers that run
an attention operator record the operator's launches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attnops import torch_npu
from attnops.testing import gpu_dry_run
from attnops.torch_npu import mindspeed_ops, rope, sink

META = torch.device("meta")
F16 = torch.float16
T, N, KVN, D, DV, BLOCKS, BLOCK = 6, 4, 2, 32, 16, 8, 16


def meta(*shape, dtype=F16):
    return torch.empty(*shape, device=META, dtype=dtype)


def kv(tokens=T, dtype=F16):
    return meta(tokens, KVN, D, dtype=dtype), meta(tokens, KVN, DV, dtype=dtype)


def nd_caches(dtype=F16):
    return meta(BLOCKS, BLOCK, KVN, D, dtype=dtype), meta(BLOCKS, BLOCK, KVN, DV, dtype=dtype)


def nz_caches(dtype=F16, x=16):
    """A 5-D ``[blocks, N, D/x, block, x]`` key cache, a 4-D ``[blocks, N*D/x, block, x]`` value cache."""
    return meta(BLOCKS, KVN, D // x, BLOCK, x, dtype=dtype), meta(BLOCKS, KVN * DV // x, BLOCK, x, dtype=dtype)


def assert_one_cache_write(launches, tokens=T, key_x=KVN * D, value_x=KVN * DV):
    (launch,) = launches
    assert (launch.kernel, launch.grid) == ("scatter_kv_kernel", (tokens, 2))
    assert (launch.constexprs["K_X"], launch.constexprs["V_X"]) == (key_x, value_x)


# --- KV-cache writes: one launch, slots read by the kernel -----------------------------------------------------

@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_scatter_nd_cache_with_device_slots(slot_dtype):
    with gpu_dry_run() as launches:
        torch_npu.npu_scatter_pa_kv_cache(*kv(), *nd_caches(), meta(T, dtype=slot_dtype), cache_mode="Norm")
    assert_one_cache_write(launches)


@pytest.mark.parametrize("dtype,x", [(F16, 16), (torch.bfloat16, 16), (torch.int8, 32), (torch.float32, 8)])
def test_scatter_nz_caches_every_element_width(dtype, x):
    with gpu_dry_run() as launches:
        torch_npu.npu_scatter_pa_kv_cache(*kv(dtype=dtype), *nz_caches(dtype, x), meta(T, dtype=torch.int32))
    assert_one_cache_write(launches, key_x=x, value_x=x)


def test_scatter_functional_returns_new_caches():
    caches = nd_caches()
    with gpu_dry_run() as launches:
        key_cache, value_cache = torch_npu.npu_scatter_pa_kv_cache_functional(
            *kv(), *caches, meta(T, dtype=torch.int32), cache_mode="Norm")
    assert_one_cache_write(launches)
    assert key_cache.shape == caches[0].shape and key_cache is not caches[0]


def test_reshape_and_cache_reads_each_layout_from_its_cache():
    key_cache, _ = nd_caches()
    _, value_cache = nz_caches()  # 4-D NZ
    with gpu_dry_run() as launches:
        torch_npu._npu_reshape_and_cache(*kv(), key_cache, value_cache, meta(T, dtype=torch.int32))
    assert_one_cache_write(launches, value_x=16)


def test_host_slots_are_checked_then_staged_without_blocking():
    """vllm-ascend builds the slot mapping with numpy: a CPU tensor is read (free), checked and staged up."""
    slots = torch.from_numpy(np.array([3, -1, 17, 127, 0, 40], dtype=np.int32))
    with gpu_dry_run() as launches:
        torch_npu.npu_scatter_pa_kv_cache(*kv(), *nd_caches(), slots, cache_mode="Norm")
        with pytest.raises(ValueError, match=r"slot_mapping: expected a slot in \[0, "):
            torch_npu.npu_scatter_pa_kv_cache(*kv(), *nd_caches(), slots + 1, cache_mode="Norm")
    assert_one_cache_write(launches)


def test_scatter_of_no_tokens_launches_nothing():
    with gpu_dry_run() as launches:
        torch_npu.npu_scatter_pa_kv_cache(*kv(0), *nd_caches(), meta(0, dtype=torch.int32), cache_mode="Norm")
    assert launches == []


@pytest.mark.parametrize("bad,match", [
    (dict(slots=meta(T + 1, dtype=torch.int32)), "slot_mapping: expected one slot per token"),
    (dict(slots=meta(T, dtype=torch.float32)), "slot_mapping"),
    (dict(key_cache=meta(BLOCKS, BLOCK, KVN, D, dtype=torch.float32)), "key_cache: expected dtype"),
    (dict(value_cache=meta(BLOCKS, BLOCK, KVN, D)), "value_cache"),
])
def test_scatter_checks_what_the_host_knows(bad, match):
    key_cache, value_cache = nd_caches()
    args = dict(slots=meta(T, dtype=torch.int32), key_cache=key_cache, value_cache=value_cache) | bad
    with gpu_dry_run(), pytest.raises((ValueError, TypeError), match=match):
        torch_npu.npu_scatter_pa_kv_cache(*kv(), args["key_cache"], args["value_cache"], args["slots"],
                                          cache_mode="Norm")


# --- KV-cache reads: one launch, lengths and table read by the kernel ----------------------------------------------

@pytest.mark.parametrize("cumsum", [False, True])
@pytest.mark.parametrize("layout", ["nd", "nz"])
def test_gather_with_device_lengths_table_and_offsets(cumsum, layout):
    caches = nd_caches() if layout == "nd" else (meta(BLOCKS, KVN * D // 16, BLOCK, 16),
                                                 meta(BLOCKS, KVN * DV // 16, BLOCK, 16))
    lens = meta(4 if cumsum else 3, dtype=torch.int32)
    with gpu_dry_run() as launches:
        torch_npu.npu_gather_pa_kv_cache(*caches, meta(3, 5, dtype=torch.int32), lens, *kv(),
                                         seq_offset=meta(3, dtype=torch.int32), is_seq_lens_cumsum=cumsum)
        key, value = torch_npu.npu_gather_pa_kv_cache_functional(*caches, meta(3, 5, dtype=torch.int32), lens, *kv(),
                                                                 is_seq_lens_cumsum=cumsum)
    seen = [(x.kernel, x.grid, x.constexprs["CUMSUM"], x.constexprs["HAS_OFFSETS"]) for x in launches]
    assert seen == [("gather_kv_kernel", (T, 2), cumsum, True), ("gather_kv_kernel", (T, 2), cumsum, False)]
    assert key.shape == (T, KVN, D) and value.shape == (T, KVN, DV)


def test_gather_with_host_metadata_is_checked_and_staged():
    table, lens = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([4, 2], dtype=torch.int32)
    with gpu_dry_run() as launches:
        torch_npu.npu_gather_pa_kv_cache(*nd_caches(), table, lens, *kv())
        with pytest.raises(ValueError, match="seq_lens: expected non-negative lengths"):
            torch_npu.npu_gather_pa_kv_cache(*nd_caches(), table, torch.tensor([4, -2], dtype=torch.int32), *kv())
        with pytest.raises(ValueError, match="block_tables: expected at least 3 rows"):
            torch_npu.npu_gather_pa_kv_cache(*nd_caches(), table, meta(3, dtype=torch.int32), *kv())
    assert len(launches) == 1


# --- ATB wrappers: host lengths checked, device lengths passed on unread -----------------------------------------

def test_paged_attention_workspace():
    with gpu_dry_run():
        workspace = torch_npu._npu_paged_attention_get_workspace(
            meta(2, N, D), *nd_caches(), KVN, N, 0.25, meta(2, 3, dtype=torch.int32), torch.tensor([40, 9]),
            meta(2, N, DV))
    assert workspace.device == META and workspace.numel() == 0


def _paged_attention(context_lens):
    key_cache, value_cache = nd_caches()
    with gpu_dry_run() as launches:
        torch_npu._npu_paged_attention(meta(2, N, D), key_cache, value_cache, KVN, N, 0.25,
                                       meta(2, 3, dtype=torch.int32), context_lens, meta(2, N, DV))
    assert launches


def test_paged_attention_with_host_context_lens():
    _paged_attention(torch.tensor([40, 9], dtype=torch.int32))


def test_paged_attention_with_device_context_lens():
    _paged_attention(meta(2, dtype=torch.int32))


def _flash_attention_unpad(seq_len):
    with gpu_dry_run() as launches:
        torch_npu._npu_flash_attention_unpad(meta(13, N, D), meta(13, KVN, D), meta(13, KVN, DV), seq_len, 0.25, N,
                                             KVN, meta(13, N, DV))
    assert launches


def test_flash_attention_unpad_with_host_seq_len():
    _flash_attention_unpad(torch.tensor([5, 8], dtype=torch.int32))


def test_flash_attention_unpad_with_device_seq_len():
    _flash_attention_unpad(meta(2, dtype=torch.int32))


def test_atb_wrappers_hand_device_lengths_to_the_operators_unread(monkeypatch):
    """What the wrappers themselves do with device lengths, the operators stubbed out: no host read, the lengths
    reach the operator on the device (FlashAttention as cu_seqlens with a leading 0)."""
    calls = {}

    def operator(name, out_dim):
        def run(query, key, value, **kw):
            calls[name] = kw
            return meta(*query.shape[:-1], out_dim)
        return run

    monkeypatch.setattr("attnops.ops.flash_attention.flash_attention", operator("fa", DV))
    monkeypatch.setattr("attnops.ops.fused_infer_attention.fused_infer_attention", operator("fia", DV))
    with gpu_dry_run():
        torch_npu._npu_flash_attention_unpad(meta(13, N, D), meta(13, KVN, D), meta(13, KVN, DV),
                                             meta(2, dtype=torch.int64), 0.25, N, KVN, meta(13, N, DV))
        torch_npu._npu_paged_attention(meta(2, N, D), *nd_caches(), KVN, N, 0.25, meta(2, 3, dtype=torch.int32),
                                       meta(2, dtype=torch.int32), meta(2, N, DV))
        with pytest.raises(ValueError, match="context_lens: expected one length per query token"):
            torch_npu._npu_paged_attention(meta(2, N, D), *nd_caches(), KVN, N, 0.25, meta(2, 3, dtype=torch.int32),
                                           meta(3, dtype=torch.int32), meta(2, N, DV))
    cu = calls["fa"]["cu_seqlens_q"]
    assert cu is calls["fa"]["cu_seqlens_k"] and cu.device == META and cu.shape == (3,) and cu.dtype == torch.int32
    lens = calls["fia"]["actual_seq_lengths_kv"]
    assert lens.device == META and lens.shape == (2,)


# --- rope, sink, attention update ---------------------------------------------------------------------------------

def test_rope_helpers():
    with gpu_dry_run():
        q = rope.append_rope("query_rope", meta(2, 5, N * D), meta(2, 5, N * 8), packed=True, heads=N, like="query")
        first, second = rope.split_head_dim(q, D, packed=True, heads=N)
        assert rope.rope_given(meta(1), meta(1))
    assert q.shape == (2, 5, N * (D + 8)) and first.shape == (2, 5, N * D) and second.shape == (2, 5, N * 8)


@pytest.mark.parametrize("layout,softmax_layout", [("BSND", ""), ("TND", ""), ("TND", "TND")])
def test_sink_forward_and_grad(layout, softmax_layout):
    out = meta(2, 5, N, DV) if layout == "BSND" else meta(10, N, DV)
    stats = meta(2, N, 5, 8, dtype=torch.float32) if layout == "BSND" else meta(10, N, 8, dtype=torch.float32)
    kw = dict(layout=layout, softmax_layout=softmax_layout, q_lens=[3, 7] if layout == "TND" else None, head_num=N)
    with gpu_dry_run():
        sink.check_sink(meta(N, dtype=torch.float32), N)
        o, m, s = sink.apply_sink(out, stats, stats, meta(N, dtype=torch.float32), **kw)
        dsink = sink.sink_grad(out, o, m, s, meta(N, dtype=torch.float32), **kw)
    assert o.shape == out.shape and m.shape == stats.shape and dsink.shape == (N,)


@pytest.mark.parametrize("softmax_layout,prefix", [("TND", None), ("", "device"), ("", "host")])
def test_ring_attention_update_tnd(softmax_layout, prefix):
    prefix = {None: None, "device": meta(3, dtype=torch.int64),
              "host": torch.tensor([0, 4, 10], dtype=torch.int64)}[prefix]
    out, stats = meta(10, N, DV), meta(10, N, 8, dtype=torch.float32)
    with gpu_dry_run():
        merged = torch_npu.npu_ring_attention_update(out, stats, stats, out, stats, stats, actual_seq_qlen=prefix,
                                                     input_layout="TND", input_softmax_layout=softmax_layout)
    assert [x.shape for x in merged] == [out.shape, stats.shape, stats.shape]


def test_ring_attention_update_sbh_and_mindspeed_positional_form():
    out, stats = meta(5, 2, N * DV), meta(2, N, 5, 8, dtype=torch.float32)
    with gpu_dry_run():
        torch_npu.npu_ring_attention_update(out, stats, stats, out, stats, stats)
        merged = mindspeed_ops.OPS.npu_ring_attention_update(out, stats, stats, out, stats, stats, None, "SBH")
    assert merged[0].shape == out.shape


def test_attention_update():
    with gpu_dry_run():
        out, lse = torch_npu.npu_attention_update([meta(12, dtype=torch.float32)] * 3, [meta(12, DV)] * 3, 1)
    assert out.shape == (12, DV) and lse.shape == (12,)


def test_mindspeed_fusion_attention_v2():
    q = meta(1, 2, 64, D)
    with gpu_dry_run() as launches:
        mindspeed_ops.OPS.npu_fusion_attention_v2(q, q, q, 2, "BNSD", None, None, None, 0.25, 1.0, 2147483647, 0,
                                                  0, None, None, None, 0, True, False, 1, None, None)
    assert launches
