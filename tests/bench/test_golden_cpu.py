"""The ``golden-cpu`` suite's pieces: its dumps judge as PASS, and a subprocess's CPU time and peak RSS are its own."""
from __future__ import annotations

import sys

from attnops.bench import SUITES
from attnops.bench.golden_cpu import _case, _measure_process, _skip_reason, write_dump
from attnops.msprobe import judge_path


def test_suite_lists_both_target_sizes_and_the_side_by_side_pair():
    names = [c.name for c in SUITES["golden-cpu"].cases]
    assert "compare-b1-n32-s4096-d128-bf16-causal" in names and "compare-b1-n8-s32768-d128-bf16-causal" in names
    assert {n.split("-b1")[0] for n in names} == {"compare", "bench-msprobe", "bench-attnops"}


def test_written_dump_is_judged_pass_forward_and_backward(tmp_path):
    write_dump(_case("compare", 2, 64), tmp_path / "step0" / "rank0")
    results = judge_path(tmp_path)
    assert [(r.call, r.verdict) for r in results] == [("NPU.npu_fusion_attention.0.forward", "PASS"),
                                                       ("NPU.npu_fusion_attention.0.backward", "PASS")]


def test_measured_process_reports_its_own_usage():
    m = _measure_process([sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
                                                "print(sum(range(3_000_000)))"])
    assert m["status"] == 0 and m["stdout"].strip() == str(sum(range(3_000_000)))
    assert m["peak_rss_mb"] >= 200 and m["cpu_s"] > 0


def test_msprobe_cases_skip_only_without_mindstudio_probe():
    import importlib.util

    reason = _skip_reason(_case("bench-msprobe", 1, 16))
    assert (reason is None) == (importlib.util.find_spec("msprobe") is not None)
    assert _skip_reason(_case("bench-attnops", 1, 16)) is None
