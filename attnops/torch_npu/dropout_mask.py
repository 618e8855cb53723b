"""``torch_npu._npu_dropout_gen_mask``: the packed dropout keep mask the fusion-attention operators read as
``dropout_mask``, drawn from Philox ``(seed, offset)`` exactly as those operators draw their own dropout from the
same ``seed``/``offset`` (so passing the mask or the seed gives the same result)."""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .._core import staging
from .._core.checks import check_tensor, int_list, require
from .._core.dropout import DropoutSpec, check_seed_offset, keep_mask, pack_bits
from ._common import with_overloads

MASK_ALIGN_BITS = 128  # the NPU's mask length is a whole number of 128-bit groups


def _npu_dropout_gen_mask(self: Tensor, size, p: float, seed: int, offset: int, *, parallel: bool | None = True,
                          sync: bool | None = None) -> Tensor:
    """uint8 bytes (LSB first) of the keep bits of ``prod(size)`` elements, element ``e`` kept with probability
    ``1 - p`` by Philox ``(seed, offset + e)``, padded with zero bits to whole 128-bit groups; on ``self``'s
    device. ``parallel``/``sync`` (the NPU's scheduling) change nothing."""
    check_tensor("self", self)
    shape = int_list("size", size)
    require(isinstance(p, numbers.Real) and 0.0 <= float(p) <= 1.0, "p", "a drop probability in [0, 1]", p)
    seed, offset = check_seed_offset(seed, offset)
    numels = math.prod(shape)
    spec = DropoutSpec(keep_prob=1.0 - float(p), block_offsets=(0,), seed=seed, offset=offset)
    keep = keep_mask(spec, numels)
    padded = -(-numels // MASK_ALIGN_BITS) * MASK_ALIGN_BITS
    keep = torch.cat([keep, keep.new_zeros(padded - numels)])
    return staging.upload(pack_bits(keep), torch.uint8, self.device)


_npu_dropout_gen_mask = with_overloads(_npu_dropout_gen_mask)
