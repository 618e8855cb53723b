"""The compiled CPU decode kernel (``attnops.ops.common.cpu_kernels``) against the fp64 golden: fp32/fp16/bf16 and int8
KV (per-channel, per-token and page-managed antiquant, with offsets), dense and shuffled paged caches, head dims
that are not multiples of the vector width, GQA and several query rows; each test asserts the kernel ran. Results
are bitwise the same on 1 and 2 threads; a failed build warns and leaves every call to the PyTorch path."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

import attnops
from attnops.ops.common import cpu_kernels
from attnops._core.errors import PerformanceWarning
from attnops.ops.fused_infer_attention import decode, fused_decode
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import check_fia, make_inputs, randint8, to_paged

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
needs_kernel = pytest.mark.usefixtures("cpu_kernel")  # built once per session, skips without a compiler


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of chunks the kernel computed (a list holding one count)."""
    count = [0]
    real = fused_decode.compute

    def counted(p, chunks, *args):
        count[0] += len(chunks)
        return real(p, chunks, *args)

    monkeypatch.setattr(fused_decode, "compute", counted)
    return count


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("d,dv", [(32, 32), (20, 12)])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_float_kv(kernel_calls, dtype, d, dv, sq, paged):
    b, n, nkv, bs, lens = 2, 8, 2, 16, [70, 33]
    q, k, v = make_inputs("BNSD", b=b, n=n, nkv=nkv, sq=sq, skv=70, d=d, dv=dv, dtype=dtype)
    kw = dict(actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv, scale_value=d ** -0.5,
              input_layout="BNSD", softmax_lse_flag=True)
    if paged:
        k, bt = to_paged(k, lens, bs, seed=4)
        v, _ = to_paged(v, lens, bs, seed=4)
        kw.update(block_table=bt, block_size=bs)
    check_fia(q, k, v, via="api", **kw)
    assert kernel_calls[0] > 0


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, F16, BF16, I8 := torch.int8], ids=str)
def test_register_blocks_and_partial_vectors(kernel_calls, dtype):
    """Query rows in blocks of 4 plus a remainder (G=5, Sq=2: 10 rows), a head dim of 6 vectors and a partial one
    (d=100) and value columns in blocks of 4, 2 and 1 vectors with a partial last one (dv=120 and dv=40), and a
    head dim and value width that are no multiple of 8 or 16 (d=36, dv=72), for every key and value dtype."""
    for d, dv in ((100, 120), (100, 40), (36, 72)):
        b, n, nkv, lens = 2, 10, 2, [70, 33]
        q = randn(b, n, 2, d, dtype=BF16 if dtype == I8 else dtype, seed=1)
        if dtype == I8:
            k, v = randint8(b, nkv, 70, d, seed=2), randint8(b, nkv, 70, dv, seed=3)
            extra = dict(key_antiquant_scale=torch.full((nkv, d), 0.02, dtype=BF16),
                         value_antiquant_scale=torch.full((nkv, dv), 0.02, dtype=BF16))
        else:
            k, v = randn(b, nkv, 70, d, dtype=dtype, seed=2), randn(b, nkv, 70, dv, dtype=dtype, seed=3)
            extra = {}
        check_fia(q, k, v, via="api", **extra, actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv,
                  scale_value=d ** -0.5, input_layout="BNSD", softmax_lse_flag=True)
    assert kernel_calls[0] > 0


@needs_kernel
@pytest.mark.parametrize("d", [64, 36, 160])
@pytest.mark.parametrize("paged", [False, True])
def test_bf16_scores_of_many_query_rows(kernel_calls, d, paged):
    """bf16 query and keys (on CPUs with AMX-BF16 the scores run on the tile unit, from the unscaled query): 20
    query rows per KV head (G=10, Sq=2: two B tiles of 16 rows), head dims a multiple of 32 (the keys' rows read
    where they lie when evenly spaced), not one (copied zero-padded) and of five steps; pages of 24 tokens, so tiles
    of 16 tokens cross pages and partial tiles end the lengths."""
    b, n, nkv, lens = 2, 20, 2, [70, 41]
    q, k, v = make_inputs("BNSD", b=b, n=n, nkv=nkv, sq=2, skv=70, d=d, dv=48, dtype=BF16)
    kw = dict(actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv, scale_value=0.3,
              input_layout="BNSD", softmax_lse_flag=True)
    if paged:
        k, bt = to_paged(k, lens, 24, seed=5)
        v, _ = to_paged(v, lens, 24, seed=5)
        kw.update(block_table=bt, block_size=24)
    check_fia(q, k, v, via="api", **kw)
    assert kernel_calls[0] > 0


