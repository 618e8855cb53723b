"""Ring attention and Ulysses on NCCL at world size 1 on CUDA: the distributed path (group info, all-to-all, ring
passes) equals the single-device attnops call."""
import pytest
import torch
import torch.distributed as dist

import attnops
from attnops.distributed import ring_flash_attention, ulysses_flash_attention
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


@pytest.mark.parametrize("kind,layout", [("ring", "BNSD"), ("ulysses", "BSND")])
def test_world1_equals_single_device(nccl_group, kind, layout):
    q, k, v, dy = (t.cuda() for t in make_qkv(layout, b=1, n1=4, n2=2, sq=64, skv=64, d=32, dtype=torch.float16,
                                              seed=9))
    single = attnops.flash_attention(q, k, v, layout=layout, head_num=4, scale=0.2, atten_mask=TRIU2048.cuda(),
                                     sparse_mode=2)
    single = single[0] if isinstance(single, tuple) else single
    fn = ring_flash_attention if kind == "ring" else ulysses_flash_attention
    out = fn(q, k, v, group=nccl_group, layout=layout, head_num=4, scale=0.2, causal=True)
    torch.testing.assert_close(out, single, atol=2e-3, rtol=2e-3)
