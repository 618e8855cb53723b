"""``sparse_flash_mla`` CPU reference, forward and backward (fp32 compute, fp64 for fp64 inputs).

Per query row, the visible ori keys (a window), the visible compressed keys (a causal prefix, or the row's selected
indices) and the per-head sink share one softmax: ``m = max(logits, sink)``, ``den = sum exp(logit - m) +
exp(sink - m)``, ``out = sum exp(logit - m) v / den``, ``lse = m + log(den)`` (keys are values: K = V). A row with no
visible key gives ``out = 0`` and ``lse = 0`` (sinks or not).

Memory is linear in the sequence: query rows go in chunks of one batch; a chunk reads the span of ori keys its rows'
windows cover and the compressed prefix its rows may see, as ``[W, D]`` slices shared by the chunk's rows, or, with
indices, the ``[C, K, D]`` rows its index rows select. A decode step (fewer chunks than threads) splits its heads
into groups that run side by side on single-threaded workers: tiny operators with a fork/join each would stall on a
busy machine. Reductions run in a fixed order (chunks in sequence, CPU ``index_add_``), so results are bitwise
repeatable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core.parallel import job_threads, run_jobs
from .problem import Batch, Problem, compute_dtype, flat_rows, selected_compressed

BUDGET_BYTES = 1 << 26


@dataclass
class _Keys:
    """One branch (``name`` "ori" or "cmp") of a chunk: keys ``k`` (``[W, D]`` shared by the rows, or ``[C, K, D]`` per
    row), their flat rows in the store (``[W]`` / ``[C, K]``) and which ones each row sees (``mask [C, W or K]``)."""
    name: str
    k: Tensor
    flat: Tensor
    mask: Tensor

    @property
    def shared(self) -> bool:
        return self.k.dim() == 2

    def products(self, x: Tensor) -> Tensor:
        """``[C, N, W]`` dot products of ``x [C, N, D]`` with the keys."""
        if self.shared:
            return (x.reshape(-1, x.shape[-1]) @ self.k.T).view(*x.shape[:2], -1)
        return torch.bmm(x, self.k.transpose(1, 2))

    def scores(self, qs: Tensor) -> Tensor:
        """``[C, N, W]`` logits of the scaled queries ``qs [C, N, D]``, ``-inf`` where masked."""
        s = self.products(qs)
        return s if bool(self.mask.all()) else s.masked_fill_(~self.mask[:, None, :], float("-inf"))

    def apply(self, p: Tensor) -> Tensor:
        """``p [C, N, W] @ keys -> [C, N, D]``."""
        if self.shared:
            return (p.reshape(-1, p.shape[-1]) @ self.k).view(*p.shape[:2], -1)
        return torch.bmm(p, self.k)

    def key_grad(self, a: Tensor, b: Tensor) -> Tensor:
        """``sum_(rows, heads) a[c, n, w] * b[c, n, :]`` per key: ``[W, D]`` (shared) or ``[C*K, D]``."""
        if self.shared:
            return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])
        return torch.bmm(a.transpose(1, 2), b).flatten(0, 1)


def _slice(store, flat_kv: Tensor, b: int, lo: int, hi: int, dt) -> tuple[Tensor, Tensor, Tensor]:
    """Logical keys ``[lo, hi)`` of batch ``b``: (positions, flat rows, keys ``[hi - lo, D]``)."""
    pos = torch.arange(lo, hi)
    flat = store.flat(b, pos)
    keys = flat_kv[flat[0]:flat[0] + len(pos)] if store.table is None else flat_kv[flat]
    return pos, flat, keys.to(dt)


def _chunk_keys(problem: Problem, b: int, batch: Batch, i0: int, i1: int, t: dict, dt) -> list[_Keys]:
    """The ori and compressed branches of query rows ``[i0, i1)`` of batch ``b`` (empty branches left out)."""
    i = torch.arange(i0, i1)
    branches = []
    lo, hi = problem.ori_bounds(batch, i)
    a, e = int(lo.min()), int(hi.max())
    if e > a:
        pos, flat, k = _slice(problem.ori, t["ori"], b, a, e, dt)
        branches.append(_Keys("ori", k, flat, (pos >= lo[:, None]) & (pos < hi[:, None])))
    thr = problem.cmp_limit(batch, i)
    if problem.cmp is None or int(thr.max()) == 0:
        return branches
    if not problem.sparse:
        pos, flat, k = _slice(problem.cmp, t["cmp"], b, 0, int(thr.max()), dt)
        branches.append(_Keys("cmp", k, flat, pos < thr[:, None]))
        return branches
    idx = t["indices"][batch.q_start + i0:batch.q_start + i1].to(torch.int64)
    sel = selected_compressed(idx, thr)
    used = sel.any(0).nonzero()
    if used.numel():
        width = int(used[-1]) + 1  # entries past the last one any row counts are not read
        idx, sel = idx[:, :width], sel[:, :width]
        flat = problem.cmp.flat(b, idx.masked_fill(~sel, 0))
        branches.append(_Keys("cmp", t["cmp"][flat.reshape(-1)].to(dt).view(*flat.shape, -1), flat, sel))
    return branches


def _rows_per_chunk(problem: Problem, batch: Batch, heads: int, dim: int, k: int) -> int:
    """Query rows per chunk so the chunk's work tensors (scores, probabilities, their gradients; gathered keys) stay
    near :data:`BUDGET_BYTES`; a finite band also bounds the rows so its shared key span stays about the window."""
    band = problem.masks.band_width
    w_ori = batch.ori_len if band is None else min(batch.ori_len, band)
    w_cmp = 0 if problem.cmp is None else (k if problem.sparse else batch.cmp_len)
    per_row = 32 * heads * (w_ori + w_cmp + 1) + (8 * k * dim if problem.sparse else 0)
    step = max(1, BUDGET_BYTES // per_row)
    return step if band is None else min(step, max(64, w_ori))


def _chunks(problem: Problem, heads: int, dim: int, k: int):
    """``(b, batch, i0, i1)`` over every batch's query rows."""
    for b, batch in enumerate(problem.batches):
        step = _rows_per_chunk(problem, batch, heads, dim, k)
        for i0 in range(0, batch.q_len, step):
            yield b, batch, i0, min(batch.q_len, i0 + step)


