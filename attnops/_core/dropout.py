"""Dropout masks: bit-packed explicit masks and the Philox seed/offset generator.

Element ``e`` of the logical mask (``[B, N1, Sq, Skv]`` in C order; TND: per-batch ``[N1, Sq_b, Skv_b]`` blocks
concatenated) is kept iff ``uniform(seed, offset + e) < keep_prob``. ``uniform`` is Philox4x32-10 exactly as
Triton's ``tl.rand(seed, offset)`` computes it for an int64 offset (counter ``(lo32, hi32, 0, 0)``, key
``(seed_lo, seed_hi)``, first word -> float), so CPU and GPU masks are bit-identical.
Packed masks are LSB-first: element ``e`` is bit ``e & 7`` of byte ``e >> 3``; 1 = keep.
"""
from __future__ import annotations

import functools
import numbers
import operator
from dataclasses import dataclass

import numpy as np
import torch

from .checks import check_tensor, fail, require
from .errors import ParamDtypeError
from .parallel import thread_store

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's uint_to_uniform_float scale for 32-bit words
CHUNK = 1 << 14  # counters per generator pass: its five uint64 buffers (640 KiB) stay in a core's L2 cache
PACKED_CHUNK = 1 << 16  # packed-mask elements per pass (a few tensor calls: no cache-resident state)


def _scratch(n: int) -> np.ndarray:
    """This thread's ``[6, n]`` uint64 buffers, kept between calls: five for the generator, one for counters."""
    store = thread_store()
    buf = store.get("dropout_scratch")
    if buf is None or buf.shape[1] < n:
        buf = store["dropout_scratch"] = np.empty((6, max(n, CHUNK)), dtype=np.uint64)
    return buf[:, :n]


def _u64(value: int) -> np.ndarray:
    return np.array(value, dtype=np.uint64)  # 0-d array operands: the cheapest ufunc calls


_A, _B, _MASK, _HALF = _u64(_ROUND_A), _u64(_ROUND_B), _u64(_M32), _u64(32)


