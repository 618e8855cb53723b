"""``compressor`` against Huawei's ``cpu_compressor``. A case is a parameter set in the vocabulary of
ops-transformer's ``test_compressor_paramset.py``; its inputs are made as ``compressor_operator_single.output_operator``
and ``compressor_golden.run_compressor_eager`` make them (the block table maps only the blocks the call reads or
writes, entry 0 meaning "do not write"; state, x and weights uniform in the case's ranges), and the operator is
called as ``run_compressor_eager`` calls it. Judged: the emitted rows of ``cmp_kv`` (Huawei's mask), the state
slots the call writes (kv and score halves) and, exactly, every slot it must leave alone."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import types
from pathlib import Path

import numpy as np
import torch

from ... import cann_ops_transformer as cot
from .verdict import Row, exact, judge

OP = "compressor"
PARAMSET = "attention/compressor/tests/pytest/test_compressor_paramset.py"
_RANGES = ("x", "wkv", "wgate", "ape", "kv_state", "score_state")
_BASE = dict(hidden_size=1024, block_size=16, cache_mode=1, data_type=torch.bfloat16, cu_seqlens=None, seqused=None,
             start_pos=None, start_p=0, **{f"{n}_datarange": [-10, 10] for n in _RANGES})
_C4A, _C4LI, _C128A = dict(head_dim=512, cmp_ratio=4, coff=2), dict(head_dim=128, cmp_ratio=4, coff=2), \
    dict(head_dim=512, cmp_ratio=128, coff=1)

# Softer data than ops-transformer's [-10, 10] everywhere (gate scores in the thousands make every softmax one-hot)
SOFT = dict(x_datarange=[-1, 1], wkv_datarange=[-0.1, 0.1], wgate_datarange=[-0.1, 0.1], ape_datarange=[-1, 1],
            kv_state_datarange=[-1, 1], score_state_datarange=[-1, 1])

CASES = {
    "C4A TH prefill, 2 batches": dict(**_C4A, layout_x="TH", batch_size=2, Seq_len=37, cu_seqlens=[0, 37, 70]),
    "C4A TH chunked, start_pos 5 / 12 (state read)": dict(
        **_C4A, layout_x="TH", batch_size=2, Seq_len=23, cu_seqlens=[0, 23, 40], start_pos=[5, 12]),
    "C4A TH decode, 3 batches of 1 token": dict(
        **_C4A, layout_x="TH", batch_size=3, Seq_len=1, cu_seqlens=[0, 1, 2, 3], start_pos=[7, 20, 3]),
    "C4A BSH, seqused, start_pos": dict(
        **_C4A, layout_x="BSH", batch_size=2, Seq_len=11, seqused=[11, 6], start_pos=[1, 8]),
    "C4Li BSH, seqused, start_pos": dict(
        **_C4LI, layout_x="BSH", batch_size=2, Seq_len=9, seqused=[9, 6], start_pos=[2, 0]),
    "C4Li TH MTP decode (3 tokens per batch)": dict(
        **_C4LI, layout_x="TH", batch_size=3, Seq_len=3, start_pos=[13, 4, 30]),
    "C128A TH prefill": dict(**_C128A, layout_x="TH", batch_size=1, Seq_len=300, block_size=128),
    "C128A TH decode, 3 batches of 1 token": dict(
        **_C128A, layout_x="TH", batch_size=3, Seq_len=1, cu_seqlens=[0, 1, 2, 3], start_pos=[255, 127, 40],
        block_size=64),
    "C128A BSH chunked, start_pos 100 / 0": dict(
        **_C128A, layout_x="BSH", batch_size=2, Seq_len=200, start_pos=[100, 0], block_size=64),
    "C4A TH chunked, soft data": dict(
        **_C4A, layout_x="TH", batch_size=2, Seq_len=23, cu_seqlens=[0, 23, 40], start_pos=[5, 12], **SOFT),
    "C4Li TH MTP decode, soft data": dict(**_C4LI, layout_x="TH", batch_size=3, Seq_len=3, start_pos=[13, 4, 30],
                                          **SOFT),
    "C128A BSH chunked, soft data": dict(
        **_C128A, layout_x="BSH", batch_size=2, Seq_len=200, start_pos=[100, 0], block_size=64, **SOFT),
}


def ops_transformer_cases(checkout: Path) -> dict[str, dict]:
    """ops-transformer's parameter sets (each list holds one value), named ``ot/<key>``."""
    spec = importlib.util.spec_from_file_location("huawei_compressor_paramset", checkout / PARAMSET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {f"ot/{key}": {name: values[0] for name, values in params.items()}
            for key, params in module.TEST_PARAMS.items()}


def _lengths(p: dict) -> tuple[list[int], list[int] | None, list[int], int]:
    """(start_pos, cu_seqlens, tokens per batch, S) as ``output_operator`` and ``run_compressor_eager`` derive them."""
    b, s = p["batch_size"], p["Seq_len"]
    start = p["start_pos"] if p["start_pos"] is not None else [p["start_p"]] * b
    cu = None
    if p["layout_x"] == "TH":
        cu = p["cu_seqlens"] if p["cu_seqlens"] is not None else [i * s for i in range(b + 1)]
        s = max(p["seqused"]) if p["seqused"] is not None else max(e - a for a, e in zip(cu, cu[1:]))
    used = p["seqused"] or ([e - a for a, e in zip(cu, cu[1:])] if cu is not None else [s] * b)
    return start, cu, used, s


def _block_table(p: dict, start: list[int], used: list[int], s: int) -> tuple[torch.Tensor, int]:
    """The table and the cache's block count: blocks numbered from 1 for the state each batch reads (the window
    before start_pos) and writes (the window around its end); every other entry 0."""
    r, bs, b = p["cmp_ratio"], p["block_size"], p["batch_size"]
    s_max = max(sp + n for sp, n in zip(start, used)) if p["layout_x"] == "TH" else max(start) + p["Seq_len"]
    per_batch = (s_max + bs - 1) // bs
    table, next_id = torch.zeros(b, per_batch, dtype=torch.int32), 1
    for i, (sp, n) in enumerate(zip(start, used)):
        read = (sp // r * r - r, sp if sp % r == 0 else sp // r * r + r, sp + s)
        end = sp + n
        write = (end // r * r - r, end if end % r == 0 else end // r * r + r, end)
        for first, last, cap in (read, write):
            last = min(last, cap)
            for j in range(max(first, 0) // bs, (last - 1) // bs + 1):
                if next_id < b * per_batch and table[i, j] == 0:
                    table[i, j] = next_id
                    next_id += 1
    return table, b * per_batch


def _uniform(p: dict, name: str, shape, dtype=torch.float32) -> torch.Tensor:
    lo, hi = p[f"{name}_datarange"]
    return torch.tensor(np.random.uniform(lo, hi, shape)).to(dtype)


def run_case(golden: types.ModuleType, name: str, params: dict) -> list[Row]:
    p = {**_BASE, **params}
    start, cu, used, s = _lengths(p)
    table, blocks = _block_table(p, start, used, s)
    d, coff, r, h, dtype = p["head_dim"], p["coff"], p["cmp_ratio"], p["hidden_size"], p["data_type"]
    kv_state = _uniform(p, "kv_state", (blocks, p["block_size"], coff * d))
    score_state = _uniform(p, "score_state", kv_state.shape)
    x = _uniform(p, "x", (cu[-1], h) if cu is not None else (p["batch_size"], p["Seq_len"], h), dtype)
    wkv, wgate = _uniform(p, "wkv", (coff * d, h), dtype), _uniform(p, "wgate", (coff * d, h), dtype)
    ape = _uniform(p, "ape", (r, coff * d))
    cache = torch.cat([kv_state, score_state], -1)
    hw_kv, hw_score = kv_state.clone(), score_state.clone()
    wrote_kv, wrote_score = torch.zeros(kv_state.shape, dtype=torch.bool), torch.zeros(kv_state.shape, dtype=torch.bool)
    with contextlib.redirect_stdout(io.StringIO()):
        hw_out, emitted = golden.cpu_compressor(
            x, wkv, wgate, hw_kv, hw_score, wrote_kv, wrote_score, ape, block_table=table, cu_seqlens=cu,
            seqused=p["seqused"], start_pos=start, cmp_ratio=r, coff=coff, cache_mode=p["cache_mode"])

    def call(dtype=None):
        def cast(t):
            return t if dtype is None else t.to(dtype)
        state = cast(cache).clone()
        out = cot.compressor(
            cast(x), cast(wkv), cast(wgate), state, cast(ape), cmp_ratio=r, state_block_table=table,
            cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32),
            seqused=None if p["seqused"] is None else torch.tensor(p["seqused"], dtype=torch.int32),
            start_pos=torch.tensor(start, dtype=torch.int32), coff=coff, cache_mode=p["cache_mode"])
        return out, state[..., :coff * d], state[..., coff * d:]

    (out, kv, score), (out64, kv64, score64) = call(), call(torch.float64)
    rows_mask = torch.from_numpy(emitted)
    untouched = int((kv[~wrote_kv] != kv_state[~wrote_kv]).sum() + (score[~wrote_score] != score_state[~wrote_score]).sum())
    return [judge(OP, name, "cmp_kv", out[rows_mask], hw_out[rows_mask], out64[rows_mask], reduction=h + coff * r),
            judge(OP, name, "kv_state written", kv[wrote_kv], hw_kv[wrote_kv], kv64[wrote_kv], reduction=h),
            judge(OP, name, "score_state written", score[wrote_score], hw_score[wrote_score], score64[wrote_score],
                  reduction=h),
            exact(OP, name, "state left alone", untouched)]
