"""Make real msprobe dumps on the CPU through attnops' torch_npu shim (needs mindstudio-probe).

    python tests/msprobe/make_dumps.py OUT_DIR

writes three dump roots: ``OUT_DIR/correct`` (FlashAttention forward+backward in fp16 and bf16, a
FusedInferAttention decode call and an NSA selected attention forward+backward, results as the shim computed
them), ``OUT_DIR/corrupt`` (four FlashAttention forwards whose dumped output is replaced by a wrong
computation: one mask row flipped, the scale dropped, sparse mode 1 run instead of 0, and QK^T overflowing in
fp16) and ``OUT_DIR/statistics`` (a statistics-only dump).
The committed fixtures in tests/msprobe/data were made by this script.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import attnops.torch_npu

attnops.torch_npu.install()  # before msprobe is imported: msprobe then takes the NPU path and hooks torch_npu
import torch_npu  # noqa: E402  (attnops' shim)
from msprobe.pytorch import PrecisionDebugger  # noqa: E402

APIS = ["npu_fusion_attention", "npu_fused_infer_attention_score", "npu_nsa_select_attention"]
B, S, N, D = 1, 32, 2, 16
SCALE = D ** -0.5


def _inputs(seed: int, dtype=torch.float16, magnitude: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, N, D, generator=g).mul(magnitude).to(dtype).requires_grad_() for _ in range(3))
    return q, k, v


def _causal() -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool).triu(1)


def _debugger(root: Path, task: str) -> PrecisionDebugger:
    config = {"task": task, "dump_path": str(root), "level": "L1",
              task: {"list": APIS, "data_mode": ["all"], **({"summary_mode": "statistics"} if task == "statistics"
                                                              else {})}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(config))
    debugger = PrecisionDebugger(config_path=str(path))
    debugger.register_custom_api(torch_npu, "npu_nsa_select_attention", "NPU")  # not in msprobe's hooked list
    return debugger


def _dump(root: Path, task: str, body) -> Path:
    debugger = _debugger(root, task)
    debugger.start()
    body()
    debugger.stop()
    debugger.step()
    (root / "config.json").unlink()
    (rank,) = (root / "step0").iterdir()
    return rank


def correct_calls():
    for seed, dtype in ((0, torch.float16), (1, torch.bfloat16)):
        q, k, v = _inputs(seed, dtype)
        out = torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=_causal(), scale=SCALE)[0]
        out.float().square().sum().backward()
    q, k, v = (x.detach() for x in _inputs(2))
    torch_npu.npu_fused_infer_attention_score(q[:, :1], k, v, num_heads=N, input_layout="BSND", scale=SCALE,
                                              softmax_lse_flag=True)
    q, k, v = (x[0].requires_grad_() for x in _inputs(3))  # TND [S, N, D], one sequence, KV heads shared below
    topk = torch.stack([torch.zeros(S, dtype=torch.int32), torch.arange(S, dtype=torch.int32) // 8], -1)
    out = torch_npu.npu_nsa_select_attention(q, k[:, :1], v[:, :1], topk.view(S, 1, 2), SCALE, N, 8, 2,
                                             atten_mask=_causal(), actual_seq_qlen=[S], actual_seq_kvlen=[S])[0]
    out.float().square().sum().backward()


# The wrong computations: (dumped call arguments, the result a broken kernel would give)
def _wrong_mask_row(q, k, v, mask):
    bad = mask.clone()
    bad[S // 2] = ~bad[S // 2]
    bad[S // 2, 0] = False  # keep one key visible
    return torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=bad, scale=SCALE)[0]


def _dropped_scale(q, k, v, mask):
    return torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=mask, scale=1.0)[0]


def _wrong_sparse_mode(q, k, v, mask):  # sparse mode 1 ignores the pre/next-token band of the dumped mode 0
    return torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=mask, scale=SCALE, pre_tockens=4,
                                          next_tockens=0, sparse_mode=1)[0]


def _fp16_overflow(q, k, v, mask):  # QK^T accumulated in fp16: inf scores, NaN rows
    s = torch.einsum("bsnd,btnd->bnst", q, k).masked_fill(mask, float("-inf")) * SCALE
    return torch.einsum("bnst,btnd->bsnd", s.softmax(-1), v)


CORRUPTIONS = (_wrong_mask_row, _dropped_scale, _wrong_sparse_mode, _fp16_overflow)


def corrupt_calls():
    for i, wrong in enumerate(CORRUPTIONS):
        q, k, v = (x.detach() for x in _inputs(10 + i, magnitude=100.0 if wrong is _fp16_overflow else 1.0))
        extra = dict(pre_tockens=4, next_tockens=0) if wrong is _wrong_sparse_mode else {}
        torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=_causal(), scale=SCALE, **extra)


def replace_outputs(rank: Path) -> None:
    """Overwrite output.0 of call i with CORRUPTIONS[i]'s result on the same inputs."""
    for i, wrong in enumerate(CORRUPTIONS):
        prefix = f"NPU.npu_fusion_attention.{i}.forward"
        load = lambda name: torch.load(rank / "dump_tensor_data" / f"{prefix}.{name}.pt")  # noqa: E731
        q, k, v, mask = load("input.0"), load("input.1"), load("input.2"), load("kwargs.atten_mask")
        with torch.no_grad():
            torch.save(wrong(q, k, v, mask).contiguous(), rank / "dump_tensor_data" / f"{prefix}.output.0.pt")


def main(out: Path, kind: str | None = None) -> None:
    """One dump root per process (msprobe's debugger is a process-wide singleton)."""
    if kind is None:
        for name in ("correct", "corrupt", "statistics"):
            subprocess.run([sys.executable, __file__, str(out), name], check=True)
        return
    torch.set_num_threads(1)
    if kind == "corrupt":
        replace_outputs(_dump(out / kind, "tensor", corrupt_calls))
    else:
        _dump(out / kind, kind if kind == "statistics" else "tensor", correct_calls)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
