"""The host-overhead suite's NSA cases: each timed call plans the operators' launches on ``meta`` tensors (the NSA
layer's compression, compressed attention, selection and window kernels, and their backward; the module's decoding
step), and the runner times them without a baseline."""
from __future__ import annotations

import pytest
import torch

from attnops._core.triton.launch import KernelFamily
from attnops.bench import run_case
from attnops.bench.cases import suite_cases
from attnops.bench.impls import build_attnops, make_inputs

pytest.importorskip("triton")

META = torch.device("meta")
NSA = {c.name: c for c in suite_cases("host-overhead", "nsa")}
LAYER_FWD = {"compress_fwd_kernel", "fwd_kernel", "importance_kernel", "topk_kernel", "selected_fwd_kernel"}
EXPECTED = {"fwd": LAYER_FWD, "fwd+bwd": LAYER_FWD | {"selected_dkdv_kernel", "compress_dw_kernel", "dkdv_kernel"},
            "decode": {"compress_cache_kernel", "importance_kernel", "selected_decode_kernel", "fwd_kernel"}}


@pytest.mark.parametrize("name", sorted(NSA))
def test_each_timed_call_plans_the_launches(name, monkeypatch):
    case = NSA[name]
    runnable = build_attnops(case, make_inputs(case, META, 0), META)
    launched = []
    run = KernelFamily.run
    monkeypatch.setattr(KernelFamily, "run", lambda self, launch, device: launched.append(launch.kernel) or run(
        self, launch, device))
    for _ in range(2):  # the decoding step's reset truncates the cache back: every call is the same step
        launched.clear()
        runnable.reset()
        runnable.fn()
        assert EXPECTED["decode" if "decode" in name else case.mode] <= set(launched), launched


def test_the_runner_times_them_without_a_baseline():
    case = NSA["host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd"]
    entry = run_case(case, META, repeat=2, warmup=1, impls=None, idle_wait=0.0, seed=0, check=False, log=print)
    assert entry["results"]["attnops"]["status"] == "ok" and entry["ratios"] == {}, entry
    assert set(NSA) == {"host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd",
                        "host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd+bwd",
                        "host-nsa-module-decode-b2-ctx4096-n16-kvn1-d128-fp16"}
