"""``python -m attnops compare``: msprobe-made dumps (committed fixtures, and a live one when mindstudio-probe is
installed), hand-written dumps with NPU-pickled tensors, exit codes, JSON records and reports."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnops
from attnops.__main__ import main
from attnops.msprobe import judge_path
from attnops.msprobe.dump import DumpFormatError, load_tensor
from attnops.msprobe.metrics import compute_metrics
from attnops.msprobe.report import call_detail, records
from attnops.msprobe.verdict import judge_tensor

from .npu_dump import save_npu_tensor, write_dump

DATA = Path(__file__).parent / "data"
B, S, N, D = 1, 32, 2, 16


def _verdicts(results):
    return {r.call: r.verdict for r in results}


# --------------------------------------------------------------------------------- committed msprobe dumps
def test_msprobe_dump_of_correct_calls_passes(capsys):
    assert main(["compare", str(DATA / "correct")]) == 0
    assert _verdicts(judge_path(DATA / "correct")) == {
        "NPU.npu_fusion_attention.0.forward": "PASS", "NPU.npu_fusion_attention.0.backward": "PASS",
        "NPU.npu_fusion_attention.1.forward": "PASS", "NPU.npu_fusion_attention.1.backward": "PASS",
        "NPU.npu_fused_infer_attention_score.0.forward": "PASS", "NPU.npu_nsa_select_attention.0.forward": "PASS",
        "NPU.npu_nsa_select_attention.0.backward": "PASS"}
    assert "7 calls: 7 PASS, 0 FAIL, 0 SKIP" in capsys.readouterr().out


def test_msprobe_dump_of_corrupted_calls_fails_each_call(capsys):
    """Calls 0-3: one mask row flipped, scale dropped, sparse mode 1 instead of 0, fp16 QK^T overflow."""
    assert main(["compare", str(DATA / "corrupt")]) == 1
    out = capsys.readouterr().out
    for i in range(4):
        assert f"FAIL  step0/proc24766  NPU.npu_fusion_attention.{i}.forward" in out
    assert "inf/NaN positions differ" in out.split("NPU.npu_fusion_attention.3.forward")[1]


def test_statistics_dump_skips_with_the_reason(capsys):
    assert main(["compare", str(DATA / "statistics")]) == 0
    results = judge_path(DATA / "statistics")
    assert len(results) == 7 and {r.verdict for r in results} == {"SKIP"}
    assert all("statistics-level dump" in r.reason for r in results)


def test_filters_and_json_records(tmp_path):
    file = tmp_path / "r.json"
    argv = [str(DATA / "correct"), "--step", "0", "--api", "*fusion_attention.0.backward", "--json", str(file)]
    assert main(["compare", *argv]) == 0
    records = json.loads(file.read_text())
    assert [(r["call"], r["tensor"], r["name"], r["verdict"]) for r in records] == [
        ("NPU.npu_fusion_attention.0.backward", f"output.{i}", name, "PASS")
        for i, name in enumerate(("dq", "dk", "dv"))]
    assert set(records[0]["npu_vs_golden"]) == {"cosine", "max_abs_err", "max_rel_err", "one_thousandth_ratio",
                                                "five_thousandths_ratio", "rmse", "mean_rel_err",
                                                "small_value_err_ratio"}
    assert all(records[0]["ratios"][k] <= limit for k, limit in (("rmse", 1.5), ("mean_rel_err", 1.5)))


def test_reports(tmp_path):
    assert main(["compare", str(DATA / "corrupt"), "--api", "npu_fusion_attention", "--out", str(tmp_path)]) == 1
    md = (tmp_path / "report.md").read_text()
    assert "4 calls: 0 PASS, 4 FAIL, 0 SKIP" in md and "## NPU.npu_fusion_attention.2.forward" in md
    assert "<table" in (tmp_path / "report.html").read_text()
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (len(list(tmp_path.glob("*.png"))) == 4) == has_matplotlib
    assert ("matplotlib is not installed" in md) != has_matplotlib


@pytest.mark.parametrize("argv, message", [
    (["missing-dir"], "does not exist"),
    (["{data}", "--step", "7"], "--step=7"),
    (["{data}", "--rank", "0"], "--rank=0"),
    (["{data}", "--api", "npu_nsa_compress*"], "--api 'npu_nsa_compress*' matches no fused-attention call"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    argv = [a.replace("{data}", str(DATA / "correct")) for a in argv]
    assert main(["compare", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--out", "{file}"], "--out '{file}': expected a directory (existing or to create), got an existing file"),
    (["--json", "{dir}"], "--json '{dir}': expected a file to write, got a directory"),
    (["--json", "{dir}/missing/r.json"], "--json '{dir}/missing/r.json': expected a file in an existing directory, "
                                         "got one in '{dir}/missing'"),
])
def test_unwritable_outputs_exit_2_with_one_line_before_judging(argv, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "report").write_text("")
    fill = {"{file}": str(tmp_path / "report"), "{dir}": str(tmp_path)}
    argv, message = ([_fill(a, fill) for a in argv], _fill(message, fill))
    monkeypatch.setattr("attnops.msprobe.cli.judge_path", lambda *a, **k: pytest.fail("judged before the check"))
    assert main(["compare", str(DATA / "correct"), *argv]) == 2
    assert capsys.readouterr().err == f"attnops compare: {message}\n"


def _fill(text, values):
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def test_a_report_that_cannot_be_written_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "report").write_text("")
    assert main(["compare", str(DATA / "statistics"), "--out", str(tmp_path / "report" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnops compare: cannot write the report: ") and err.count("\n") == 1
    assert str(tmp_path / "report") in err


def test_broken_dump_json_exits_2_naming_the_file(tmp_path, capsys):
    (tmp_path / "dump.json").write_text("{not json")
    assert main(["compare", str(tmp_path)]) == 2
    assert f"{tmp_path / 'dump.json'}: not readable as JSON" in capsys.readouterr().err


# ---------------------------------------------------------------------------- NPU-pickled tensor files
def test_npu_pickled_tensor_loads_without_torch_npu(tmp_path):
    x = torch.randn(3, 5).half()
    save_npu_tensor(x, tmp_path / "x.pt")
    with pytest.raises(Exception, match="torch_npu"):  # what torch.load alone does with such a file
        torch.load(tmp_path / "x.pt", weights_only=True)
    y = load_tensor(tmp_path / "x.pt")
    assert y.dtype == torch.float16 and torch.equal(y, x)


def test_unloadable_tensor_file_is_a_format_error(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"garbage")
    with pytest.raises(DumpFormatError, match="x.pt: not a loadable tensor file"):
        load_tensor(tmp_path / "x.pt")


# ------------------------------------------------------------------------------------ hand-written dumps
def _fa_call(out, dq=None):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, S, N, D, generator=g).half() for _ in range(3))
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    kwargs = dict(atten_mask=mask, scale=D ** -0.5, sparse_mode=0)
    res = attnops.flash_attention(q, k, v, layout="BSND", head_num=N, return_stats=True, precision="npu",
                                  **kwargs)
    fwd = {"input_args": [q, k, v, N, "BSND"], "input_kwargs": kwargs,
           "output": [out(res.out), res.softmax_max, res.softmax_sum, torch.empty(0, dtype=torch.float16), None,
                      None, B * N * S * S]}
    return q, k, v, res, fwd


def test_hand_written_dump_emulated_outputs_pass(tmp_path):
    q, k, v, res, fwd = _fa_call(lambda o: o)
    dy = torch.randn(B, S, N, D, generator=torch.Generator().manual_seed(6)).half()
    grads = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, layout="BSND",
                                             head_num=N, atten_mask=fwd["input_kwargs"]["atten_mask"],
                                             scale=D ** -0.5, precision="npu")
    write_dump(tmp_path / "step0" / "rank0", {
        "NPU.npu_fusion_attention.0.forward": fwd,
        "NPU.npu_fusion_attention.0.backward": {"input": [dy, None, None], "output": [*grads[:3], None]}})
    results = judge_path(tmp_path, rank=0)
    assert _verdicts(results) == {"NPU.npu_fusion_attention.0.forward": "PASS",
                                  "NPU.npu_fusion_attention.0.backward": "PASS"}
    assert all(t.verdict.exact for r in results for t in r.tensors)  # N is E here


def _wrong_row(o):
    o = o.clone()
    o[0, S // 2] += 0.05
    return o


@pytest.mark.parametrize("corrupt, reason", [
    (_wrong_row, "ratio"),
    (lambda o: torch.where(torch.arange(S).view(1, S, 1, 1) == 3, torch.inf, o).half(), "inf/NaN positions"),
    (lambda o: o.float(), "NPU torch.float32"),
    (lambda o: o[:, :-1], "[1, 31, 2, 16] vs emulation"),
])
def test_hand_written_dump_with_a_wrong_output_fails(tmp_path, corrupt, reason):
    *_, fwd = _fa_call(corrupt)
    write_dump(tmp_path, {"NPU.npu_fusion_attention.0.forward": fwd})
    (result,) = judge_path(tmp_path)
    assert result.verdict == "FAIL" and reason in "; ".join(result.tensors[0].verdict.reasons)


def test_hand_written_statistics_dump_skips(tmp_path):
    *_, fwd = _fa_call(lambda o: o)
    write_dump(tmp_path, {"NPU.npu_fusion_attention.0.forward": fwd}, with_data=False)
    (result,) = judge_path(tmp_path)
    assert result.verdict == "SKIP" and "input_args[0]" in result.reason


def _statistics_only(rank_dir, entry, labels):
    """Turn the dumped ``output.<i>`` tensors ``labels`` of ``entry`` into statistics (no data, as msprobe writes)."""
    doc = json.loads((rank_dir / "dump.json").read_text())
    for label in labels:
        del doc["data"][entry]["output"][int(label.split(".")[1])]["data_name"]
    (rank_dir / "dump.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("corrupt, verdict", [(lambda o: o, "PASS"), (_wrong_row, "FAIL")])
def test_outputs_dumped_as_statistics_are_named_and_the_others_judged(tmp_path, corrupt, verdict):
    *_, fwd = _fa_call(corrupt)
    entry = "NPU.npu_fusion_attention.0.forward"
    _statistics_only(write_dump(tmp_path, {entry: fwd}), entry, ["output.1", "output.2"])
    (result,) = judge_path(tmp_path)
    assert result.verdict == verdict
    tensors = {t.tensor: (t.name, t.verdict.verdict) for t in result.tensors}
    assert tensors == {"output.0": ("attention_out", verdict), "output.1": ("softmax_max", "SKIP"),
                       "output.2": ("softmax_sum", "SKIP")}
    detail = call_detail(result)
    for label, name in (("output.1", "softmax_max"), ("output.2", "softmax_sum")):
        assert f"{label} ({name}): not judged: dumped as statistics only" in detail
    skipped = [r for r in records([result]) if r["verdict"] == "SKIP"]
    assert [(r["tensor"], r["name"], r["shape"]) for r in skipped] == [
        ("output.1", "softmax_max", [B, N, S, 8]), ("output.2", "softmax_sum", [B, N, S, 8])]


def test_a_call_with_no_output_tensor_dumped_skips(tmp_path):
    *_, fwd = _fa_call(lambda o: o)
    entry = "NPU.npu_fusion_attention.0.forward"
    _statistics_only(write_dump(tmp_path, {entry: fwd}), entry, ["output.0", "output.1", "output.2"])
    (result,) = judge_path(tmp_path)
    assert result.verdict == "SKIP"
    assert result.reason == f"tensor data not dumped (statistics-level dump): {entry}.output[0] and 2 more"


def test_arguments_attnops_rejects_skip_with_the_error(tmp_path):
    *_, fwd = _fa_call(lambda o: o)
    fwd["input_kwargs"]["sparse_mode"] = 9
    write_dump(tmp_path, {"NPU.npu_fusion_attention.0.forward": fwd})
    (result,) = judge_path(tmp_path)
    assert result.verdict == "SKIP" and "attnops cannot re-run it: " in result.reason and "sparse_mode" in result.reason


def test_dropout_and_unsupported_apis_skip(tmp_path):
    *_, fwd = _fa_call(lambda o: o)
    fwd["input_kwargs"]["keep_prob"] = 0.9
    write_dump(tmp_path, {"NPU.npu_fusion_attention.0.forward": fwd,
                          "NPU.npu_nsa_compress_infer.0.forward": {"input_args": [], "input_kwargs": {}, "output": []}})
    reasons = {r.call: (r.verdict, r.reason) for r in judge_path(tmp_path)}
    assert reasons["NPU.npu_fusion_attention.0.forward"][0] == "SKIP"
    assert "dropout mask" in reasons["NPU.npu_fusion_attention.0.forward"][1]
    assert reasons["NPU.npu_nsa_compress_infer.0.forward"] == (
        "SKIP", "npu_nsa_compress_infer is not re-run: an in-place update of a paged cache, not an attention result")


# ------------------------------------------------------------------------------------------------ metrics
def test_the_bf16_floor_lets_a_ten_percent_row_pass_as_docs_compare_says():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 2, 64, generator=g).bfloat16() for _ in range(3))
    emulated = attnops.flash_attention(q, k, v, layout="BSND", head_num=2, precision="npu")
    golden = attnops.flash_attention(q.double(), k.double(), v.double(), layout="BSND", head_num=2)
    verdicts = {}
    for factor in (1.1, 1.5):
        npu = emulated.clone()
        npu[0, 64] = (npu[0, 64].float() * factor).bfloat16()
        verdicts[factor] = judge_tensor(npu, emulated, golden)
    ten = verdicts[1.1]
    assert ten.verdict == "PASS" and ten.ratios["rmse"] < 0.5
    assert ten.npu.rmse / ten.emulation.rmse > 4  # the un-floored metrics the records carry show it
    assert verdicts[1.5].verdict == "FAIL" and verdicts[1.5].ratios["max_rel_err"] > 5


def test_metrics_follow_msprobes_definitions():
    bench = torch.tensor([1.0, -2.0, 0.0, 2.0 ** -12, 4.0], dtype=torch.float64)
    actual = torch.tensor([1.002, -2.0, 2.0 ** -13, 2.0 ** -12, 4.04], dtype=torch.float64)
    m = compute_metrics(actual, bench, torch.float16)
    err = (actual - bench).abs()
    assert m.max_abs_err == pytest.approx(0.04)
    assert m.rmse == pytest.approx(float(err.square().mean().sqrt()))
    large = bench.abs() > 2.0 ** -10  # 1, -2, 4: relative errors 0.002, 0, 0.01 (eps 2^-10 in the denominator)
    rel = err[large] / (bench[large].abs() + 2.0 ** -10)
    assert m.mean_rel_err == pytest.approx(float(rel.mean())) and m.max_rel_err == pytest.approx(float(rel.max()))
    assert m.small_value_err_ratio == pytest.approx(0.5)  # of the two small values, one is off
    assert m.one_thousandth_ratio == pytest.approx(2 / 5) and m.five_thousandths_ratio == pytest.approx(3 / 5)
    assert m.cosine == pytest.approx(float(actual @ bench / actual.norm() / bench.norm()))


# --------------------------------------------------------------------------------- live msprobe (optional)
@pytest.mark.slow  # ~100 s: five processes import msprobe
@pytest.mark.skipif(importlib.util.find_spec("msprobe") is None,
                    reason="mindstudio-probe is not installed (pip install 'attnops[msprobe]')")
def test_live_msprobe_dump(tmp_path):
    subprocess.run([sys.executable, str(Path(__file__).parent / "make_dumps.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=600)
    for kind in ("correct", "correct_more"):
        assert set(_verdicts(judge_path(tmp_path / kind)).values()) == {"PASS"}
    for kind in ("corrupt", "corrupt_more"):
        assert set(_verdicts(judge_path(tmp_path / kind)).values()) == {"FAIL"}
    assert set(_verdicts(judge_path(tmp_path / "statistics")).values()) == {"SKIP"}
