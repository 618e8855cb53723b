"""Ring and Ulysses attention on CPU with Gloo, checked against one single-device call.

    torchrun --nproc-per-node 2 examples/ring_attention_cpu.py

Every rank builds the same global q/k/v, takes its shard, runs the distributed forward and backward, and compares
its slice of the output and of dq with :func:`attnops.flash_attention` on the whole sequence.
"""
import torch
import torch.distributed as dist

import attnops
from attnops.distributed import ring_flash_attention, ring_shard, ulysses_flash_attention


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same global tensors on every rank
    b, n, s, d = 1, 4, 64 * world, 32
    q, k, v, dy = (torch.randn(b, n, s, d) for _ in range(4))  # BNSD

    # single-device reference (causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    causal_mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    ref = attnops.flash_attention(*leaves, atten_mask=causal_mask, sparse_mode=2)
    ref.backward(dy)

    # ring: load-balanced shards (global chunks r and 2P-1-r)
    local = [ring_shard(x, rank, world).requires_grad_() for x in (q, k, v)]
    out = ring_flash_attention(*local, causal=True)
    out.backward(ring_shard(dy, rank, world))
    ring_err = (out - ring_shard(ref, rank, world)).abs().max().item()
    ring_grad_err = (local[0].grad - ring_shard(leaves[0].grad, rank, world)).abs().max().item()

    # Ulysses: contiguous sequence slices, all heads (heads must divide by the world size)
    part = slice(rank * s // world, (rank + 1) * s // world)
    local = [x[:, :, part].clone().requires_grad_() for x in (q, k, v)]
    out = ulysses_flash_attention(*local, layout="BNSD", causal=True)
    out.backward(dy[:, :, part])
    uly_err = (out - ref[:, :, part]).abs().max().item()
    uly_grad_err = (local[0].grad - leaves[0].grad[:, :, part]).abs().max().item()

    print(f"rank {rank}/{world}: ring max|out-ref|={ring_err:.2e} max|dq-ref|={ring_grad_err:.2e}; "
          f"ulysses max|out-ref|={uly_err:.2e} max|dq-ref|={uly_grad_err:.2e}", flush=True)
    assert max(ring_err, ring_grad_err, uly_err, uly_grad_err) < 1e-4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
