"""Greedy generation with a tiny random DeepSeek-sparse-attention language model and its paged cache (CPU,
seconds).

An embedding, one ``attnops.nn.DeepSeekSparseAttention`` layer (residual) and an output head over a toy vocabulary.
The prompt goes through the cache in one call (prefill: the indexer picks ``index_topk`` keys per token, sparse
attention reads only those); each new token is then one call of one token over the paged latent cache. The result
equals greedy decoding by recomputing the whole sequence at every step.

    python examples/dsa_decode.py
"""
import time

import torch
from torch import nn

from attnops.nn import DeepSeekSparseAttention


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.attn = DeepSeekSparseAttention(hidden, 4, kv_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16,
                                            index_heads=4, index_dim=16, index_topk=8)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens, cache=None):
        x = self.embed(tokens)
        return self.head(x + self.attn(x, cache))


def main():
    torch.manual_seed(0)
    model = TinyLM().eval()
    prompt = torch.randint(0, 64, (2, 24))
    new_tokens = 8
    with torch.no_grad():
        start = time.perf_counter()
        cache = model.attn.new_cache(2, prompt.shape[1] + new_tokens, block_size=16)
        logits = model(prompt, cache)  # prefill
        generated = [logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(new_tokens - 1):  # decode: one token per call
            generated.append(model(generated[-1], cache)[:, -1].argmax(-1, keepdim=True))
        cached = torch.cat(generated, 1)
        elapsed = time.perf_counter() - start

        sequence = prompt
        for _ in range(new_tokens):  # the same by recomputing everything at each step
            sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, sequence[:, prompt.shape[1]:])
    print(f"generated {cached.tolist()} in {elapsed * 1e3:.0f} ms (cache lengths {cache.lengths}); "
          "matches full recomputation")


if __name__ == "__main__":
    main()
