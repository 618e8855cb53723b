"""Judging real NPU runs: msprobe dumps of the fused-attention calls re-run against the float64 golden and the
NPU-precision emulation (``python -m attnops compare``, docs/compare.md).

Modules: :mod:`.dump` (reading dump.json and the .pt files, NPU-pickled ones included), :mod:`.rebuild` (entries
back into torch_npu calls), :mod:`.references` (golden G and emulation E; :mod:`.nsa_references` for the NSA
operators, :mod:`._reference` the two ways of re-running), :mod:`.metrics` (msprobe's columns), :mod:`.verdict`,
:mod:`.judge` (:mod:`.judge_path`: a dump path, ``--jobs``), :mod:`.report` and :mod:`.cli`.
"""
from .judge import CallResult, TensorResult, judge_dump
from .judge_path import judge_path

__all__ = ["CallResult", "TensorResult", "judge_dump", "judge_path"]
