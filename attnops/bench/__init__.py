"""Benchmarks: a registry of cases (:mod:`.cases`) and a runner (:func:`main`, ``python -m attnops bench``).

Suites: ``fa-cpu`` (the CPU acceptance cases against SDPA), ``fa-cpu-long`` (32768-token causal sequence: time and
peak memory), ``fa-gpu`` (CUDA: SDPA backends, FlexAttention, flash-attn) and ``fa-smoke`` (seconds, any device).
"""
from .cases import SUITES, Case, Suite, register_suite, suite_cases
from .runner import main, run_case

__all__ = ["SUITES", "Case", "Suite", "main", "register_suite", "run_case", "suite_cases"]
