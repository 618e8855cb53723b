"""The ``host-overhead`` suite: the host (Python and dispatch) cost of one call on the Triton path.

Every call runs inside :func:`attnops.testing.gpu_dry_run` on ``meta`` tensors: the Triton path is planned as for a
GPU and its launches are recorded instead of run, and ``meta`` tensors have no data, so what is timed is exactly the
host work a GPU call would do before its (asynchronous) launches: validation, dispatch, metadata, allocation, launch
planning. Scenarios (``case.params["scenario"]``): ``fa`` (FlashAttention, the case's mode), ``fia-run`` (a paged
decode step through a :func:`attnops.fused_infer_attention_plan` made beforehand, untimed), ``fia-call`` (the same
step as one :func:`attnops.fused_infer_attention` call, repeated as across the layers of a model step), ``npu-fia``
and ``npu-paged`` (the same step through the torch_npu shim's ``npu_fused_infer_attention_score`` and
``_npu_paged_attention``, as vllm-ascend-style callers make it), ``fia-prefill`` (chunked prefill: ``sq`` new tokens per
sequence over ``skv`` cached ones, one call), ``nsa-layer`` (:func:`attnops.native_sparse_attention` on ``seq_lens``,
its gates and learned compression weights given, the case's mode) and ``nsa-decode`` (one token through
:class:`attnops.nn.NativeSparseAttention` with an :class:`~attnops.nn.NSACache` prefilled with ``skv`` tokens,
truncated back before every call). A paged case with ``params["host_table"]`` holds every tensor on the CPU instead,
with a block table of real (shuffled) page ids, so that any host work per page would show. PyTorch runs elementwise
ops on ``meta`` through Python decompositions (tens to hundreds of microseconds each, where a GPU launch costs 5-10),
so paths made of many small ops read high.

The baseline ``custom-op-floor`` is the least any custom-op design pays: a ``torch.library`` custom op that takes the
same tensors and only allocates its output (with an autograd formula that only allocates the gradients), measured in
the same run (for the NSA decode step: on its one input). ``params["limit_s"]``: the case's limit on the median
(the runner prints whether it is met).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .types import Case, Inputs, Runnable, autograd_runnable

META = torch.device("meta")


PAGE = 128  # tokens per page of the paged scenarios
DECODE_LIMIT_S = 150e-6  # one decode call (FIA, its torch_npu forms), planned or not
NSA_LAYER_LIMIT_S = 5e-3  # NSA layer forward + backward
NSA_DECODE_LIMIT_S = 1e-3  # one decoding step of the NSA module
DSA_PREFILL_LIMIT_S = 1e-3  # DSA sparse prefill (one sequence)
DSA_INDEXER_LIMIT_S = 250e-6  # the lightning indexer (one sequence)
NSA_LAYER = dict(compress_block_size=32, compress_stride=16, select_block_size=64, select_block_count=16,
                 window_size=512)  # the layer's defaults, written out


def host_inputs(case: Case, device: torch.device, seed: int):
    """The case's tensors: ``meta`` (``device`` must be ``meta``: the suite times host work only), or for a
    ``host_table`` case CPU tensors (never written: allocated, not touched)."""
    if device.type != "meta":
        raise ValueError(f"the host-overhead suite runs on the meta device (got {device}): it times host work only")
    scenario = case.params.get("scenario", "fa")
    dt = getattr(torch, case.dtype)
    if scenario == "fa":
        shape_q, shape_kv = (case.batch, case.heads, case.sq, case.d), (case.batch, case.kv_heads, case.skv, case.d)
        q, k, v, dy = (torch.empty(s, dtype=dt, device=META) for s in (shape_q, shape_kv, shape_kv, shape_q))
        return Inputs(q, k, v, dy, dict(causal=case.causal), case.d ** -0.5)
    if scenario == "nsa-layer":
        t = sum(case.seq_lens)
        q, k, v, dy = (_meta((t, n, d), dt) for n, d in ((case.heads, case.d), (case.kv_heads, case.d),
                                                          (case.kv_heads, case.dv), (case.heads, case.dv)))
        extra = [_meta((t, case.heads, 3), dt)] + [_meta((NSA_LAYER["compress_block_size"], case.kv_heads), dt)] * 2
        cum = [sum(case.seq_lens[:i]) for i in range(len(case.seq_lens) + 1)]
        return Inputs(q, k, v, dy, dict(NSA_LAYER, cu_seqlens=cum, extra=extra), case.d ** -0.5)
    if scenario == "nsa-decode":
        return _decode_inputs(case, dt)
    if scenario == "dsa":
        return _dsa_module(case).dsa_inputs(_dsa_case(case), device, seed)
    where = torch.device("cpu") if case.params.get("host_table") else META
    pages = -(-case.skv // PAGE)
    q = torch.empty(case.batch, case.heads, case.sq, case.d, dtype=dt, device=where)
    cache = torch.empty(case.batch * pages, case.kv_heads, PAGE, case.d, dtype=dt, device=where)
    ids = torch.randperm(case.batch * pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = ids.view(case.batch, pages) if where.type == "cpu" else torch.empty(case.batch, pages,
                                                                                 dtype=torch.int32, device=META)
    kw = dict(num_heads=case.heads, num_key_value_heads=case.kv_heads, block_table=table, block_size=PAGE,
              actual_seq_lengths_kv=[case.skv] * case.batch, causal=case.causal)
    if scenario == "fia-prefill":
        kw["actual_seq_lengths"] = [case.sq] * case.batch
    return Inputs(q, cache, cache, q, kw, case.d ** -0.5)


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _decode_inputs(case: Case, dtype: torch.dtype):
    """The module (on ``meta``), its cache prefilled with ``skv`` tokens (in a dry run, untimed) and the next token."""
    from ..nn import NativeSparseAttention
    p = case.params
    m = NativeSparseAttention(p["hidden"], case.heads, case.kv_heads, case.d).to(device=META, dtype=dtype)
    cache = m.new_cache(case.batch, max_seq_len=p["max_seq_len"])
    with torch.no_grad():
        _dry(lambda: m(_meta((case.batch, case.skv, p["hidden"]), dtype), cache=cache))()
    x = _meta((case.batch, 1, p["hidden"]), dtype)
    return Inputs(x, None, None, None, dict(module=m, cache=cache), case.d ** -0.5)


def _dsa_case(case: Case) -> Case:
    """The case as the DSA suites' builders take it (``params["dsa_op"]``: dsa_prefill, dsa_decode, dsa_indexer)."""
    return dataclasses.replace(case, op=case.params["dsa_op"])


