"""Single-process checks: sharding round trips, the ring dropout mask, argument validation, and PyTorch's
``context_parallel()`` region (world size 1)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from attnops._core.errors import ParamInvalidError
from attnops.distributed import (allgather_flash_attention, allgather_sequence, hybrid_dropout_mask,
                                 hybrid_flash_attention, hybrid_groups, hybrid_shard, hybrid_unshard,
                                 ring_dropout_mask, ring_flash_attention, ring_shard, ring_unshard,
                                 ulysses_flash_attention)
from tests.helpers import cum, randn


@pytest.mark.parametrize("layout,shape,lens", [("BNSD", (2, 3, 16, 4), None), ("SBH", (8, 2, 6), None),
                                               ("TND", (24, 2, 4), [8, 16])])
def test_shard_round_trip_and_chunk_order(layout, shape, lens):
    x = randn(*shape)
    world = 2
    shards = [ring_shard(x, r, world, layout=layout, actual_seq_len=cum(lens) if lens else None) for r in range(world)]
    assert torch.equal(ring_unshard(shards, layout=layout, actual_seq_len=cum(lens) if lens else None), x)
    if layout == "BNSD":  # rank 0 holds chunks 0 and 3 of 4
        assert torch.equal(shards[0], torch.cat([x[:, :, 0:4], x[:, :, 12:16]], 2))


def test_ring_dropout_mask_covers_the_single_device_range():
    mask = ring_dropout_mask(world_size=2, keep_prob=0.5, seed=3, offset=0, head_num=2, batch=1, seq_len=8)
    assert mask.dtype == torch.uint8 and mask.numel() == 2 * 8 * 8 // 8
    with pytest.raises(ValueError, match="seq_len"):
        ring_dropout_mask(world_size=2, keep_prob=0.5, seed=3, head_num=2, seq_len=6)


def test_requires_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    q = randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="group"):
        ring_flash_attention(q, q, q)


@pytest.fixture
def world1(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ring_validation(world1):
    q = randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="query"):
        ring_flash_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5])
    with pytest.raises(ValueError, match="key"):
        ring_flash_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="pse_type"):
        ring_flash_attention(q, q, q, pse=randn(1, 2, 6, 6), pse_type=1)
    with pytest.raises(ValueError, match="head_num"):
        ring_flash_attention(q.flatten(2), q.flatten(2), q.flatten(2), layout="BSH")
    t = randn(6, 2, 8)
    with pytest.raises(ValueError, match="actual_seq_len"):
        ring_flash_attention(t, t, t, layout="TND", actual_seq_len=[3, 6])
    with pytest.raises(ValueError, match="softmax_layout"):
        ring_flash_attention(q, q, q, softmax_layout="TND", return_stats=True)


def test_ulysses_validation(world1):
    q = randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="key"):
        ulysses_flash_attention(q, q[:, :4], q[:, :4])
    with pytest.raises(ValueError, match="actual_seq_len"):
        ulysses_flash_attention(q[0], q[0], q[0], layout="TND")
    out = ulysses_flash_attention(q, q, q, causal=True)
    assert out.shape == q.shape


@pytest.mark.parametrize("layout,shape,lens", [("BSND", (2, 16, 2, 4), None), ("TND", (24, 2, 4), [8, 16])])
def test_hybrid_shard_round_trip(layout, shape, lens):
    x = randn(*shape)
    seqs = cum(lens) if lens else None
    shards = [[hybrid_shard(x, ulysses_rank=u, ulysses_degree=2, ring_rank=r, ring_degree=2, layout=layout,
                            actual_seq_len=seqs) for u in range(2)] for r in range(2)]
    assert torch.equal(hybrid_unshard(shards, layout=layout, actual_seq_len=seqs), x)
    if layout == "BSND":  # ring rank 0 holds chunks 0 and 3 of 4 (length 4 each); Ulysses rank 1 its second half
        assert torch.equal(shards[0][1], x[:, 12:16])


def test_hybrid_validation(world1):
    with pytest.raises(ValueError, match="ulysses_degree"):
        hybrid_groups(2, 1)
    groups = hybrid_groups(1, 1)
    q = randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="ulysses_group"):
        hybrid_flash_attention(q, q, q, ulysses_group=None, ring_group=groups.ring)
    with pytest.raises(ValueError, match="pse_type"):
        hybrid_flash_attention(q, q, q, ulysses_group=groups.ulysses, ring_group=groups.ring, pse=randn(2),
                               pse_type=1)
    with pytest.raises(ValueError, match="head_num"):
        hybrid_dropout_mask(ulysses_degree=2, ring_degree=1, keep_prob=0.5, seed=1, head_num=3, seq_len=4)
    out = hybrid_flash_attention(q, q, q, ulysses_group=groups.ulysses, ring_group=groups.ring, causal=True)
    assert out.shape == q.shape


def test_allgather_validation(world1):
    q = randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="split"):
        allgather_flash_attention(q, q, q, split="zigzag")
    with pytest.raises(ValueError, match="actual_seq_len"):
        allgather_flash_attention(q, q, q, actual_seq_len=[4])
    with pytest.raises(ValueError, match="key"):
        allgather_flash_attention(q, q[:, :2], q[:, :2])
    t = randn(4, 2, 8)
    with pytest.raises(ValueError, match="pse"):
        allgather_flash_attention(t, t, t, layout="TND", actual_seq_len=[4], pse=torch.ones(2))
    with pytest.raises(ValueError, match="actual_seq_len"):
        allgather_flash_attention(t, t, t, layout="TND", actual_seq_len=[3, 4])
    with pytest.raises(ValueError, match="x"):
        allgather_sequence(t, layout="TND", actual_seq_len=[6])


def test_torch_context_parallel_region_rejects_what_it_cannot_serve(world1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import attnops

    mesh = init_device_mesh("cpu", (1,))
    q = randn(1, 2, 4, 8)
    plain = attnops.flash_attention(q, q, q, causal=True)
    buffers = [q.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2]):
        torch.testing.assert_close(attnops.flash_attention(buffers[0], buffers[0], buffers[0], causal=True), plain)
        with pytest.raises(ValueError, match="keep_prob"):
            attnops.flash_attention(q, q, q, keep_prob=0.5, seed=1)
        with pytest.raises(ValueError, match="pse"):
            attnops.flash_attention(q, q, q, pse=torch.ones(2), pse_type=2)
        with pytest.raises(ValueError, match="pre_tokens"):  # the window's sparse-mode form
            attnops.flash_attention(q, q, q, window_size=(2, 0))


def test_hybrid_tnd_statistics_need_the_true_tnd_layout(world1):
    groups = hybrid_groups(1, 1)
    t = randn(8, 2, 8)
    with pytest.raises(ValueError, match="softmax_layout"):
        hybrid_flash_attention(t, t, t, ulysses_group=groups.ulysses, ring_group=groups.ring, layout="TND",
                               actual_seq_len=[8], return_stats=True)
    res = hybrid_flash_attention(t, t, t, ulysses_group=groups.ulysses, ring_group=groups.ring, layout="TND",
                                 actual_seq_len=[8], return_stats=True, softmax_layout="TND")
    assert res.softmax_max.shape == (8, 2, 8)



@pytest.mark.parametrize("name, options, dv", [("dropout_p", dict(dropout_p=0.1), 8),
                                               ("attn_mask", dict(attn_mask=torch.ones(4, 4).tril()), 8),
                                               ("value", {}, 4)])
def test_sdpa_in_torch_context_parallel_rejects_what_a_ring_cannot_serve(world1, name, options, dv):
    """CPU SDPA calls the ring cannot honour raise an attnops error naming the argument, before any sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (1,))
    q, v = randn(1, 2, 4, 8), randn(1, 2, 4, dv)
    with context_parallel(mesh, buffers=[q, v], buffer_seq_dims=[2, 2]):
        with pytest.raises(ParamInvalidError, match=f"^{name}: expected .* inside torch's context_parallel"):
            F.scaled_dot_product_attention(q, q, v, is_causal=True, **options)
