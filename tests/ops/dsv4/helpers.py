"""DeepSeek-V4 sparse flash MLA test cases: per-batch inputs, their packing into every layout pair, and the golden
over all batches."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnops.testing import golden_dsv4 as G
from attnops.testing.compare import attention_reductions

LAYOUT_PAIRS = [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BBND"), ("TND", "PA_BBND")]


@dataclass
class Case:
    """Per-batch lengths (``cmp_lens`` None: sliding window only; default: the compressed blocks of each batch) and
    the call's options; ``topk``: CSA with index rows of that width (``rows``: given index rows per batch, else
    well-formed random ones), ``None``: HCA."""
    q_lens: list[int]
    ori_lens: list[int]
    cmp_lens: list[int] | None = None
    residual: list[int] | None = None
    heads: int = 3
    dim: int = 8
    ratio: int = 4
    topk: int | None = None
    sinks: bool = True
    scale: float = 0.4
    masks: dict = field(default_factory=lambda: dict(ori_mask_mode=4, ori_win_left=5, ori_win_right=0,
                                                     cmp_mask_mode=3))
    dtype: torch.dtype = torch.float64
    seed: int = 0
    rows: list[list[list[int]]] | None = None


def hca(q_lens, ori_lens, **kw) -> Case:
    """A case with the compressed keys of each batch (``Lcmp = Lori // r``, residual ``Lori % r``)."""
    r = kw.get("ratio", 4)
    return Case(q_lens, ori_lens, [n // r for n in ori_lens], [n % r for n in ori_lens], **kw)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def well_formed_rows(case: Case, b: int, g) -> list[list[int]]:
    """Index rows as the indexer writes them: distinct visible compressed positions first, then -1."""
    lq, lcmp = case.q_lens[b], case.cmp_lens[b]
    mask_len = case.ori_lens[b] if case.residual is None else lcmp * case.ratio + case.residual[b]
    rows = []
    for i in range(lq):
        thr = G.cmp_threshold(lq, lcmp, i, case.ratio, case.masks.get("cmp_mask_mode", 3), mask_len)
        pick = torch.randperm(thr, generator=g)[:case.topk].tolist()
        rows.append(pick + [-1] * (case.topk - len(pick)))
    return rows


@dataclass
class Parts:
    """One case's per-batch inputs (fp64 leaves, cast to the case's dtype when packed)."""
    qs: list[torch.Tensor]
    oris: list[torch.Tensor]
    cmps: list[torch.Tensor] | None
    rows: list[list[list[int]]] | None
    sinks: torch.Tensor | None


def make_parts(case: Case) -> Parts:
    g = _gen(case.seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(case.dtype).to(torch.float64)

    qs = [rnd(n, case.heads, case.dim) for n in case.q_lens]
    oris = [rnd(n, case.dim) for n in case.ori_lens]
    cmps = None if case.cmp_lens is None else [rnd(n, case.dim) for n in case.cmp_lens]
    rows = None
    if case.topk is not None:
        rows = case.rows or [well_formed_rows(case, b, g) for b in range(len(case.q_lens))]
    sinks = rnd(case.heads).float().double() if case.sinks else None
    return Parts(qs, oris, cmps, rows, sinks)


def golden(case: Case, parts: Parts, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    m = case.masks
    return [G.sparse_flash_mla(parts.qs[b].to(dtype), parts.oris[b].to(dtype),
                               None if parts.cmps is None else parts.cmps[b].to(dtype),
                               None if parts.rows is None else parts.rows[b],
                               None if parts.sinks is None else parts.sinks.to(dtype), case.scale, ratio=case.ratio,
                               ori_mask_mode=m.get("ori_mask_mode", 4), win_left=m.get("ori_win_left", 127),
                               win_right=m.get("ori_win_right", 0), cmp_mask_mode=m.get("cmp_mask_mode", 3),
                               residual=None if case.residual is None else case.residual[b], dtype=dtype)
            for b in range(len(case.q_lens))]


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cu(lens) -> torch.Tensor:
    return _i32([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])


def _pack_rows(parts: list[torch.Tensor], layout: str, pad: int) -> tuple[torch.Tensor, list[int]]:
    """Per-batch ``[L_b, ...]`` -> BSND ``[B, max L + pad, ...]`` or TND ``[sum L + pad, ...]`` (zero padded);
    returns the packed tensor and each batch's first flat row."""
    tail = parts[0].shape[1:]
    if layout == "TND":
        starts = [0, *torch.tensor([p.shape[0] for p in parts]).cumsum(0).tolist()[:-1]]
        return torch.cat([*parts, torch.zeros(pad, *tail, dtype=parts[0].dtype)]), starts
    s = max(p.shape[0] for p in parts) + pad
    out = torch.zeros(len(parts), s, *tail, dtype=parts[0].dtype)
    for b, p in enumerate(parts):
        out[b, :p.shape[0]] = p
    return out, [b * s for b in range(len(parts))]


def _paged(parts: list[torch.Tensor], block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shuffled paged cache ``[blocks, block_size, 1, D]`` and its table (-1 past each batch's blocks)."""
    nblocks = [-(-p.shape[0] // block_size) for p in parts]
    total = sum(nblocks) + 1
    perm = torch.randperm(total, generator=_gen(seed)).tolist()
    table = torch.full((len(parts), max(max(nblocks), 1) + 1), -1, dtype=torch.int32)
    cache = torch.zeros(total, block_size, 1, parts[0].shape[-1], dtype=parts[0].dtype)
    for b, p in enumerate(parts):
        for j in range(nblocks[b]):
            phys = perm.pop()
            table[b, j] = phys
            rows = p[j * block_size:(j + 1) * block_size]
            cache[phys, :rows.shape[0]] = rows
    return cache, table


def pack(case: Case, parts: Parts, layout_q: str, layout_kv: str, *, pad_q: int = 0, block_size: int = 4,
         requires_grad: bool = False, derive_cmp_len: bool = False) -> tuple[dict, list[int]]:
    """``sparse_flash_mla``'s arguments for the layout pair and each batch's first flat query row. BSND pads query
    rows to the longest batch (``seqused_q``) plus ``pad_q``; TND appends ``pad_q`` rows. ``derive_cmp_len``: a
    paged cache without ``seqused_cmp_kv``."""
    dt = case.dtype

    def leaf(x, dtype=dt):
        x = x.detach().to(dtype, copy=True)
        return x.requires_grad_() if requires_grad else x

    q, q_starts = _pack_rows(parts.qs, layout_q, pad_q)
    kw = dict(q=leaf(q), layout_q=layout_q, layout_kv=layout_kv, scale=case.scale, cmp_ratio=case.ratio,
              **case.masks)
    if layout_q == "TND":
        kw["cu_seqlens_q"] = _cu(case.q_lens)
    elif len(set(case.q_lens)) > 1 or pad_q:
        kw["seqused_q"] = _i32(case.q_lens)
    if parts.sinks is not None:
        kw["sinks"] = leaf(parts.sinks, torch.float64 if dt == torch.float64 else torch.float32)
    if case.residual is not None:
        kw["cmp_residual_kv"] = _i32(case.residual)
    branches = [("ori", parts.oris, case.ori_lens)]
    if parts.cmps is not None:
        branches.append(("cmp", parts.cmps, case.cmp_lens))
    for name, kv, lens in branches:
        kv = [x[:, None] for x in kv]
        if layout_kv == "PA_BBND":
            cache, table = _paged(kv, block_size, case.seed + len(name))
            kw[f"{name}_kv"], kw[f"{name}_block_table"] = leaf(cache), table
            if name == "ori" or not derive_cmp_len:
                kw[f"seqused_{name}_kv"] = _i32(lens)
        else:
            packed, _ = _pack_rows(kv, layout_kv, 0)
            kw[f"{name}_kv"] = leaf(packed)
            if layout_kv == "TND":
                kw[f"cu_seqlens_{name}_kv"] = _cu(lens)
            else:
                kw[f"seqused_{name}_kv"] = _i32(lens)
    if parts.rows is not None:
        rows = [_i32(r).view(len(r), 1, -1) if r else torch.empty(0, 1, case.topk, dtype=torch.int32)
                for r in parts.rows]
        packed, _ = _pack_rows(rows, layout_q, pad_q)
        kw["cmp_sparse_indices"] = packed.masked_fill(_padding_rows(packed, q_starts, case.q_lens, layout_q), -1)
    return kw, q_starts


def _padding_rows(packed, starts, lens, layout) -> torch.Tensor:
    flat = torch.ones(packed.shape[0] * (packed.shape[1] if layout == "BSND" else 1), dtype=torch.bool)
    for s, n in zip(starts, lens):
        flat[s:s + n] = False
    return flat.view(*packed.shape[:(2 if layout == "BSND" else 1)], 1, 1)


def rows_of(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [R, N, D], lse [R, N])`` flat query rows of either layout (lse has one kv head)."""
    return out.reshape(-1, *out.shape[-2:]), lse.reshape(-1, out.shape[-2])


def expected(case: Case, parts: Parts, starts: list[int], rows: int, dtype=torch.float64):
    """The golden placed at each batch's flat rows, zeros elsewhere: ``(out [R, N, D], lse [R, N])``."""
    out = torch.zeros(rows, case.heads, case.dim, dtype=dtype)
    lse = torch.zeros(rows, case.heads, dtype=dtype)
    for s, (o, l) in zip(starts, golden(case, parts, dtype)):
        out[s:s + o.shape[0]], lse[s:s + o.shape[0]] = o, l
    return out, lse


def call(kw: dict):
    import attnops

    kw = dict(kw)
    return attnops.sparse_flash_mla(kw.pop("q"), kw.pop("ori_kv"), **kw)


INPUTS = ("q", "ori_kv", "cmp_kv", "sinks")


def weights(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def loss_weights(kw: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    rows = kw["q"].shape[0] * (kw["q"].shape[1] if kw["layout_q"] == "BSND" else 1)
    return weights((rows, case.heads, case.dim), 1), weights((rows, case.heads), 2)


def golden_grads(case: Case, layouts, dtype=torch.float64, **pack_kw) -> dict:
    """Gradients of the golden (computed in ``dtype``) of ``sum(w_o out) + sum(w_l lse)``, packed as the inputs."""
    parts = make_parts(case)
    kw, starts = pack(case, parts, *layouts, **pack_kw)
    w_out, w_lse = loss_weights(kw, case)
    for x in [*parts.qs, *parts.oris, *(parts.cmps or []), *([parts.sinks] if parts.sinks is not None else [])]:
        x.requires_grad_()
    total = 0
    for s, (o, l) in zip(starts, golden(case, parts, dtype)):
        n = o.shape[0]
        total = total + (o.double() * w_out[s:s + n]).sum() + (l.double() * w_lse[s:s + n]).sum()
    if isinstance(total, torch.Tensor) and total.requires_grad:  # else no row sees a key: every gradient is 0
        total.backward()
    repack, _ = pack(case, _grad_parts(parts), *layouts, **pack_kw)
    return {n: repack[n] for n in INPUTS if n in repack}


def grads_and_golden(case: Case, layouts, **pack_kw) -> tuple[dict, dict]:
    """(the implementation's gradients by name, the fp64 golden's) of ``sum(w_o out) + sum(w_l lse)``."""
    parts = make_parts(case)
    kw, _ = pack(case, parts, *layouts, requires_grad=True, **pack_kw)
    out, lse = rows_of(*call(kw))
    w_out, w_lse = loss_weights(kw, case)
    ((out.double() * w_out).sum() + (lse.double() * w_lse).sum()).backward()
    return {n: kw[n].grad for n in INPUTS if n in kw}, golden_grads(case, layouts, **pack_kw)


def _grad_parts(parts):
    """The parts with each tensor replaced by its golden gradient (zeros where none flowed)."""
    def g(x):
        return torch.zeros_like(x) if x.grad is None else x.grad

    return type(parts)([g(x) for x in parts.qs], [g(x) for x in parts.oris],
                       None if parts.cmps is None else [g(x) for x in parts.cmps], parts.rows,
                       None if parts.sinks is None else g(parts.sinks))


def reductions(case: Case, parts: Parts) -> dict[str, int]:
    """The tolerance rule's ``reduction`` of each output and gradient (:func:`attention_reductions` with K = V):
    a row attends at most every ori key, its index row (or every compressed key) and the sink; the shared KV's
    gradient adds the key and value gradients over every head of the rows that read it (a compressed key as often
    as an index row repeats it); a sink's gradient sums over every query row."""
    cmp_keys = 0 if parts.cmps is None else case.topk or max(case.cmp_lens, default=0)
    keys = max(case.ori_lens, default=0) + cmp_keys + int(parts.sinks is not None)
    rows = max(case.q_lens, default=1) * case.heads
    repeats = max((row.count(c) for batch in parts.rows or [] for row in batch for c in row if c >= 0), default=1)
    fwd = attention_reductions(case.dim, case.dim, rows, max(keys, 1))
    return dict(attn_out=fwd["out"], softmax_lse=fwd["lse"], q=fwd["dq"], ori_kv=2 * case.dim + 2 * rows,
                cmp_kv=2 * case.dim + 2 * repeats * rows, sinks=case.dim + max(sum(case.q_lens), 1))
