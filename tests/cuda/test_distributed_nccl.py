"""Every context-parallel mode on NCCL at world size 1 on CUDA (ring, Ulysses, hybrid Ulysses x ring, KV all-gather):
the distributed path (group info, all-to-all, all-gather, reduce-scatter, ring passes) equals the single-device
attnops call, forward and backward."""
import pytest
import torch
import torch.distributed as dist

import attnops
from attnops.distributed import (allgather_flash_attention, hybrid_flash_attention, ring_flash_attention,
                                 ulysses_flash_attention)
from tests.helpers import TRIU2048, make_qkv


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    store = tmp_path_factory.mktemp("nccl") / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _distributed(kind, group):
    if kind == "hybrid":
        return lambda *qkv, **kw: hybrid_flash_attention(*qkv, ulysses_group=group, ring_group=group, **kw)
    fn = {"ring": ring_flash_attention, "ulysses": ulysses_flash_attention, "allgather": allgather_flash_attention}
    return lambda *qkv, **kw: fn[kind](*qkv, group=group, **kw)


@pytest.mark.parametrize("kind,layout", [("ring", "BNSD"), ("ulysses", "BSND"), ("hybrid", "BSND"),
                                         ("allgather", "BSND")])
def test_world1_equals_single_device(nccl_group, kind, layout):
    q, k, v, dy = (t.cuda() for t in make_qkv(layout, b=1, n1=4, n2=2, sq=64, skv=64, d=32, dtype=torch.float16,
                                              seed=9))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single = attnops.flash_attention(*leaves, layout=layout, head_num=4, scale=0.2, atten_mask=TRIU2048.cuda(),
                                     sparse_mode=2)
    single = single[0] if isinstance(single, tuple) else single
    single.backward(dy)
    shards = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _distributed(kind, nccl_group)(*shards, layout=layout, head_num=4, scale=0.2, causal=True)
    out.backward(dy)
    torch.testing.assert_close(out, single, atol=2e-3, rtol=2e-3)
    for got, want in zip(shards, leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=2e-3, rtol=2e-3)
