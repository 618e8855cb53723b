"""A/B of two FlashAttention CPU references in one process: another revision's ``reference.py`` is loaded beside
the working tree's, and both are timed with SDPA in random order, so the machine's drift (a shared VM's speed moves
by 5-10% within minutes) hits all three alike. B=1, N=8, S=4096, D=128, fp32; ``LAYOUT`` (environment) BNSD (the
default: SDPA and attnops take the same tensors) or BSND (SDPA on contiguous BNSD copies).

    git worktree add /tmp/base <rev>
    python benchmarks/fa_ab.py /tmp/base/attnops/ops/common/reference.py [fwd fb fwd_causal fb_causal]

Prints, per case, the min and the median over ``REP`` (environment, default 5) rounds and SDPA time / each
reference's time.
The other revision's reference must work with this tree's ``FAProblem`` and core modules.
"""
from __future__ import annotations

import importlib.util
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnops
import attnops.ops.common.backends as backends

S, N, D = 4096, 8, 128
CASES = ("fwd", "fb", "fwd_causal", "fb_causal")


def _load(path: str):
    name = "attnops.ops.flash_attention._reference_b"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    other = _load(sys.argv[1])
    current = backends.reference
    cases = sys.argv[2:] or CASES
    torch.manual_seed(0)
    layout = os.environ.get("LAYOUT", "BNSD")
    q, k, v, dy = (torch.randn(1, S, N, D) for _ in range(4))
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v, dy)]
    if layout == "BNSD":
        q, k, v, dy = heads_first
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)

    def ours(module, causal, bwd):
        qq, kk, vv = (t.clone().requires_grad_(bwd) for t in (q, k, v))
        kw = dict(sparse_mode=2, atten_mask=mask) if causal else {}

        def run():
            backends.reference = module
            for t in (qq, kk, vv):
                t.grad = None
            with torch.set_grad_enabled(bwd):
                out = attnops.flash_attention(qq, kk, vv, layout=layout, **kw)
                if bwd:
                    out.backward(dy)
        return run

    def sdpa(causal, bwd):
        qq, kk, vv = (t.clone().requires_grad_(bwd) for t in heads_first[:3])

        def run():
            for t in (qq, kk, vv):
                t.grad = None
            with torch.set_grad_enabled(bwd):
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                if bwd:
                    out.backward(heads_first[3])
        return run

    rounds = int(os.environ.get("REP", "5"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {layout}, min / median of {rounds}; "
          f"B: {sys.argv[1]}")
    for name in cases:
        causal, bwd = "causal" in name, name.startswith("fb")
        runs = {"A (this tree)": ours(current, causal, bwd), "B": ours(other, causal, bwd), "sdpa": sdpa(causal, bwd)}
        for run in runs.values():
            run()
        times = {label: [] for label in runs}
        for _ in range(rounds):
            for label in random.sample(list(runs), len(runs)):
                t0 = time.perf_counter()
                runs[label]()
                times[label].append(time.perf_counter() - t0)
        backends.reference = current
        for stat in (min, statistics.median):
            t = {label: stat(ts) for label, ts in times.items()}
            print(f"{name:11s} {stat.__name__:6s} " + "  ".join(f"{label} {x:.4f} s" for label, x in t.items())
                  + f" | sdpa/A {t['sdpa'] / t['A (this tree)']:.3f}  sdpa/B {t['sdpa'] / t['B']:.3f}")


if __name__ == "__main__":
    main()
