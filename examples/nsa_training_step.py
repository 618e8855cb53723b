"""A training step with the Native Sparse Attention module, then chunked decoding with its cache (CPU, seconds).

    python examples/nsa_training_step.py
"""
import torch

import attnops
from attnops.nn import NativeSparseAttention


def main() -> None:
    torch.manual_seed(0)
    hidden = 64
    layer = NativeSparseAttention(hidden, num_heads=4, num_kv_heads=1, head_dim=16, compress_block_size=16,
                                  compress_stride=8, select_block_size=16, select_block_count=4, window_size=32)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)

    # packed training batch: two sequences of odd lengths (no block-size constraint)
    x = torch.randn(203 + 77, hidden)
    cu = torch.tensor([0, 203, 280])
    loss = layer(x, cu_seqlens=cu).square().mean()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.4f}, |d compress_weight_k| {layer.compress_weight_k.grad.norm():.2e}")

    # the functional form: BSND input, the window off, the selection given by hand (-1 = unused slot)
    q, k, v = torch.randn(2, 40, 4, 16), torch.randn(2, 40, 1, 16), torch.randn(2, 40, 1, 16)
    own = (torch.arange(40) // 16).view(1, 40, 1, 1)
    idx = torch.cat([own, own - 1], -1).expand(2, 40, 1, 2)  # [B, T, N2, 2]: own block, previous (-1 for block 0)
    out = attnops.native_sparse_attention(q, k, v, g_slc=torch.ones(2, 40, 4), layout="BSND", block_indices=idx,
                                          select_block_size=16, select_block_count=2, window_size=0)
    print(f"selected attention on given blocks: {tuple(out.shape)}")

    # decoding: chunks through the cache give the full forward's outputs
    with torch.no_grad():
        prompt = torch.randn(1, 50, hidden)
        cache = layer.new_cache(batch_size=1)
        chunks = [layer(prompt[:, :40], cache=cache)] + [layer(prompt[:, i:i + 1], cache=cache) for i in range(40, 50)]
        err = (torch.cat(chunks, 1) - layer(prompt)).abs().max().item()
    print(f"cached decoding vs full forward: max |diff| {err:.1e}")
    assert err < 1e-5


if __name__ == "__main__":
    main()
