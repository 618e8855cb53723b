"""Hopper fast-path rules checked on ``python -m attnops aot --json`` records (``--check``): which kernels must use
wgmma, which must load K/V with 16-byte vectors, and that no default configuration spills. A rule applies to the
default configuration (the one the launcher runs) of fp16/bf16 cases only: fp32 products take the tf32/FMA paths
and are outside the targets. Kernel names are ``fnmatch`` patterns per operator.

An AOT case compiles its launches for every target, but the FlashAttention backward has a form per target (the
single dK/dV/dQ pass from sm_90 on, the dK/dV pass beside a dQ kernel before: the ``-dq-kernel`` cases): a record of
the form a target never runs (:func:`launched`) is outside every rule."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Callable

HALF_DTYPES = ("fp16", "bf16")


@dataclass(frozen=True)
class Rule:
    name: str
    targets: tuple[str, ...]
    kernels: dict  # operator -> kernel name patterns
    holds: Callable[[dict], bool]
    expected: str
    exempt: tuple = ()  # (operator, case substring, kernel pattern, reason): what a rule does not cover, and why

    def applies(self, record: dict) -> bool:
        if record["target"] not in self.targets or not record["default"] or not launched(record):
            return False
        if not any(dtype in record["case"] for dtype in HALF_DTYPES):
            return False
        if not any(fnmatch(record["kernel"], p) for p in self.kernels.get(record["operator"], ())):
            return False
        return not any(op == record["operator"] and text in record["case"] and fnmatch(record["kernel"], kernel)
                       for op, text, kernel, _ in self.exempt)


def launched(record: dict) -> bool:
    """Whether the launcher runs this compiled launch on the record's target: False for the FlashAttention
    backward's form of the other architecture (``launch.dq_in_pass``)."""
    if record["operator"] != "flash_attention" or record["kernel"] not in ("dq_kernel", "dkdv_kernel"):
        return True
    return ("-dq-kernel" in record["case"]) == (record["target"] == "sm_80")


RULES = (
    Rule("tensor cores", ("sm_90",),
         {"flash_attention": ("fwd_kernel", "dq_kernel", "dkdv_kernel"),
          "nsa": ("fwd_kernel", "importance_kernel", "selected_dkdv_kernel"),
          "dsv4-compressor": ("compressor_project_kernel",), "dsv4-indexer-v2": ("indexer_v2_kernel",),
          "dsv4": ("sparse_flash_mla_kernel", "sparse_flash_mla_split_kernel"),
          "dsa": ("sparse_attention_dq_kernel", "sparse_attention_dkdv_kernel")},
         lambda r: r["ptx"]["mma_sync"] == 0 and r["ptx"]["wgmma"] > 0, "wgmma > 0 and mma.sync = 0",
         exempt=(("flash_attention", "d256", "*", "D=Dv=256: 64-key backward blocks and 64-row forward tiles with "
                  "every feature spill; the backward takes 32x32 tiles, that forward 32x16"),
                 ("flash_attention", "d192-dv128", "dkdv_kernel",
                  "D=192/Dv=128: 64-key backward blocks spill (4-10 words; 118 with every feature), the pass takes "
                  "32x32 tiles (16x16 with features)"))),
    Rule("vector loads", ("sm_90", "sm_80"),
         {"fused_infer_attention": ("split_kernel",), "nsa": ("selected_*", "compress_*"),
          "dsv4": ("sparse_flash_mla_kernel", "sparse_flash_mla_split_kernel")},
         lambda r: r["ptx"]["ld_global_narrow"] == 0, "no scalar global loads of 2 bytes or fewer"),
    Rule("no spills", ("sm_90", "sm_80"),
         {**{op: ("*",) for op in ("flash_attention", "fused_infer_attention", "nsa", "torch_npu", "dsv4-compressor",
                                   "dsv4-indexer-v2")}, "dsv4": ("sparse_flash_mla_*",),
          "dsa": ("sparse_attention_d*",)},
         lambda r: r["spills"] == 0, "0 words of local memory",
         exempt=(("dsv4-indexer-v2", "paged-top1024-", "indexer_v2_kernel",
                  "sm_80 only (none on sm_90): 4 words with a 1024-wide top-k through a block table under sm_80's "
                  "128-register cap at 8 warps, as the DSA indexer's"),
                 ("dsa", "backward", "sparse_attention_dq_kernel",
                  "sm_80 only (none on sm_90): 62 words for 16-bit inputs, the 64 x 256 fp32 dQ accumulator beside "
                  "mma.sync's register operands; the tiles are sm_90's (wgmma)"))),
)


def violations(records: list[dict], rules: tuple[Rule, ...] = RULES) -> list[str]:
    """One line per (rule, record) that breaks a rule: where, what was expected and what the compiler produced."""
    found = []
    for rule in rules:
        for r in records:
            if rule.applies(r) and not rule.holds(r):
                tiles = " ".join(f"{k}={v}" for k, v in sorted(r["tiles"].items()))
                found.append(f"{rule.name}: {r['operator']}/{r['case']} {r['kernel']} on {r['target']} [{tiles} "
                             f"warps={r['warps']}]: expected {rule.expected}, got wgmma={r['ptx']['wgmma']} "
                             f"mma.sync={r['ptx']['mma_sync']} narrow loads={r['ptx']['ld_global_narrow']} "
                             f"spills={r['spills']}")
    return found
