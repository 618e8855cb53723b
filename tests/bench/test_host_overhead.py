"""The host-overhead suite's NSA cases: each timed call plans the operators' launches on ``meta`` tensors (the NSA
layer's compression, compressed attention, selection and window kernels, and their backward; the module's decoding
step), and the runner times them beside the custom-op floor; the one-call decodes (FIA and its torch_npu forms) run
the decode kernels."""
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


@pytest.mark.parametrize("name", ["host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd",
                                  "host-nsa-module-decode-b2-ctx4096-n16-kvn1-d128-fp16"])
def test_the_runner_times_them_beside_the_floor(name):
    entry = run_case(NSA[name], META, repeat=2, warmup=1, impls=None, idle_wait=0.0, seed=0, check=False, log=print)
    assert entry["results"]["attnops"]["status"] == "ok" and set(entry["ratios"]) == {"custom-op-floor"}, entry


def test_the_nsa_cases_and_their_limits():
    assert {name: c.params.get("limit_s") for name, c in NSA.items()} == {
        "host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd": None,
        "host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd+bwd": 5e-3,
        "host-nsa-module-decode-b2-ctx4096-n16-kvn1-d128-fp16": 1e-3}
    assert set(NSA) == {"host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd",
                        "host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd+bwd",
                        "host-nsa-module-decode-b2-ctx4096-n16-kvn1-d128-fp16"}


DECODE = {c.name: c for pattern in ("fia-decode-call", "npu-") for c in suite_cases("host-overhead", pattern)}


@pytest.mark.parametrize("name", sorted(DECODE))
def test_each_one_call_decode_launches_the_decode_kernels(name, monkeypatch):
    """The one-call FIA decode and the torch_npu shim's calls (dense meta and shuffled CPU block tables), each with
    the 150 us limit, run the two decode kernels at every call."""
    case = DECODE[name]
    assert case.params["limit_s"] == 150e-6
    runnable = build_attnops(case, make_inputs(case, META, 0), META)
    launched = []
    run = KernelFamily.run
    monkeypatch.setattr(KernelFamily, "run", lambda self, launch, device: launched.append(launch.kernel) or run(
        self, launch, device))
    for _ in range(2):
        runnable.fn()
    assert launched == ["split_kernel", "merge_kernel"] * 2, launched
    assert len(DECODE) == 8


DSA = {c.name: c for c in suite_cases("host-overhead", "host-dsa-")}
DSA_KERNELS = {"prefill": ["sparse_attention_kernel"], "indexer": ["indexer_topk_kernel"],
               "decode": ["sparse_attention_kernel", "sparse_attention_merge_kernel"]}


@pytest.mark.parametrize("name", sorted(DSA))
def test_each_dsa_case_launches_its_kernels_with_a_limit(name, monkeypatch):
    """DSA sparse prefill, indexer and paged decode at full DeepSeek-V3.2 size, on meta (nothing drawn)."""
    case = DSA[name]
    assert case.params["limit_s"] > 0 and case.baselines == ("custom-op-floor",)
    runnable = build_attnops(case, make_inputs(case, META, 0), META)
    launched = []
    run = KernelFamily.run
    monkeypatch.setattr(KernelFamily, "run", lambda self, launch, device: launched.append(launch.kernel) or run(
        self, launch, device))
    runnable.fn()
    assert launched == DSA_KERNELS[name.split("-")[2]], launched
    assert len(DSA) == 4