def _dsa_module(case: Case):
    from . import dsa, dsa_gpu

    return dsa if case.params["dsa_op"] == "dsa_indexer" else dsa_gpu


def _dry(call):
    """``call`` run inside a dry run without the host-read guard (the guard's own dispatch mode would be timed)."""
    from .._core.triton import dry_run

    def fn():
        run = dry_run.push()
        try:
            return call()
        finally:
            dry_run.pop(run)
    return fn


def build_host(case: Case, inp, device: torch.device):
    """One attnops call of the case's scenario on the Triton path (launches recorded, not run)."""
    import attnops

    scenario = case.params.get("scenario", "fa")
    if scenario == "fa":
        leaves = [t.detach().requires_grad_(case.mode != "fwd") for t in (inp.q, inp.k, inp.v)]
        r = autograd_runnable(lambda q, k, v: attnops.flash_attention(q, k, v, **inp.kwargs), leaves, inp.dy,
                               case.mode)
        return Runnable(_dry(r.fn), r.reset)
    if scenario == "nsa-layer":
        kw = dict(inp.kwargs)
        tensors = [inp.q, inp.k, inp.v, *kw.pop("extra")]
        leaves = [t.detach().requires_grad_(case.mode != "fwd") for t in tensors]
        r = autograd_runnable(lambda *x: attnops.native_sparse_attention(*x, **kw), leaves, inp.dy, case.mode)
        return Runnable(_dry(r.fn), r.reset)
    if scenario == "nsa-decode":
        m, cache = inp.kwargs["module"], inp.kwargs["cache"]

        def step():
            with torch.no_grad():
                m(inp.q, cache=cache)
        return Runnable(_dry(step), lambda: cache.truncate(case.skv))
    if scenario == "dsa":
        return Runnable(_dry(_dsa_module(case).build_dsa(_dsa_case(case), inp, device).fn))
    if scenario == "fia-run":
        plan = _dry(lambda: attnops.fused_infer_attention_plan(inp.q, inp.k, inp.v, **inp.kwargs))()
        if not plan.kernels:
            raise RuntimeError("the decode plan does not run on the Triton decode kernels")
        table = inp.kwargs["block_table"]
        return Runnable(_dry(lambda: plan.run(inp.q, inp.k, inp.v, block_table=table)))
    if scenario.startswith("npu-"):
        return Runnable(_dry(_npu_call(case, inp)))
    return Runnable(_dry(lambda: attnops.fused_infer_attention(inp.q, inp.k, inp.v, **inp.kwargs)))


