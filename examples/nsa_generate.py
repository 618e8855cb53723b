"""Greedy generation with a tiny random NSA language model and its KV cache (CPU, seconds).

An embedding, one ``attnops.nn.NativeSparseAttention`` layer (residual) and an output head over a toy vocabulary.
The prompt goes through the cache in one call (prefill); each new token is then one call of one token, which
attends to the cached keys/values (compressed blocks, selected blocks, window) instead of recomputing the whole
sequence. The result equals greedy decoding by recomputing the full sequence at every step.

    python examples/nsa_generate.py
"""
import time

import torch
from torch import nn

from attnops.nn import NativeSparseAttention


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.attn = NativeSparseAttention(hidden, num_heads=4, num_kv_heads=2, head_dim=16, compress_block_size=16,
                                          compress_stride=8, select_block_size=16, select_block_count=4,
                                          window_size=32)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """``tokens [B, T]`` -> logits ``[B, T, vocab]`` (with ``cache``: continuing the cached sequences)."""
        x = self.embed(tokens)
        return self.head(x + self.attn(x, cache=cache))


@torch.no_grad()
def generate(model: TinyLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = model.attn.new_cache(prompt.shape[0], max_seq_len=prompt.shape[1] + new_tokens)
    tokens = prompt
    logits = model(prompt, cache=cache)  # prefill
    for _ in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
        logits = model(nxt, cache=cache)  # one token, attends to the cache
    return tokens


@torch.no_grad()
def generate_by_recomputing(model: TinyLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(new_tokens):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    return tokens


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM().double()
    prompt = torch.randint(0, 64, (2, 40))
    start = time.perf_counter()
    out = generate(model, prompt, new_tokens=24)
    print(f"generated {out.shape[1] - prompt.shape[1]} tokens x {out.shape[0]} sequences with the cache in "
          f"{time.perf_counter() - start:.2f} s")
    print("sequence 0:", out[0, prompt.shape[1]:].tolist())
    # the same tokens as recomputing the whole sequence at every step (whose cost grows with the length)
    assert torch.equal(out, generate_by_recomputing(model, prompt, new_tokens=24))
    print("identical to greedy decoding by recomputation")


if __name__ == "__main__":
    main()
