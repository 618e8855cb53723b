"""A vllm-ascend-style attention layer through the torch_npu shim: K/V written into a paged cache with
npu_scatter_pa_kv_cache, prefill with npu_fused_infer_attention_score, decode with _npu_paged_attention (CPU, seconds).

    python examples/vllm_style_decode.py

Every step is checked against SDPA over each sequence's full history.
"""
import numpy as np
import torch
import torch.nn.functional as F

import attnops.torch_npu

attnops.torch_npu.install()   # only where the real torch_npu is absent

import torch_npu  # noqa: E402

HEADS, KV_HEADS, D, BLOCK, NUM_BLOCKS = 8, 2, 64, 16, 32
MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


class PagedAttentionLayer:
    def __init__(self, max_seqs: int, device):
        self.key_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, D, device=device)
        self.value_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, D, device=device)
        self.block_table = torch.randperm(NUM_BLOCKS)[:max_seqs * 8].view(max_seqs, 8).int().to(device)
        self.seq_lens = np.zeros(max_seqs, dtype=np.int64)

    def slot_mapping(self, new_tokens):
        slots = [int(self.block_table[b, p // BLOCK]) * BLOCK + p % BLOCK
                 for b, n in enumerate(new_tokens) for p in range(self.seq_lens[b], self.seq_lens[b] + n)]
        return torch.tensor(slots, dtype=torch.int32)

    def forward(self, query, key, value, new_tokens):
        """query [T, HEADS, D], key/value [T, KV_HEADS, D]: the new tokens of every sequence, packed."""
        torch_npu.npu_scatter_pa_kv_cache(key, value, self.key_cache, self.value_cache,
                                          self.slot_mapping(new_tokens), cache_mode="Norm")
        self.seq_lens += np.asarray(new_tokens)
        if max(new_tokens) == 1:                                   # decode: the graph-mode kernel
            out = torch.empty_like(query)
            torch_npu._npu_paged_attention(query, self.key_cache, self.value_cache, KV_HEADS, HEADS, D ** -0.5,
                                           self.block_table, torch.from_numpy(self.seq_lens).int(), out)
            return out
        out, _ = torch_npu.npu_fused_infer_attention_score(   # prefill: causal over the cached history
            query, self.key_cache.flatten(2), self.value_cache.flatten(2), atten_mask=MASK,
            block_table=self.block_table, actual_seq_lengths=np.cumsum(new_tokens),
            actual_seq_lengths_kv=self.seq_lens, num_heads=HEADS, num_key_value_heads=KV_HEADS,
            input_layout="TND", scale=D ** -0.5, sparse_mode=3, block_size=BLOCK)
        return out


def sdpa(query, keys, values):
    """Bottom-right causal attention of query [Sq, N, D] over keys/values [Skv, KV_N, D]."""
    g = HEADS // KV_HEADS
    sq, skv = query.shape[0], keys.shape[0]
    keep = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(g, 0),
                                         values.transpose(0, 1).repeat_interleave(g, 0), attn_mask=keep)
    return out.transpose(0, 1)


def main() -> None:
    torch.manual_seed(0)
    device = torch.npu.device
    layer = PagedAttentionLayer(max_seqs=2, device=device)
    history = [[], []]
    for step, new in enumerate([[40, 23], [1, 1], [1, 1], [1, 1]]):           # prefill, then decode steps
        t = sum(new)
        q, k, v = torch.randn(t, HEADS, D), torch.randn(t, KV_HEADS, D), torch.randn(t, KV_HEADS, D)
        out = layer.forward(q.to(device), k.to(device), v.to(device), new).cpu()
        err, start = 0.0, 0
        for b, n in enumerate(new):
            history[b].append((k[start:start + n], v[start:start + n]))
            keys, values = (torch.cat([h[i] for h in history[b]]) for i in (0, 1))
            err = max(err, (out[start:start + n] - sdpa(q[start:start + n], keys, values)).abs().max().item())
            start += n
        print(f"step {step}: {'decode' if max(new) == 1 else 'prefill'}, lengths {layer.seq_lens.tolist()}, "
              f"max |attnops - SDPA| = {err:.2e}")
        assert err < 1e-4


if __name__ == "__main__":
    main()
