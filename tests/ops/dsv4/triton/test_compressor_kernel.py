"""The DeepSeek-V4 compressor's Triton kernels through the public operator (``ATTNOPS_BACKEND=triton``) against the
fp64 golden with the tolerance rule: C4A / C4Li / C128A, packed and batched x, seqused, the state cache read and
written as the reference does (block table, entry 0, start_pos, ring mode, a strided cache), chunked prefill then
decode, RMSNorm + RoPE (both rotary modes), fp16. CUDA when there is a GPU, else Triton's CPU interpreter; each test
checks that the kernels ran (a silent fallback to the reference fails)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_compressor as G
from attnops.testing.compare import assert_close_to_golden
from tests.ops.dsv4.test_compressor import _read_state, _state, _table, _weights, randn
from tests.triton_backend import DEVICE, triton_backend  # noqa: F401  (the fixture)

pytest.importorskip("triton")

F, H = torch.float32, torch.float16
PROJECT = ["compressor_project_kernel"] * 2
POOLED = PROJECT + ["compressor_pool_kernel"]
SAVED = POOLED + ["compressor_save_kernel"]


def _dev(**kw):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _check(name, got, xs, wkv, wgate, ape, coff, *, start_pos=0, history=None):
    """``got`` (one batch's emitted rows) against the fp64 golden, the fp32 / low-precision golden as the baseline."""
    want, _ = G.compress(xs, wkv, wgate, ape, coff=coff, start_pos=start_pos, history=history)
    base, _ = G.compress(xs, wkv, wgate, ape, coff=coff, start_pos=start_pos, history=history, dtype=got.dtype)
    assert_close_to_golden(name, got.cpu(), want, base, reduction=xs.shape[-1] + coff * ape.shape[0])


@pytest.mark.parametrize("ratio,coff,dim", [(4, 2, 16), pytest.param(4, 2, 128, marks=pytest.mark.slow), (8, 1, 16),
                                            pytest.param(128, 1, 8, marks=pytest.mark.slow)])
def test_packed_prefill_matches_golden(triton_backend, ratio, coff, dim):
    """C4A, C4Li (D=128), C128A-like: rows and the saved state of three batches (one shorter than a block)."""
    lens, hidden, bs = [3 * ratio + 1, ratio - 1, 2 * ratio], 32, 16
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=ratio)
    xs = [randn(n, hidden, dtype=F, seed=10 + b) for b, n in enumerate(lens)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    table = _table(3, -(-max(lens) // bs))
    state = _state(int(table.max()) + 1, bs, dim, coff).to(DEVICE)
    out = attnops.compressor(torch.cat(xs).to(DEVICE), *(t.to(DEVICE) for t in (wkv, wgate)), state, ape.to(DEVICE),
                             **_dev(cmp_ratio=ratio, coff=coff, state_block_table=table, cu_seqlens=cu)).cpu()
    assert triton_backend == SAVED
    row = 0
    for b, xb in enumerate(xs):
        count = lens[b] // ratio
        _check(f"rows of batch {b}", out[row:row + count], xb, wkv, wgate, ape, coff)
        row += count
        _, new = G.compress(xb, wkv, wgate, ape, coff=coff)
        torch.testing.assert_close(_read_state(state.cpu(), table, b, range(lens[b]), bs), new.float())
    assert not out[row:].any()  # padding rows


def test_batched_x_with_seqused_and_no_state(triton_backend):
    ratio, coff, dim, hidden = 4, 2, 16, 24
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=3)
    x = randn(2, 10, hidden, dtype=F, seed=4)
    out = attnops.compressor(*(t.to(DEVICE) for t in (x, wkv, wgate, _state(1, 4, dim, coff), ape)),
                             **_dev(cmp_ratio=ratio, coff=coff, seqused=torch.tensor([10, 7], dtype=torch.int32)))
    assert triton_backend == POOLED
    assert out.shape == (2, 3, dim)
    out = out.cpu()
    for b, n in enumerate([10, 7]):
        _check(f"batch {b}", out[b, :n // ratio], x[b, :n], wkv, wgate, ape, coff)
        assert not out[b, n // ratio:].any()


@pytest.mark.parametrize("ratio,coff", [(4, 2), (8, 1)])
def test_chunked_prefill_then_decode_matches_golden(triton_backend, ratio, coff):
    """Two requests: prefill in uneven chunks (start_pos not a multiple of r), then one-token decode steps: the rows
    (the first window of a call read from the state) and the state equal the golden of one pass."""
    dim, hidden, bs, total = 16, 32, 8, 4 * ratio + 3
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=5)
    xs = [randn(total, hidden, dtype=F, seed=6 + b) for b in range(2)]
    table = _table(2, -(-total // bs))
    state = _state(int(table.max()) + 1, bs, dim, coff).to(DEVICE)
    rows, done = [[], []], [0, 0]
    steps = [[ratio + 1, 2, 2 * ratio], [3, 2 * ratio + 2, ratio - 1]]  # then decode, one token at a time
    while min(done) < total:
        sizes = [min(steps[b].pop(0) if steps[b] else 1, total - done[b]) for b in range(2)]
        cu = torch.tensor([0, sizes[0], sizes[0] + sizes[1]], dtype=torch.int32)
        x = torch.cat([xs[b][done[b]:done[b] + sizes[b]] for b in range(2)])
        out = attnops.compressor(*(t.to(DEVICE) for t in (x, wkv, wgate)), state, ape.to(DEVICE),
                                 **_dev(cmp_ratio=ratio, coff=coff, state_block_table=table, cu_seqlens=cu,
                                        start_pos=torch.tensor(done, dtype=torch.int32))).cpu()
        row = 0
        for b in range(2):
            count = (done[b] + sizes[b]) // ratio - done[b] // ratio
            rows[b] += list(out[row:row + count])
            row += count
            done[b] += sizes[b]
    assert set(triton_backend) == set(SAVED)
    for b in range(2):
        _check(f"rows of request {b}", torch.stack(rows[b]), xs[b], wkv, wgate, ape, coff)
        _, new = G.compress(xs[b], wkv, wgate, ape, coff=coff)
        torch.testing.assert_close(_read_state(state.cpu(), table, b, range(total), bs), new.float())


def test_state_is_read_through_the_table_and_entry_zero_is_not_written(triton_backend):
    """A decode call whose first window lies in the state (block 0 included: read, never written); the state is a
    strided view of a larger buffer."""
    ratio, coff, dim, hidden, bs, start = 4, 2, 8, 16, 4, 7
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=8)
    history = randn(start, 2 * coff * dim, dtype=F, seed=9)
    table = torch.tensor([[0, 3, 2, 5]], dtype=torch.int32)  # positions 0-3 in block 0 (read-only)
    buffer = torch.stack([_state(6, bs, dim, coff)] * 2, dim=1).to(DEVICE)  # [blocks, layers, block_size, W]
    state = buffer[:, 1]
    for p in range(start):
        state[int(table[0, p // bs]), p % bs] = history[p].to(DEVICE)
    block0 = state[0].clone()
    x = randn(1, hidden, dtype=F, seed=10)
    out = attnops.compressor(*(t.to(DEVICE) for t in (x, wkv, wgate)), state, ape.to(DEVICE),
                             **_dev(cmp_ratio=ratio, coff=coff, state_block_table=table,
                                    cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
                                    start_pos=torch.tensor([start], dtype=torch.int32))).cpu()
    assert triton_backend == SAVED
    _check("decode row", out[:1], x, wkv, wgate, ape, coff, start_pos=start, history=history)
    _, new = G.compress(x, wkv, wgate, ape, coff=coff, start_pos=start, history=history)
    torch.testing.assert_close(state[3, 3].cpu(), new[0].float())
    assert torch.equal(state[0], block0) and (buffer[:, 0] == 7).all()


def test_ring_cache_mode_keeps_the_tail_and_streams(triton_backend):
    ratio, coff, dim, hidden = 4, 2, 8, 16
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=12)
    x = randn(1, 19, hidden, dtype=F, seed=13)
    state, ring = _state(3, 8, dim, coff).to(DEVICE), torch.tensor([2], dtype=torch.int32)
    kw = _dev(cmp_ratio=ratio, coff=coff, state_block_table=ring, cache_mode=2)
    dev = [t.to(DEVICE) for t in (wkv, wgate)]
    out = attnops.compressor(x[:, :10].to(DEVICE), *dev, state, ape.to(DEVICE), **kw).cpu()
    _, new = G.compress(x[0, :10], wkv, wgate, ape, coff=coff)
    # only the tail from (10 // 4) * 4 - 4 = 4 is written, at slots p % 8; slots 2 and 3 keep their old value
    torch.testing.assert_close(state[2, [4, 5, 6, 7, 0, 1]].cpu(), new[4:].float())
    assert (state[2, 2:4] == 7).all() and (state[[0, 1]] == 7).all()
    rows = [out[0, :2]]
    for t in range(10, 19):
        out = attnops.compressor(x[:, t:t + 1].to(DEVICE), *dev, state, ape.to(DEVICE),
                                 start_pos=torch.tensor([t]).to(DEVICE), **kw).cpu()
        rows.append(out[0, :(t + 1) // ratio - t // ratio])
    assert set(triton_backend) == set(SAVED)
    _check("streamed rows", torch.cat(rows), x[0], wkv, wgate, ape, coff)


@pytest.mark.parametrize("rotary_mode", [1, 2])
def test_rms_norm_and_rope_of_the_output(triton_backend, rotary_mode):
    ratio, coff, dim, hidden, rope = 4, 2, 16, 32, 8
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=14)
    x = randn(15, hidden, dtype=F, seed=15)
    rows_out = min(15, 15 // ratio + 2)
    sin, cos = randn(rows_out, rope, dtype=F, seed=16), randn(rows_out, rope, dtype=F, seed=17)
    weight = randn(dim, dtype=F, seed=18)
    out = attnops.compressor(*(t.to(DEVICE) for t in (x, wkv, wgate, _state(1, 4, dim, coff), ape)),
                             **_dev(cmp_ratio=ratio, coff=coff, cu_seqlens=torch.tensor([0, 9, 15], dtype=torch.int32),
                                    norm_weight=weight, rope_sin=sin, rope_cos=cos, rope_head_dim=rope,
                                    norm_eps=1e-6, rotary_mode=rotary_mode)).cpu()
    assert triton_backend == POOLED
    parts = [(x[:9], 2), (x[9:], 1)]
    want = torch.cat([G.compress(p, wkv, wgate, ape, coff=coff)[0] for p, _ in parts])
    base = torch.cat([G.compress(p, wkv, wgate, ape, coff=coff, dtype=F)[0] for p, _ in parts])
    n = want.shape[0]
    post = dict(eps=1e-6, rope_head_dim=rope, rotary_mode=rotary_mode)
    assert_close_to_golden("normed rows", out[:n], G.rms_norm_rope(want, weight, sin[:n], cos[:n], **post),
                           G.rms_norm_rope(base, weight, sin[:n], cos[:n], dtype=F, **post),
                           reduction=hidden + coff * ratio + dim)
    assert not out[n:].any()


def test_fp16_within_twice_the_plain_error(triton_backend):
    ratio, coff, dim, hidden = 4, 2, 32, 64
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=H, seed=19)
    x = randn(1, 23, hidden, dtype=H, seed=20)
    out = attnops.compressor(*(t.to(DEVICE) for t in (x, wkv, wgate, _state(1, 4, dim, coff), ape)),
                             cmp_ratio=ratio, coff=coff)
    assert triton_backend == POOLED and out.dtype == H
    _check("fp16 rows", out[0, :5], x[0], wkv, wgate, ape, coff)


def test_odd_ratio_empty_batch_seqused_and_history(triton_backend):
    """Ratio 3 with overlap, an odd block size, an empty batch, seqused below the segment and start positions inside
    a block whose earlier rows come from the state."""
    ratio, coff, dim, hidden, bs = 3, 2, 8, 16, 5
    wkv, wgate, ape = _weights(hidden, dim, ratio, coff, dtype=F, seed=30)
    segs, used, starts = [0, 7, 5], [0, 6, 5], [0, 4, 10]
    table = _table(3, 4)
    state = _state(int(table.max()) + 1, bs, dim, coff)
    history = [randn(s, 2 * coff * dim, dtype=F, seed=31 + b) for b, s in enumerate(starts)]
    for b, rows in enumerate(history):
        for p in range(starts[b]):
            state[int(table[b, p // bs]), p % bs] = rows[p]
    xs = [randn(n, hidden, dtype=F, seed=40 + b) for b, n in enumerate(segs)]
    cu = torch.tensor([0, *torch.tensor(segs).cumsum(0).tolist()], dtype=torch.int32)
    state = state.to(DEVICE)
    out = attnops.compressor(torch.cat(xs).to(DEVICE), *(t.to(DEVICE) for t in (wkv, wgate)), state, ape.to(DEVICE),
                             **_dev(cmp_ratio=ratio, coff=coff, state_block_table=table, cu_seqlens=cu,
                                    seqused=torch.tensor(used, dtype=torch.int32),
                                    start_pos=torch.tensor(starts, dtype=torch.int32))).cpu()
    assert triton_backend == SAVED
    row = 0
    for b in range(3):
        xb, sp, n = xs[b][:used[b]], starts[b], used[b]
        count = (sp + n) // ratio - sp // ratio
        if count:
            _check(f"batch {b}", out[row:row + count], xb, wkv, wgate, ape, coff, start_pos=sp, history=history[b])
        row += count
        _, new = G.compress(xb, wkv, wgate, ape, coff=coff, start_pos=sp, history=history[b])
        torch.testing.assert_close(_read_state(state.cpu(), table, b, range(sp, sp + n), bs), new.float())
    assert not out[row:].any()
