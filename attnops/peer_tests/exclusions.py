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
}


def exclusion_reason(nodeid: str) -> str | None:
    """Why the case ``nodeid`` is excluded, or None."""
    return EXCLUDED.get(nodeid.split("[", 1)[0])
