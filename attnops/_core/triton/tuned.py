"""Tiles chosen by measurement: each launch's tuning candidates and the tuned table the launchers read.

A launch's candidates (:func:`candidates`) are its family's own tile configurations (the first is the default;
FlashAttention lists its tile class's alternatives) and the default with other warp counts and pipeline depths
(:data:`WARPS`, :data:`STAGES`), which never change a plan's grid or buffers. ``python -m attnops gpu-report --tune``
times them on the GPU and writes a table, ``<gpu>-triton<version>.json`` (:func:`table_name`), into
``attnops/gpu/tuned/`` (``ATTNOPS_TUNED_DIR`` overrides the folder). On CUDA a launch runs with the table's
configuration for its (family, kernel, :func:`bucket`) when the table is the one of this GPU and Triton version and
that configuration is still one of the launch's candidates; else with the default. Tables are read once per process.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TUNED_DIR = Path(__file__).resolve().parents[2] / "gpu" / "tuned"
FORMAT = 1
MAX_WARPS, MAX_STAGES = 8, 4


def signature(config) -> dict:
    """A ``triton.Config`` as the table writes it: tiles, warps, stages."""
    return {"tiles": dict(sorted(config.kwargs.items())), "num_warps": config.num_warps,
            "num_stages": config.num_stages}


def candidates(configs: list) -> list:
    """The tuning candidates of a launch whose family gives ``configs`` (the first is its default): those, then the
    default with twice the warps (at most ``MAX_WARPS``) and one stage less or more (1 to ``MAX_STAGES``), without
    repeats."""
    import triton

    default = configs[0]
    warps = (default.num_warps, min(MAX_WARPS, 2 * default.num_warps))
    stages = (default.num_stages, max(1, default.num_stages - 1), min(MAX_STAGES, default.num_stages + 1))
    variants = [triton.Config(dict(default.kwargs), num_warps=w, num_stages=s, pre_hook=default.pre_hook)
                for w in warps for s in stages]
    unique = {}
    for config in (*configs, *variants):
        unique.setdefault(json.dumps(signature(config), sort_keys=True), config)
    return list(unique.values())


def bucket(launch, configs: list) -> str:
    """The shape class of a launch: its first tensor's dtype, its non-tile constexprs (head-dim tiles, features) and
    its default configuration (the family's own class choice); never sequence lengths."""
    dtype = next((str(a.dtype).removeprefix("torch.") for a in launch.args if isinstance(a, torch.Tensor)), "-")
    constexprs = ",".join(f"{k}={v}" for k, v in sorted(launch.kwargs.items()))
    return f"{dtype}|{constexprs}|{json.dumps(signature(configs[0]), sort_keys=True)}"


def table_name(gpu: str, triton_version: str) -> str:
    """The file name of the table of a GPU (``torch.cuda.get_device_name``) and a Triton version."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{slug}-triton{triton_version}.json"


def tuned_dir() -> Path:
    return Path(os.environ.get("ATTNOPS_TUNED_DIR") or TUNED_DIR)


@functools.cache
def load_table(directory: str, gpu: str, triton_version: str) -> dict:
    """``{(family, kernel, bucket): signature}`` of the table of ``gpu`` and ``triton_version`` in ``directory``;
    empty when there is none or it names another GPU or Triton version."""
    path = Path(directory) / table_name(gpu, triton_version)
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    if table.get("gpu") != gpu or table.get("triton") != triton_version or table.get("format") != FORMAT:
        return {}
    return {(e["family"], e["kernel"], e["bucket"]): e["chosen"] for e in table["entries"]}


@functools.cache
def _device_table(index: int, directory: str) -> dict:
    import triton

    return load_table(directory, torch.cuda.get_device_name(index), triton.__version__)


def choose(family: str, launch, configs: list, device: torch.device):
    """The configuration ``launch`` runs with on ``device``: the tuned table's, else ``configs[0]``."""
    if device.type != "cuda":
        return configs[0]
    table = _device_table(device.index if device.index is not None else torch.cuda.current_device(),
                          str(tuned_dir()))
    if not table:
        return configs[0]
    chosen = table.get((family, launch.kernel, bucket(launch, configs)))
    if chosen is None:
        return configs[0]
    return next((c for c in candidates(configs) if signature(c) == chosen), configs[0])
