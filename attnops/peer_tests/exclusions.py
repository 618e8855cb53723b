"""Every peer test attnops does not run, with the reason (the one list; ``docs/peer_tests.md`` repeats it).

Keys are pytest node ids relative to the peer checkout, without parameters (``file::function``); a key names all
of that function's cases.
"""
from __future__ import annotations

EXCLUDED: dict[str, str] = {
    "tests/test_rotary.py::test_compilation_count":
        "counts compilations of flash-attn's Triton rotary kernel on a GPU; attnops' rotary on the CPU is not a "
        "Triton kernel",
    "tests/test_flash_attn.py::test_flash_attn_race_condition":
        "repeats one forward and backward 250 times at batch 60 to catch GPU thread races (hours on a CPU); "
        "attnops' bitwise determinism is what test_flash_attn_deterministic and its varlen form check",
    "tests/test_flash_attn.py::test_flash_attn_generator_arg_must_be_none":
        "calls the raw CUDA extension's entry points (flash_attn_gpu.fwd/bwd/varlen_fwd/varlen_bwd) with their "
        "positional C++ signatures; attnops provides the Python API, not the extension",
    "tests/test_flash_attn.py::test_flash_attn_varlen_paged_kv_num_splits":
        "calls the private _flash_attn_varlen_forward (the extension's argument order, its rng_state output and its "
        "num_splits scheduling knob); attnops provides the public flash_attn_varlen_func",
    "hopper/test_flash_attn.py::test_flash_attn_race_condition":
        "FA3's race test: allocates tens of GiB and repeats one backward 1000 times to catch GPU thread races; "
        "attnops' bitwise determinism is what flash-attn 2's test_flash_attn_deterministic checks",
    "hopper/test_flash_attn_triton_amd.py::test_flash_attn_race_condition":
        "the same race test as in hopper/test_flash_attn.py",
}

# Whole files of a suite's directory that the runner does not run, with the reason.
EXCLUDED_FILES: dict[str, str] = {
    "hopper/test_kvcache.py": "a benchmark script (argparse, timings), no test functions",
    "hopper/test_attn_kvcache.py":
        "written for an earlier FA3 API: passes gqa_parallel to flash_attn_with_kvcache, which the checkout's own "
        "hopper/flash_attn_interface.py no longer takes (FA3 itself raises the same TypeError)",
    "hopper/test_flash_attn_bwd_determinism.py":
        "imports FA3's private _flash_attn_backward (the extension's positional signature and its workspace "
        "outputs); attnops provides FA3's public functions",
    "hopper/test_util.py": "helpers imported by the other hopper test files, no test functions",
    "test/test_custom_ops/test_attention_to_ffn.py":
        "attention-FFN disaggregation: a MoE communication operator, not attention",
    "test/test_custom_ops/test_ffn_to_attention.py":
        "attention-FFN disaggregation: a MoE communication operator, not attention",
    "test/test_custom_ops/test_attention_worker_schedule.py":
        "attention-FFN disaggregation: a scheduling operator for MoE communication, not attention",
    "test/test_custom_ops/test_npu_attention_worker_combine.py":
        "attention-FFN disaggregation: a MoE communication operator, not attention",
    "test/test_custom_ops/test_atb_linear.py":
        "ATB's linear (matmul plus fp32 add), not attention; its fp16 matmuls of 4096 x 16384 by 16384 x 4096 take "
        "tens of minutes on a CPU",
    "test/test_custom_ops/test_npu_attn_softmax.py":
        "npu_attn_softmax_: an in-place softmax primitive, not a fused attention operator; attnops does not provide it",
    "test/test_custom_ops/test_npu_gather_sparse_index.py":
        "npu_gather_sparse_index: a generic gather, not attention; attnops does not provide it",
}


def exclusion_reason(nodeid: str) -> str | None:
    """Why the case ``nodeid`` is excluded, or None."""
    return EXCLUDED.get(nodeid.split("[", 1)[0])
