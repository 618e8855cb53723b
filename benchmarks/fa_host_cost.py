"""Host cost of one FlashAttention call on the GPU path, without a GPU: ``meta`` tensors inside
``attnops.testing.gpu_dry_run(check_host_reads=False)``, where the kernels' launches are recorded, not run, so only
the Python around them (validation, dispatch, planning) takes time, as on a GPU where launches are asynchronous.

    python benchmarks/fa_host_cost.py [B N S D]        # default 2 16 4096 128, fp16, BNSD

Prints, per case (forward; forward + backward, with ``out.backward(grad)``; not causal and causal), the median of
``CALLS`` calls after a warm-up, single-threaded: the best of ``ROUNDS`` rounds (a shared machine's other load
only adds time) and the median round. Meta tensors make some PyTorch internals slower than on a GPU (autograd's
allocations go through Python meta functions), and the dry run's recording costs some microseconds per launch.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import attnops
from attnops.testing import gpu_dry_run

CALLS, WARMUP, ROUNDS = 50, 20, 9


def _median_us(fn) -> float:
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(shape: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    q, k, v = (torch.empty(shape, device="meta", dtype=torch.float16) for _ in range(3))
    leaves = [torch.empty(shape, device="meta", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    grad = torch.empty(shape, device="meta", dtype=torch.float16)

    def forward(causal):
        return lambda: attnops.flash_attention(q, k, v, causal=causal)

    def forward_backward(causal):
        def step():
            attnops.flash_attention(*leaves, causal=causal).backward(grad)
            for t in leaves:
                t.grad = None
        return step

    print(f"shape {list(shape)} fp16 BNSD, median of {CALLS} calls: best / median of {ROUNDS} rounds (us)")
    with gpu_dry_run(check_host_reads=False) as launches:
        for name, make in (("fwd", forward), ("fwd+bwd", forward_backward)):
            for causal in (False, True):
                fn = make(causal)
                for _ in range(WARMUP):
                    fn()
                rounds = []
                for _ in range(ROUNDS):
                    rounds.append(_median_us(fn))
                    launches.clear()
                print(f"  {name:8s} causal={causal!s:5s}  {min(rounds):7.1f} / {statistics.median(rounds):7.1f}")


if __name__ == "__main__":
    main(tuple(int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (2, 16, 4096, 128))
