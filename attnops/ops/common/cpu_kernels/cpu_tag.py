"""The CPU tag in the kernel's cache key: the instruction-set features a ``-march=native`` build may use, so a
library built on one machine is never loaded on another that lacks one of them (an illegal instruction).

The tag reads ``machine named-features #digest``: the features that matter for the kernel by name (AVX2, AVX-512,
SVE, ...) and a digest of every feature the CPU reports (x86 ``flags``; aarch64 ``Features`` and the cores'
``CPU implementer``/``CPU part``, which ``-mcpu=native`` tunes and targets by; macOS ``sysctl`` ``machdep.cpu`` and
``hw.optional``), so two CPUs that differ in any feature get different tags.
"""
from __future__ import annotations

import hashlib
import platform
import subprocess
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NAMED = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16",
         "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile",  # x86
         "asimd", "asimdhp", "fphp", "asimddp", "dotprod", "fp16", "bf16", "i8mm", "sve", "sve2", "svebf16", "sme")
_SYSCTL_KEYS = ("machdep.cpu.features", "machdep.cpu.leaf7_features", "machdep.cpu.brand_string")


def cpu_tag(cpuinfo: Path = CPUINFO, sysctl: str | None = None, machine: str | None = None) -> str:
    """The tag of this CPU (see the module docstring); ``cpuinfo`` and ``sysctl`` (the text of
    ``sysctl machdep.cpu hw.optional``, read on macOS when None) stand in for the machine's own."""
    machine = machine or platform.machine()
    if sysctl is None and platform.system() == "Darwin":
        sysctl = _run_sysctl()
    features = _sysctl_features(sysctl) if sysctl is not None else _cpuinfo_features(cpuinfo)
    if not features:
        features = {platform.processor() or "unknown"}
    named = "+".join(name for name in NAMED if name in features) or "baseline"
    digest = hashlib.sha256(" ".join(sorted(features)).encode()).hexdigest()[:8]
    return f"{machine} {named} #{digest}"


def _cpuinfo_features(cpuinfo: Path) -> set[str]:
    """Every feature word of every core in a ``/proc/cpuinfo`` text, and ``implementer=0x41``-style words for the
    core models; empty when it cannot be read."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return set()
    features = set()
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features"):
            features.update(value.split())
        elif key in ("CPU implementer", "CPU part"):
            features.add(f"{key.split()[-1]}={value.strip()}")
    return features


def _sysctl_features(text: str) -> set[str]:
    """The features in ``sysctl machdep.cpu hw.optional`` output: x86 feature words (lower case), Apple's
    ``hw.optional.arm.FEAT_X: 1`` as ``x`` and other ``hw.optional.x: 1`` as ``x``, and the brand string."""
    features = set()
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in _SYSCTL_KEYS[:2]:
            features.update(word.lower().replace(".", "_") for word in value.split())
        elif key == _SYSCTL_KEYS[2]:
            features.add(f"brand={value}")
        elif key.startswith("hw.optional.") and value == "1":
            features.add(key.rpartition(".")[2].lower().removeprefix("feat_"))
    return features


def _run_sysctl() -> str | None:
    try:
        done = subprocess.run(["sysctl", "machdep.cpu", "hw.optional"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout or None
