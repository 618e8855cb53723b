"""attnops.nn.NativeSparseAttention on the GPU hot path, checked without a GPU: its forward and backward (batched and
packed) and its cached decoding (a prefill then token by token, with an NSACache whose tensors live on ``meta``) run
inside :func:`attnops.testing.gpu_dry_run`: launches recorded, nothing read back, every tensor on the inputs' device
(a mask or position built on the host raises)."""
from __future__ import annotations

import pytest
import torch

from attnops.nn import NativeSparseAttention
from attnops.testing import gpu_dry_run

pytest.importorskip("triton")

META = torch.device("meta")
HIDDEN = 256


def _module(compress="weighted"):
    return NativeSparseAttention(HIDDEN, 8, 2, 64, compress_block_size=32, compress_stride=16, select_block_size=64,
                                 select_block_count=4, window_size=128, compress=compress).to(META, torch.float16)


def _x(*shape):
    return torch.empty(*shape, HIDDEN, device=META, dtype=torch.float16)


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("compress", ["weighted", "mean"])
def test_forward_and_backward(compress, packed):
    m = _module(compress)
    with gpu_dry_run() as launches:
        out = m(_x(600), cu_seqlens=[0, 300, 600]) if packed else m(_x(2, 300))
        out.sum().backward()
    kernels = [launch.kernel for launch in launches]
    assert "selected_dkdv_kernel" in kernels and "compress_dw_kernel" in kernels
    assert all(p.grad is not None and p.grad.device == META for p in m.parameters())


@pytest.mark.parametrize("max_seq_len", [None, 400], ids=["growing", "preallocated"])
def test_cached_decoding_reads_nothing_back(max_seq_len):
    m = _module()
    cache = m.new_cache(2, max_seq_len)
    with torch.no_grad(), gpu_dry_run() as launches:
        m(_x(2, 300), cache=cache)
        prefill = len(launches)
        for _ in range(3):
            m(_x(2, 1), cache=cache)
    steps = [launch.kernel for launch in launches[prefill:]]
    assert prefill and len(steps) == 3 * len(steps[:len(steps) // 3])
    assert {"decode_step_kernel", "selected_decode_kernel", "importance_kernel", "topk_kernel"} <= set(steps)
    assert cache.seq_len == 303 and cache.lengths.device == META and cache.block_table.device == META
    assert cache.compressed_keys.device == META


def test_decoding_steps_are_capturable(monkeypatch):
    """With preallocated storage, every step after the first launches the same kernels with the same grids and
    stages nothing (no upload): what a CUDA graph captured once replays correctly for the following tokens."""
    from attnops._core import staging

    m = _module()
    cache = m.new_cache(2, max_seq_len=400)
    uploads = []
    upload = staging.upload
    monkeypatch.setattr(staging, "upload", lambda *a, **k: uploads.append(1) or upload(*a, **k))
    steps = []
    with torch.no_grad(), gpu_dry_run() as launches:
        m(_x(2, 300), cache=cache)
        for _ in range(4):
            first, staged = len(launches), len(uploads)
            m(_x(2, 1), cache=cache)
            steps.append((launches[first:], len(uploads) - staged))
    assert all(step == steps[1] for step in steps[2:]) and steps[1][1] == 0
