"""The size rule: which parametrized cases are small enough for the CPU."""
from __future__ import annotations

MAX_SCORES = 256 * 256 * 128  # seqlen_q * seqlen_k * head dim
_SEQLEN_Q = ("seqlen_q", "seqlen")
_SEQLEN_K = ("seqlen_k", "seqlen")
_HEAD_DIM = ("d", "headdim", "head_dim")

DESCRIPTION = ("size rule: a case runs when seqlen_q * seqlen_k * d <= 256 * 256 * 128 = "
               f"{MAX_SCORES}, read from its parameters (seqlen_q or seqlen, seqlen_k or seqlen, d or headdim or "
               "head_dim); a factor the case does not parametrize counts as 1")


def _first(params: dict, names: tuple[str, ...]) -> int:
    for name in names:
        value = params.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 1


def case_size(params: dict) -> int:
    """``seqlen_q * seqlen_k * d`` of a case's parameters (missing factors count as 1)."""
    return _first(params, _SEQLEN_Q) * _first(params, _SEQLEN_K) * _first(params, _HEAD_DIM)


def fits(params: dict) -> bool:
    return case_size(params) <= MAX_SCORES