def test_the_tile_unit_serves_decode_scores_where_it_serves_the_gemm():
    """The decode kernel's bf16 scores take the AMX tile unit exactly where the bf16 GEMM does (one decision per
    process, ATTNOPS_CPU_AMX=0 turning both off)."""
    from attnops.ops.common import bf16_gemm

    if cpu_kernels.library() is None:
        pytest.skip(cpu_kernels.status())
    assert cpu_kernels.tile_scores() == (bf16_gemm.unit() == "AMX-BF16")


@needs_kernel
@pytest.mark.parametrize("kmode,vmode", [(0, 0), (1, 1), (5, 5), (0, 1)])
def test_int8_kv(kernel_calls, kmode, vmode):
    b, n, nkv, d, bs, lens = 2, 4, 2, 32, 16, [70, 33]
    q = randn(b, n, 1, d, dtype=F16, seed=1)
    k, v = randint8(b, nkv, 70, d, seed=2), randint8(b, nkv, 70, d, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout="BNSD", seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout="BNSD", seed=4)
    g = torch.Generator().manual_seed(6)
    shapes = {0: ((nkv, d), F16), 1: ((b, 80), F32), 5: ((kc.shape[0], nkv, bs), F32)}
    p = {}
    for name, mode in (("key", kmode), ("value", vmode)):
        shape, pdt = shapes[mode]
        p[f"{name}_antiquant_scale"] = (torch.rand(shape, generator=g) * 0.02 + 0.005).to(pdt)
        p[f"{name}_antiquant_offset"] = (torch.randn(shape, generator=g) * 4).to(pdt)
    check_fia(q, kc, vc, via="api", **p, key_antiquant_mode=kmode, value_antiquant_mode=vmode, block_table=bt,
              block_size=bs, actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv, scale_value=0.25,
              input_layout="BNSD", softmax_lse_flag=True)
    assert kernel_calls[0] > 0


def _on_threads(counts, call) -> list:
    """``call()`` on each thread count of ``counts`` in turn, every one of those threads used (no dynamic count)."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(call())
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.fixture(params=["openmp_team", "own_pool"])
def workers(request):
    """The kernel's workers: PyTorch's OpenMP threads (where PyTorch runs on GNU OpenMP), or the library's pool."""
    from attnops._core import parallel

    entry = parallel.openmp_parallel_entry()
    if request.param == "openmp_team" and entry is None:
        pytest.skip("PyTorch does not run on GNU OpenMP here")
    lib = cpu_kernels.library()
    lib.attnops_use_openmp_team(entry if request.param == "openmp_team" else None)
    yield request.param
    lib.attnops_use_openmp_team(entry)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_same_bits_on_one_and_two_threads(kernel_calls, monkeypatch, dtype, workers):
    """One thread, two and three (the caller and the workers; the last chunks cut into single heads): the same
    bits."""
    monkeypatch.setattr(decode, "CHUNK_TOKENS", 256)
    monkeypatch.setenv("ATTNOPS_CPU_DYNAMIC_THREADS", "0")
    q, k, v = make_inputs("BNSD", b=2, n=8, nkv=2, sq=1, skv=1500, d=64, dtype=dtype)
    kw = dict(num_key_value_heads=2, layout="BNSD", return_lse=True, actual_seq_lengths_kv=[1500, 999])
    results = _on_threads((1, 2, 1, 3), lambda: attnops.fused_infer_attention(q, k, v, **kw))
    assert kernel_calls[0] >= 4 * (6 + 4)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("mode", [3, 5])
def test_same_bits_on_one_and_two_threads_with_per_token_antiquant(kernel_calls, monkeypatch, mode):
    """Per-token (mode 3) and page-managed (mode 5) scales and offsets of each KV head, on a shuffled paged cache: a
    chunk cut into single heads reads each head's own parameters."""
    monkeypatch.setattr(decode, "CHUNK_TOKENS", 32)
    monkeypatch.setenv("ATTNOPS_CPU_DYNAMIC_THREADS", "0")
    b, n, nkv, d, bs, lens = 2, 8, 4, 32, 16, [150, 97]
    q = randn(b, n, 1, d, dtype=F16, seed=1)
    kc, bt = to_paged(randint8(b, nkv, 150, d, seed=2), lens, bs, cache_layout="BNSD", seed=4)
    vc, _ = to_paged(randint8(b, nkv, 150, d, seed=3), lens, bs, cache_layout="BNSD", seed=4)
    g = torch.Generator().manual_seed(6)
    shape = (b, nkv, 160) if mode == 3 else (kc.shape[0], nkv, bs)
    p = {f"{name}_antiquant_{what}": torch.rand(shape, generator=g) * 0.02 + 0.005 if what == "scale" else
         torch.randn(shape, generator=g) * 4 for name in ("key", "value") for what in ("scale", "offset")}
    kw = dict(**p, key_antiquant_mode=mode, value_antiquant_mode=mode, block_table=bt, block_size=bs,
              actual_seq_lengths_kv=lens, num_key_value_heads=nkv, layout="BNSD", return_lse=True)
    results = _on_threads((1, 2, 3), lambda: attnops.fused_infer_attention(q, kc, vc, **kw))
    assert kernel_calls[0] == 3 * (5 + 4)  # chunks of two pages
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@needs_kernel
@pytest.mark.skipif(platform.system() != "Linux", reason="the runnable tasks are counted on Linux")
def test_no_worker_where_other_processes_take_every_cpu():
    """As many busy processes as CPUs: no CPU is free for a worker (this process's own threads do not count)."""
    import subprocess
    import time

    lib = cpu_kernels.library()
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count())]
    try:
        time.sleep(0.2)
        assert lib.attnops_workers_with_a_cpu(4) == 0
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert 0 <= lib.attnops_workers_with_a_cpu(4) <= 4


