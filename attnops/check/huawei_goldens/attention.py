"""``sparse_flash_mla`` against Huawei's ``GeneralizedSFA``: each case's inputs and golden output come from the golden
module's own generator ``gen_data(params)`` (random lengths within the case, paged caches, index rows padded with
-1, per-head sinks), and the operator is called as ops-transformer's test does
(``tests/pytest/batch/sparse_flash_mla_process.py``, ``call_npu``): ``sparse_flash_mla_metadata`` first, then
``sparse_flash_mla`` with every argument by keyword. The cases: ops-transformer's own parameter sets
(``sparse_flash_mla_paramset.py``, named ``ot/...``) and :data:`CASES`, one per branch."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import types
from pathlib import Path

import torch

from ... import cann_ops_transformer as cot
from ...testing.compare import attention_reductions
from .verdict import Row, judge

OP = "sparse_flash_mla"
PARAMSET = "attention/sparse_flash_mla/tests/pytest/sparse_flash_mla_paramset.py"
BF16 = torch.bfloat16
_BASE = dict(layout_q="TND", layout_kv="PA_BBND", q_type=BF16, ori_kv_type=BF16, cmp_kv_type=BF16, N1=16, N2=1,
             D=512, block_size1=16, block_size2=16, softmax_scale=0.04419417, ori_mask_mode=4, cmp_mask_mode=3,
             ori_win_left=127, ori_win_right=0, q_datarange=[-10, 10], ori_kv_datarange=[-10, 10],
             cmp_kv_datarange=[-10, 10], ori_kv_topk_mode="no", cmp_kv_topk_mode="no", return_softmax_lse=False)


def _tnd(cu_q, **kw) -> dict:
    return dict(cu_seqlens_q=cu_q, B=len(cu_q) - 1, T1=cu_q[-1], S1=max(b - a for a, b in zip(cu_q, cu_q[1:])), **kw)


def _cmp(ori: list[int], r: int) -> dict:
    """Compressed lengths and residuals of ori lengths (``Lcmp * r + residual == Lori``)."""
    return dict(cmp_ratio=r, seqused_cmp_kv=[n // r for n in ori], cmp_residual_kv=[n % r for n in ori])


# Softer data than the generator's default (keys in [-30, -10] make every softmax nearly one-hot): the generator
# draws kv from [a, b] as uniform [2a - b, a], so [1, 3] gives [-1, 1]; the sinks then weigh in too.
SOFT = dict(q_datarange=[-1, 1], ori_kv_datarange=[1, 3], cmp_kv_datarange=[1, 3])

# one case per branch: SWA only, HCA, CSA; BSND / TND / PA_BBND; seqused; residuals; -1 padding; rows with no key
CASES = {
    "SWA TND/PA, win 127, a batch with Lq > Lori (rows without keys)": _tnd(
        [0, 1, 4, 9], template_mode="SWA", S2=150, seqused_ori_kv=[150, 17, 3], **SOFT),
    "SWA BSND/BSND, band win 7, seqused_q and seqused_ori_kv": dict(
        template_mode="SWA", layout_q="BSND", layout_kv="BSND", B=2, S1=6, S2=40, seqused_q=[6, 4],
        seqused_ori_kv=[40, 25], ori_win_left=7),
    "SWA TND/TND, ori mask 3 (causal), lse": _tnd(
        [0, 5, 8], template_mode="SWA", layout_kv="TND", S2=30, T2=50, cu_seqlens_ori_kv=[0, 30, 50],
        ori_mask_mode=3, return_softmax_lse=True, **SOFT),
    "SWA TND/TND, ori mask 0 (all keys)": _tnd(
        [0, 5, 8], template_mode="SWA", layout_kv="TND", S2=30, T2=50, cu_seqlens_ori_kv=[0, 30, 50],
        ori_mask_mode=0),
    "SWA BSND/PA, ori win -1 (unbounded), lse": dict(
        template_mode="SWA", layout_q="BSND", B=2, S1=3, S2=70, seqused_ori_kv=[70, 33], ori_win_left=-1,
        return_softmax_lse=True),
    "HCA TND/PA r128, residuals": _tnd(
        [0, 3, 5], template_mode="HCA", S2=300, seqused_ori_kv=[300, 260], **_cmp([300, 260], 128), **SOFT),
    "HCA BSND/BSND r4, seqused, residuals, lse": dict(
        template_mode="HCA", layout_q="BSND", layout_kv="BSND", B=2, S1=7, S2=42, seqused_ori_kv=[42, 30],
        return_softmax_lse=True, **_cmp([42, 30], 4)),
    "HCA TND/TND r4, cmp mask 0": _tnd(
        [0, 4, 6], template_mode="HCA", layout_kv="TND", S2=38, T2=60, T3=14, cu_seqlens_ori_kv=[0, 38, 60],
        cu_seqlens_cmp_kv=[0, 9, 14], cmp_mask_mode=0, **_cmp([38, 22], 4)),
    "CSA TND/PA r4 K16, random index counts (-1 padding), win 127": _tnd(
        [0, 6, 7], template_mode="CSA", S2=170, K=16, seqused_ori_kv=[170, 45], cmp_sparse_indices_mode="random",
        **_cmp([170, 45], 4), **SOFT),
    "CSA BSND/BSND r4 K8, seqused_q, lse": dict(
        template_mode="CSA", layout_q="BSND", layout_kv="BSND", B=2, S1=9, S2=50, K=8, seqused_q=[9, 5],
        seqused_ori_kv=[50, 37], return_softmax_lse=True, **_cmp([50, 37], 4), **SOFT),
    "CSA TND/TND r4 K32, seqused_q < segment, seqused kv < segment": _tnd(
        [0, 16], template_mode="CSA", layout_kv="TND", S2=38, T2=38, T3=9, K=32, cu_seqlens_ori_kv=[0, 38],
        cu_seqlens_cmp_kv=[0, 9], seqused_q=[10], seqused_ori_kv=[22], seqused_cmp_kv=[5], cmp_residual_kv=[2],
        cmp_ratio=4),
    "CSA BSND/PA r4 K4, a batch with Lq > Lori": dict(
        template_mode="CSA", layout_q="BSND", B=2, S1=6, S2=64, K=4, seqused_ori_kv=[64, 4], **_cmp([64, 4], 4)),
    **{f"HCA TND/PA r{r}": _tnd([0, 2, 5], template_mode="HCA", S2=3 * r + 5, seqused_ori_kv=[3 * r + 5, 2 * r],
                                **_cmp([3 * r + 5, 2 * r], r)) for r in (1, 2, 8, 16, 32, 64)},
    **{f"CSA TND/PA r{r} K8": _tnd([0, 3, 4], template_mode="CSA", S2=12 * r + 1, K=8,
                                   seqused_ori_kv=[12 * r + 1, 5 * r], **_cmp([12 * r + 1, 5 * r], r))
       for r in (1, 2, 8, 128)},
}


def _with_defaults(params: dict) -> dict:
    """What ops-transformer's ``utils.generate_case_with_default_param`` adds to a case: ``cu_seqlens_q`` of a BSND
    query (full rows; the generator of index rows reads it) and the block counts of a paged one."""
    params = dict(params)
    if params["layout_q"] == "BSND" and params.get("cu_seqlens_q") is None:
        params["cu_seqlens_q"] = [b * params["S1"] for b in range(params["B"] + 1)]
    if params["layout_kv"] == "PA_BBND":
        ori = params["seqused_ori_kv"]
        params["block_num1"] = sum(math.ceil(n / params["block_size1"]) for n in ori)
        r = params.get("cmp_ratio")
        params["block_num2"] = 0 if r is None else sum(math.ceil(n // r / params["block_size2"]) for n in ori)
    return params


def ops_transformer_cases(checkout: Path) -> dict[str, dict]:
    """ops-transformer's parameter sets (each list holds one value), named ``ot/<key>``."""
    spec = importlib.util.spec_from_file_location("huawei_sparse_flash_mla_paramset", checkout / PARAMSET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {f"ot/{key}": {name: values[0] for name, values in params.items()}
            for key, params in module.TEST_PARAMS.items()}


def _call(data: dict, dtype: torch.dtype | None = None):
    """The op as ``call_npu`` calls it; floating inputs in ``dtype`` when given (G)."""
    md, t = data["metadata_input"], data["input"]

    def cast(x):
        return x.to(dtype) if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point() else x

    layout_q = t["layout_q"]
    metadata = cot.sparse_flash_mla_metadata(
        num_heads_q=md["N1"], num_heads_kv=md["N2"], head_dim=md["D"], cu_seqlens_q=t["cu_seqlens_q"],
        cu_seqlens_ori_kv=t["cu_seqlens_ori_kv"], cu_seqlens_cmp_kv=t["cu_seqlens_cmp_kv"],
        seqused_q=t["seqused_q"], seqused_ori_kv=t["seqused_ori_kv"], seqused_cmp_kv=t["seqused_cmp_kv"],
        cmp_residual_kv=t["cmp_residual_kv"], batch_size=md["B"], max_seqlen_q=md["max_seqlen_q"],
        max_seqlen_ori_kv=md["max_seqlen_ori_kv"], max_seqlen_cmp_kv=md["max_seqlen_cmp_kv"], ori_topk=0,
        cmp_topk=md["K"] if t["cmp_sparse_indices"] is not None else 0, cmp_ratio=md["cmp_ratio"] or 1,
        ori_mask_mode=t["ori_mask_mode"], cmp_mask_mode=3 if t["cmp_mask_mode"] is None else t["cmp_mask_mode"],
        ori_win_left=t["ori_win_left"], ori_win_right=t["ori_win_right"], layout_q=layout_q,
        layout_kv=t["layout_kv"], has_ori_kv=t["ori_kv"] is not None, has_cmp_kv=t["cmp_kv"] is not None)
    return cot.sparse_flash_mla(
        cast(t["q"]), ori_kv=cast(t["ori_kv"]), cmp_kv=cast(t["cmp_kv"]), ori_sparse_indices=None,
        cmp_sparse_indices=t["cmp_sparse_indices"], ori_block_table=t["ori_block_table"],
        cmp_block_table=t["cmp_block_table"], cu_seqlens_q=t["cu_seqlens_q"] if layout_q == "TND" else None,
        cu_seqlens_ori_kv=t["cu_seqlens_ori_kv"], cu_seqlens_cmp_kv=t["cu_seqlens_cmp_kv"],
        seqused_q=t["seqused_q"], seqused_ori_kv=t["seqused_ori_kv"], seqused_cmp_kv=t["seqused_cmp_kv"],
        cmp_residual_kv=t["cmp_residual_kv"], ori_topk_length=None, cmp_topk_length=None, sinks=cast(t["sinks"]),
        metadata=metadata, softmax_scale=t["softmax_scale"], cmp_ratio=md["cmp_ratio"] or 1,
        ori_mask_mode=t["ori_mask_mode"], cmp_mask_mode=0 if t["cmp_mask_mode"] is None else t["cmp_mask_mode"],
        ori_win_left=t["ori_win_left"], ori_win_right=t["ori_win_right"], layout_q=layout_q,
        layout_kv=t["layout_kv"], topk_value_mode=1, return_softmax_lse=bool(data["params"]["return_softmax_lse"]))


def _reduction(data: dict) -> int:
    """Terms summed into one output: the head dim, then at most the keys a row sees."""
    md, t = data["metadata_input"], data["input"]
    ori = md["max_seqlen_ori_kv"]
    if t["ori_mask_mode"] == 4 and t["ori_win_left"] >= 0:
        ori = min(ori, t["ori_win_left"] + 1 + t["ori_win_right"])
    cmp = md["max_seqlen_cmp_kv"] if md["K"] is None else min(md["K"], md["max_seqlen_cmp_kv"])
    return attention_reductions(md["D"], md["D"], md["max_seqlen_q"], int(ori) + int(cmp))["out"]


def run_case(golden: types.ModuleType, name: str, params: dict) -> list[Row]:
    """Generate the case with Huawei's ``gen_data``, run attnops (and in float64 for G), judge out and lse."""
    params = _with_defaults({**_BASE, "testcase_name": name, **params})
    with contextlib.redirect_stdout(io.StringIO()):
        data = golden.gen_data(params)
    out, lse = _call(data)
    out64, lse64 = _call(data, torch.float64)
    reduction = _reduction(data)
    rows = [judge(OP, name, "attn_out", out, data["cpu_output"], out64, reduction=reduction)]
    if params["return_softmax_lse"]:
        huawei = data["softmax_lse"]
        if params["layout_q"] == "TND":  # Huawei's [T1, N2, G]; the op's (and the NPU's) [N2, T1, G]
            huawei = huawei.transpose(0, 1)
        rows.append(judge(OP, name, "softmax_lse", lse, huawei, lse64, reduction=reduction))
    return rows
