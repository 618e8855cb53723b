"""Every peer test attnops does not run, with the reason (the one list; ``docs/peer_tests.md`` repeats it).

Keys are pytest node ids relative to the peer checkout, without parameters (``file::function``); a key names all
of that function's cases.
"""
from __future__ import annotations

EXCLUDED: dict[str, str] = {
    "tests/test_rotary.py::test_compilation_count":
        "counts compilations of flash-attn's Triton rotary kernel on a GPU; attnops' rotary on the CPU is not a "
        "Triton kernel",
}


def exclusion_reason(nodeid: str) -> str | None:
    """Why the case ``nodeid`` is excluded, or None."""
    return EXCLUDED.get(nodeid.split("[", 1)[0])
