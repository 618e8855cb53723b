"""Make real msprobe dumps on the CPU through attnops' torch_npu shim (needs mindstudio-probe).

    python tests/msprobe/make_dumps.py OUT_DIR

writes five dump roots: ``OUT_DIR/correct`` (FlashAttention forward+backward in fp16 and bf16, a
FusedInferAttention decode call and an NSA selected attention forward+backward, results as the shim computed
them), ``OUT_DIR/corrupt`` (four FlashAttention forwards whose dumped output is replaced by a wrong
computation: one mask row flipped, the scale dropped, sparse mode 1 run instead of 0, and QK^T overflowing in
fp16), ``OUT_DIR/statistics`` (a statistics-only dump), ``OUT_DIR/correct_more`` (an FIA v2 prefill, NSA
compression and compressed attention forward+backward, and the two NSA decoding operators) and
``OUT_DIR/corrupt_more`` (FIA v2 and NSA calls whose dumped output is a wrong computation's, see
:data:`MORE_CORRUPTIONS`).
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
# not in msprobe's hooked list: registered with register_custom_api
CUSTOM_APIS = ["npu_nsa_select_attention", "npu_nsa_compress", "npu_nsa_compress_attention",
               "npu_nsa_select_attention_infer", "npu_nsa_compress_attention_infer"]
MORE_APIS = ["npu_fused_infer_attention_score_v2", *CUSTOM_APIS[1:]]
B, S, N, D = 1, 32, 2, 16
SCALE = D ** -0.5


def _inputs(seed: int, dtype=torch.float16, magnitude: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, N, D, generator=g).mul(magnitude).to(dtype).requires_grad_() for _ in range(3))
    return q, k, v


def _causal() -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool).triu(1)


def _debugger(root: Path, task: str, apis: list[str]) -> PrecisionDebugger:
    config = {"task": task, "dump_path": str(root), "level": "L1",
              task: {"list": apis, "data_mode": ["all"], **({"summary_mode": "statistics"} if task == "statistics"
                                                              else {})}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(config))
    debugger = PrecisionDebugger(config_path=str(path))
    for api in CUSTOM_APIS:
        if api in apis:
            debugger.register_custom_api(torch_npu, api, "NPU")
    return debugger


def _dump(root: Path, task: str, body, apis: list[str] = APIS) -> Path:
    debugger = _debugger(root, task, apis)
    debugger.start()
    body()
    debugger.stop()
    debugger.step()
    (root / "config.json").unlink()
    (rank,) = (root / "step0").iterdir()
    (rank / "stack.json").unlink(missing_ok=True)  # call stacks with this machine's paths
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


# ------------------------------------------------------------------------------- FIA v2, FA v3 and NSA
T, PAGE = 32, 16  # NSA tokens (TND), paged-cache block size


def _tnd(seed: int, heads: tuple[int, ...] = (N, 1, 1), dtype=torch.float16, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, n, D, generator=g).to(dtype).requires_grad_(grad) for n in heads]


def _backward(out: torch.Tensor) -> None:
    out.float().square().sum().backward()


def _fia_v2_prefill(mask=None):
    q, k, v = (x.detach() for x in _inputs(21))
    return torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=N, input_layout="BSND",
                                                        softmax_scale=SCALE, atten_mask=_causal() if mask is None
                                                        else mask, sparse_mode=0)


def _fia_v2_large_scores(wrong: bool = False):  # QK^T overflows fp16 unless accumulated in fp32
    q, k, v = (x.detach() for x in _inputs(22, magnitude=100.0))
    if wrong:
        return _fp16_overflow(q, k, v, torch.zeros(S, S, dtype=torch.bool))
    return torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=N, input_layout="BSND",
                                                        softmax_scale=SCALE)


def _compress(weight_seed: int = 24, grad: bool = False):
    (k,) = _tnd(25, (1,), grad=grad)
    w = torch.rand(8, 1, generator=torch.Generator().manual_seed(weight_seed)).half().requires_grad_(grad)
    return torch_npu.npu_nsa_compress(k, w, 8, 4, actual_seq_len=[T]), (k, w)


def _compress_attention(scale=SCALE, grad: bool = False):
    q, k, v = _tnd(26, (N, 1, 1), grad=grad)
    kc, vc = (k[:7].detach().requires_grad_(grad), v[:7].detach().requires_grad_(grad))
    return torch_npu.npu_nsa_compress_attention(q, kc, vc, scale, N, 8, 4, 8, 2, actual_seq_qlen=[T],
                                                actual_cmp_seq_kvlen=[7], actual_sel_seq_kvlen=[4]), (q, kc, vc)


def _paged_cache(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 1, N, D, generator=g).half()
    k, v = (torch.randn(4, PAGE, D, generator=g).half() for _ in range(2))  # (blocks, page, KV_N*D), KV_N = 1
    return q, k, v, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)


def _select_infer(topk=((0, 3), (1, 2))):
    q, k, v, table = _paged_cache(27)
    topk = torch.tensor(topk, dtype=torch.int32).view(2, 1, 2)
    return torch_npu.npu_nsa_select_attention_infer(q, k, v, topk, SCALE, N, 1, 8, 2, PAGE,
                                                    layout="BSND", block_table=table, actual_seq_kvlen=[32, 20])


def _compress_attention_infer(scale=SCALE):
    q, k, v, table = _paged_cache(28)
    return torch_npu.npu_nsa_compress_attention_infer(q[:, 0], k, v, scale, N, 1, 16, 3, PAGE, 8, 4, layout="TND",
                                                      block_table=table, actual_cmp_seq_kvlen=[30, 19])


def correct_more_calls():  # the grad ops called directly and FA v3 are in the hand-written tests (data size)
    _fia_v2_prefill()
    _backward(_compress(grad=True)[0])
    _backward(_compress_attention(grad=True)[0][0])
    _select_infer()
    _compress_attention_infer()


# entry -> (its call with correct arguments, the same call computed wrongly): the dumped output.0 is the latter's
MORE_CORRUPTIONS = {
    "NPU.npu_fused_infer_attention_score_v2.0.forward": (  # one mask row flipped
        _fia_v2_prefill, lambda: _fia_v2_prefill(_causal().index_fill(0, torch.tensor([S // 2]), False))),
    "NPU.npu_fused_infer_attention_score_v2.1.forward": (_fia_v2_large_scores,  # QK^T in fp16
                                                         lambda: _fia_v2_large_scores(wrong=True)),
    "NPU.npu_nsa_compress.0.forward": (lambda: _compress()[0], lambda: _compress(weight_seed=31)[0]),
    "NPU.npu_nsa_select_attention_infer.0.forward": (_select_infer, lambda: _select_infer(((0, 3), (0, 2)))),
    "NPU.npu_nsa_compress_attention_infer.0.forward": (_compress_attention_infer,
                                                       lambda: _compress_attention_infer(scale=1.0)),
}


def corrupt_more_calls():
    with torch.no_grad():
        for call, _ in MORE_CORRUPTIONS.values():
            call()


def replace_more_outputs(rank: Path) -> None:
    """Overwrite output.0 of each entry of :data:`MORE_CORRUPTIONS` with its wrong computation's result."""
    for entry, (_, wrong) in MORE_CORRUPTIONS.items():
        with torch.no_grad():
            result = wrong()
        first = result if isinstance(result, torch.Tensor) else result[0]
        torch.save(first.contiguous(), rank / "dump_tensor_data" / f"{entry}.output.0.pt")


def main(out: Path, kind: str | None = None) -> None:
    """One dump root per process (msprobe's debugger is a process-wide singleton)."""
    if kind is None:
        for name in ("correct", "corrupt", "statistics", "correct_more", "corrupt_more"):
            subprocess.run([sys.executable, __file__, str(out), name], check=True)
        return
    torch.set_num_threads(1)
    if kind == "corrupt":
        replace_outputs(_dump(out / kind, "tensor", corrupt_calls))
    elif kind == "correct_more":
        _dump(out / kind, "tensor", correct_more_calls, MORE_APIS)
    elif kind == "corrupt_more":
        replace_more_outputs(_dump(out / kind, "tensor", corrupt_more_calls, MORE_APIS))
    else:
        _dump(out / kind, kind if kind == "statistics" else "tensor", correct_calls)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
