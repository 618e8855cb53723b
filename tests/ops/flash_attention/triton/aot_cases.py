"""Compile the Triton FlashAttention launches of one problem for a GPU target (``attnops._core.triton.aot``) and
print the result as JSON: run as ``python -m tests.ops.flash_attention.triton.aot_cases ARCH CASE_JSON`` in a process
without ``TRITON_INTERPRET`` (``test_gpu_compile.py`` starts it; the test process runs the interpreter).

A case names a dtype, head dims and features; the problem is built with ``build_problem`` on small CPU tensors
and the launches come from the launchers' own plans (``launch.forward_plan`` / ``backward_plan``), so the
compiled signatures are those of the real call sites.
"""
import dataclasses
import json
import sys

import torch

from attnops._core.dropout import pack_bits
from attnops.ops.common.problem import build_problem
from attnops._core.triton.aot import compile_launch
from attnops.ops.common.triton import autotune, launch
from tests.helpers import PREFIX3072, TRIU2048, cum, make_qkv, random_keep

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FEATURES = ("causal", "explicit", "band", "prefix", "tnd", "device", "pse_full0", "pse_full1", "pse_row", "alibi",
            "slopes2", "slopes3", "drop_seed", "drop_packed", "mha")


def _inputs(case: dict):
    """``(query, key, value, dy, build_problem kwargs)`` of a case (tiny shapes: only the signature matters)."""
    feats, dtype, d, dv = set(case["features"]), DTYPES[case["dtype"]], case["d"], case["dv"]
    n1, n2 = (4, 4) if "mha" in feats else (4, 2)
    kw = dict(head_num=n1, scale=d ** -0.5)
    if "tnd" in feats:
        q_lens = kv_lens = [17, 40]  # Sq == Skv per batch, as in-kernel ALiBi (slopes) requires
        q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, d=d, dv=dv, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype)
        kw.update(layout="TND", softmax_layout="TND")
        if "device" in feats:  # cu_seqlens tensors: the prepare and tail kernels too
            cu = torch.tensor([0] + cum(q_lens), dtype=torch.int32)
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens))
        else:
            kw.update(actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))
        b, sq, skv = 2, 40, 40
    else:
        b, sq = 2, 1100 if "alibi" in feats else 40
        skv = sq
        q, k, v, dy = make_qkv("BNSD", b=b, n1=n1, n2=n2, sq=sq, skv=skv, d=d, dv=dv, dtype=dtype)
        kw.update(layout="BNSD")
    if "causal" in feats or "alibi" in feats:  # the compressed ALiBi pse needs a causal mask
        kw.update(atten_mask=TRIU2048, sparse_mode=3)
    if "band" in feats:
        kw.update(atten_mask=TRIU2048, sparse_mode=4, pre_tokens=9, next_tokens=2)
    if "prefix" in feats:
        kw.update(atten_mask=PREFIX3072, sparse_mode=6, prefix=[14] * b)
    if "explicit" in feats:
        kw.update(atten_mask=random_keep(b * n1 * sq * skv, 0.3).reshape(b, n1, sq, skv), sparse_mode=0)
    for name, pse_type, rows in (("pse_full0", 0, sq), ("pse_full1", 1, sq), ("pse_row", 1, 1),
                                 ("alibi", 1, 1024)):
        if name in feats:
            kw.update(pse=torch.randn(1, n1, rows, skv, dtype=dtype), pse_type=pse_type)
    for name, pse_type in (("slopes2", 2), ("slopes3", 3)):
        if name in feats:
            kw.update(pse=torch.rand(b, n1), pse_type=pse_type, q_start_idx=3, kv_start_idx=1)
    if "drop_seed" in feats:
        kw.update(keep_prob=0.9, seed=2**40 + 77, offset=2**33 + 5)
    if "drop_packed" in feats:
        kw.update(keep_prob=0.9, drop_mask=pack_bits(random_keep(n1 * b * sq * skv, 0.9)))
    return q, k, v, dy, kw


def launches(case: dict, arch: int = 90) -> list:
    """The forward launch and the backward launches of a case, in the backward's form for ``sm_<arch>`` (the dQ
    kernel beside the dK/dV pass before sm_90: ``launch.dq_in_pass``)."""
    q, k, v, dy, kw = _inputs(case)
    p = build_problem(q, k, v, **kw)
    (out, smax, ssum), fwd = launch.forward_plan(p, q, k, v, interpret=False)
    _, bwd = launch.backward_plan(p, q, k, v, dy, out, smax, ssum, interpret=False, fused=arch >= 90)
    return fwd + bwd


def compile_case(arch: int, case: dict) -> dict:
    """``{kernel: [variant dicts] or error text}`` for every launch of the case compiled for ``sm_<arch>``."""
    result = {}
    for item in launches(case, arch):
        try:
            result[item.kernel] = [dataclasses.asdict(v) for v in compile_launch(autotune.KERNELS.aot_launch(item), ("cuda", arch, 32))]
        except Exception as e:  # the report names the failure; the test fails on it
            result[item.kernel] = f"{type(e).__name__}: {e}"
    return result


if __name__ == "__main__":
    print(json.dumps(compile_case(int(sys.argv[1]), json.loads(sys.argv[2]))))
