"""What is timed: attnops and the baselines, as zero-argument callables built once per (case, device).

Every builder returns a :class:`Runnable` (``fn`` runs one timed call, ``reset`` runs before it, untimed) or
raises :class:`Unavailable` with the reason (missing package, unsupported dtype/layout/device), which the runner
records as a skipped row. Inputs are random normal, the same for every implementation (seeded).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._core.dropout import pack_bits
from .types import DSV4_KERNEL_OPS, DSV4_OPS, NSA_INFER_OPS, Case, Inputs, Runnable, Unavailable, autograd_runnable

CAUSAL_MASK_SIZE = 2048  # CANN's compressed causal mask for sparse_mode 2


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    if case.op in ("nsa_decode", "nsa_prefill_decode"):
        from . import nsa_decode

        return nsa_decode.decode_inputs(case, device, seed)
    if case.op in NSA_INFER_OPS:
        return _nsa_decode().infer_inputs(case, device, seed)
    if case.op == "host_overhead":
        return _host_overhead().host_inputs(case, device, seed)
    if case.op in ("dsa_prefill", "dsa_decode", "dsa_kl_loss"):
        return _dsa_gpu().dsa_inputs(case, device, seed)
    if case.op in ("dsa_sparse", "dsa_indexer"):
        from . import dsa

        return dsa.dsa_inputs(case, device, seed)
    if case.op in DSV4_OPS:
        return _dsv4().dsv4_inputs(case, device, seed)
    if case.op in DSV4_KERNEL_OPS:
        from . import dsv4_kernels

        return dsv4_kernels.kernel_inputs(case, device, seed)
    if case.op != "flash_attention":
        from . import sparse_infer

        return {"nsa_selected": sparse_infer.nsa_inputs, "nsa_layer": sparse_infer.nsa_inputs,
                "fia_decode": sparse_infer.fia_inputs,
                "fia_prefill": sparse_infer.fia_inputs}[case.op](case, device, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = _dtype(case.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dt)

    scale = 1.0 / math.sqrt(case.d)
    kw: dict = dict(layout=case.layout, head_num=case.heads, scale=scale)
    if case.layout == "TND":
        tq = sum(case.seq_lens)
        q, k, v, dy = (randn(tq, case.heads, case.d), randn(tq, case.kv_heads, case.d),
                       randn(tq, case.kv_heads, case.dv), randn(tq, case.heads, case.dv))
        cum = [sum(case.seq_lens[:i + 1]) for i in range(len(case.seq_lens))]
        kw.update(actual_seq_qlen=cum, actual_seq_kvlen=cum)
    elif case.layout in ("BSND", "BNSD"):
        q, k, v, dy = (randn(case.batch, case.sq, case.heads, case.d),
                       randn(case.batch, case.skv, case.kv_heads, case.d),
                       randn(case.batch, case.skv, case.kv_heads, case.dv),
                       randn(case.batch, case.sq, case.heads, case.dv))
        if case.layout == "BNSD":  # the same values, laid out as SDPA takes them
            q, k, v, dy = (t.transpose(1, 2).contiguous() for t in (q, k, v, dy))
    else:
        raise ValueError(f"benchmark cases use layout BSND, BNSD or TND, got {case.layout!r}")
    compressed = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device).triu(1)
    if case.band is not None:
        kw.update(atten_mask=compressed, sparse_mode=4, pre_tokens=case.band[0], next_tokens=case.band[1])
    elif case.causal:
        kw.update(atten_mask=compressed, sparse_mode=2)
    if "keep_prob" in case.params:  # dropout: Philox seed/offset, or a random packed mask ("drop_mask": True)
        kw.update(keep_prob=case.params["keep_prob"], seed=1234, offset=0)
        if case.params.get("drop_mask"):
            numel = case.heads * sum(sq * skv for sq, skv in case.lengths)
            keep = torch.rand(numel, generator=gen) < case.params["keep_prob"]
            kw.update(drop_mask=pack_bits(keep).to(device), seed=None)
    return Inputs(q, k, v, dy, kw, scale)


def _to_bnsd(x: torch.Tensor, case: Case) -> torch.Tensor:
    """attnops layout -> contiguous [B, N, S, D] (what SDPA/Flex prefer; the very tensor for BNSD cases; one TND
    sequence as a batch of one)."""
    if case.layout == "TND":
        if len(case.seq_lens) != 1:
            raise Unavailable("needs a dense [B, N, S, D] layout (case is TND with several sequences)")
        return x.transpose(0, 1).unsqueeze(0).contiguous()
    return x if case.layout == "BNSD" else x.transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------------------- attnops


def build_attnops(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    """The Pythonic API (custom op + autograd): the reference on the CPU, the Triton kernels on CUDA (``auto``; a call
    the Triton verifier refuses runs the reference and logs why)."""
    import attnops

    if case.op == "host_overhead":
        return _host_overhead().build_host(case, inp, device)
    if case.op in ("dsa_prefill", "dsa_decode"):
        return _dsa_gpu().build_dsa(case, inp, device)
    if case.op == "dsa_kl_loss":
        return _dsa_gpu().build_kl_loss(case, inp, device)
    if case.op in ("dsa_sparse", "dsa_indexer"):
        from . import dsa

        return dsa.build_dsa(case, inp, device)
    if case.op in DSV4_OPS:
        return _dsv4().build_dsv4(case, inp, device)
    if case.op in DSV4_KERNEL_OPS:
        from . import dsv4_kernels

        return dsv4_kernels.build_kernel_case(case, inp, device)
    if case.op in ("nsa_decode", "nsa_prefill_decode"):
        from . import nsa_decode

        return (nsa_decode.build_decode if case.op == "nsa_decode" else nsa_decode.build_prefill_decode)(
            case, inp, device)
    if case.op in NSA_INFER_OPS:
        return _nsa_decode().build_infer(case, inp, device)
    if case.op != "flash_attention":
        from . import sparse_infer

        return {"nsa_selected": sparse_infer.build_nsa_selected, "nsa_layer": sparse_infer.build_nsa_layer}.get(
            case.op, sparse_infer.build_fia)(case, inp, device)
    kw = inp.kwargs
    leaves = [t.detach().clone().requires_grad_(case.mode != "fwd") for t in (inp.q, inp.k, inp.v)]

    def to_bnsd(out):
        return None if out is None or case.layout == "TND" else out if case.layout == "BNSD" else out.transpose(1, 2)

    if case.mode == "bwd":
        with torch.no_grad():
            res = attnops.flash_attention(*leaves, return_stats=True, **kw)

        def bwd():
            return attnops.flash_attention_backward(inp.dy, *leaves, res.out, res.softmax_max, res.softmax_sum, **kw)
        return Runnable(bwd, output=lambda: to_bnsd(res.out))
    r = autograd_runnable(lambda q, k, v: attnops.flash_attention(q, k, v, **kw), leaves, inp.dy, case.mode)
    out_fn = r.output
    r.output = lambda: to_bnsd(out_fn())
    return r


def build_attnops_one_thread(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    """attnops on one thread (in the two-thread cases of the CPU decode suites: the ratio ``attnops-1t / attnops``
    is what the second thread gains)."""
    r = build_attnops(case, inp, device)
    r.threads = 1
    return r


# ------------------------------------------------------------------------------------------------ baselines


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa-math": SDPBackend.MATH, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def build_sdpa(case: Case, inp: Inputs, device: torch.device, name: str = "sdpa") -> Runnable:
    """torch.nn.functional.scaled_dot_product_attention (default dispatch, or one forced backend)."""
    import contextlib

    import torch.nn.functional as F

    if name not in ("sdpa", "sdpa-math") and device.type != "cuda":
        raise Unavailable(f"{name} is a CUDA backend")
    if case.band is not None:
        raise Unavailable("SDPA takes a band only as an S x S mask tensor (not what this case measures)")
    q, k, v, dy = (_to_bnsd(t, case) for t in (inp.q, inp.k, inp.v, inp.dy))
    leaves = [t.requires_grad_(case.mode != "fwd") for t in (q, k, v)]
    gqa = case.heads != case.kv_heads

    def ctx():
        if name == "sdpa":
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel([_sdpa_backend(name)])

    def forward(q_, k_, v_):
        with ctx():
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=case.causal, scale=inp.scale, enable_gqa=gqa)

    try:  # the forced backends raise on unsupported inputs: report that as unavailable
        with torch.no_grad():
            forward(*leaves)
    except RuntimeError as e:
        raise Unavailable(str(e).splitlines()[0][:200]) from None
    return autograd_runnable(forward, leaves, dy, case.mode)


def build_flex(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    """FlexAttention compiled with torch.compile (causal through a block mask)."""
    if device.type != "cuda":
        raise Unavailable("FlexAttention is benchmarked compiled on CUDA only")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Unavailable(f"FlexAttention not available: {e}") from None
    q, k, v, dy = (_to_bnsd(t, case) for t in (inp.q, inp.k, inp.v, inp.dy))
    leaves = [t.requires_grad_(case.mode != "fwd") for t in (q, k, v)]
    block_mask = None
    if case.band is not None:
        pre, nxt = case.band
        block_mask = create_block_mask(lambda b, h, qi, ki: (ki - qi >= -pre) & (ki - qi <= nxt), None, None,
                                       case.sq, case.skv, device=device)
    elif case.causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, case.sq, case.skv, device=device)
    compiled = torch.compile(flex_attention)
    gqa = case.heads != case.kv_heads
    return autograd_runnable(lambda q_, k_, v_: compiled(q_, k_, v_, block_mask=block_mask, scale=inp.scale,
                                                          enable_gqa=gqa), leaves, dy, case.mode)


def build_flash_attn(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    """Tri Dao's flash-attn package (flash_attn_func; varlen for TND), when importable."""
    if device.type != "cuda":
        raise Unavailable("flash-attn needs CUDA")
    try:
        import flash_attn
    except ImportError:
        raise Unavailable("flash-attn is not installed") from None
    if case.dtype not in ("float16", "bfloat16"):
        raise Unavailable("flash-attn supports fp16/bf16 only")
    if case.layout == "BNSD":
        raise Unavailable("flash-attn takes BSND or varlen tensors")
    leaves = [t.detach().clone().requires_grad_(case.mode != "fwd") for t in (inp.q, inp.k, inp.v)]
    window = (-1, -1) if case.band is None else case.band  # (left, right) = (pre_tokens, next_tokens)
    if case.layout == "TND":
        cu = torch.tensor([0] + inp.kwargs["actual_seq_qlen"], dtype=torch.int32, device=device)
        mx = max(case.seq_lens)

        def forward(q, k, v):
            return flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, softmax_scale=inp.scale,
                                                     causal=case.causal, window_size=window)
    else:
        def forward(q, k, v):  # BSND is flash-attn's native layout
            return flash_attn.flash_attn_func(q, k, v, softmax_scale=inp.scale, causal=case.causal,
                                              window_size=window)
    r = autograd_runnable(forward, leaves, inp.dy, case.mode)
    out_fn = r.output
    r.output = lambda: None if case.layout == "TND" or out_fn() is None else out_fn().transpose(1, 2)
    return r