def _npu_call(case: Case, inp):
    """The decode as vllm-ascend-style callers make it through the torch_npu shim: ``npu-fia``
    (``npu_fused_infer_attention_score``, BSH query, ``[blocks, 128, N2*D]`` caches) or ``npu-paged``
    (``_npu_paged_attention``, ``[tokens, N, D]`` query, ``[blocks, 128, N2, D]`` caches, host ``context_lens``,
    written into ``out``)."""
    from .. import torch_npu

    kw, q, dev = inp.kwargs, inp.q, inp.q.device
    blocks = inp.k.shape[0]
    if case.params["scenario"] == "npu-fia":
        query = q.view(case.batch, 1, case.heads * case.d)
        cache = torch.empty(blocks, PAGE, case.kv_heads * case.d, dtype=q.dtype, device=dev)
        return lambda: torch_npu.npu_fused_infer_attention_score(
            query, cache, cache, num_heads=case.heads, num_key_value_heads=case.kv_heads, input_layout="BSH",
            scale=case.d ** -0.5, block_table=kw["block_table"], block_size=PAGE,
            actual_seq_lengths_kv=kw["actual_seq_lengths_kv"])
    query = q.view(case.batch, case.heads, case.d)
    cache = torch.empty(blocks, PAGE, case.kv_heads, case.d, dtype=q.dtype, device=dev)
    lens, out = torch.tensor(kw["actual_seq_lengths_kv"], dtype=torch.int32), _like(query)
    return lambda: torch_npu._npu_paged_attention(query, cache, cache, case.kv_heads, case.heads, case.d ** -0.5,
                                                  kw["block_table"], lens, out)


