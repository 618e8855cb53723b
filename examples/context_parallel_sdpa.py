"""PyTorch's context parallelism on a CPU: a model's ``F.scaled_dot_product_attention`` and torch_npu's
``npu_fusion_attention`` inside ``context_parallel()``, checked against the single-device run.

    torchrun --nproc-per-node 2 examples/context_parallel_sdpa.py

The model code is written as for one device. ``import attnops.distributed`` is what makes the region work on a
CPU: inside it PyTorch runs SDPA as ring attention over the mesh, and attnops serves each ring step (PyTorch alone
has no CPU kernel for that and raises NotImplementedError).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard

import attnops.distributed  # noqa: F401  (CPU SDPA and attnops' attention inside context_parallel())
import attnops.torch_npu

attnops.torch_npu.install()   # only where the real torch_npu is absent

import torch_npu  # noqa: E402


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def fusion_attention(q, k, v):
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)                          # compressed causal mask
    return torch_npu.npu_fusion_attention(q, k, v, q.shape[1], "BNSD", atten_mask=mask, sparse_mode=2,
                                          scale=q.shape[-1] ** -0.5)[0]


class SelfAttention(torch.nn.Module):
    """Causal self-attention with grouped KV heads, on ``[batch, seq, dim]``."""

    def __init__(self, attention, dim: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.attention, self.heads, self.kv_heads, self.head_dim = attention, heads, kv_heads, dim // heads
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)              # BNSD
        k, v = self.wkv(x).view(b, s, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        return self.wo(self.attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


def check(attention, mesh) -> float:
    """Largest difference of the output, input gradient and weight gradients from the single-device run."""
    torch.manual_seed(0)                                                                  # same model and data
    model = SelfAttention(attention)
    x, dy = torch.randn(2, 32, 64), torch.randn(2, 32, 64)

    xs = x.clone().requires_grad_()
    ref = model(xs)
    ref.backward(dy)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    buffers = [x.clone(), dy.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1]):                # sequence dim 1
        x_local = buffers[0].detach().clone().requires_grad_()                           # this rank's shard
        out = model(x_local)
        out.backward(buffers[1])
    out, dx = context_parallel_unshard(mesh, [out.detach(), x_local.grad], [1, 1])
    for p in model.parameters():
        dist.all_reduce(p.grad)                                                           # as DDP/FSDP would
    pairs = [(out, ref), (dx, xs.grad), *zip((p.grad for p in model.parameters()), ref_grads)]
    return max((mine - single).abs().max().item() for mine, single in pairs)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, attention in (("F.scaled_dot_product_attention", sdpa),
                            ("torch_npu.npu_fusion_attention", fusion_attention)):
        diff = check(attention, mesh)
        assert diff < 1e-4, f"{name}: differs from the single-device run by {diff}"
        if dist.get_rank() == 0:
            print(f"{name} in context_parallel() on {dist.get_world_size()} processes: matches one device "
                  f"(max |diff| {diff:.1e})")
    dist.barrier()                                                    # every rank done before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
