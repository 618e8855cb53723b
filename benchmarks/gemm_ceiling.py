"""How fast can a tiled pure-PyTorch FlashAttention forward be on this CPU? Times, interleaved, SDPA's CPU forward
against the two GEMMs alone (S = Q K^T and S V, nothing else) of the reference's non-causal tiling (one head x R
rows x all 4096 columns, MKL multi-threaded per call) and of a head-batched tiling (torch.bmm).

    python benchmarks/gemm_ceiling.py [repeats]
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

S, N, D = 4096, 8, 128


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, N, S, D) for _ in range(3))
    qh, kh, vh = q[0], k[0], v[0]
    bufs = {r: (torch.empty(r, S), torch.empty(N, S, D)) for r in (128, 256, 512)}
    bbuf = (torch.empty(N, 64, S), torch.empty(N, S, D))

    def gemms_per_head(r):
        s, o = bufs[r]
        for h in range(N):
            for r0 in range(0, S, r):
                torch.mm(qh[h, r0:r0 + r], kh[h].t(), out=s)
                torch.mm(s, vh[h], out=o[h, r0:r0 + r])

    def gemms_batched():
        s, o = bbuf
        for r0 in range(0, S, 64):
            torch.bmm(qh[:, r0:r0 + 64], kh.transpose(1, 2), out=s)
            torch.bmm(s, vh, out=o[:, r0:r0 + 64])

    def sdpa():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    cands = {"sdpa forward (everything)": sdpa, "GEMMs only, 1 head x 128 rows": lambda: gemms_per_head(128),
             "GEMMs only, 1 head x 256 rows": lambda: gemms_per_head(256),
             "GEMMs only, 1 head x 512 rows": lambda: gemms_per_head(512),
             "GEMMs only, 8 heads x 64 rows (bmm)": gemms_batched}
    best = {name: float("inf") for name in cands}
    for f in cands.values():
        f()
    for _ in range(reps):
        for name, f in cands.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    flops = 4 * N * S * S * D
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, min of {reps}")
    for name, t in best.items():
        print(f"  {name:38s} {t:.3f} s  {flops / t / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