def _like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s shape, dtype and device (``torch.empty_like`` is a slow Python kernel on ``meta``)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@functools.cache
def _floor_op():
    """``attnops_bench::floor(q, k, v) -> empty(q.shape)``, differentiable (the backward allocates three
    gradients)."""
    @torch.library.custom_op("attnops_bench::floor", mutates_args=(), device_types=("cpu", "cuda", "meta"))
    def floor(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return _like(query)

    @floor.register_fake
    def _(query, key, value):
        return _like(query)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        return tuple(_like(t) for t in ctx.saved_tensors)

    floor.register_autograd(backward, setup_context=setup)
    return floor


def build_floor(case: Case, inp, device: torch.device):
    """The ``custom-op-floor`` baseline: one trivial custom op call (and its backward) on the same tensors."""
    q = inp.q if case.mode == "fwd" or inp.dy.shape == inp.q.shape else _like(inp.dy)  # the output's shape (NSA: Dv)
    tensors = (q, inp.k, inp.v) if inp.k is not None else (q,) * 3  # the NSA decode step: one input
    leaves = [t.detach().requires_grad_(case.mode != "fwd") for t in tensors]
    return autograd_runnable(_floor_op(), leaves, inp.dy, case.mode)


def host_cases() -> tuple[Case, ...]:
    """FlashAttention forward and forward+backward, [2, 16, 4096, 128] fp16, full and causal; FusedInferAttention
    paged decode (N1=32, N2=8, D=128, fp16, 128-token pages) at B=1 x 32k and B=64 x 8k through a plan, as one
    call and through the torch_npu shim (FIA and ``_npu_paged_attention``), the B=64 plan, one call and shim FIA once
    more with CPU tensors and a shuffled block table, and chunked prefill (B=4 x 512 new
    tokens over 4k cached, causal); the NSA layer forward and forward+backward on two sequences of 2048 tokens (16
    query heads, 1 KV head, D=192, Dv=128, fp16) and the NSA module's decoding step at context 4096 (B=2, hidden
    2048, 16 query heads, 1 KV head, D=128, fp16)."""
    shape = dict(op="host_overhead", batch=2, heads=16, kv_heads=16, sq=4096, skv=4096, d=128, dv=128,
                 dtype="float16", layout="BNSD", baselines=("custom-op-floor",))
    fa = tuple(Case(name=f"host-fa-b2-n16-s4096-d128-fp16-{mode}-{'causal' if causal else 'full'}", mode=mode,
                    causal=causal, **shape) for mode in ("fwd", "fwd+bwd") for causal in (False, True))
    fia = dict(op="host_overhead", heads=32, kv_heads=8, d=128, dv=128, dtype="float16", layout="BNSD",
               baselines=("custom-op-floor",))
    decode = tuple(Case(name=f"host-fia-decode-{kind}-b{b}-kv{s}-n32-kvn8-d128-fp16", batch=b, sq=1, skv=s,
                        params={"scenario": f"fia-{kind}", "limit_s": DECODE_LIMIT_S}, **fia)
                   for kind in ("run", "call") for b, s in ((1, 32768), (64, 8192)))
    shuffled = tuple(Case(name=f"host-{name}-b64-kv8192-n32-kvn8-d128-fp16-cpu-shuffled", batch=64, sq=1, skv=8192,
                          params={"scenario": scenario, "host_table": True, "limit_s": DECODE_LIMIT_S}, **fia)
                     for name, scenario in (("fia-decode-run", "fia-run"), ("fia-decode-call", "fia-call"),
                                            ("npu-fia-decode", "npu-fia")))  # npu-paged: its out.copy_ would copy
    npu = tuple(Case(name=f"host-{name}-b{b}-kv{s}-n32-kvn8-d128-fp16", batch=b, sq=1, skv=s,
                     params={"scenario": scenario, "limit_s": DECODE_LIMIT_S}, **fia)
                for name, scenario in (("npu-fia-decode", "npu-fia"), ("npu-paged-attention", "npu-paged"))
                for b, s in ((1, 32768), (64, 8192)))
    prefill = Case(name="host-fia-chunked-prefill-b4-q512-kv4096-n32-kvn8-d128-fp16", batch=4, sq=512, skv=4096,
                   causal=True, params={"scenario": "fia-prefill"}, **fia)
    layer = dict(op="host_overhead", heads=16, kv_heads=1, d=192, dv=128, dtype="float16", layout="TND",
                 seq_lens=(2048, 2048), causal=True, baselines=("custom-op-floor",), params={"scenario": "nsa-layer"})
    nsa = (Case(name="host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd", mode="fwd", **layer),
           Case(name="host-nsa-layer-t4096-2x2048-n16-kvn1-d192-dv128-fp16-fwd+bwd", mode="fwd+bwd",
                **dict(layer, params=dict(layer["params"], limit_s=NSA_LAYER_LIMIT_S))))
    nsa_decode = Case(name="host-nsa-module-decode-b2-ctx4096-n16-kvn1-d128-fp16", op="host_overhead", batch=2,
                      heads=16, kv_heads=1, sq=1, skv=4096, d=128, dv=128, dtype="float16", layout="BSND", causal=True,
                      baselines=("custom-op-floor",), params={"scenario": "nsa-decode", "hidden": 2048, "max_seq_len": 8192,
                              "limit_s": NSA_DECODE_LIMIT_S})
    return (*fa, *decode, *npu, *shuffled, prefill, *nsa, nsa_decode, *_dsa_host_cases())


def _dsa_host_cases() -> tuple[Case, ...]:
    """DSA at DeepSeek-V3.2 shapes (bf16, top-2048; the dsa-gpu suite's): sparse prefill over 4096 tokens (128 heads,
    latent 512 + rope 64), the lightning indexer over the same tokens (64 heads x 128), paged decode at B=1 x 32k
    and B=64 x 8k."""
    mla = dict(op="host_overhead", heads=128, kv_heads=1, d=576, dv=512, dtype="bfloat16", causal=True,
               baselines=("custom-op-floor",))
    params = dict(scenario="dsa", topk=2048)
    return (Case(name="host-dsa-prefill-t4096-n128-top2048-bf16", sq=4096, skv=4096,
                 params=dict(params, dsa_op="dsa_prefill", limit_s=DSA_PREFILL_LIMIT_S), **mla),
            Case(name="host-dsa-indexer-t4096-n64-top2048-bf16", sq=4096, skv=4096,
                 params=dict(params, dsa_op="dsa_indexer", rope=0, limit_s=DSA_INDEXER_LIMIT_S),
                 **dict(mla, heads=64, d=128, dv=0)),
            *(Case(name=f"host-dsa-decode-b{b}-kv{ctx}-n128-top2048-bf16", batch=b, sq=1, skv=ctx,
                   params=dict(params, dsa_op="dsa_decode", limit_s=DECODE_LIMIT_S), **mla)
              for b, ctx in ((1, 32768), (64, 8192))))