def _key_rows_read(problem: Problem, k: int) -> tuple[int, int]:
    """About how many ori and cmp key rows the chunks read in all (each chunk reads its rows' keys once)."""
    band = problem.masks.band_width
    ori = cmp = 0
    for batch in problem.batches:
        ori += batch.q_len + (batch.ori_len if band is None else batch.q_len + band)
        cmp += batch.q_len * k if problem.sparse else batch.cmp_len
    return ori, cmp


def _flat_inputs(problem: Problem, q: Tensor, ori_kv: Tensor, cmp_kv: Tensor | None, indices: Tensor | None,
                 dt: torch.dtype) -> dict:
    """The flat views the chunks read; a key store no larger than what the chunks read of it is converted to the
    compute dtype once (a large paged cache read by few queries is converted part by part)."""
    reads = _key_rows_read(problem, 0 if indices is None else indices.shape[-1])

    def store(kv, read):
        flat = kv.reshape(-1, kv.shape[-1])
        return flat.to(dt) if flat.shape[0] <= read else flat

    return {"q": flat_rows(q, problem.layout_q), "ori": store(ori_kv, reads[0]),
            "cmp": None if cmp_kv is None else store(cmp_kv, reads[1]),
            "indices": None if indices is None else indices.reshape(-1, indices.shape[-1])}


def _rows_with_keys(branches: list[_Keys]) -> Tensor:
    """``[C]`` bool: the chunk's rows that see at least one key."""
    return torch.stack([br.mask.any(1) for br in branches]).any(0)


