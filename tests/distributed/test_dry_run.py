"""Context parallelism on the GPU path, on ``meta`` tensors inside ``gpu_dry_run()``: sharding, the TND chunk
gathers and the ring / Ulysses orchestration around the operator read no device value on the host and hand the
operator only tensors on the inputs' device. A one-rank Gloo group runs the whole call without a collective (Gloo
takes no ``meta`` tensors, and one rank never exchanges); the operator is stubbed where its own host reads (being
removed in FlashAttention) would stop the call, and called for real in strict-xfail tests that flip when they are."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from attnops.distributed import ring, ring_flash_attention, ring_shard, ring_unshard, ulysses, ulysses_flash_attention
from attnops.distributed.sharding import RingChunks
from attnops.ops.flash_attention import FlashAttentionResult
from attnops.testing import HostSyncError, gpu_dry_run

META = torch.device("meta")
F16 = torch.float16
FA_SYNC = pytest.mark.xfail(strict=True, raises=HostSyncError,
                            reason="FlashAttention sync: attnops/_core/masks.py:409 (blocking upload of the causal "
                                   "mask), attnops/ops/flash_attention/triton/launch.py:142 (batch metadata)")


def meta(*shape, dtype=F16, grad=False):
    return torch.empty(*shape, device=META, dtype=dtype, requires_grad=grad)


@pytest.fixture
def world1(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def operator_calls(monkeypatch):
    """Stub the FlashAttention forward/backward the ring and Ulysses call; record each call's keywords after checking
    that every tensor they get lives on ``meta``."""
    calls = []

    def record(tensors, kw):
        for name, t in [*enumerate(tensors), *kw.items()]:
            assert not isinstance(t, torch.Tensor) or t.device == META, f"argument {name} on {t.device}"
        calls.append(kw)

    def forward(q, k, v, *, return_stats=False, **kw):
        record((q, k, v), kw)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if not return_stats:
            return out
        stats = torch.empty(*q.shape[:-1], 8, device=q.device, dtype=torch.float32)
        return FlashAttentionResult(out, stats, stats.clone(), 0, 0)

    def backward(dy, q, k, v, out, smax, ssum, **kw):
        record((dy, q, k, v, out, smax, ssum), kw)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    monkeypatch.setattr(ring, "flash_attention", forward)
    monkeypatch.setattr(ring, "flash_attention_backward", backward)
    monkeypatch.setattr(ulysses, "flash_attention", forward)
    return calls


def test_sharding_on_meta():
    x, packed = meta(2, 32, 4, 8), meta(48, 4, 8)
    with gpu_dry_run():
        shards = [ring_shard(x, r, 2, layout="BSND") for r in range(2)]
        whole = ring_unshard(shards, layout="BSND")
        packed_shards = [ring_shard(packed, r, 2, layout="TND", actual_seq_len=[16, 48]) for r in range(2)]
        packed_whole = ring_unshard(packed_shards, layout="TND", actual_seq_len=[16, 48])
    assert whole.shape == x.shape and packed_shards[0].shape == (24, 4, 8) and packed_whole.shape == packed.shape


def test_tnd_chunk_rows_are_staged_once_per_device():
    chunks = RingChunks(True, [2, 5, 1])
    local = meta(16, 4, 8)
    with gpu_dry_run():
        first, second = chunks.take(local, 0), chunks.take(local, 1)
        chunks.add_(meta(16, 4, 8, dtype=torch.float32), 1, second)
        joined = chunks.join(first, second)
        assert chunks.rows(0, META) is chunks.rows(0, META)
    assert first.shape == (8, 4, 8) and joined.shape == local.shape
    assert chunks.rows(1, torch.device("cpu")).tolist() == [2, 3, 9, 10, 11, 12, 13, 15]


@pytest.mark.parametrize("layout,shape,lens", [("BNSD", (1, 4, 8, 16), None), ("TND", (32, 4, 16), [16, 32])])
def test_ring_forward_and_backward_on_meta(world1, operator_calls, layout, shape, lens):
    q = meta(*shape, grad=True)
    with gpu_dry_run():
        out = ring_flash_attention(q, q, q, layout=layout, causal=True, actual_seq_len=lens,
                                   pse=meta(4, dtype=torch.float32), pse_type=2)
        out.backward(torch.empty_like(out))
    assert out.shape == q.shape and q.grad.shape == q.shape
    # one rank: chunk pairs (0,0) and (1,1) are diagonal (causal, no mask tensor), (1,0) is full, (0,1) skipped
    assert len(operator_calls) == 6
    assert [kw.get("causal", False) for kw in operator_calls[:3]] == [True, False, True]
    assert all("atten_mask" not in kw for kw in operator_calls)


@pytest.mark.parametrize("layout,shape,lens", [("BSND", (1, 16, 4, 16), None), ("TND", (16, 4, 16), [5, 16])])
def test_ulysses_on_meta(world1, operator_calls, layout, shape, lens):
    q = meta(*shape, grad=True)
    with gpu_dry_run():
        out = ulysses_flash_attention(q, q, q, layout=layout, causal=True, actual_seq_len=lens)
    assert out.shape == q.shape
    (kw,) = operator_calls
    assert kw["causal"] is True and "atten_mask" not in kw


@FA_SYNC
def test_ring_flash_attention_launches(world1):
    q = meta(1, 4, 8, 16)
    with gpu_dry_run() as launches:
        ring_flash_attention(q, q, q, causal=True)
    assert launches


@FA_SYNC
def test_ulysses_flash_attention_launches(world1):
    q = meta(1, 16, 4, 16)
    with gpu_dry_run() as launches:
        ulysses_flash_attention(q, q, q, causal=True)
    assert launches
