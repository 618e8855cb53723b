"""Peers of the NSA decode operators on the CPU (``nsa_selected_infer`` / ``nsa_compress_infer`` cases): what a
PyTorch user writes instead, every call starting from the same paged caches, block table and (selected) block
indices as attnops, so the gathers are part of their cost.

* ``sdpa-folded-gather`` (selected attention): the selected blocks' rows gathered through the block table into contiguous
  ``K/V [B, N2, count * block, D]`` (one ``index_select`` each), then ``scaled_dot_product_attention`` with the GQA
  group folded into the query rows (``q [B, N2, G, D]``);
* ``flex-paged`` (selected attention): ``torch.compile``'d ``flex_attention`` reading the paged caches in place (a
  strided ``[1, N2, blocks * page, D]`` view) through a ``BlockMask`` of each (request, KV head)'s selected pages,
  the mask built every call (needs ``select_block_size`` equal to the page size; compiled afresh for each case);
* ``sdpa-folded-scores`` (compressed attention): every request's compressed keys gathered through the block table,
  SDPA folded for the output, and the probabilities ``softmax(q K^T * scale)`` (fp32) for the next step's blocks;
* ``matmul-folded-scores`` (compressed attention): the same gather and probabilities, the output ``P V`` from them
  (``P`` in the input dtype).

The compressed peers score the next step's selection blocks as the operator does (:mod:`attnops.ops.nsa.decode`:
a strided ``conv1d`` of the group-summed probabilities, the first and the last two blocks forced, ``torch.topk`` of
the rest); ``flex_attention`` is no peer there: it returns no probabilities, and the scores ``q K^T`` they need
leave only one matmul for ``P V``. The compared output of a compressed case is the attention output followed by
the chosen block indices (a different block differs by at least 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import Case, Inputs, Runnable, Unavailable

FORCED = (0, -2, -1)  # the first and the last two selection blocks (the operator's forced choice)
SHAPES = ((1, 32768), (8, 4096))  # (requests, context tokens)
PEERS = {"nsa_selected_infer": ("sdpa-folded-gather", "flex-paged"),
         "nsa_compress_infer": ("sdpa-folded-scores", "matmul-folded-scores")}


def infer_cases() -> tuple[Case, ...]:
    """Both operators, N1=32, N2=8, D=128, selection 16 blocks of 64, compression 32 / stride 16, paged caches in
    shuffled 64-token pages: B=1 x 32k and B=8 x 4k contexts, fp32/bf16/fp16, on 1 and 2 threads (two threads:
    also ``attnops-1t``), beside the peers and the read bandwidth."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return tuple(Case(name=f"nsa-{op[4:-6]}-infer-b{batch}-kv{skv}-n32-kvn8-d128-{short[dtype]}-t{threads}", op=op,
                      batch=batch, heads=32, kv_heads=8, d=128, dv=128, sq=1, skv=skv, dtype=dtype,
                      baselines=(*PEERS[op], "read-bandwidth", *(("attnops-1t",) if threads > 1 else ())),
                      params={"block": 64, "count": 16, "stride": 16, "threads": threads})
                 for op in PEERS for batch, skv in SHAPES for dtype in short for threads in (1, 2))