def _statistics(parts: list[Tensor], sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(m, den)`` ``[C, N]`` of the logits ``parts`` (turned into ``exp(logit - m)`` in place) and the sink."""
    m = torch.stack([s.amax(-1) for s in parts]).amax(0)
    if sink is not None:
        m = torch.maximum(m, sink)
    den = torch.zeros_like(m) if sink is None else torch.exp(sink - m)
    for s in parts:
        den += s.sub_(m[..., None]).exp_().sum(-1)
    return m, den


def _head_groups(problem: Problem, heads: int, dim: int, k: int, threads: int) -> list[tuple] | None:
    """With fewer chunks than ``threads`` (a decode step: one chunk of one row), ``(b, batch, i0, i1, head slice)``
    jobs that split every chunk's heads into ``threads`` groups; None otherwise."""
    chunks = list(_chunks(problem, heads, dim, k))
    if len(chunks) >= threads:
        return None
    step = -(-heads // threads)
    return [(*c, slice(h, min(heads, h + step))) for c in chunks for h in range(0, heads, step)]


def sparse_flash_mla_forward(problem: Problem, q: Tensor, ori_kv: Tensor, cmp_kv: Tensor | None,
                             indices: Tensor | None, sinks: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [R, N, D] in q's dtype, lse [R, N])`` over the flat query rows (lse fp32, fp64 for fp64 inputs). Chunks
    run in sequence; with fewer chunks than threads (decoding) their head groups run side by side on single-threaded
    workers (:func:`run_jobs`), each writing its own heads."""
    dt = compute_dtype(q)
    t = _flat_inputs(problem, q, ori_kv, cmp_kv, indices, dt)
    rows, heads, dim = t["q"].shape
    out = torch.zeros(rows, heads, dim, dtype=dt)
    lse = torch.zeros(rows, heads, dtype=dt)
    sink = None if sinks is None else sinks.to(dt)
    k = 0 if indices is None else indices.shape[-1]

    def job(item: tuple) -> None:
        b, batch, i0, i1, hs = item
        branches = _chunk_keys(problem, b, batch, i0, i1, t, dt)
        if not branches:
            return
        r = slice(batch.q_start + i0, batch.q_start + i1)
        qs = t["q"][r, hs].to(dt) * scale
        parts = [br.scores(qs) for br in branches]
        m, den = _statistics(parts, None if sink is None else sink[hs])
        o = branches[0].apply(parts[0])
        for br, p in zip(branches[1:], parts[1:]):
            o += br.apply(p)
        lse_r = m + torch.log(den)
        infinite = m.isinf()  # lse is the max's infinity, as logsumexp: log(0) = -inf where every logit the row
        if bool(infinite.any()):  # sees is -inf (no sink), +inf with a +inf logit; the output is NaN there
            lse_r = torch.where(infinite, m, lse_r)
        seen = _rows_with_keys(branches)[:, None, None]
        out[r, hs] = (o / den[..., None]).masked_fill_(~seen, 0)
        lse[r, hs] = lse_r.masked_fill_(~seen[..., 0], 0)

    groups = _head_groups(problem, heads, dim, k, job_threads(q.device))
    if groups is None:
        for b, batch, i0, i1 in _chunks(problem, heads, dim, k):
            job((b, batch, i0, i1, slice(None)))
    else:  # few rows: head groups side by side on single-threaded workers (no fork/join per small op)
        run_jobs(job, groups, q.device)
    return out.to(q.dtype), lse


def sparse_flash_mla_backward(problem: Problem, dout: Tensor, dlse: Tensor | None, q: Tensor, ori_kv: Tensor,
                              cmp_kv: Tensor | None, indices: Tensor | None, sinks: Tensor | None, out: Tensor,
                              lse: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None,
                                                                  Tensor | None]:
    """``(dq, d_ori_kv, d_cmp_kv, d_sinks, cmp_softmax_l1_norm)`` from the forward's ``out`` and flat ``lse [R, N]``
    (``dlse``: the gradient of ``lse``, flat, or None). ``cmp_softmax_l1_norm`` (indices only): per index entry, the
    probability of its key summed over the heads (0 for entries that do not count)."""
    dt = compute_dtype(q)
    t = _flat_inputs(problem, q, ori_kv, cmp_kv, indices, dt)
    do, o = flat_rows(dout, problem.layout_q), flat_rows(out, problem.layout_q)
    rows, heads, dim = t["q"].shape
    dq = torch.zeros(rows, heads, dim, dtype=dt)
    d_store = {"ori": torch.zeros(t["ori"].shape, dtype=dt),
               "cmp": None if cmp_kv is None else torch.zeros(t["cmp"].shape, dtype=dt)}
    sink = None if sinks is None else sinks.to(dt)
    d_sinks = None if sinks is None else torch.zeros(heads, dtype=dt)
    k = 0 if indices is None else indices.shape[-1]
    l1 = None if indices is None else torch.zeros(rows, k, dtype=dt)
    for b, batch, i0, i1 in _chunks(problem, heads, dim, k):
        branches = _chunk_keys(problem, b, batch, i0, i1, t, dt)
        if not branches:
            continue
        r = slice(batch.q_start + i0, batch.q_start + i1)
        qc, g, row_lse = t["q"][r].to(dt), do[r].to(dt), lse[r].to(dt)
        delta = (g * o[r].to(dt)).sum(-1)
        if dlse is not None:
            delta = delta - dlse[r].to(dt)
        dqc = torch.zeros_like(qc)
        for br in branches:
            p = br.scores(qc * scale).sub_(row_lse[..., None]).exp_()
            ds = p * (br.products(g) - delta[..., None])
            dqc += br.apply(ds)
            d_keys = br.key_grad(ds, qc).mul_(scale).add_(br.key_grad(p, g))
            d_store[br.name].index_add_(0, br.flat.reshape(-1), d_keys)
            if l1 is not None and br.name == "cmp":
                l1[r, :p.shape[-1]] = p.sum(1)
        dq[r] = dqc * scale
        if sink is not None:
            seen = _rows_with_keys(branches)[:, None]
            d_sinks -= (torch.exp(sink - row_lse) * delta).masked_fill_(~seen, 0).sum(0)

    def shaped(x: Tensor | None, like: Tensor | None) -> Tensor | None:
        return None if like is None else x.reshape(like.shape).to(like.dtype)

    return (dq.view(q.shape).to(q.dtype), shaped(d_store["ori"], ori_kv), shaped(d_store["cmp"], cmp_kv),
            shaped(d_sinks, sinks), None if l1 is None else l1.view(indices.shape))
