"""A paged cache for DeepSeek sparse attention: the latent KV, its rope part and the indexer's keys share one block
table and per-sequence lengths (as vllm-ascend lays them out)."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import Described, require


class DSACache:
    """Paged caches ``latent [blocks, block_size, 1, Dc]``, ``rope [.., Dr]``, ``index [.., Di]`` for ``batch``
    sequences of up to ``max_len`` tokens; sequence ``b`` owns the blocks ``block_table[b]``."""

    def __init__(self, batch: int, max_len: int, *, latent_dim: int, rope_dim: int, index_dim: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device=None):
        per_seq = -(-max_len // block_size)
        blocks = batch * per_seq
        self.block_size = block_size
        self.latent = torch.zeros(blocks, block_size, 1, latent_dim, dtype=dtype, device=device)
        self.rope = torch.zeros(blocks, block_size, 1, rope_dim, dtype=dtype, device=device)
        self.index = torch.zeros(blocks, block_size, 1, index_dim, dtype=dtype, device=device)
        self.block_table = torch.arange(blocks, dtype=torch.int32, device=device).view(batch, per_seq)
        self.lengths = [0] * batch
        self.max_len = max_len

    def append(self, latent: Tensor, rope: Tensor, index: Tensor) -> Tensor:
        """Write ``[B, S, D]`` new rows of every sequence after its current length; returns the new per-sequence
        lengths (int32 ``[B]``)."""
        batch, new = latent.shape[:2]
        require(all(n + new <= self.max_len for n in self.lengths), "latent",
                f"at most {self.max_len} tokens per sequence in the cache", Described(f"{max(self.lengths)} + {new}"))
        pos = torch.tensor(self.lengths)[:, None] + torch.arange(new)  # [B, S]
        blocks = self.block_table.cpu()[torch.arange(batch)[:, None], pos // self.block_size].long()
        slots = (blocks * self.block_size + pos % self.block_size).reshape(-1).to(self.latent.device)
        for cache, rows in ((self.latent, latent), (self.rope, rope), (self.index, index)):
            cache.view(-1, cache.shape[-1])[slots] = rows.reshape(-1, rows.shape[-1]).to(cache.dtype)
        self.lengths = [n + new for n in self.lengths]
        return torch.tensor(self.lengths, dtype=torch.int32)
