"""attnops._core.parallel: jobs on single-threaded workers, and the FlashAttention reference run that way equals
its serial run bit for bit (each job owns its outputs, so the thread count cannot change a result)."""
import os
import threading

import pytest
import torch

import attnops
from attnops._core import parallel
from attnops._core.parallel import run_jobs
from attnops.ops.common import reference_tiles
from tests.helpers import PREFIX3072, TRIU2048, check_fa, cum, make_qkv, randn

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["openmp_team", "thread_pool"])
def runner(request, two_threads, monkeypatch):
    """Each way of running jobs: PyTorch's OpenMP threads (where PyTorch runs on GNU OpenMP), the Python pool."""
    if request.param == "openmp_team":
        if parallel._openmp_team() is None:
            pytest.skip("PyTorch does not run on GNU OpenMP here")
    else:
        monkeypatch.setattr(parallel, "_team", [None])
    return request.param


def test_jobs_run_single_threaded_on_two_threads_and_the_caller_keeps_its_threads(runner):
    seen, gate = {}, threading.Barrier(2, timeout=30)

    def job(i):
        if i < 2:
            gate.wait()  # the first two jobs run at once: on two threads
        seen[i] = (threading.get_native_id(), torch.get_num_threads(), torch.is_grad_enabled())

    run_jobs(job, range(4), CPU)
    assert sorted(seen) == [0, 1, 2, 3]
    assert seen[0][0] != seen[1][0]
    assert all(n == 1 and not grad for _, n, grad in seen.values())
    assert torch.get_num_threads() == 2


def test_one_thread_runs_the_jobs_in_the_caller(runner):
    torch.set_num_threads(1)
    ids = []
    run_jobs(lambda _: ids.append((threading.get_native_id(), torch.get_num_threads())), range(3), CPU)
    assert ids == [(threading.get_native_id(), 1)] * 3


def test_no_jobs_wake_no_worker_and_one_job_runs_on_the_caller(runner, monkeypatch):
    """An empty list opens no parallel region (its threads would have to arrive at its end: on a busy machine
    milliseconds late); a single job runs on the calling thread, its operators single-threaded."""
    regions = []
    if runner == "openmp_team":
        team = parallel._openmp_team()
        monkeypatch.setattr(type(team), "run", lambda self, threads, job, items, run=type(team).run: (
            regions.append(threads), run(self, threads, job, items))[1])
    run_jobs(lambda _: pytest.fail("no job expected"), [], CPU)
    seen = []
    run_jobs(lambda _: seen.append((threading.get_native_id(), torch.get_num_threads())), [0], CPU)
    assert regions == ([1] if runner == "openmp_team" else [])
    if runner == "openmp_team":
        assert seen == [(threading.get_native_id(), 1)]


def test_a_failing_job_raises_after_the_jobs_that_started_ended(runner):
    done, gate = [], threading.Barrier(2, timeout=30)

    def job(i):
        if i < 2:
            gate.wait()
        if i == 1:
            raise ValueError("job 1 failed")
        done.append(i)

    with pytest.raises(ValueError, match="job 1 failed"):
        run_jobs(job, range(2), CPU)
    assert done == [0]


def test_a_job_can_run_jobs_of_its_own_serially(runner):
    inner = []
    run_jobs(lambda i: run_jobs(lambda j: inner.append((i, j, threading.get_native_id())), range(2), CPU), range(2),
             CPU)
    assert sorted((i, j) for i, j, _ in inner) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_outer = {}
    for i, _, tid in inner:
        by_outer.setdefault(i, set()).add(tid)
    assert all(len(tids) == 1 for tids in by_outer.values())  # an inner job runs on its outer job's thread


def test_a_workers_thread_store_is_kept_between_calls(runner):
    stores = {}
    for _ in range(3):
        run_jobs(lambda i: stores.setdefault(threading.get_native_id(), set()).add(id(parallel.thread_store())),
                 range(8), CPU)
    assert all(len(ids) == 1 for ids in stores.values())


def test_workers_follow_the_callers_inference_mode(runner):
    with torch.inference_mode():
        out = torch.zeros(4)  # an inference tensor: only inference mode may write it in place
        run_jobs(lambda i: out[i:i + 1].add_(i), range(4), CPU)
    assert out.tolist() == [0, 1, 2, 3]


