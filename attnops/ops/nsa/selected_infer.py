"""NSA selected attention for decoding (torch_npu's ``npu_nsa_select_attention_infer``), pure PyTorch.

One query token per request attends, per KV head, to the blocks of ``select_block_size`` keys its
``topk_indices [B, N2, count]`` name, read from a paged cache through ``block_table``. As op-plugin's golden for
the op: the indices are taken in order up to the first ``-1`` (padding), each block is cut at the request's KV
length, the chosen blocks' keys are concatenated (a repeated index counts twice, as in training) and one exact
softmax runs over them. The query is the newest token, so nothing is masked; a request that selects nothing gets
output 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.checks import check_int, check_tensor, fail, int_list, require
from .compress import NSA_DTYPES

PAD = -1


@dataclass(frozen=True)
class SelectedInferSpec:
    batch: int
    n1: int
    n2: int
    dv: int
    block_size: int
    page_size: int
    kv_lens: list[int]
    scale: float


def build_selected_infer_spec(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor, block_table: Tensor,
                              *, scale_value: float, head_num: int, key_value_head_num: int, select_block_size: int,
                              select_block_count: int, page_block_size: int, actual_seq_kvlen
                              ) -> SelectedInferSpec:
    """Validate a call: ``query [B, N1, D]``, caches ``[blocks, page_block_size, N2, D/Dv]``."""
    check_tensor("query", query, ndim=3, dtypes=NSA_DTYPES)
    batch, n1, d = query.shape
    require(head_num == n1, "head_num", f"the number of query heads ({n1})", head_num)
    n2 = check_int("key_value_head_num", key_value_head_num, lo=1)
    require(n1 % n2 == 0, "key_value_head_num", f"a divisor of head_num={n1}", n2)
    page = check_int("page_block_size", page_block_size, lo=1)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=4, dtypes=(query.dtype,))
        require(tuple(t.shape[1:3]) == (page, n2), name, f"a paged cache [blocks, page_block_size={page}, "
                f"key_value_head_num={n2}, D]", t)
    require(key.shape[-1] == d, "key", f"head dim D={d} like query", key)
    require(value.shape[0] == key.shape[0], "value", f"{key.shape[0]} blocks like key", value)
    block = check_int("select_block_size", select_block_size, lo=1)
    count = check_int("select_block_count", select_block_count, lo=1)
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32, torch.int64), shape=(batch, n2, count))
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64))
    require(block_table.shape[0] == batch, "block_table", f"[B={batch}, maxBlocks]", block_table)
    lens = int_list("actual_seq_kvlen", actual_seq_kvlen)
    require(lens is not None and len(lens) == batch, "actual_seq_kvlen", f"B={batch} per-request KV lengths", lens)
    for b, n in enumerate(lens):
        require(0 <= n <= block_table.shape[1] * page, f"actual_seq_kvlen[{b}]",
                f"a length in [0, {block_table.shape[1] * page}] (the block_table's pages)", n)
    spec = SelectedInferSpec(batch, n1, n2, value.shape[-1], block, page, lens, float(scale_value))
    for b in range(batch):
        pages = block_table[b, :-(-lens[b] // page)]
        bad = (pages < 0) | (pages >= key.shape[0])
        if bool(bad.any()):
            fail("block_table", f"block ids in [0, {key.shape[0]}) for the pages of request {b}'s "
                 f"{lens[b]} keys", f"{int(pages[bad][0])} in row {b}")
        limit = -(-lens[b] // block)
        idx = _chosen(topk_indices[b])
        for h, chosen in enumerate(idx):
            if bool(((chosen < 0) | (chosen >= limit)).any()):
                fail("topk_indices", f"block indices in [0, {limit}) (request {b}: {lens[b]} keys in blocks of "
                     f"{block}) or -1 for padding", f"{chosen.tolist()} for KV head {h} of request {b}")
    return spec


def _chosen(topk: Tensor) -> list[Tensor]:
    """Per KV head, the block indices before the first ``-1``."""
    out = []
    for row in topk.long():
        pad = (row == PAD).nonzero()
        out.append(row[:int(pad[0])] if len(pad) else row)
    return out


def selected_infer_forward(spec: SelectedInferSpec, query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor,
                           block_table: Tensor) -> Tensor:
    """``attention_out [B, N1, Dv]`` in the query's dtype (fp32 compute, fp64 for fp64 inputs)."""
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.zeros(spec.batch, spec.n1, spec.dv, dtype=acc, device=query.device)
    g = spec.n1 // spec.n2
    for b in range(spec.batch):
        for n2, blocks in enumerate(_chosen(topk_indices[b])):
            pos = _positions(blocks, spec.block_size, spec.kv_lens[b])
            if pos.numel() == 0:
                continue
            pages, slots = block_table[b].long()[pos // spec.page_size], pos % spec.page_size
            heads = slice(n2 * g, (n2 + 1) * g)
            s = query[b, heads].to(acc) @ key[pages, slots, n2].to(acc).T * spec.scale
            out[b, heads] = torch.softmax(s, -1) @ value[pages, slots, n2].to(acc)
    return out.to(query.dtype)


def _positions(blocks: Tensor, size: int, kv_len: int) -> Tensor:
    """The KV positions of ``blocks`` in order, each block cut at ``kv_len``."""
    if blocks.numel() == 0:
        return blocks
    pos = (blocks.view(-1, 1) * size + torch.arange(size, device=blocks.device)).flatten()
    return pos[pos < kv_len]
