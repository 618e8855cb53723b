"""Results: environment metadata, the JSON file and an optional PNG plot (when matplotlib is installed)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def _git(*args: str) -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    else:
        info["name"] = f"{info['cpu_model']} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)"
    return info


def environment(device: torch.device) -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        import attnops
        version = attnops.__version__
    except Exception:  # noqa: BLE001 - metadata only
        version = None
    return {
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device_info(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "attnops": version,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "argv": sys.argv,
    }


def write_json(result: dict, out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


class PlotSkipped(Exception):
    """Why no PNG was written (the plot is optional)."""


def write_plot(result: dict, out_dir: Path, stem: str) -> Path:
    """Bar chart of the median time of every implementation per case (min-max whiskers); raises
    :class:`PlotSkipped` without matplotlib or without any timed implementation."""
    try:
        import matplotlib
    except ImportError:
        raise PlotSkipped("matplotlib is not installed; pip install matplotlib (or the [bench] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    impls = sorted({name for c in cases for name, r in c["results"].items() if r.get("status") == "ok"})
    if not impls:
        raise PlotSkipped("no implementation ran")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4.5))
    width = 0.8 / len(impls)
    for i, name in enumerate(impls):
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(cases):
            r = c["results"].get(name, {})
            if r.get("status") == "ok":
                xs.append(j + i * width)
                ys.append(r["median_s"])
                lo.append(r["median_s"] - r["min_s"])
                hi.append(r["max_s"] - r["median_s"])
        ax.bar(xs, ys, width, yerr=[lo, hi], label=name, capsize=2)
    ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels([c["case"]["name"] for c in cases], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(f"{result['suite']} on {result['environment']['device'].get('name', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
