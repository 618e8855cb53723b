"""Hopper fast-path rules checked on ``python -m attnops aot --json`` records (``--check``): which kernels must use
wgmma, which must load K/V with 16-byte vectors, and that no default configuration spills. A rule applies to the
default configuration (the one the launcher runs) of the records it names: its targets, its dtypes (the tensor-core
and vector-load rules cover fp16/bf16 cases only, fp32 products take the tf32/FMA paths; no spills covers every
dtype) and its kernels (``fnmatch`` patterns per operator pattern), less its exemptions, each with its reason
(listed in ``docs/performance.md``). Records exist only where the launcher runs a kernel: the registry marks the
launches of one target (``KernelLaunch.targets``), e.g. the FlashAttention backward's form before sm_90."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Callable

HALF_DTYPES = ("fp16", "bf16")


@dataclass(frozen=True)
class Rule:
    name: str
    targets: tuple[str, ...]
    dtypes: tuple[str, ...] | None  # case-name dtypes the rule covers (None: every case)
    kernels: dict  # operator pattern -> kernel name patterns
    holds: Callable[[dict], bool]
    expected: str
    exempt: tuple = ()  # (operator, case substring, kernel pattern, targets, reason): what a rule does not cover, why

    def applies(self, record: dict) -> bool:
        if record["target"] not in self.targets or not record["default"]:
            return False
        if self.dtypes is not None and not any(dtype in record["case"] for dtype in self.dtypes):
            return False
        if not any(fnmatch(record["operator"], op) and any(fnmatch(record["kernel"], p) for p in patterns)
                   for op, patterns in self.kernels.items()):
            return False
        return not any(op == record["operator"] and text in record["case"] and fnmatch(record["kernel"], kernel)
                       and record["target"] in targets for op, text, kernel, targets, _ in self.exempt)


RULES = (
    Rule("tensor cores", ("sm_90",), HALF_DTYPES,
         {"flash_attention": ("fwd_kernel", "dq_kernel", "dkdv_kernel"),
          "nsa": ("fwd_kernel", "importance_kernel", "selected_dkdv_kernel"),
          "dsa": ("sparse_attention_kernel", "indexer_topk_kernel", "sparse_attention_dq_kernel",
                  "sparse_attention_dkdv_kernel"),
          "dsv4-compressor": ("compressor_project_kernel",), "dsv4-indexer-v2": ("indexer_v2_kernel",),
          "dsv4": ("sparse_flash_mla_kernel", "sparse_flash_mla_split_kernel")},
         lambda r: r["ptx"]["mma_sync"] == 0 and r["ptx"]["wgmma"] > 0, "wgmma > 0 and mma.sync = 0",
         exempt=(("flash_attention", "d256-mask-pse-dropout", "*", ("sm_90",),
                  "D=Dv=256 with every per-element feature: 64-row forward tiles spill 8 words and 64-key backward "
                  "blocks 14-82 with the head dim split in two, 20-60 in four (Triton 3.9 or 3.6); the forward "
                  "takes 32x16 tiles, the backward 16x16"),
                 ("flash_attention", "d192-dv128-mask-pse-dropout", "dkdv_kernel", ("sm_90",),
                  "D=192/Dv=128 with every per-element feature: 64-key backward blocks spill (118 words; 4-44 with "
                  "the head dim split in two), the pass takes 16x16 tiles"))),
    Rule("vector loads", ("sm_90", "sm_80"), HALF_DTYPES,
         {"fused_infer_attention": ("split_kernel",), "nsa": ("selected_*", "compress_*"),
          "dsv4": ("sparse_flash_mla_kernel", "sparse_flash_mla_split_kernel")},
         lambda r: r["ptx"]["ld_global_narrow"] == 0, "no scalar global loads of 2 bytes or fewer"),
    Rule("no spills", ("sm_90", "sm_80"), None, {"*": ("*",)},
         lambda r: r["spills"] == 0, "0 words of local memory",
         exempt=(*(("flash_attention", f"{dtype}-d128-mask-pse-dropout", "dkdv_kernel", ("sm_90",),
                    "4 words with Triton 3.9 (none with 3.6, one stage): the 16x64 wgmma tiles with an explicit mask, "
                    "a pse and dropout at 255 registers; one, three or four stages spill 6-20, 4 or 16 warps and "
                    "32-row steps 78-140, and the spill-free 16x32 tiles are mma.sync") for dtype in HALF_DTYPES),
                 ("dsv4-indexer-v2", "paged-top1024-", "indexer_v2_kernel", ("sm_80",),
                  "4 words with a 1024-wide top-k through a block table under sm_80's "
                  "128-register cap at 8 warps, as the DSA indexer's"),
                 ("dsv4-indexer-v2", "paged-top512-fp32", "indexer_v2_kernel", ("sm_80",),
                  "2 words (Triton 3.9) under the same cap; 1 stage, 4 or 16 warps spill 2-4 words in other fp32 "
                  "cases"),
                 ("nsa", "-d192-", "selected_dkdv_kernel", ("sm_80",),
                  "6-12 words for 16-bit inputs with Triton 3.6 (none with 3.9): 64-key blocks (wgmma's M on sm_90) "
                  "beside mma.sync's register operands; 32-key blocks compile spill-free there but would give up "
                  "wgmma on sm_90"),
                 ("dsa", "indexer-", "indexer_topk_kernel", ("sm_80",),
                  "2-6 words with a 2048-wide top-k under sm_80's 128-register cap (16-bit inputs at 8 warps, its one "
                  "configuration: 4 warps would spill on sm_90 instead; fp32 at 16 warps, paged)"),
                 ("dsa", "backward", "sparse_attention_dq_kernel", ("sm_80",),
                  "62 words for 16-bit inputs, the 64 x 256 fp32 dQ accumulator beside mma.sync's register operands; "
                  "the tiles are sm_90's (wgmma)"))),
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