def build_flashinfer(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    """FlashInfer's ragged-KV batch prefill (forward only; dense cases as equal-length ragged batches)."""
    if device.type != "cuda":
        raise Unavailable("flashinfer needs CUDA")
    if case.mode != "fwd":
        raise Unavailable("flashinfer has no backward")
    if case.band is not None:
        raise Unavailable("the band case is measured against FlexAttention and flash-attn")
    if case.layout == "BNSD":
        raise Unavailable("flashinfer's ragged prefill takes [T, N, D] tensors")
    try:
        import flashinfer
    except ImportError:
        raise Unavailable("flashinfer is not installed") from None
    lens = [s for s, _ in case.lengths]
    indptr = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)
    q, k, v = (t.reshape(-1, t.shape[-2], t.shape[-1]) for t in (inp.q, inp.k, inp.v))  # [T, N, D]
    state: dict = {}
    try:
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD")
        wrapper.plan(indptr, indptr, case.heads, case.kv_heads, case.d, causal=case.causal, sm_scale=inp.scale)
        wrapper.run(q, k, v)
    except (TypeError, AttributeError, RuntimeError, ValueError) as e:  # API differences between versions
        raise Unavailable(f"flashinfer: {str(e).splitlines()[0][:200]}") from None

    def fwd():
        state["out"] = wrapper.run(q, k, v)
    to_bnsd = (lambda o: None if o is None or case.layout == "TND"
               else o.view(case.batch, case.sq, case.heads, case.dv).transpose(1, 2))
    return Runnable(fwd, output=lambda: to_bnsd(state.get("out")))


