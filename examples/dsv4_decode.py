"""Greedy generation with a tiny random DeepSeek-V4-attention language model and its paged caches (CPU, seconds).

An embedding, two ``attnops.nn.DeepSeekV4Attention`` layers (residual) and an output head over a toy vocabulary:
a CSA layer (a window of 16 tokens, one C4A row per 4 tokens of which the indexer picks 8 per token) and an HCA
layer (the window, every compressed row of 16 tokens). Each layer has its own ``DSV4Cache``. The prompt goes
through the caches in two chunks (chunked prefill); each new token is then one call of one token. The result
equals greedy decoding by recomputing the whole sequence at every step.

    python examples/dsv4_decode.py
"""
import time

import torch
from torch import nn

from attnops.nn import DeepSeekV4Attention


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        common = dict(head_dim=32, rope_dim=8, window=16)
        self.layers = nn.ModuleList([
            DeepSeekV4Attention(hidden, 4, cmp_ratio=4, index_topk=8, index_heads=4, index_dim=16, **common),
            DeepSeekV4Attention(hidden, 4, cmp_ratio=16, index_topk=None, **common)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens, caches=None):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = x + layer(x, None if caches is None else caches[i])
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = TinyLM().eval()
    prompt = torch.randint(0, 64, (2, 40))
    new_tokens = 12
    with torch.no_grad():
        start = time.perf_counter()
        caches = [layer.new_cache(2, prompt.shape[1] + new_tokens, block_size=16) for layer in model.layers]
        model(prompt[:, :25], caches)  # chunked prefill
        logits = model(prompt[:, 25:], caches)
        generated = [logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(new_tokens - 1):  # decode: one token per call
            generated.append(model(generated[-1], caches)[:, -1].argmax(-1, keepdim=True))
        cached = torch.cat(generated, 1)
        elapsed = time.perf_counter() - start

        sequence = prompt
        for _ in range(new_tokens):  # the same by recomputing everything at each step
            sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, sequence[:, prompt.shape[1]:])
    print(f"generated {cached.tolist()} in {elapsed * 1e3:.0f} ms ({caches[0].seq_len} tokens cached per layer); "
          "matches full recomputation")


if __name__ == "__main__":
    main()
