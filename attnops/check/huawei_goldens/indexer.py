"""``lightning_indexer`` (LightningIndexerV2) against Huawei's ``GeneralizedLIV2``. A case is the parameter tuple of
ops-transformer's ``test_lightning_indexer_v2_single.py``; the golden module's ``liv2_output_single(params,
is_batch=True)`` makes the inputs (paged keys, offsets) and the golden result, and the operator is called as its
eager branch calls it: ``lightning_indexer_metadata`` first, then ``lightning_indexer`` by keyword.

Judged: ``sparse_values`` (both sorted descending, as Huawei's test sorts the NPU's) with the tolerance rule, and
``sparse_indices`` exactly, except that a row may pick different keys when their scores tie within that tolerance
(the same count of valid entries, values within the bound): a top-k cut is tie-sensitive."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import types
from pathlib import Path

import torch

from ... import cann_ops_transformer as cot
from .verdict import Row, exact, judge

OP = "lightning_indexer"
PARAMSET = "attention/lightning_indexer_v2/tests/pytest/test_lightning_indexer_v2_paramset.py"
FIELDS = ("batch_size", "q_seq", "k_seq", "q_t_size", "k_t_size", "q_head_num", "k_head_num", "head_dim",
          "block_size", "block_num", "qk_dtype", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
          "cmp_residual_k", "output_idx_offset", "layout_q", "layout_k", "topk", "mask_mode", "query_datarange",
          "key_datarange", "weights_datarange", "cmp_ratio", "return_value", "max_seqlen_q")
_BASE = dict(q_t_size=None, k_t_size=None, q_head_num=16, k_head_num=1, head_dim=128, block_size=None,
             block_num=None, qk_dtype="BF16", cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
             cmp_residual_k=None, output_idx_offset=None, layout_q="BSND", layout_k="BSND", mask_mode=3,
             query_datarange=[-10, 10], key_datarange=[-10, 10], weights_datarange=[-1, 1], cmp_ratio=4,
             return_value=1, max_seqlen_q=-1)


def _tnd(cu_q: list[int], cu_k: list[int], **kw) -> dict:
    return dict(layout_q="TND", layout_k="TND", batch_size=len(cu_q) - 1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                q_t_size=cu_q[-1], k_t_size=cu_k[-1], q_seq=max(b - a for a, b in zip(cu_q, cu_q[1:])),
                k_seq=max(b - a for a, b in zip(cu_k, cu_k[1:])), **kw)


CASES = {
    "BSND mask 0 (all keys), top 16 of 40": dict(batch_size=2, q_seq=4, k_seq=40, topk=16, mask_mode=0, cmp_ratio=1),
    "BSND mask 3 r4, residuals, top 8": dict(batch_size=2, q_seq=6, k_seq=20, topk=8, cmp_residual_k=[1, 3]),
    "BSND mask 3 r4, seqused_q / seqused_k, top > valid (-1 padding)": dict(
        batch_size=2, q_seq=7, k_seq=12, topk=16, seqused_q=[7, 3], seqused_k=[12, 5], cmp_residual_k=[2, 0]),
    "BSND mask 3 r1 (causal over keys)": dict(batch_size=1, q_seq=9, k_seq=9, topk=4, cmp_ratio=1),
    "BSND mask 3 r128, rows without keys": dict(batch_size=1, q_seq=5, k_seq=3, topk=4, cmp_ratio=128,
                                               cmp_residual_k=[2]),
    "TND mask 3 r4": _tnd([0, 5, 13], [0, 9, 20], topk=8, cmp_residual_k=[3, 1]),
    "TND mask 0, seqused_q < segment": _tnd([0, 6, 10], [0, 30, 50], topk=12, mask_mode=0, cmp_ratio=1,
                                            seqused_q=[4, 4]),
    "BSND/PA_BBND mask 3 r4, block 16": dict(
        batch_size=2, q_seq=4, k_seq=50, layout_k="PA_BBND", seqused_k=[50, 21], block_size=16, block_num=6,
        topk=16, cmp_residual_k=[0, 2]),
    "TND/PA_BBND mask 0": dict(**{k: v for k, v in _tnd([0, 3, 5], [0, 1, 2], topk=32, mask_mode=0,
                                                       cmp_ratio=1).items() if k not in ("layout_k", "cu_seqlens_k")},
                               layout_k="PA_BBND", seqused_k=[40, 70], block_size=16, block_num=8),
    "BSND mask 3 r4, output_idx_offset": dict(batch_size=2, q_seq=4, k_seq=24, topk=8, cmp_residual_k=[2, 2],
                                              output_idx_offset="[1, 1000]"),
    "BSND fp16, 64 heads, ops-transformer's data ranges": dict(
        batch_size=1, q_seq=3, k_seq=64, q_head_num=64, topk=32, qk_dtype="FP16", cmp_residual_k=[1],
        query_datarange=[-448, 448], key_datarange=[-20, 20], weights_datarange=[-123, 123]),
}


def ops_transformer_cases(checkout: Path) -> dict[str, dict]:
    """ops-transformer's parameter sets (each list holds one value), named ``ot/<key>``. The paramset module reads
    ``torch.npu.get_device_properties()`` at import (the shim answers)."""
    spec = importlib.util.spec_from_file_location("huawei_liv2_paramset", checkout / PARAMSET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    def value(v):
        return {torch.float16: "FP16", torch.bfloat16: "BF16"}[v] if isinstance(v, torch.dtype) else v
    return {f"ot/{key}": {name: value(values[0]) for name, values in params.items()}
            for key, params in module.TEST_PARAMS.items()}


def _max_seqlen_k(d: dict, p: dict) -> int:
    """The longest key sequence. Huawei's harness derives ``max_seqlen_k`` of TND keys without ``seqused_k`` as
    ``max(cu_seqlens_q[b + 1] - cu_seqlens_k[b])``, mixing query and key offsets, which can understate it (and
    attnops' metadata rejects a hint below the lengths it bounds): the true maximum is passed where it is larger."""
    if d["seqused_k"] is not None:
        true = int(d["seqused_k"].max())
    elif d["cu_seqlens_k"] is not None:
        true = int(d["cu_seqlens_k"].diff().max())
    else:
        true = p["k_seq"]
    return max(int(d["max_seqlen_k_meta"]), true)


def _call(d: dict, p: dict, return_value: int, dtype: torch.dtype | None = None):
    """The op as the golden module's eager branch calls it (``cmp_residual_k`` as the case gives it;
    ``max_seqlen_k`` see :func:`_max_seqlen_k`)."""
    residual = None if p["cmp_residual_k"] is None else torch.tensor(p["cmp_residual_k"], dtype=torch.int32)
    lengths = dict(cu_seqlens_q=d["cu_seqlens_q"], cu_seqlens_k=d["cu_seqlens_k"], seqused_q=d["seqused_q"],
                   seqused_k=d["seqused_k"], cmp_residual_k=residual)
    metadata = cot.lightning_indexer_metadata(
        num_heads_q=p["q_head_num"], num_heads_k=p["k_head_num"], head_dim=p["head_dim"], topk=d["topk"], **lengths,
        batch_size=p["batch_size"], max_seqlen_q=d["max_seqlen_q"], max_seqlen_k=_max_seqlen_k(d, p),
        layout_q=d["layout_query"], layout_k=d["layout_key"], mask_mode=d["mask_mode"], cmp_ratio=d["cmp_ratio"])

    def cast(t):
        return t if dtype is None else t.to(dtype)
    return cot.lightning_indexer(
        cast(d["query"]), cast(d["key"]), cast(d["weights"]), **lengths, block_table=d["block_table"],
        output_idx_offset=d["output_idx_offset"], metadata=metadata, topk=d["topk"], max_seqlen_q=d["max_seqlen_q"],
        layout_q=d["layout_query"], layout_k=d["layout_key"], mask_mode=d["mask_mode"], cmp_ratio=d["cmp_ratio"],
        return_value=return_value)


def _sorted(values: torch.Tensor) -> torch.Tensor:
    return values.sort(dim=-1, descending=True).values


def run_case(golden: types.ModuleType, name: str, params: dict) -> list[Row]:
    p = {**_BASE, **params}
    with contextlib.redirect_stdout(io.StringIO()):
        d = golden.liv2_output_single(tuple(p[f] for f in FIELDS), is_batch=True)
    idx, _ = _call(d, p, p["return_value"])
    _, vals = _call(d, p, 1)
    _, vals64 = _call(d, p, 1, torch.float64)
    a_vals, h_vals = _sorted(vals), _sorted(d["cpu_topk_value"].to(vals.dtype))
    values = judge(OP, name, "sparse_values", a_vals, h_vals, _sorted(vals64), reduction=p["q_head_num"] + p["head_dim"])
    a_idx, h_idx = idx.reshape(-1, idx.shape[-1]), d["cpu_result"].reshape(-1, idx.shape[-1])
    a_v, h_v = a_vals.reshape(a_idx.shape), h_vals.reshape(h_idx.shape)
    differ = [i for i in range(a_idx.shape[0]) if set(a_idx[i].tolist()) != set(h_idx[i].tolist())]
    ties = [i for i in differ if (a_idx[i] >= 0).sum() == (h_idx[i] >= 0).sum()
            and float(torch.where(a_v[i] == h_v[i], 0.0, (a_v[i] - h_v[i]).abs()).max()) <= values.bound_attnops]
    notes = [f"{len(ties)} of {a_idx.shape[0]} rows pick different keys whose scores tie within the bound"] if ties \
        else []
    if _max_seqlen_k(d, p) != int(d["max_seqlen_k_meta"]):
        notes.append(f"Huawei's harness passes max_seqlen_k={int(d['max_seqlen_k_meta'])}, below the key lengths; "
                     f"{_max_seqlen_k(d, p)} passed")
    note = "; ".join(notes)
    rows = [exact(OP, name, "sparse_indices", len(differ) - len(ties), note)]
    return rows + [values] if p["return_value"] else rows