CASES = {
    "bsnd_causal": lambda: (make_qkv("BSND", b=1, n1=4, sq=40, skv=40, seed=1),
                            dict(layout="BSND", atten_mask=TRIU2048, sparse_mode=2)),
    "tnd_gqa_prefix_fp16": lambda: (
        make_qkv("TND", n1=4, n2=2, q_lens=[9, 0, 17], kv_lens=[12, 3, 17], dtype=torch.float16, seed=2),
        dict(layout="TND", actual_seq_qlen=cum([9, 0, 17]), actual_seq_kvlen=cum([12, 3, 17]), atten_mask=PREFIX3072,
             sparse_mode=6, prefix=[4, 3, 2])),
    "tnd_mqa_causal": lambda: (
        make_qkv("TND", n1=4, n2=1, q_lens=[70], kv_lens=[70], seed=6),
        dict(layout="TND", actual_seq_qlen=[70], actual_seq_kvlen=[70], atten_mask=TRIU2048, sparse_mode=3)),
    "bsnd_mqa_fp16": lambda: (make_qkv("BSND", b=1, n1=2, n2=1, sq=50, skv=61, dtype=torch.float16,
                                                      seed=7), dict(layout="BSND")),
    "bnsd_shared_pse_dropout": lambda: (make_qkv("BNSD", b=2, n1=2, sq=11, skv=13, seed=3),
                                        dict(layout="BNSD", pse=randn(1, 2, 11, 13, seed=4), keep_prob=0.7, seed=5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attention_on_workers_equals_the_serial_run(case, runner, monkeypatch):
    (q, k, v, dy), kw = CASES[case]()
    monkeypatch.setattr(reference_tiles, "MAX_ROWS", 16)  # many row chunks and chunk groups per head
    heads = q.shape[2] if kw["layout"] == "BSND" else q.shape[1]
    golden_kw = {name: value for name, value in kw.items() if name != "seed"}
    check_fa(q, k, v, dy, scale=q.shape[-1] ** -0.5, head_num=heads, drop="seed", drop_seed=kw.get("seed", 0),
             **golden_kw)  # correct on the workers

    def run():
        res = attnops.flash_attention(q, k, v, return_stats=True, **kw)
        grads = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum,
                                                 **kw)
        return (res.out, res.softmax_max, res.softmax_sum, *(g for g in grads if g is not None))

    parallel = run()
    torch.set_num_threads(1)
    serial = run()
    for a, b in zip(parallel, serial):
        assert torch.equal(a, b)


def _jobs_in_child(queue) -> None:
    torch.set_num_threads(2)
    out = torch.zeros(4)
    run_jobs(lambda i: out[i:i + 1].add_(i + 1), range(4), CPU)
    queue.put(out.tolist())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_pool(two_threads):
    import multiprocessing

    run_jobs(lambda _: None, range(2), CPU)  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_jobs_in_child, args=(queue,))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "run_jobs hung in a forked child"
    assert queue.get(timeout=5) == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("make", [
    lambda: torch.empty(3, 5, 7),
    lambda: torch.empty(7, 5, 3).permute(2, 1, 0),  # not contiguous: sliced along its longest dimension
    lambda: torch.empty(100_003),  # pieces of unequal size
    lambda: torch.empty(()),
    lambda: torch.empty(0, 4),
    lambda: torch.empty(2, 4096, 130)[:, :, 1:129],
])
def test_fill_sets_every_element_on_the_workers(runner, make):
    from attnops._core.parallel import fill_

    a, b = make(), torch.empty(9, 9)
    fill_([(a, 2.5), (b, float("-inf"))], CPU)
    assert bool((a == 2.5).all()) and bool((b == float("-inf")).all())


def test_serial_ops_make_the_callers_operators_single_threaded_and_keep_the_job_count(two_threads):
    """Inside, PyTorch's operators on this thread see one thread (OpenMP and MKL) while jobs still get the caller's
    count; afterwards both are back; another thread keeps its own count meanwhile; nesting changes nothing."""
    from attnops._core import parallel

    if not parallel._thread_count_setters():
        pytest.skip("no OpenMP runtime loaded in this process")
    other = {}
    with parallel.serial_ops():
        assert torch.get_num_threads() == 1 and parallel.job_threads(CPU) == 2
        with parallel.serial_ops():
            assert torch.get_num_threads() == 1 and parallel.job_threads(CPU) == 2
        assert torch.get_num_threads() == 1
        thread = threading.Thread(target=lambda: other.update(n=torch.get_num_threads()))
        thread.start()
        thread.join()
    assert torch.get_num_threads() == 2 and parallel.job_threads(CPU) == 2
    assert other["n"] == 2
