"""Prefill then token-by-token decode from a paged KV cache with attnops.fused_infer_attention (CPU, seconds).

    python examples/paged_decode.py

Each decode step's output is checked against SDPA over the same keys and values gathered contiguously.
"""
import torch
import torch.nn.functional as F

import attnops

HEADS, KV_HEADS, D = 8, 2, 64


def sdpa_decode(q, keys, values):
    """q [N, D], keys/values [S, KV_N, D] -> [N, D], GQA by repeating the KV heads."""
    g = HEADS // KV_HEADS
    k = keys.transpose(0, 1).repeat_interleave(g, 0)
    v = values.transpose(0, 1).repeat_interleave(g, 0)
    return F.scaled_dot_product_attention(q.unsqueeze(1), k, v).squeeze(1)


def main() -> None:
    torch.manual_seed(0)
    cache = attnops.PagedKVCache(num_blocks=16, block_size=64, num_kv_heads=KV_HEADS, head_dim=D)
    prompts = [150, 37]
    seqs = [cache.new_sequence() for _ in prompts]
    history = []
    for s, n in zip(seqs, prompts):                                  # prefill: write the prompts' K/V
        k, v = torch.randn(n, KV_HEADS, D), torch.randn(n, KV_HEADS, D)
        cache.append(s, k, v)
        history.append([k, v])

    for step in range(4):                                            # decode: one new token per sequence
        for i, s in enumerate(seqs):
            k, v = torch.randn(1, KV_HEADS, D), torch.randn(1, KV_HEADS, D)
            cache.append(s, k, v)
            history[i] = [torch.cat([history[i][0], k]), torch.cat([history[i][1], v])]
        q = torch.randn(len(seqs), HEADS, 1, D)                      # [B, N, 1, D]
        out = attnops.fused_infer_attention(q, cache.key_cache, cache.value_cache, num_key_value_heads=KV_HEADS,
                                            **cache.attention_kwargs(seqs))
        err = max((out[i, :, 0] - sdpa_decode(q[i, :, 0], *history[i])).abs().max().item()
                  for i in range(len(seqs)))
        print(f"step {step}: lengths {cache.seq_lens(seqs)}, max |attnops - SDPA| = {err:.2e}")
        assert err < 1e-5


if __name__ == "__main__":
    main()
