"""Random DSA inputs in every layout, with the per-batch rows the golden reads: BSND or TND queries, BSND, TND or
paged (PA_BSND, shuffled blocks, -1 past each batch's blocks) keys."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    q_layout: str
    kv_layout: str
    q_lens: list[int]
    kv_lens: list[int]
    s1: int  # padded query length (BSND) or token total (TND)
    s2: int  # padded key length (BSND) or token total (TND)
    page: int = 16

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    def q_tensor(self, rows_per_token: tuple, gen, dtype):
        """A query-side tensor ``[B, S1, *rows]`` / ``[T1, *rows]`` and a function giving batch b's ``[Lq, *rows]``."""
        if self.q_layout == "BSND":
            x = torch.randn(self.batch, self.s1, *rows_per_token, generator=gen).to(dtype)
            return x, lambda b: x[b, :self.q_lens[b]]
        x = torch.randn(self.s1, *rows_per_token, generator=gen).to(dtype)
        starts = [sum(self.q_lens[:b]) for b in range(self.batch)]
        return x, lambda b: x[starts[b]:starts[b] + self.q_lens[b]]

    def q_lengths(self) -> torch.Tensor | None:
        if self.q_layout == "TND":
            return torch.tensor(self.q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        return torch.tensor(self.q_lens, dtype=torch.int32)

    def kv_lengths(self) -> torch.Tensor:
        if self.kv_layout == "TND":
            return torch.tensor(self.kv_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        return torch.tensor(self.kv_lens, dtype=torch.int32)

    def kv_tensor(self, width: int, gen, dtype, table=None):
        """A key-side tensor with one head, batch b's ``[Lk, width]`` rows, and the block table (paged only; pass
        ``table`` to lay a second tensor out like the first)."""
        if self.kv_layout == "BSND":
            x = torch.randn(self.batch, self.s2, 1, width, generator=gen).to(dtype)
            return x, lambda b: x[b, :self.kv_lens[b], 0], None
        if self.kv_layout == "TND":
            x = torch.randn(self.s2, 1, width, generator=gen).to(dtype)
            starts = [sum(self.kv_lens[:b]) for b in range(self.batch)]
            return x, lambda b: x[starts[b]:starts[b] + self.kv_lens[b], 0], None
        per = [-(-n // self.page) for n in self.kv_lens]
        cols = max(max(per), 1) + 1
        if table is None:
            order = torch.randperm(sum(per) + 2, generator=gen)
            table = torch.full((self.batch, cols), -1, dtype=torch.int32)
            used = 0
            for b, n in enumerate(per):
                table[b, :n] = order[used:used + n].to(torch.int32)
                used += n
        x = torch.randn(int(table.max()) + 3, self.page, 1, width, generator=gen).to(dtype)

        def rows(b):
            blocks = table[b, :per[b]].long()
            return x[blocks, :, 0].reshape(-1, width)[:self.kv_lens[b]]

        return x, rows, table
