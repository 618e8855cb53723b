"""The compiled CPU decode kernel (:mod:`attnops._core.cpu_kernels`) on :mod:`.decode`'s chunks.

One kernel call computes a chunk's partials ``(row max, row sum, un-normalised output)`` for every KV head,
streaming its K and V once from where they lie (pages in any order, fp32/fp16/bf16/int8) and converting in
registers. Per-token and page-managed antiquant scales and offsets are applied in the kernel; per-channel and
per-tensor ones are folded into the query (keys) and into the chunk's output (values) here.

:func:`unsupported` is the one predicate that routes a call: when it names a reason (or a chunk's mask is not
all-keep), :mod:`.decode` runs its pure-PyTorch partial instead.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core import cpu_kernels
from .problem import FIAProblem
from .quant import Antiquant

F32 = torch.float32
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def unsupported(p: FIAProblem) -> str | None:
    """Why the kernel cannot serve the decode chunks of ``p`` (None: it serves every chunk whose mask keeps
    everything, see :func:`takes`)."""
    if cpu_kernels.library() is None:
        return "the CPU decode kernel is not available"
    if torch.compiler.is_compiling():
        return "torch.compile traces the PyTorch path"
    if p.device.type != "cpu":
        return "tensors not on the CPU"
    if p.pse is not None:
        return "a pse"
    seg = next((s for segs in p.kv for s in segs), None)
    if seg is not None and (seg.key.dtype not in _DTYPE_CODES or seg.value.dtype not in _DTYPE_CODES):
        return f"K/V dtype {seg.key.dtype}/{seg.value.dtype} (int4 runs on the PyTorch path)"
    return None


def takes(p: FIAProblem, b: int, sq: int, c0: int, c1: int, pieces) -> bool:
    """Whether the kernel computes rows ``[0, sq)`` x columns ``[c0, c1)`` of batch ``b`` (nothing masked there, and
    every run with unit stride along the head dim)."""
    return (p.mask.masked_block(b, 0, sq, c0, c1) is None
            and all(pc.key.stride(-1) == 1 and pc.value.stride(-1) == 1 for pc in pieces))


def _token_factors(quant: Antiquant | None, b: int, piece, keep: list) -> list[int]:
    """``[scale addr, offset addr, sr, sn, sl]`` of a piece's per-token antiquant (zeros when there is none or it is
    per-channel)."""
    if quant is None or quant.kind == "static":
        return [0] * 5
    r, l = piece.key.shape[0], piece.key.shape[2]
    scale, offset = (None if t is None else t.contiguous()
                     for t in quant.factors(b, piece.pos, piece.block, r, l))
    if offset is not None and offset.stride() != scale.stride():
        offset = offset.expand_as(scale).contiguous()
        scale = scale.expand_as(offset).contiguous()
    keep += [scale, offset]
    sr, sn, sl, _ = scale.stride()
    return [scale.data_ptr(), 0 if offset is None else offset.data_ptr(), sr, 0 if scale.shape[1] == 1 else sn, sl]


def _runs(p: FIAProblem, b: int, pieces, keep: list) -> Tensor:
    """The kernel's run descriptors (``Run`` in ``decode.cpp``) of a chunk's pieces."""
    rows = []
    for pc in pieces:
        k, v = pc.key, pc.value
        rows.append([k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3], k.shape[0], k.shape[2],
                     *_token_factors(p.key_quant, b, pc, keep), *_token_factors(p.value_quant, b, pc, keep)])
    return torch.tensor(rows, dtype=torch.int64)


def _static(quant: Antiquant | None, n2: int) -> tuple[Tensor, Tensor | None] | None:
    """A per-channel/per-tensor antiquant's scale and offset as ``[N2|1, 1, D|1]``, else None."""
    if quant is None or quant.kind != "static":
        return None
    return tuple(None if t is None else t.reshape(t.shape[1], 1, t.shape[3]) for t in (quant.scale, quant.offset))


def kernel_query(p: FIAProblem, qs: Tensor) -> tuple[Tensor, Tensor | None]:
    """The query ``[N2, rows, D]`` the kernel takes (per-channel key scales folded in) and the score shift
    ``[N2, rows]`` a per-channel key offset adds (``(q * scale) . offset``), or None."""
    static = _static(p.key_quant, p.n2)
    if static is None:
        return qs.contiguous(), None
    scale, offset = static
    q = (qs * scale).contiguous()
    return q, None if offset is None else (q * offset).sum(-1)


def partial(p: FIAProblem, chunk, q: Tensor, shift: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk's row max ``[N1, Sq]``, row sum and un-normalised output ``[N1, Sq, Dv]`` (``q``, ``shift``: from
    :func:`kernel_query`)."""
    lib = cpu_kernels.library()
    keep: list = []
    runs = _runs(p, chunk.b, chunk.pieces, keep)
    n2, rows = q.shape[0], q.shape[1]
    k0, v0 = chunk.pieces[0].key, chunk.pieces[0].value
    dv = v0.shape[-1]
    m, total = torch.empty(n2, rows, dtype=F32), torch.empty(n2, rows, dtype=F32)
    o = torch.empty(n2, rows, dv, dtype=F32)
    scratch = torch.empty(lib.attnops_decode_scratch(n2 * rows, p.d, dv, chunk.length), dtype=F32)
    code = lib.attnops_decode_chunk(q.data_ptr(), n2, rows, p.d, dv, _DTYPE_CODES[k0.dtype], _DTYPE_CODES[v0.dtype],
                                    runs.data_ptr(), runs.shape[0], chunk.length, scratch.data_ptr(), m.data_ptr(),
                                    total.data_ptr(), o.data_ptr())
    if code != 0:
        raise RuntimeError(f"attnops_decode_chunk returned {code}")
    if shift is not None:
        m += shift
    static = _static(p.value_quant, n2)
    if static is not None:
        scale, offset = static
        o = (o if offset is None else o.add_(offset * total.unsqueeze(-1))).mul_(scale)
    sq = rows // p.group
    return m.view(p.n1, sq), total.view(p.n1, sq), o.view(p.n1, sq, dv)