def _folded(case: Case, q: torch.Tensor) -> torch.Tensor:
    """``query [B, N1, D]`` as ``[B, N2, G, D]`` (head ``n2 * G + g`` is row ``g`` of KV head ``n2``)."""
    return q.view(case.batch, case.kv_heads, case.heads // case.kv_heads, case.d)


def _as_bn1sd(case: Case, out: torch.Tensor) -> torch.Tensor:
    """An output ``[B, N2, G, Dv]`` or ``[B, N1, Dv]`` as ``[B, N1, 1, Dv]`` (what the runner compares)."""
    return out.reshape(case.batch, case.heads, 1, case.dv)


def _selected_rows(case: Case, inp: Inputs) -> torch.Tensor:
    """Row ids ``[B, N2, count * block]`` of the selected keys in a cache viewed as ``[blocks * page * N2, D]``."""
    block, page, n2 = case.params["block"], inp.k.shape[1], case.kv_heads
    pos = (inp.kwargs["topk"].long().unsqueeze(-1) * block + torch.arange(block)).flatten(2)  # [B, N2, L]
    pages = inp.kwargs["table"].long().gather(1, (pos // page).flatten(1)).view_as(pos)
    return (pages * page + pos % page) * n2 + torch.arange(n2).view(1, -1, 1)


def build_selected_sdpa(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    q = _folded(case, inp.q)
    k_rows, v_rows = inp.k.view(-1, case.d), inp.v.view(-1, case.dv)
    state = {}

    def run():
        with torch.no_grad():
            rows = _selected_rows(case, inp).flatten()
            k = k_rows.index_select(0, rows).view(case.batch, case.kv_heads, -1, case.d)
            v = v_rows.index_select(0, rows).view(case.batch, case.kv_heads, -1, case.dv)
            state["out"] = F.scaled_dot_product_attention(q, k, v, scale=inp.scale)
    return Runnable(run, output=lambda: _as_bn1sd(case, state["out"]) if "out" in state else None)


def build_selected_flex(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError as e:
        raise Unavailable(f"FlexAttention not available: {e}") from None
    page = inp.k.shape[1]
    if case.params["block"] != page:
        raise Unavailable("the block mask names whole pages: select_block_size must equal the page size")
    b, n2, count, blocks = case.batch, case.kv_heads, case.params["count"], inp.k.shape[0]
    q = _folded(case, inp.q)
    k, v = (t.view(-1, n2, t.shape[-1]).permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1) for t in (inp.k, inp.v))
    counts = torch.full((b, n2, 1), count, dtype=torch.int32)
    # a fresh compile per case, for this shape: past dynamo's recompile limit the calls would run the eager
    # flex_attention (which ignores the block sparsity: every key), and the dynamic-shape recompile after a change
    # of shape gave wrong fp16/bf16 results here
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    state = {}

    def run():
        with torch.no_grad():
            pages = inp.kwargs["table"].gather(1, inp.kwargs["topk"].flatten(1)).view(b, n2, 1, count)
            indices = torch.zeros(b, n2, 1, blocks, dtype=torch.int32)
            indices[..., :count] = pages
            mask = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(128, page), seq_lengths=(q.shape[2],
                                                                                              k.shape[2]))
            state["out"] = compiled(q, k, v, block_mask=mask, scale=inp.scale)
    try:  # the compile, outside the timing
        run()
    except Exception as e:  # noqa: BLE001 - inductor raises many types
        raise Unavailable(f"flex_attention does not compile here: {str(e).splitlines()[0][:200]}") from None
    return Runnable(run, output=lambda: _as_bn1sd(case, state["out"]))


def _compressed_kv(case: Case, inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's compressed keys and values ``[B, N2, S2, D]`` gathered through the block table (all
    requests hold the same number of compressed keys in these cases)."""
    table = inp.kwargs["table"].long()
    s2 = inp.kwargs["lens"][0]
    return tuple(t[table].view(case.batch, -1, case.kv_heads, t.shape[-1])[:, :s2].transpose(1, 2)
                 for t in (inp.k, inp.v))


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 ``softmax(q K^T * scale)`` ``[B, N2, G, S2]``."""
    return torch.softmax(q.float() @ k.float().transpose(-1, -2) * scale, -1)


def _next_blocks(case: Case, p: torch.Tensor) -> torch.Tensor:
    """The next step's selection blocks ``[B, N2, count]`` int32 from the probabilities ``p [B, N2, G, S2]``: block
    ``k`` scores ``sum_t times[t] * P[m * (k + 1) - t]`` summed over the group (``m`` compressed keys per selection
    block, ``nn`` per compression block, ``times[t]``: the pairs ``a < m, c < nn`` with ``a + c = t``); the forced
    blocks first, then the best others."""
    prm = case.params
    stride, count = prm["stride"], prm["count"]
    m, nn = prm["block"] // stride, 2  # the cases' compression blocks are 2 * stride tokens
    s2 = p.shape[-1]
    n_blocks = -(-((s2 - 1) * stride + 2 * stride) // prm["block"])
    taps = torch.arange(m + nn - 1)
    times = torch.minimum(torch.minimum(taps + 1, torch.tensor(min(m, nn))), m + nn - 1 - taps).float()
    # score[k] = sum_u times[u] * P[m * k + u - (nn - 2)]: a conv1d of stride m (times is symmetric)
    summed = p.sum(2).flatten(0, 1).unsqueeze(1)  # [B * N2, 1, S2]
    left = nn - 2
    padded = F.pad(summed, (max(left, 0), m * n_blocks + len(taps)))[..., max(-left, 0):]
    score = F.conv1d(padded, times.view(1, 1, -1), stride=m)[..., :n_blocks].view(case.batch, case.kv_heads, -1)
    score[..., s2 - 1:] = 0  # blocks k >= S2 - 1 score 0
    forced = torch.tensor([f % n_blocks for f in FORCED]).expand(case.batch, case.kv_heads, -1)
    best = torch.topk(score[..., 1:n_blocks - 2], count - len(FORCED), dim=-1).indices + 1
    return torch.cat([forced, best], -1).to(torch.int32)


def _compared(case: Case, out: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """The attention output followed by the chosen blocks, per request ``[B, 1, 1, N1 * Dv + N2 * count]``."""
    return torch.cat([out.reshape(case.batch, -1).float(), topk.reshape(case.batch, -1).float()], 1).view(
        case.batch, 1, 1, -1)


def build_compress_peer(case: Case, inp: Inputs, device: torch.device, fused_softmax: bool) -> Runnable:
    """``sdpa-folded-scores`` (``fused_softmax``: SDPA's output, the probabilities apart) or
    ``matmul-folded-scores`` (the output from the probabilities)."""
    q = _folded(case, inp.q)
    state = {}

    def run():
        with torch.no_grad():
            k, v = _compressed_kv(case, inp)
            p = _probabilities(q, k, inp.scale)
            out = (F.scaled_dot_product_attention(q, k, v, scale=inp.scale) if fused_softmax
                   else p.to(v.dtype) @ v)
            state["out"] = (out, _next_blocks(case, p))
    return Runnable(run, output=lambda: _compared(case, *state["out"]) if "out" in state else None)


def output_of_attnops(case: Case, result) -> torch.Tensor:
    """attnops' result in the form the peers' outputs take (see :func:`_compared`)."""
    if case.op == "nsa_selected_infer":
        return _as_bn1sd(case, result)
    return _compared(case, *result)
