"""Native Sparse Attention on packed sequences: forward, backward and a check of the selection branch (CPU).

    python examples/nsa_layer.py
"""
import torch

import attnops


def main() -> None:
    torch.manual_seed(0)
    T, N1, N2, D, DV = 2048, 4, 1, 64, 64
    q = torch.randn(T, N1, D, requires_grad=True)
    k = torch.randn(T, N2, D, requires_grad=True)
    v = torch.randn(T, N2, DV, requires_grad=True)
    gates = torch.rand(T, N1, 3, requires_grad=True)                      # compression / selection / window
    wk, wv = (torch.full((32, N2), 1 / 32, requires_grad=True) for _ in range(2))  # learnable pooling weights
    cu = torch.tensor([0, 1024, 2048])                                     # two sequences of 1024 tokens

    out = attnops.native_sparse_attention(q, k, v, gates, wk, wv, cu_seqlens=cu, compress_block_size=32,
                                          compress_stride=16, select_block_size=64, select_block_count=16,
                                          window_size=256)
    out.square().mean().backward()
    print(f"out {tuple(out.shape)}, |dq| {q.grad.norm():.2e}, |d gates| {gates.grad.norm():.2e}, "
          f"|d wk| {wk.grad.norm():.2e}")

    # the selection branch alone: each token attends to its own 64-token block and the 15 before it
    own = torch.arange(1024) // 64
    topk = (own.unsqueeze(1) - torch.arange(16)).clamp(min=0).to(torch.int32)    # [1024, 16], local block ids
    topk = torch.cat([topk, topk]).unsqueeze(1)                                    # [T, N2, 16]
    o_slc = attnops.nsa_selected_attention(q.detach(), k.detach(), v.detach(), topk, select_block_size=64,
                                           causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    print(f"selected attention {tuple(o_slc.shape)}")


if __name__ == "__main__":
    main()