@needs_kernel
def test_batches_merged_together_get_the_bits_of_a_call_of_their_own(monkeypatch):
    """Batches 0 and 2 (3 chunks each) merge in one pass, batch 1 (2 chunks) alone: each equals a B=1 call."""
    monkeypatch.setattr(decode, "CHUNK_TOKENS", 64)
    lens = [150, 100, 129]
    q, k, v = make_inputs("BNSD", b=3, n=8, nkv=2, sq=1, skv=150, d=32, dtype=BF16)
    kw = dict(num_key_value_heads=2, layout="BNSD", return_lse=True)
    out, lse = attnops.fused_infer_attention(q, k, v, actual_seq_lengths_kv=lens, **kw)
    for b, n in enumerate(lens):
        alone = attnops.fused_infer_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], actual_seq_lengths_kv=[n], **kw)
        assert torch.equal(out[b:b + 1], alone[0]) and torch.equal(lse[b:b + 1], alone[1])


def test_a_failed_build_warns_and_the_pytorch_path_serves(monkeypatch, tmp_path, kernel_calls):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.warns(PerformanceWarning, match="could not be built"):
        assert cpu_kernels.library() is None
    assert cpu_kernels.status().startswith("pure PyTorch (build failed")
    q, k, v = make_inputs("BNSD", b=2, n=4, nkv=2, sq=1, skv=40, d=16, dtype=F16)
    check_fia(q, k, v, via="api", num_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_lse_flag=True)
    assert kernel_calls[0] == 0


def _two_thread_call(inputs, expected, queue) -> None:
    torch.set_num_threads(2)
    q, k, v = inputs
    queue.put(torch.equal(attnops.fused_infer_attention(q, k, v, num_key_value_heads=2, layout="BNSD")[0], expected))


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_the_kernel_on_a_pool_of_its_own(kernel_calls, monkeypatch):
    """The parent's pool threads do not exist in a forked child: a two-thread call there neither hangs nor differs
    from the parent's."""
    import multiprocessing

    monkeypatch.setattr(decode, "CHUNK_TOKENS", 256)
    monkeypatch.setenv("ATTNOPS_CPU_DYNAMIC_THREADS", "0")  # the pools run whatever the load (the child inherits it)
    inputs = make_inputs("BNSD", b=1, n=8, nkv=2, sq=1, skv=1500, d=64, dtype=BF16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parent = attnops.fused_infer_attention(*inputs, num_key_value_heads=2, layout="BNSD")[0]  # pool started
    finally:
        torch.set_num_threads(threads)
    assert kernel_calls[0] >= 6
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_two_thread_call, args=(inputs, parent, queue))
    child.start()
    same = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0 and same


@needs_kernel
def test_the_kernel_loads_no_openmp_runtime_of_its_own():
    """The kernel's threads are its own: the library is built without OpenMP and loads no runtime."""
    assert "-fopenmp" not in cpu_kernels._state["recipe"].flags
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert len({line.split()[-1] for line in maps if "libgomp" in line}) <= 1


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("ATTNOPS_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert cpu_kernels.status() == "pure PyTorch (disabled by ATTNOPS_CPU_KERNELS=0)"


@pytest.mark.slow  # two real compiles; the recipe test in tests/_core/test_cpu_kernel_build.py covers the flag
@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("arch", ["x86-64", "haswell"])  # plain loops; AVX2 without AVX-512
def test_other_instruction_sets(monkeypatch, tmp_path, kernel_calls, arch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNOPS_CPU_ARCH", arch)
    assert cpu_kernels.library() is not None
    q, k, v = make_inputs("BNSD", b=2, n=4, nkv=2, sq=2, skv=40, d=20, dtype=BF16)
    check_fia(q, k, v, via="api", num_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_lse_flag=True)
    test_int8_kv(kernel_calls, 1, 1)
    assert kernel_calls[0] > 0
