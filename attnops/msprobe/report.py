"""Reports of judged calls: JSON records (one per compared tensor), a markdown and an HTML report with a summary
and per-call tables, and error histograms (matplotlib, the optional ``bench`` extra: without it the reports say
there is no plot)."""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

import torch

from .judge import CallResult, TensorResult
from .metrics import histogram_edges
from .verdict import RATIO_LIMITS

__all__ = ["records", "write_json", "write_reports", "summary_line", "call_detail"]

_METRICS = ("cosine", "max_abs_err", "max_rel_err", "one_thousandth_ratio", "five_thousandths_ratio", "rmse",
            "mean_rel_err", "small_value_err_ratio")


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _tensor_record(call: CallResult, t: TensorResult) -> dict:
    v = t.verdict
    return {"call": call.call, "where": call.where, "tensor": t.tensor, "name": t.name, "verdict": v.verdict,
            "reasons": v.reasons, "dtype": v.dtype, "shape": list(v.shape), "exact": v.exact,
            "npu_vs_golden": {k: _finite(x) for k, x in (v.npu.as_dict() if v.npu else {}).items()},
            "emulation_vs_golden": {k: _finite(x) for k, x in (v.emulation.as_dict() if v.emulation else {}).items()},
            "ratios": {k: _finite(x) for k, x in v.ratios.items()}, "note": call.note}


def records(results: list[CallResult]) -> list[dict]:
    """One record per compared tensor; a SKIP call gives one record with ``tensor`` null and its ``reason``."""
    out = []
    for r in results:
        if r.verdict == "SKIP":
            out.append({"call": r.call, "where": r.where, "tensor": None, "verdict": "SKIP", "reason": r.reason})
        out.extend(_tensor_record(r, t) for t in r.tensors)
    return out


def write_json(results: list[CallResult], file: str | Path) -> None:
    Path(file).write_text(json.dumps(records(results), indent=1) + "\n")


def summary_line(results: list[CallResult]) -> str:
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "FAIL", "SKIP")}
    return f"{len(results)} calls: " + ", ".join(f"{n} {v}" for v, n in counts.items())


def call_detail(r: CallResult) -> str:
    """A SKIP's reason, or the FAIL reasons of the tensors and the note on how the call was judged."""
    if r.reason:
        return r.reason
    return "; ".join([f"{t.tensor} ({t.name}): {', '.join(t.verdict.reasons)}" for t in r.tensors
                      if t.verdict.reasons] + ([r.note] if r.note else []))


def _table(r: CallResult) -> tuple[list[str], list[list[str]]]:
    head = ["tensor", "dtype", "shape", "verdict", "exact"] + [f"N:{m}" for m in _METRICS] + \
        [f"E:{m}" for m in _METRICS] + [f"ratio:{m} (<= {lim})" for m, lim in RATIO_LIMITS.items()]
    rows = []
    for t in r.tensors:
        v = t.verdict
        npu = v.npu.as_dict() if v.npu else {}
        emu = v.emulation.as_dict() if v.emulation else {}
        rows.append([f"{t.tensor} {t.name}", v.dtype, str(list(v.shape)), v.verdict, "yes" if v.exact else "no"]
                    + [f"{npu[m]:.4g}" if m in npu else "" for m in _METRICS]
                    + [f"{emu[m]:.4g}" if m in emu else "" for m in _METRICS]
                    + [f"{v.ratios[m]:.3g}" if m in v.ratios else "" for m in RATIO_LIMITS])
    return head, rows


def _plot(r: CallResult, file: Path) -> bool:
    """Histogram of log10 |N - G| and |E - G| per tensor (the counts the metrics pass made); False without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tensors = [t for t in r.tensors if t.verdict.histograms and any(h is not None for h in t.verdict.histograms)]
    if not tensors:
        return False
    edges = histogram_edges().log10()
    fig, axes = plt.subplots(1, len(tensors), figsize=(4 * len(tensors), 3), squeeze=False)
    for ax, t in zip(axes[0], tensors):
        hists = [(h, label) for h, label in zip(t.verdict.histograms, ("NPU vs fp64", "emulation vs fp64"))
                 if h is not None]
        used = torch.nonzero(sum(h for h, _ in hists)).flatten()
        lo, hi = int(used[0]), int(used[-1]) + 1  # the bins either series fills
        for counts, label in hists:
            ax.stairs(counts[lo:hi].double().numpy(), edges[lo:hi + 1].numpy(), fill=True, alpha=0.5, label=label)
        ax.set_title(f"{t.tensor} {t.name}: {t.verdict.verdict}", fontsize=9)
        ax.set_xlabel("log10 |error|")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(file, dpi=80)
    plt.close(fig)
    return True


def write_reports(results: list[CallResult], out_dir: str | Path) -> Path:
    """Write ``report.md``, ``report.html`` and one ``<call>.png`` per compared call into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# attnops compare", "", summary_line(results), "",
          "NPU value N and NPU emulation E (attnops, precision=\"npu\") against the float64 golden G; verdict by "
          "msprobe's benchmark standard with ratio = metric(N,G) / max(metric(E,G), minimum_err).", "",
          "| call | where | verdict | reason |", "|---|---|---|---|"]
    md += [f"| {r.call} | {r.where} | {r.verdict} | {call_detail(r)} |" for r in results]
    body = [f"<h1>attnops compare</h1><p>{html.escape(summary_line(results))}</p>"]
    plots_missing = False
    for r in results:
        md += ["", f"## {r.call} ({r.where}): {r.verdict}", ""]
        body.append(f"<h2>{html.escape(r.call)} ({html.escape(r.where)}): {r.verdict}</h2>")
        if r.verdict == "SKIP" or not r.tensors:
            md.append(call_detail(r))
            body.append(f"<p>{html.escape(call_detail(r))}</p>")
            continue
        head, rows = _table(r)
        md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(row) + " |" for row in rows]
        body.append("<table border=1><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
                    + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
                    + "</table>")
        reasons = call_detail(r)
        if reasons:
            md += ["", reasons]
            body.append(f"<p>{html.escape(reasons)}</p>")
        png = f"{r.where.replace('/', '_')}_{r.call}.png"
        if _plot(r, out / png):
            md += ["", f"![errors of {r.call}]({png})"]
            body.append(f'<img src="{html.escape(png)}">')
        else:
            plots_missing = True
    if plots_missing:
        note = "No error histograms: matplotlib is not installed (pip install 'attnops[bench]')."
        md += ["", note]
        body.append(f"<p>{note}</p>")
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "report.html").write_text("<!doctype html><html><head><meta charset='utf-8'><title>attnops compare"
                                     "</title></head><body>" + "\n".join(body) + "</body></html>\n")
    return out / "report.md"
