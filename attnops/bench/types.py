"""The benchmark's types, shared by the case registry, the builders and the runner: a :class:`Case` (what is
measured and how much work it is), the :class:`Inputs` built for it, the :class:`Runnable` a builder returns or
the :class:`Unavailable` it raises, and :func:`autograd_runnable`, the fwd / bwd / fwd+bwd forms of a forward.

FLOP model (FlashAttention convention): the forward is ``2 * N1 * kept * (D + Dv)`` (``4 * N * Sq * Skv * D`` when
``Dv == D``) summed over batches, where ``kept`` counts the (query, key) pairs the mask keeps (``Sq * Skv`` for
full attention, about half of it for causal); the backward is 2.5x the forward.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

MODES = ("fwd", "bwd", "fwd+bwd")
NSA_INFER_OPS = ("nsa_selected_infer", "nsa_compress_infer")  # the NSA decode operators alone
DSV4_OPS = ("dsv4_decode", "dsv4_prefill")  # DeepSeek-V4 attention (sparse_flash_mla)
DSV4_KERNEL_OPS = ("dsv4_compressor", "dsv4_indexer_v2")  # DeepSeek-V4 compressor and lightning indexer v2
BWD_FACTOR = 2.5


def sampled_row_chunks(s: int, sample: tuple[int, int] | None) -> list[tuple[int, int]]:
    """Query row ranges ``[lo, hi)`` a case times: all ``S`` rows, or with ``sample = (chunks, rows)`` ``chunks``
    ranges of ``rows`` rows centred on evenly spaced points of the sequence (causal cost grows along the rows: the
    sample spans the whole range)."""
    if not sample:
        return [(0, s)]
    chunks, rows = sample
    starts = (min(s - rows, max(0, (2 * c + 1) * s // (2 * chunks) - rows // 2)) for c in range(chunks))
    return [(lo, lo + rows) for lo in starts]


@dataclass(frozen=True)
class Case:
    """One benchmark case. ``seq_lens`` (TND only) lists the per-sequence lengths (queries and keys alike)."""

    name: str
    op: str = "flash_attention"
    mode: str = "fwd"
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    sq: int = 4096
    skv: int = 4096
    d: int = 128
    dv: int = 128
    dtype: str = "float32"
    causal: bool = False
    layout: str = "BSND"
    seq_lens: tuple[int, ...] | None = None
    baselines: tuple[str, ...] = ("sdpa",)
    track_memory: bool = False
    params: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.layout == "TND" and not self.seq_lens:
            raise ValueError("TND cases need seq_lens")

    @property
    def band(self) -> tuple[int, int] | None:
        """``(pre_tokens, next_tokens)`` of a band case (sparse_mode 4, Sq == Skv: keeps ``-pre <= j - i <= next``)."""
        return (self.params["pre_tokens"], self.params["next_tokens"]) if "pre_tokens" in self.params else None

    @property
    def lengths(self) -> list[tuple[int, int]]:
        """(Sq_b, Skv_b) of every batch."""
        if self.layout == "TND":
            return [(s, s) for s in self.seq_lens]
        return [(self.sq, self.skv)] * self.batch

    def decode_keys(self) -> int:
        """Keys (and values) an NSA decode operator reads per request and KV head: the selected blocks, or the
        compressed keys of ``skv`` tokens."""
        p = self.params
        return p["count"] * p["block"] if self.op == "nsa_selected_infer" else self.skv // p["stride"]

    def kept_pairs(self) -> int:
        """Number of (query, key) pairs the mask keeps, summed over batches (causal is top-left aligned)."""
        if self.op == "nsa_selected":  # every query attends to count*block selected keys (causal masking ignored)
            return sum(self.seq_lens) * self.params["count"] * self.params["block"]
        if self.op in ("dsa_sparse", "dsa_indexer"):  # row i reads min(topk, i + 1) keys (indexer: all i + 1)
            s, k = self.sq, self.params["topk"]
            if self.op == "dsa_indexer":
                return s * (s + 1) // 2
            return sum(min(k, i + 1) for lo, hi in sampled_row_chunks(s, self.params.get("sample"))
                       for i in range(lo, hi))
        if self.op == "nsa_layer":  # selected + window keys per query, plus the compressed branch (~S/stride/2)
            p = self.params
            return sum(s * (p["count"] * p["block"] + p["window"]) + s * s // (2 * p["stride"])
                       for s in self.seq_lens)
        if self.op == "dsv4_decode":  # the window, plus topk C4A rows (CSA) or every C128A row (HCA)
            p = self.params
            return self.batch * (p["window"] + (p["topk"] if p["cmp_ratio"] == 4 else self.skv // 128))
        if self.op == "dsv4_prefill":  # token i: its window and min(topk, completed C4A rows)
            p = self.params
            return sum(min(p["window"], i + 1) + min(p["topk"], (i + 1) // 4) for i in range(self.skv))
        if self.op == "dsv4_compressor":  # the projection's outputs (heads 1, d the hidden size): T x 2 * coff * D
            return self.skv * 2 * 2 * self.params["dim"]
        if self.op == "dsv4_indexer_v2":  # token i may use the (i + 1) // 4 compressed keys its blocks completed
            return sum((i + 1) // 4 for i in range(self.sq))
        if self.op in NSA_INFER_OPS:  # one query per request
            return self.batch * self.decode_keys()
        if self.op in ("dsa_prefill", "dsa_decode", "dsa_kl_loss"):  # each query: min(topk, its causal keys)
            topk = self.params["topk"]
            if self.op == "dsa_decode":
                return self.batch * min(topk, self.skv)
            return sum(min(topk, i + 1) for i in range(self.sq))
        if self.op in ("nsa_decode", "nsa_prefill_decode"):  # the new tokens' selected, window and compressed keys
            p = self.params
            decode = self.op == "nsa_decode"
            new, cmp = (1, self.skv // p["stride"]) if decode else (self.skv, self.skv // (2 * p["stride"]))
            return self.batch * new * (p["count"] * p["block"] + p["window"] + cmp)
        total = 0
        for sq, skv in self.lengths:
            if self.band is not None:
                pre, nxt = self.band
                total += sum(max(0, min(skv - 1, i + nxt) - max(0, i - pre) + 1) for i in range(sq))
            elif not self.causal:
                total += sq * skv
            else:  # row i keeps keys 0..i (sparse_mode 2, is_causal=True)
                full_rows = max(0, sq - skv)  # rows i >= skv keep every key
                n = min(sq, skv)
                total += n * (n + 1) // 2 + full_rows * skv
        return total

    def forward_flops(self) -> float:
        if self.op == "host_overhead":
            return 0.0  # host work only: nothing is computed
        return 2.0 * self.heads * self.kept_pairs() * (self.d + self.dv)

    def flops(self) -> float:
        fwd = self.forward_flops()
        return {"fwd": fwd, "bwd": BWD_FACTOR * fwd, "fwd+bwd": (1 + BWD_FACTOR) * fwd}[self.mode]

    def describe(self) -> dict:
        out = asdict(self)
        out["seq_lens"] = list(self.seq_lens) if self.seq_lens else None
        out["baselines"] = list(self.baselines)
        out["flops"] = self.flops()
        out["kept_pairs"] = self.kept_pairs()
        return out


class Unavailable(Exception):
    """This implementation cannot run this case here (the message says why)."""


@dataclass
class Runnable:
    fn: Callable[[], object]
    reset: Callable[[], None] = lambda: None
    output: Callable[[], torch.Tensor | None] = lambda: None  # forward output in [B, N, S, Dv] for checks
    threads: int | None = None  # the CPU thread count its calls run with (None: the case's "threads", if any)


@dataclass
class Inputs:
    """One case's tensors in attnops' layout (``q``, ``k``, ``v``, ``dy``) and the attnops keywords."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dy: torch.Tensor
    kwargs: dict
    scale: float


def autograd_runnable(forward: Callable[..., torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor,
                      mode: str) -> Runnable:
    """fwd: forward only (no graph); fwd+bwd: forward + out.backward(dy); bwd: backward of a retained graph."""
    state: dict = {}

    def zero_grads():
        for t in leaves:
            t.grad = None

    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                state["out"] = forward(*leaves)
        return Runnable(fwd, output=lambda: state.get("out"))
    if mode == "fwd+bwd":
        def fwd_bwd():
            out = forward(*leaves)
            out.backward(dy)
            state["out"] = out.detach()
        return Runnable(fwd_bwd, reset=zero_grads, output=lambda: state.get("out"))

    out = forward(*leaves)
    state["out"] = out.detach()

    def bwd():
        torch.autograd.backward(out, dy, retain_graph=True)
    return Runnable(bwd, reset=zero_grads, output=lambda: state.get("out"))


def randn_on(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Standard normal values drawn on the CPU from ``gen``, on ``device`` in ``dtype``; on ``meta`` an empty tensor
    (nothing to draw: the host-overhead suite builds cases of full size there)."""
    if torch.device(device).type == "meta":
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