BUILDERS: dict[str, Callable[[Case, Inputs, torch.device], Runnable]] = {
    "attnops": build_attnops,
    "sdpa": build_sdpa,
    "sdpa-math": lambda c, i, d: build_sdpa(c, i, d, "sdpa-math"),
    "sdpa-flash": lambda c, i, d: build_sdpa(c, i, d, "sdpa-flash"),
    "sdpa-efficient": lambda c, i, d: build_sdpa(c, i, d, "sdpa-efficient"),
    "sdpa-cudnn": lambda c, i, d: build_sdpa(c, i, d, "sdpa-cudnn"),
    "flex": build_flex,
    "flash-attn": build_flash_attn,
    "flashinfer": build_flashinfer,
    "attnops-dense": lambda c, i, d: _sparse_infer().build_dense_causal(c, i, d),
    "attnops-dense-rows": lambda c, i, d: _dsa().build_dense_rows(c, i, d),
    "sdpa-gathered": lambda c, i, d: _sparse_infer().build_sdpa_gathered(c, i, d),
    "read-bandwidth": lambda c, i, d: _sparse_infer().build_read_bandwidth(c, i, d),
    "nsa-recompute": lambda c, i, d: _nsa_decode().build_recompute(c, i, d),
    "custom-op-floor": lambda c, i, d: _host_overhead().build_floor(c, i, d),
    "attnops-dense-mha": lambda c, i, d: _dsa_gpu().build_dense_mha(c, i, d),
    "sdpa-dense-folded": lambda c, i, d: _dsv4().build_dense_folded(c, i, d),
    "sdpa-folded": lambda c, i, d: _decode_peers().build_sdpa_folded(c, i, d),
    "flex-folded": lambda c, i, d: _decode_peers().build_flex_folded(c, i, d),
    "ort-gqa": lambda c, i, d: _decode_peers().build_ort_gqa(c, i, d),
    "attnops-1t": lambda c, i, d: build_attnops_one_thread(c, i, d),
    "sdpa-folded-gather": lambda c, i, d: _nsa_peers().build_selected_sdpa(c, i, d),
    "flex-paged": lambda c, i, d: _nsa_peers().build_selected_flex(c, i, d),
    "sdpa-folded-scores": lambda c, i, d: _nsa_peers().build_compress_peer(c, i, d, fused_softmax=True),
    "matmul-folded-scores": lambda c, i, d: _nsa_peers().build_compress_peer(c, i, d, fused_softmax=False),
}
NOT_PEERS = ("read-bandwidth", "custom-op-floor", "nsa-recompute")  # references, not other libraries


def is_peer(name: str) -> bool:
    """Whether baseline ``name`` is another library's implementation (not attnops on other settings, nor a
    reference such as the read bandwidth)."""
    return not name.startswith("attnops") and name not in NOT_PEERS


def _decode_peers():
    from . import decode_peers

    return decode_peers


def _nsa_peers():
    from . import nsa_peers

    return nsa_peers


def _host_overhead():
    from . import host_overhead

    return host_overhead


def _dsa_gpu():
    from . import dsa_gpu

    return dsa_gpu


def _dsv4():
    from . import dsv4

    return dsv4


def _dsa():
    from . import dsa

    return dsa


def _nsa_decode():
    from . import nsa_decode

    return nsa_decode


def _sparse_infer():
    from . import sparse_infer

    return sparse_infer
OURS = "attnops"
