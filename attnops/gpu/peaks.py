"""Known peak figures of NVIDIA GPUs (dense bf16 tensor-core TFLOP/s without sparsity, HBM GB/s), from the
vendors' data sheets, looked up by the CUDA device name."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    model: str
    bf16_tflops: float | None
    hbm_gbps: float | None

    def describe(self) -> str:
        fmt = (lambda x, unit: "unknown" if x is None else f"{x:g} {unit}")
        return f"{self.model}: bf16 dense {fmt(self.bf16_tflops, 'TFLOP/s')}, HBM {fmt(self.hbm_gbps, 'GB/s')}"


# (substrings that must all appear in the upper-cased device name, peak); the first match wins, most specific first
KNOWN: tuple[tuple[tuple[str, ...], Peak], ...] = (
    (("H200",), Peak("H200 SXM", 989.0, 4800.0)),
    (("H100", "NVL"), Peak("H100 NVL", 835.0, 3900.0)),
    (("H100", "PCIE"), Peak("H100 PCIe", 756.0, 2000.0)),
    (("H100",), Peak("H100 SXM", 989.0, 3350.0)),
    (("A100", "PCIE", "40GB"), Peak("A100 PCIe 40GB", 312.0, 1555.0)),
    (("A100", "PCIE"), Peak("A100 PCIe 80GB", 312.0, 1935.0)),
    (("A100", "40GB"), Peak("A100 SXM 40GB", 312.0, 1555.0)),
    (("A100",), Peak("A100 SXM 80GB", 312.0, 2039.0)),
)


def peak_for(device_name: str) -> Peak:
    """The peak figures of the device called ``device_name``; "unknown" figures (None) for a GPU not in the table."""
    name = device_name.upper()
    for keys, peak in KNOWN:
        if all(k in name for k in keys):
            return peak
    return Peak(device_name, None, None)