@functools.lru_cache(maxsize=16)
def _round_keys(seed: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The Philox key ``(k0, k1)`` of each round for ``seed`` (its low 64 bits, two's complement)."""
    seed &= (1 << 64) - 1
    k0, k1 = seed & _M32, seed >> 32
    keys = []
    for _ in range(_ROUNDS):
        keys.append((_u64(k0), _u64(k1)))
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return tuple(keys)


def _philox_words(seed: int, counters: np.ndarray) -> np.ndarray:
    """First 32-bit Philox4x32-10 word (as uint64) of each uint64 counter (counter ``(lo32, hi32, 0, 0)``, key
    ``(seed_lo, seed_hi)``): whole arrays per step, in this thread's scratch buffers (the result is one of them,
    valid until the thread's next call). ``counters`` is read only.

    Round: ``(c0, c1, c2, c3) <- (hi(B*c2) ^ c1 ^ k0, lo(B*c2), hi(A*c0) ^ c3 ^ k1, lo(A*c0))``. Products are
    exact in uint64: the high word is ``p >> 32`` and the low word ``p`` itself, left unmasked until it is xored
    into a word that is multiplied next (masked then). Explicit ufunc calls on 0-d array operands: each call's
    overhead is a good part of a pass over ``CHUNK`` counters.
    """
    shape, counters = counters.shape, counters.reshape(-1)
    c0, c1, c2, c3, t = _scratch(counters.size)[:5]
    xor, shr, mul, mask = np.bitwise_xor, np.right_shift, np.multiply, np.bitwise_and
    (k0, k1), *keys = _round_keys(seed)
    # round 1: c2 = c3 = 0, so only c0 is multiplied; c1 becomes 0
    mask(counters, _MASK, out=c3)
    mul(c3, _A, out=c3)
    shr(counters, _HALF, out=c0)
    xor(c0, k0, out=c0)
    shr(c3, _HALF, out=c2)
    xor(c2, k1, out=c2)
    c1_zero = True
    for r, (k0, k1) in enumerate(keys):
        mul(c2, _B, out=c2)
        if c1_zero:
            shr(c2, _HALF, out=c1)
            xor(c1, k0, out=c1)
            c1_zero = False
        else:
            shr(c2, _HALF, out=t)
            xor(c1, t, out=c1)
            xor(c1, k0, out=c1)
            mask(c1, _MASK, out=c1)
        if r == len(keys) - 1:
            return c1.reshape(shape)  # the first word of the last round
        mul(c0, _A, out=c0)
        shr(c0, _HALF, out=t)
        xor(c3, t, out=c3)
        xor(c3, k1, out=c3)
        mask(c3, _MASK, out=c3)
        c0, c1, c2, c3 = c1, c2, c3, c0
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=64)
def _keep_threshold(keep_prob: float) -> int:
    """The ``T`` such that ``tl.rand`` < ``keep_prob`` iff the folded word ``u`` is below ``T``.

    ``tl.rand`` bitcasts the word ``w`` to int32, folds it to ``u = x if x >= 0 else -x - 1`` (in ``[0, 2**31)``)
    and returns ``float32(u) * scale`` in fp32; that is non-decreasing in ``u``, so its comparison with the fp32
    ``keep_prob`` is a threshold on ``u``, found by bisection with the same fp32 arithmetic."""
    kp, scale = np.float32(keep_prob), np.float32(_UNIFORM_SCALE)
    lo, hi = 0, 1 << 31
    while lo < hi:
        mid = (lo + hi) // 2
        if np.float32(mid) * scale < kp:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _keep_from_words(words: np.ndarray, threshold: int) -> np.ndarray:
    """Bool keep of 32-bit ``words`` (uint64, overwritten): ``u < T`` is ``w < T or w >= 2**32 - T``, i.e.
    ``(w + T) mod 2**32 < 2T``."""
    words += threshold
    words &= _M32
    return words < 2 * threshold


def philox_randint(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """First 32-bit Philox4x32-10 output word for int64 ``counters`` (as int64 in [0, 2**32))."""
    flat = counters.to(torch.int64).reshape(-1).numpy().view(np.uint64)
    out = np.empty(flat.size, dtype=np.int64)
    for a in range(0, flat.size, CHUNK):
        out[a:a + CHUNK] = _philox_words(seed, flat[a:a + CHUNK])
    return torch.from_numpy(out).view(counters.shape)


def philox_uniform(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), bit-identical to ``tl.rand(seed, counters)``."""
    w = philox_randint(seed, counters)
    u = torch.where(w >= 1 << 31, _M32 - w, w)  # the word as int32 x, folded: x >= 0 ? x : -x - 1
    return u.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


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

    @property
    def _chunk(self) -> int:
        return CHUNK if self.packed is None else PACKED_CHUNK

    def _keep_rows(self, first: int, stride: int, rows: int, width: int) -> np.ndarray:
        """Bool keep bits ``[rows, width]`` of the mask elements ``first + i * stride + j``."""
        if self.packed is not None:  # torch's gather releases the GIL (numpy's fancy indexing does not)
            index = torch.arange(rows, dtype=torch.int64).mul_(stride).add_(first).unsqueeze(1) + torch.arange(width)
            return unpack_bits(self.packed, index).numpy()
        counters = _scratch(rows * width)[5].reshape(rows, width)
        starts = np.arange(rows, dtype=np.uint64) * np.uint64(stride) + np.uint64(first + self.offset)  # < 2**64
        np.add(starts[:, None], np.arange(width, dtype=np.uint64), out=counters)
        return _keep_from_words(_philox_words(self.seed, counters), _keep_threshold(self.keep_prob))

    def scale_block_(self, out: torch.Tensor, b: int, heads: slice, sq: int, skv: int, r0: int, r1: int, c0: int,
                     c1: int, col_range=None) -> torch.Tensor:
        """Fill ``out`` (``[Nh, r1-r0, c1-c0]``, fp32/fp64) with ``keep / keep_prob`` (0 where dropped) for query
        heads ``heads``, rows ``[r0, r1)`` and columns ``[c0, c1)`` of batch ``b`` (``sq``/``skv``: its lengths).

        Vectorised over groups of rows of about ``CHUNK`` elements. ``col_range(ra, rb)``, when given, bounds the
        columns rows ``[ra, rb)`` may keep (the mask's band): entries outside are set to 0 without drawing their bits
        (the caller's mask drops them anyway), so tiles crossing a causal diagonal draw little more than their
        kept half.
        """
        host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)  # reference on a GPU
        dst = host.numpy()
        scale = dst.dtype.type(1.0 / self.keep_prob)
        rows = max(1, self._chunk // max(1, c1 - c0))
        for n in range(heads.start, heads.stop):
            head = dst[n - heads.start]
            base = self.block_offsets[b] + n * sq * skv
            for ra in range(r0, r1, rows):
                rb = min(r1, ra + rows)
                a, z = (c0, c1) if col_range is None else col_range(ra, rb)
                a, z = max(a, c0), max(min(z, c1), max(a, c0))
                block = head[ra - r0:rb - r0]
                block[:, :a - c0] = 0
                block[:, z - c0:] = 0
                if a < z:
                    keep = self._keep_rows(base + ra * skv + a, skv, rb - ra, z - a)
                    np.multiply(keep, scale, out=block[:, a - c0:z - c0])
        return out if host is out else out.copy_(host)


def keep_mask(spec: DropoutSpec, numels: int) -> torch.Tensor:
    """The whole logical keep mask as a 1-D bool tensor of ``numels`` elements (tests, golden, export)."""
    keep = np.empty(numels, dtype=bool)
    for a in range(0, numels, spec._chunk):
        keep[a:a + spec._chunk] = spec._keep_rows(a, 0, 1, min(spec._chunk, numels - a))[0]
    return torch.from_numpy(keep)


def build_dropout_spec(*, keep_prob: float, drop_mask: torch.Tensor | None, seed: int | None, offset: int,
                       numels: int | None, block_offsets: list[int]) -> DropoutSpec | None:
    """Validate dropout arguments; None when ``keep_prob == 1`` (any mask is then ignored). ``numels`` is None when
    the sequence lengths are device tensors: a packed mask's size is then not checked (the kernels read no byte past
    its end). A packed mask stays on its device (the reference copies it to the CPU)."""
    require(isinstance(keep_prob, numbers.Real) and 0.0 < keep_prob <= 1.0, "keep_prob", "a value in (0, 1]",
            keep_prob)
    if keep_prob == 1.0:
        return None
    if drop_mask is not None:
        check_tensor("drop_mask", drop_mask, dtypes=(torch.uint8,))
        if numels is not None:
            need = packed_mask_bytes(numels)
            require(drop_mask.numel() >= need, "drop_mask",
                    f"a bit-packed uint8 mask of at least ceil(numels/8) = {need} bytes (numels = "
                    f"N1*sum(Sq_b*Skv_b) = {numels})", drop_mask)
        return DropoutSpec(float(keep_prob), tuple(block_offsets), packed=drop_mask.reshape(-1))
    require(seed is not None, "drop_mask", "a packed mask, or a seed for the Philox generator, when keep_prob < 1",
            None)
    seed, offset = check_seed_offset(seed, offset)
    return DropoutSpec(float(keep_prob), tuple(block_offsets), seed=seed, offset=offset)


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_seed_offset(seed, offset) -> tuple[int, int]:
    """Validate a Philox ``seed`` and ``offset``; returns them as Python ints.

    Both travel as int64 (the custom ops' schema, Triton's kernel arguments): ``seed`` in ``[-2**63, 2**63)``, keyed
    on its 64 bits (two's complement, so ``-1`` is the key ``2**64 - 1``), ``offset`` in ``[0, 2**63)``. Ints,
    numpy integers and one-element integer tensors are accepted; bools and floats are not. Element ``e`` uses the
    counter ``(offset + e) mod 2**64``.
    """
    if type(seed) is int and type(offset) is int and INT64_MIN <= seed <= INT64_MAX and 0 <= offset <= INT64_MAX:
        return seed, offset  # the common case, checked at once
    return (_philox_int("seed", seed, INT64_MIN, "[-2**63, 2**63 - 1] (int64; Philox keys on its 64 bits)"),
            _philox_int("offset", offset, 0, "[0, 2**63 - 1] (a non-negative int64 Philox counter offset)"))


def _philox_int(name: str, value, lo: int, expected_range: str) -> int:
    is_bool = isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    try:
        v = None if is_bool else operator.index(value)
    except TypeError:
        v = None
    if v is None:
        fail(name, f"an int in {expected_range}", value, error=ParamDtypeError)
    require(lo <= v <= INT64_MAX, name, f"an int in {expected_range}", v)
    return v


def draw_seed() -> int:
    """A fresh 63-bit seed from PyTorch's default generator (reproducible under ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
