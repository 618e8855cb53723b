"""Dropout masks: bit-packed explicit masks and the Philox seed/offset generator.

Element ``e`` of the logical mask (``[B, N1, Sq, Skv]`` in C order; TND: per-batch ``[N1, Sq_b, Skv_b]`` blocks
concatenated) is kept iff ``uniform(seed, offset + e) < keep_prob``. ``uniform`` is Philox4x32-10 exactly as
Triton's ``tl.rand(seed, offset)`` computes it for an int64 offset (counter ``(lo32, hi32, 0, 0)``, key
``(seed_lo, seed_hi)``, first word -> float), so CPU and GPU masks are bit-identical.
Packed masks are LSB-first: element ``e`` is bit ``e & 7`` of byte ``e >> 3``; 1 = keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_tensor, require

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's uint_to_uniform_float scale for 32-bit words


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant ``a`` and int64 tensor ``b`` of 32-bit values."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    p_lo = b * a_lo  # < 2**48
    p_hi = b * a_hi  # < 2**48
    mid = p_hi + (p_lo >> 16)
    hi = mid >> 16
    lo = ((mid & 0xFFFF) << 16) | (p_lo & 0xFFFF)
    return hi & _M32, lo & _M32


def philox_randint(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """First 32-bit Philox4x32-10 output word for int64 ``counters`` (as int64 in [0, 2**32))."""
    counters = counters.to(torch.int64)
    c0 = counters & _M32
    c1 = (counters >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    seed &= (1 << 64) - 1
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def philox_uniform(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), bit-identical to ``tl.rand(seed, counters)``."""
    x = philox_randint(seed, counters)
    x = torch.where(x >= 1 << 31, x - (1 << 32), x)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x).to(torch.int32)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """Pack a bool keep mask (any shape, C order) into LSB-first uint8 bytes."""
    flat = keep.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Bool keep bits of ``packed`` (uint8, LSB-first) at element indices ``index`` (int64)."""
    byte = packed[index >> 3].to(torch.int32)
    return ((byte >> (index & 7).to(torch.int32)) & 1).bool()


def packed_mask_bytes(numels: int) -> int:
    """Bytes needed for ``numels`` mask bits."""
    return (numels + 7) // 8


@dataclass(frozen=True)
class DropoutSpec:
    """Dropout of one call: ``keep_prob`` and either a packed mask or a Philox (seed, offset)."""

    keep_prob: float
    block_offsets: tuple[int, ...]  # start of each batch's [N1, Sq_b, Skv_b] block in element order
    packed: torch.Tensor | None = None
    seed: int = 0
    offset: int = 0

    def keep_block(self, b: int, heads: slice, sq: int, skv: int, r0: int, r1: int, c0: int, c1: int
                   ) -> torch.Tensor:
        """Bool keep tile ``[Nh, r1-r0, c1-c0]`` for batch ``b`` (``sq``/``skv`` are its lengths)."""
        n = torch.arange(heads.start, heads.stop).view(-1, 1, 1)
        i = torch.arange(r0, r1).view(1, -1, 1)
        j = torch.arange(c0, c1).view(1, 1, -1)
        index = self.block_offsets[b] + (n * sq + i) * skv + j
        if self.packed is not None:
            return unpack_bits(self.packed, index)
        return philox_uniform(self.seed, index + self.offset) < torch.tensor(self.keep_prob, dtype=torch.float32)


def keep_mask(spec: DropoutSpec, numels: int) -> torch.Tensor:
    """The whole logical keep mask as a 1-D bool tensor of ``numels`` elements (tests, golden, export)."""
    index = torch.arange(numels, dtype=torch.int64)
    if spec.packed is not None:
        return unpack_bits(spec.packed, index)
    return philox_uniform(spec.seed, index + spec.offset) < torch.tensor(spec.keep_prob, dtype=torch.float32)


def build_dropout_spec(*, keep_prob: float, drop_mask: torch.Tensor | None, seed: int | None, offset: int,
                       numels: int, block_offsets: list[int]) -> DropoutSpec | None:
    """Validate dropout arguments; None when ``keep_prob == 1`` (any mask is then ignored)."""
    require(isinstance(keep_prob, (int, float)) and 0.0 < keep_prob <= 1.0, "keep_prob", "a value in (0, 1]",
            keep_prob)
    if keep_prob == 1.0:
        return None
    if drop_mask is not None:
        check_tensor("drop_mask", drop_mask, dtypes=(torch.uint8,))
        need = packed_mask_bytes(numels)
        require(drop_mask.numel() >= need, "drop_mask",
                f"a bit-packed uint8 mask of at least ceil(numels/8) = {need} bytes (numels = N1*sum(Sq_b*Skv_b) "
                f"= {numels})", drop_mask)
        return DropoutSpec(float(keep_prob), tuple(block_offsets), packed=drop_mask.reshape(-1).cpu())
    require(seed is not None, "drop_mask", "a packed mask, or a seed for the Philox generator, when keep_prob < 1",
            None)
    return DropoutSpec(float(keep_prob), tuple(block_offsets), seed=int(seed), offset=int(offset))


def draw_seed() -> int:
    """A fresh 63-bit seed from PyTorch's default generator (reproducible under ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
