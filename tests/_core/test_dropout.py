"""Dropout machinery: Philox4x32-10 bit-identical to Triton's tl.rand (checked under TRITON_INTERPRET=1 in a
subprocess, so this process never imports Triton without the interpreter), int64 offsets beyond 2**32, and
the LSB-first bit packing of drop masks."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from attnops import ParamDtypeError, ParamInvalidError
from attnops._core.dropout import (CHUNK, DropoutSpec, build_dropout_spec, check_seed_offset, keep_mask, pack_bits,
                                   packed_mask_bytes, philox_randint, philox_uniform, unpack_bits)

M32 = 0xFFFFFFFF


def _philox_py(seed: int, counter: int) -> int:
    """Philox4x32-10 first output word, plain Python ints (Random123 / Triton round structure)."""
    c0, c1, c2, c3 = counter & M32, (counter >> 32) & M32, 0, 0
    k0, k1 = seed & M32, (seed >> 32) & M32
    for _ in range(10):
        p_b, p_a = 0xCD9E8D57 * c2, 0xD2511F53 * c0
        c0, c1, c2, c3 = ((p_b >> 32) ^ c1 ^ k0) & M32, p_b & M32, ((p_a >> 32) ^ c3 ^ k1) & M32, p_a & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0


def test_philox_known_answer():
    # Random123 known-answer vector philox4x32_10(ctr=0, key=0) -> first word 0x6627e8d5
    assert int(philox_randint(0, torch.tensor([0]))[0]) == 0x6627E8D5


@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**32 + 5, 2**63 - 1])
def test_philox_matches_plain_python(seed):
    counters = [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 3 * 2**32 + 11, 2**40 + 12345, 2**62 + 3]
    got = philox_randint(seed, torch.tensor(counters, dtype=torch.int64)).tolist()
    assert got == [_philox_py(seed, c) for c in counters]


def test_uniform_range_and_int64_offsets():
    u = philox_uniform(42, torch.arange(4096, dtype=torch.int64) + 2**33)
    assert u.dtype == torch.float32 and bool((u >= 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.03
    # offsets differing only above bit 32 give different streams (the high word enters the counter)
    assert not torch.equal(philox_uniform(42, torch.arange(64) + 2**33), philox_uniform(42, torch.arange(64)))


_TRITON_SCRIPT = textwrap.dedent("""
    import json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        print("NO_TRITON", e)
        sys.exit(0)

    @triton.jit
    def rand_kernel(out_ptr, seed, base, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        r = tl.rand(seed, base + offs.to(tl.int64))
        tl.store(out_ptr + offs, r, mask=offs < n)

    results = []
    for seed, base in json.loads(sys.argv[1]):
        out = torch.empty(256, dtype=torch.float32)
        rand_kernel[(1,)](out, seed, base, 256, BLOCK=256)
        results.append(out.view(torch.int32).tolist())
    print(json.dumps(results))
""")


def test_philox_uniform_bit_identical_to_triton_interpreter():
    cases = [(0, 0), (12345, 7), (2**40 + 3, 2**32 - 5), (987654321, 3 * 2**32 + 11), (2**63 - 1, 2**45),
             (-1, 2**32 - 100), (-2**63, 5), (-123456789, 2**63 - 200)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("NO_TRITON"):
        pytest.skip(f"triton is not importable ({proc.stdout.strip()}): cannot compare philox_uniform with tl.rand")
    triton_bits = json.loads(proc.stdout.strip().splitlines()[-1])
    for (seed, base), bits in zip(cases, triton_bits):
        ours = philox_uniform(seed, torch.arange(256, dtype=torch.int64) + base)
        assert ours.view(torch.int32).tolist() == bits, (seed, base)


# ------------------------------------------------------------------------------------------- bit packing


def test_pack_bits_is_lsb_first():
    keep = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert pack_bits(keep).tolist() == [0b00000001, 0b10000010, 0b00000011]
    assert pack_bits(keep).dtype == torch.uint8
    assert packed_mask_bytes(18) == 3 and packed_mask_bytes(16) == 2


@pytest.mark.parametrize("numel", [1, 8, 13, 1000])
def test_pack_unpack_round_trip(numel):
    g = torch.Generator().manual_seed(numel)
    keep = torch.rand(numel, generator=g) < 0.5
    packed = pack_bits(keep)
    assert packed.numel() == (numel + 7) // 8
    assert torch.equal(unpack_bits(packed, torch.arange(numel)), keep)
    # numpy's little-endian bit order is the same convention (the torch_npu golden decodes with it)
    assert np.array_equal(np.packbits(keep.numpy(), bitorder="little"), packed.numpy())
    idx = torch.tensor([numel - 1, 0])
    assert torch.equal(unpack_bits(packed, idx), keep[idx])


def test_pack_bits_multidimensional_c_order():
    keep = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(3)) < 0.5
    assert torch.equal(pack_bits(keep), pack_bits(keep.reshape(-1)))


def test_keep_mask_and_spec():
    keep = torch.rand(20, generator=torch.Generator().manual_seed(4)) < 0.5
    spec = build_dropout_spec(keep_prob=0.5, drop_mask=pack_bits(keep), seed=None, offset=0, numels=20,
                              block_offsets=[0])
    assert torch.equal(keep_mask(spec, 20), keep)
    spec = build_dropout_spec(keep_prob=0.3, drop_mask=None, seed=9, offset=2**33, numels=20, block_offsets=[0])
    want = philox_uniform(9, torch.arange(20) + 2**33) < torch.tensor(0.3)
    assert torch.equal(keep_mask(spec, 20), want)
    # a tile of batch b reads elements block_offsets[b] + (n * Sq + i) * Skv + j
    spec = DropoutSpec(0.3, (0, 6), seed=9, offset=2**33)
    tile = spec.scale_block_(torch.empty(1, 1, 3), 1, slice(1, 2), 2, 3, 1, 2, 0, 3)  # head 1, row 1 of a 2x3 batch
    assert torch.equal(tile.flatten() != 0, want[6 + (1 * 2 + 1) * 3 + torch.arange(3)])


def test_dropout_spec_validation():
    assert build_dropout_spec(keep_prob=1.0, drop_mask=None, seed=None, offset=0, numels=8, block_offsets=[0]) is None
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ParamInvalidError, match="keep_prob"):
            build_dropout_spec(keep_prob=bad, drop_mask=None, seed=1, offset=0, numels=8, block_offsets=[0])
    with pytest.raises(ParamInvalidError, match="drop_mask"):
        build_dropout_spec(keep_prob=0.5, drop_mask=torch.zeros(1, dtype=torch.uint8), seed=None, offset=0,
                           numels=9, block_offsets=[0])
    with pytest.raises(ParamInvalidError, match="drop_mask"):
        build_dropout_spec(keep_prob=0.5, drop_mask=torch.zeros(2, dtype=torch.bool), seed=None, offset=0,
                           numels=9, block_offsets=[0])


# ------------------------------------------------------------------------- vectorised generator, tiles, chunks


def _keep_py(seed: int, counter: int, keep_prob: float) -> bool:
    """tl.rand(seed, counter) < keep_prob from the plain-Python Philox word and Triton's fp32 conversion."""
    x = _philox_py(seed, counter % 2**64)
    x = x - 2**32 if x >= 2**31 else x
    u = np.float32(-x - 1 if x < 0 else x) * np.float32(4.6566127342e-10)
    return bool(u < np.float32(keep_prob))


def test_randint_over_chunk_boundaries_matches_plain_python():
    base = 2**32 - CHUNK // 2 - 7  # the chunks cross a 2**32 boundary of the counter
    n = CHUNK + 300
    got = philox_randint(-5, torch.arange(n, dtype=torch.int64) + base).tolist()
    step = 97
    assert got[::step] == [_philox_py(-5, base + i) for i in range(0, n, step)]
    assert got[CHUNK - 3:CHUNK + 3] == [_philox_py(-5, base + i) for i in range(CHUNK - 3, CHUNK + 3)]


@pytest.mark.parametrize("keep_prob", [0.9, 0.5, 0.01, 0.999999, float(np.float32(1234567) * np.float32(4.6566127342e-10))])
def test_keep_decision_matches_the_fp32_uniform(keep_prob):
    """The integer threshold equals ``tl.rand < keep_prob`` in fp32, also for keep_prob exactly on a uniform value:
    50 windows of 1000 counters spread over 2**31 .. 2**31 + 4e8."""
    got, want = [], []
    for start in range(2**31, 2**31 + 50 * 7_919_000, 7_919_000):
        got.append(keep_mask(DropoutSpec(keep_prob, (), seed=77, offset=start), 1000))
        counters = start + torch.arange(1000, dtype=torch.int64)
        want.append(philox_uniform(77, counters) < torch.tensor(keep_prob, dtype=torch.float32))
    assert torch.equal(torch.cat(got), torch.cat(want))


@pytest.mark.parametrize("offset", [0, 2**32 - 1000, 5 * 2**32 + 3])
def test_scale_block_tiles_are_bit_identical_to_plain_python(offset):
    """Odd shapes, several heads, TND block offsets, row groups of more than one chunk, a band bound: every drawn
    element equals the plain-Python Philox decision, the others are 0."""
    keep_prob, seed = 0.7, 2**40 + 9
    sq, skv = 37, 29
    block_offsets = (0, 3 * 11 * 13)  # batch 0: [3, 11, 13]; batch 1: [3, 37, 29]
    spec = DropoutSpec(keep_prob, block_offsets, seed=seed, offset=offset)
    r0, r1, c0, c1 = 2, 35, 3, 28
    col_range = (lambda ra, rb: (max(0, ra - 20), min(skv, rb + 1)))  # a sliding band
    out = torch.full((2, r1 - r0, c1 - c0), float("nan"))
    spec.scale_block_(out, 1, slice(1, 3), sq, skv, r0, r1, c0, c1, col_range=col_range)
    for h in range(2):
        for i in range(r0, r1):
            for j in range(c0, c1):
                e = block_offsets[1] + ((1 + h) * sq + i) * skv + j
                got = float(out[h, i - r0, j - c0])
                if max(0, i - 20) <= j <= i:  # inside the band: drawn
                    assert got == (np.float32(1 / keep_prob) if _keep_py(seed, offset + e, keep_prob) else 0.0)
                else:  # outside: 0 or drawn (a row group draws its union of columns)
                    assert got in (0.0, float(np.float32(1 / keep_prob)))


def test_scale_block_many_chunks_equals_keep_mask_and_packed():
    """A tile of several chunks (both generator and packed paths) equals the whole-mask export element by element."""
    b, n, sq, skv = 1, 2, 40, CHUNK // 16 + 5
    numels = n * sq * skv
    seed_spec = DropoutSpec(0.6, (0,), seed=3, offset=2**32 - numels // 2)
    keep = keep_mask(seed_spec, numels).view(n, sq, skv)
    packed_spec = DropoutSpec(0.6, (0,), packed=pack_bits(keep))
    for spec in (seed_spec, packed_spec):
        out = torch.empty(n, sq - 3, skv - 2, dtype=torch.float64)
        spec.scale_block_(out, 0, slice(0, n), sq, skv, 3, sq, 1, skv - 1)
        assert torch.equal(out != 0, keep[:, 3:, 1:-1]) and bool((out[out != 0] == 1 / 0.6).all())


# ------------------------------------------------------------------------------------- seed/offset validation


def test_check_seed_offset_accepts_the_int64_range():
    assert check_seed_offset(2**63 - 1, 2**63 - 1) == (2**63 - 1, 2**63 - 1)
    assert check_seed_offset(-2**63, 0) == (-2**63, 0)
    assert check_seed_offset(np.int64(5), torch.tensor([7])) == (5, 7)


@pytest.mark.parametrize("name,seed,offset,error,match", [
    ("seed", 2**63, 0, ParamInvalidError, r"seed: expected an int in \[-2\*\*63, 2\*\*63 - 1\].*got 9223372036854775808"),
    ("seed", 2**70, 0, ParamInvalidError, "seed: .*got 1180591620717411303424"),
    ("seed", -2**63 - 1, 0, ParamInvalidError, "seed: .*got -9223372036854775809"),
    ("offset", 1, -1, ParamInvalidError, r"offset: expected an int in \[0, 2\*\*63 - 1\].*got -1"),
    ("offset", 1, 2**63, ParamInvalidError, "offset: .*got 9223372036854775808"),
    ("seed", True, 0, ParamDtypeError, "seed: .*got True"),
    ("seed", 1.0, 0, ParamDtypeError, "seed: .*got 1.0"),
    ("offset", 1, 2.5, ParamDtypeError, "offset: .*got 2.5"),
    ("offset", 1, torch.tensor([1.0]), ParamDtypeError, "offset"),
])
def test_check_seed_offset_rejects(name, seed, offset, error, match):
    with pytest.raises(error, match=match):
        check_seed_offset(seed, offset)
    with pytest.raises(error, match=match):
        build_dropout_spec(keep_prob=0.5, drop_mask=None, seed=seed, offset=offset, numels=8, block_offsets=[0])
