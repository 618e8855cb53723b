"""Host side of :mod:`.step`: allocates the step's lookups and rotated ``[T, N1 + N2, D]`` queries and keys and
launches one program per token."""
from __future__ import annotations

import torch

from ...._core.triton.launch import Launch, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from .family import KERNELS


def decode_step_plan(lengths, t: int, slot_table, slot_offset: int, compressed_table, rope_table, q, k,
                     interpret: bool):
    """``((positions [B, t], slots [B, t], compressed_slots [T], ends [T], qk [T, N1 + N2, D]), [Launch])``."""
    q, k = unit_last_stride(q), unit_last_stride(k)
    rows, heads_q, d = q.shape
    heads = heads_q + k.shape[1]
    index = dict(dtype=torch.int64, device=q.device)
    positions, slots = torch.empty(lengths.shape[0], t, **index), torch.empty(lengths.shape[0], t, **index)
    compressed, ends = torch.empty(rows, **index), torch.empty(rows, **index)
    qk = q.new_empty(rows, heads, d)
    args = (lengths, slot_table, compressed_table, rope_table.contiguous(), q, k, positions, slots, compressed, ends,
            qk, t, compressed_table.shape[1] - 1, slot_table.stride(0), slot_offset, compressed_table.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads_q, heads)
    launch = Launch("decode_step_kernel", (rows,), args,
                    dict(HALF=d // 2, BLOCK_D=pow2(d), EXACT_MUL=not interpret))
    return (positions, slots, compressed, ends, qk), [launch]


def decode_step(lengths, t: int, slot_table, slot_offset: int, compressed_table, rope_table, q, k):
    """Run :func:`decode_step_plan`."""
    outputs, launches = decode_step_plan(lengths, t, slot_table, slot_offset, compressed_table, rope_table, q, k,
                                         interpreting(q.device))
    KERNELS.run_all(launches, q.device)
    return outputs
