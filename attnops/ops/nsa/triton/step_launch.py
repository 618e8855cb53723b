"""Host side of :mod:`.step`: allocates the step's lookups and rotated ``[T, N1 + N2, D]`` queries and keys and
launches one program per token (writing the compressed-attention masks into the caller's buffer when given)."""
from __future__ import annotations

import torch

from ...._core.triton.launch import Launch, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from .family import KERNELS


def decode_step_plan(lengths, t: int, slot_table, slot_offset: int, compressed_table, rope_table, q, k, masks,
                     interpret: bool):
    """``((positions [B, t], slots [B, t], compressed_slots [T], ends [T], qk [T, N1 + N2, D]), [Launch])``;
    ``masks``: a :class:`~attnops.ops.nsa.step.CompressedMasks` to fill, or None."""
    q, k = unit_last_stride(q), unit_last_stride(k)
    rows, heads_q, d = q.shape
    heads = heads_q + k.shape[1]
    index = dict(dtype=torch.int64, device=q.device)
    positions, slots = torch.empty(lengths.shape[0], t, **index), torch.empty(lengths.shape[0], t, **index)
    compressed, ends = torch.empty(rows, **index), torch.empty(rows, **index)
    qk = q.new_empty(rows, heads, d)
    if masks is None:
        out, rule = positions, (0,) * 7  # unused
    else:
        out = masks.out.view(torch.uint8)
        rule = (out.stride(0), masks.rows, masks.n_sel, masks.block, masks.stride, masks.select_block, masks.local)
    args = (lengths, slot_table, compressed_table, rope_table.contiguous(), q, k, positions, slots, compressed, ends,
            qk, out, t, compressed_table.shape[1] - 1, slot_table.stride(0), slot_offset, compressed_table.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads_q, heads, *rule)
    launch = Launch("decode_step_kernel", (rows,), args,
                    dict(HALF=d // 2, BLOCK_D=pow2(d), EXACT_MUL=not interpret, MASKS=masks is not None))
    return (positions, slots, compressed, ends, qk), [launch]


def decode_step(lengths, t: int, slot_table, slot_offset: int, compressed_table, rope_table, q, k, masks):
    """Run :func:`decode_step_plan`."""
    outputs, launches = decode_step_plan(lengths, t, slot_table, slot_offset, compressed_table, rope_table, q, k,
                                         masks, interpreting(q.device))
    KERNELS.run_all(launches, q.device)
    return outputs
