"""Benchmark suites: the registry of named case lists (operator, mode, shapes, dtype); the cases' type and work
model are :mod:`.types`'."""
from __future__ import annotations

from dataclasses import dataclass

from . import golden_cpu
from .decode_peers import peer_cases
from .host_overhead import host_cases
from .nsa_peers import infer_cases
from .types import MODES, Case

@dataclass(frozen=True)
class Suite:
    """A named list of cases: ``description`` is one line (suite listings), ``details`` what else a reader of the
    results needs to know."""

    name: str
    description: str
    cases: tuple[Case, ...]
    details: str = ""
    device: str = "cpu"
    repeat: int = 5
    warmup: int = 1
    multiprocess: bool = False  # cases run on spawned process groups (attnops.bench.context_parallel)
    runner: str = ""  # a module of attnops.bench with the suite's own run_suite(cases, repeat, warmup), format_row


SUITES: dict[str, Suite] = {}


def register_suite(suite: Suite) -> Suite:
    if suite.name in SUITES:
        raise ValueError(f"suite {suite.name!r} is already registered")
    SUITES[suite.name] = suite
    return suite


def _fa_cases(prefix: str, modes, causal_opts, **shape) -> tuple[Case, ...]:
    cases = []
    for causal in causal_opts:
        for mode in modes:
            tag = "causal" if causal else "full"
            cases.append(Case(name=f"{prefix}-{mode}-{tag}", mode=mode, causal=causal, **shape))
    return tuple(cases)


register_suite(Suite(
    name="fa-cpu",
    description="FlashAttention vs SDPA on the CPU: B=1, N=8, S=4096, D=128, fp32, causal and full, BNSD and BSND",
    details="SDPA is torch.nn.functional.scaled_dot_product_attention. BNSD: both take the same [B, N, S, D] "
            "tensors; BSND: attnops takes [B, S, N, D], SDPA a contiguous BNSD copy made outside the timing",
    cases=tuple(case for layout in ("BNSD", "BSND") for case in _fa_cases(
        f"fa-b1-n8-s4096-d128-fp32-{layout.lower()}", ("fwd", "fwd+bwd"), (False, True), batch=1, heads=8,
        kv_heads=8, sq=4096, skv=4096, d=128, dv=128, dtype="float32", layout=layout)),
    device="cpu", repeat=5, warmup=1))

TRAIN_CPU_SHAPES = ((1, 8, 4096, 128), (1, 8, 1024, 64), (2, 16, 1024, 64))  # (B, N, S, D)

register_suite(Suite(
    name="train-cpu",
    description="FlashAttention training vs SDPA on the CPU: fwd and fwd+bwd, fp32 and bf16, causal and full, three "
                "shapes",
    details="[B, N, S, D] = [1, 8, 4096, 128], [1, 8, 1024, 64], [2, 16, 1024, 64]; BNSD, the same tensors for both; "
            "SDPA is torch.nn.functional.scaled_dot_product_attention (ATen's fused "
            "CPU flash kernel, is_causal=True for causal), attnops causal is sparse_mode=2; repeats alternate the "
            "two implementations",
    cases=tuple(case for dt in ("float32", "bfloat16") for b, n, s, d in TRAIN_CPU_SHAPES for case in _fa_cases(
        f"fa-b{b}-n{n}-s{s}-d{d}-{'fp32' if dt == 'float32' else 'bf16'}", ("fwd", "fwd+bwd"), (False, True),
        batch=b, heads=n, kv_heads=n, sq=s, skv=s, d=d, dv=d, dtype=dt, layout="BNSD")),
    device="cpu", repeat=7, warmup=1))

register_suite(Suite(
    name="fa-cpu-long",
    description="FlashAttention on one causal 32768-token sequence on the CPU (TND, N=8, D=128, fp32): time and "
                "peak memory",
    details="Forward and backward time and peak resident memory; no baseline (SDPA's math fallback would need "
            "O(S^2) memory)",
    cases=tuple(Case(name=f"fa-tnd-t32768-n8-d128-fp32-{mode}-causal", mode=mode, heads=8, kv_heads=8, d=128, dv=128,
                     dtype="float32", causal=True, layout="TND", seq_lens=(32768,), sq=32768, skv=32768,
                     baselines=(), track_memory=True)
                for mode in ("fwd", "bwd")),
    device="cpu", repeat=1, warmup=0))

register_suite(Suite(
    name="fa-gpu",
    description="FlashAttention vs SDPA, FlexAttention and flash-attn on CUDA: B=4, N=16, S=4096, D=128, bf16 and "
                "fp16",
    details="Causal and full, fwd, bwd and fwd+bwd; SDPA with each backend (flash, efficient, cuDNN), FlexAttention "
            "compiled, flash-attn when installed",
    cases=tuple(c for dt in ("bfloat16", "float16") for c in _fa_cases(
        f"fa-b4-n16-s4096-d128-{dt}", ("fwd", "bwd", "fwd+bwd"), (False, True), batch=4, heads=16, kv_heads=16,
        sq=4096, skv=4096, d=128, dv=128, dtype=dt,
        baselines=("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "flash-attn"))),
    device="cuda", repeat=20, warmup=3))

GPU_BASELINES = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "flash-attn", "flashinfer")
TOTAL_TOKENS = 16384  # fa-gpu-targets: 16k tokens per call (batch x S), hidden 2048 (N=16, D=128), bf16


def _random_lengths(total: int, count: int, seed: int) -> tuple[int, ...]:
    """``count`` random sequence lengths summing to ``total`` (fixed by ``seed``, no torch RNG state touched)."""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), count - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


def _target_cases() -> tuple[Case, ...]:
    """The fa-gpu-targets cases: dense S = 1k..16k at 16k total tokens (fwd, bwd; causal and full), varlen TND with
    random lengths at the same total, and a 1k band (sparse_mode 4) at S = 16k; peak memory tracked."""
    shape = dict(heads=16, kv_heads=16, d=128, dv=128, dtype="bfloat16", track_memory=True)
    cases = []
    for s in (1024, 2048, 4096, 8192, 16384):
        cases += _fa_cases(f"fa-t16k-s{s}-n16-d128-bf16", ("fwd", "bwd"), (False, True), batch=TOTAL_TOKENS // s,
                           sq=s, skv=s, baselines=("sdpa",) + GPU_BASELINES, **shape)
    lens = _random_lengths(TOTAL_TOKENS, 8, seed=6)
    cases += _fa_cases("fa-t16k-tnd-random8-n16-d128-bf16", ("fwd", "bwd"), (False, True), layout="TND",
                       seq_lens=lens, sq=max(lens), skv=max(lens), baselines=("flash-attn", "flashinfer"), **shape)
    cases += [Case(name=f"fa-s16384-band1k-n16-d128-bf16-{mode}", mode=mode, batch=1, sq=16384, skv=16384,
                   params={"pre_tokens": 1024, "next_tokens": 0}, baselines=("flex", "flash-attn"), **shape)
              for mode in ("fwd", "bwd")]
    return tuple(cases)


register_suite(Suite(
    name="fa-gpu-targets",
    description="FlashAttention on CUDA at 16k tokens per call (bf16, N=16, D=128): dense S=1k..16k, varlen, a 1k "
                "band; time and peak memory",
    details="Dense causal and full fwd and bwd vs SDPA (flash, efficient, cuDNN), FlexAttention compiled, "
            "flash-attn and flashinfer when installed; varlen TND with 8 random lengths; a 1k band (sparse_mode 4) "
            "at S=16k (time vs kept area)",
    cases=_target_cases(), device="cuda", repeat=20, warmup=3))

def _dsa_cpu_cases() -> tuple[Case, ...]:
    mla = dict(kv_heads=1, d=576, dv=512, causal=True, layout="TND", baselines=("attnops-dense-rows",))
    sparse = tuple(Case(name=f"dsa-sparse-t{s}-n16-k2048-fp32-fwd", op="dsa_sparse", sq=s, skv=s, seq_lens=(s,),
                        heads=16, track_memory=True, params={"topk": 2048, "rope": 64}, **mla) for s in (8192, 32768))
    sampled = (Case(name="dsa-sparse-t32768-n128-k2048-fp32-fwd-rows16x64", op="dsa_sparse", sq=32768, skv=32768,
                    seq_lens=(32768,), heads=128, params={"topk": 2048, "rope": 64, "sample": (16, 64)}, **mla),)
    indexer = tuple(Case(name=f"dsa-indexer-t{s}-n16-d128-k2048-fp32", op="dsa_indexer", sq=s, skv=s, heads=16,
                         kv_heads=1, d=128, dv=0, causal=True, baselines=(), track_memory=True,
                         params={"topk": 2048, "rope": 0}) for s in (8192, 32768))
    return sparse + sampled + indexer


register_suite(Suite(
    name="dsa-cpu",
    description="DSA sparse attention (top-k 2048) vs dense causal FlashAttention, and the lightning indexer, CPU",
    details="One causal sequence, MLA shapes: N1=16 query heads, one latent kv head (512 + 64 rope), value = latent, "
            "fp32, forward; each row reads min(2048, i+1) keys spread over its prefix (1/8 of the causal work at "
            "32k). DeepSeek-V3.2's N1=128 at 32k times the same 16 evenly spaced chunks of 64 query rows with both "
            "(a full dense run takes about half an hour). Indexer: 16 heads of 128, causal top-2048; peak memory "
            "recorded",
    cases=_dsa_cpu_cases(), device="cpu", repeat=1, warmup=0))

register_suite(Suite(
    name="nsa-cpu",
    description="NSA selected attention vs dense causal FlashAttention on the CPU: 16384 tokens, fwd+bwd",
    details="One sequence, N1=16, N2=1, count=16, block=64, Dqk=192, Dv=128, fp32; the baseline is the dense causal "
            "attnops.flash_attention on the same q/k/v",
    cases=(Case(name="nsa-selected-t16384-n16-g16-k16-b64-fp32-fwd+bwd", op="nsa_selected", mode="fwd+bwd",
                heads=16, kv_heads=1, d=192, dv=128, layout="TND", seq_lens=(16384,), sq=16384, skv=16384,
                causal=True, baselines=("attnops-dense",), params={"block": 64, "count": 16}),),
    device="cpu", repeat=1, warmup=1))

register_suite(Suite(
    name="fia-cpu",
    description="FusedInferAttentionScore vs SDPA on the CPU: paged decode and prefill, fp32, N=32, KV_N=8, D=128",
    details="Paged decode: B=8, KV 4096, shuffled 128-token blocks; prefill: B=1, S=4096, full and causal; SDPA runs "
            "on the same data gathered into contiguous tensors",
    cases=(Case(name="fia-decode-paged-b8-kv4096-n32-kvn8-d128-fp32", op="fia_decode", batch=8, heads=32,
                kv_heads=8, sq=1, skv=4096, baselines=("sdpa-gathered",), params={"block_size": 128}),
           Case(name="fia-prefill-b1-s4096-n32-kvn8-d128-fp32-full", op="fia_prefill", batch=1, heads=32,
                kv_heads=8, sq=4096, skv=4096, baselines=("sdpa-gathered",)),
           Case(name="fia-prefill-b1-s4096-n32-kvn8-d128-fp32-causal", op="fia_prefill", batch=1, heads=32,
                kv_heads=8, sq=4096, skv=4096, causal=True, baselines=("sdpa-gathered",))),
    device="cpu", repeat=5, warmup=1))

def _decode_cases(prefix: str = "fia-decode", shapes=((1, 32768), (8, 4096)),
                  dtypes=(("float32", None), ("bfloat16", None), ("float16", None), ("float16", "int8")),
                  pages_kinds=("dense", "sequential", "shuffled"), *, heads: int = 32, kv_heads: int = 8,
                  d: int = 128) -> tuple[Case, ...]:
    """Decode (one query row) over ``(batch, KV length)`` shapes, query dtypes (int8: the KV), dense or paged KV
    (128-token pages in sequential or shuffled order), beside the read bandwidth and SDPA on the same KV."""
    cases = []
    for batch, skv in shapes:
        for dtype, kv in dtypes:
            for pages in pages_kinds:
                tag = f"{dtype}-int8kv" if kv else dtype
                cases.append(Case(name=f"{prefix}-b{batch}-kv{skv}-{tag}-{pages}", op="fia_decode", batch=batch,
                                  heads=heads, kv_heads=kv_heads, sq=1, skv=skv, d=d, dv=d, dtype=dtype,
                                  baselines=("read-bandwidth", "sdpa-gathered"),
                                  params={"pages": pages, "block_size": 128, **({"kv": kv} if kv else {})}))
    return tuple(cases)


register_suite(Suite(
    name="fia-cpu-decode",
    description="FusedInferAttention decode on the CPU vs the read bandwidth and SDPA: B=1 x 32k, B=8 x 4k, dense and paged",
    details="N=32, KV_N=8, D=128, fp32/bf16/fp16 and int8 KV; ratio read-bandwidth/attnops = the fraction of the read bandwidth (torch.sum over as many bytes as the KV, "
            "measured in the same run) at which attnops reads the KV; ratio sdpa-gathered/attnops = speed-up over SDPA "
            "on the same KV, contiguous (int8 KV: SDPA on the dequantized values); paged caches use 128-token blocks "
            "in sequential or shuffled order",
    cases=_decode_cases(), device="cpu", repeat=5, warmup=1))

register_suite(Suite(
    name="decode-cpu-peers",
    description="FIA decode on the CPU vs SDPA (GQA folded, enable_gqa), compiled flex_attention, onnxruntime GQA; 1 "
                "and 2 threads",
    details="N=32, KV_N=8, D=128, fp32/bf16/fp16 and int8 KV (bf16 query, per-channel antiquant), contiguous and "
            "paged (128-token pages, shuffled); every implementation on the case's thread count; attnops-1t: attnops "
            "on one thread in the two-thread cases; beside-load: one CPU-bound process runs meanwhile; the peers "
            "read the same K/V contiguous (int8: dequantized); 'strongest peer' names the fastest per case; ratio "
            "read-bandwidth/attnops = the fraction of the read bandwidth (torch.sum over as many bytes as the KV, same "
            "threads) at which attnops reads the KV",
    cases=peer_cases(), device="cpu", repeat=7, warmup=1))

register_suite(Suite(
    name="fia-gpu",
    description="FusedInferAttention decode on CUDA vs the HBM read bandwidth and SDPA: B=1 x 32k, B=8 x 4k, "
                "B=64 x 8k, dense and paged",
    details="N=32, KV_N=8, D=128, bf16 and bf16 with int8 KV (per-channel antiquant); paged caches use 128-token "
            "blocks in shuffled order; ratio read-bandwidth/attnops = the fraction of the read bandwidth (torch.sum "
            "over as many bytes as the KV, measured in the same run); ratio sdpa-gathered/attnops = speed-up over "
            "SDPA on the same KV, contiguous",
    cases=_decode_cases("fia-gpu-decode", ((1, 32768), (8, 4096), (64, 8192)),
                        (("bfloat16", None), ("bfloat16", "int8")), ("dense", "shuffled")),
    device="cuda", repeat=20, warmup=3))

register_suite(Suite(
    name="fia-smoke",
    description="Tiny FusedInferAttention decode cases (seconds on any device): the runner end to end",
    cases=_decode_cases("fia-smoke-decode", ((2, 512),), (("float32", None), ("float16", "int8")),
                        ("dense", "shuffled"), heads=4, kv_heads=2, d=32),
    device="cpu", repeat=3, warmup=1))

register_suite(Suite(
    name="fa-cpu-dropout",
    description="The cost of dropout on the CPU: causal FlashAttention fwd+bwd without dropout, Philox 0.9, packed 0.9",
    details="B=1, N=8, S=512, D=64, fp32, BNSD, causal, forward+backward without dropout, with keep_prob=0.9 from a "
            "Philox seed, and from a packed drop_mask",
    cases=tuple(Case(name=f"fa-b1-n8-s512-d64-fp32-bnsd-fwd+bwd-causal-{tag}", mode="fwd+bwd", batch=1, heads=8,
                     kv_heads=8, sq=512, skv=512, d=64, dv=64, dtype="float32", causal=True, layout="BNSD",
                     baselines=(), params=params)
                for tag, params in (("nodrop", {}), ("philox0.9", {"keep_prob": 0.9}),
                                    ("packed0.9", {"keep_prob": 0.9, "drop_mask": True}))),
    device="cpu", repeat=10, warmup=1))

register_suite(Suite(
    name="fa-smoke",
    description="Tiny FlashAttention cases (seconds on any device): checks that the runner works end to end",
    cases=_fa_cases("fa-b1-n2-s256-d64-fp32", ("fwd", "bwd", "fwd+bwd"), (False, True), batch=1, heads=2,
                    kv_heads=2, sq=256, skv=256, d=64, dv=64, dtype="float32", track_memory=True),
    device="cpu", repeat=3, warmup=1))


def _nsa_cases(prefix: str, lengths, dims, modes, *, heads: int, kv_heads: int, dtype: str, baselines) -> tuple:
    """NSA selected attention (every mode) and the whole layer (fwd, fwd+bwd) on one causal sequence per length:
    block 64, top-16, window 512 (the layer: compression blocks of 32 every 16 tokens)."""
    params = {"block": 64, "count": 16, "window": 512, "stride": 16}
    cases = []
    for t in lengths:
        for d, dv in dims:
            shape = dict(heads=heads, kv_heads=kv_heads, d=d, dv=dv, dtype=dtype, layout="TND", seq_lens=(t,), sq=t,
                         skv=t, causal=True, baselines=baselines, params=params)
            tag = f"t{t}-n{heads}-kv{kv_heads}-d{d}-dv{dv}-{dtype}"
            cases += [Case(name=f"{prefix}-selected-{tag}-{mode}-causal", op="nsa_selected", mode=mode, **shape)
                      for mode in modes]
            cases += [Case(name=f"{prefix}-layer-{tag}-{mode}-causal", op="nsa_layer", mode=mode, **shape)
                      for mode in modes if mode != "bwd"]
    return tuple(cases)


register_suite(Suite(
    name="nsa-gpu",
    description="NSA selected attention and the whole layer vs dense causal attention on CUDA: T=8k..64k, 64/4 heads, "
                "bf16",
    details="One causal sequence of T = 8k, 16k, 32k, 64k tokens, N1=64, N2=4, D=128 and D=192/Dv=128, bf16; "
            "selection blocks of 64 tokens, top-16 (each token its own and the preceding blocks), window 512, "
            "compression blocks of 32 every 16 tokens; baselines: attnops.flash_attention (causal) and SDPA's flash "
            "backend (causal) on the same q/k/v. FLOPs count the kept (query, key) pairs: count*block per token "
            "(selected), plus the window and ~T/32 compressed keys per token (layer)",
    cases=_nsa_cases("nsa", (8192, 16384, 32768, 65536), ((128, 128), (192, 128)), MODES, heads=64, kv_heads=4,
                     dtype="bfloat16", baselines=("attnops-dense", "sdpa-flash")),
    device="cuda", repeat=10, warmup=2))

register_suite(Suite(
    name="nsa-smoke",
    description="Tiny NSA cases (seconds on any device): selected attention and the layer through the runner",
    cases=_nsa_cases("nsa-smoke", (1024,), ((32, 32),), MODES, heads=4, kv_heads=1, dtype="float32",
                     baselines=("sdpa",)),
    device="cpu", repeat=3, warmup=1))


def _dsa_cases(prefix: str, lengths, decode, *, heads: int, index_heads: int, topk: int, dtype: str) -> tuple:
    """DSA sparse attention prefill (vs the dense causal MHA prefill of the same tokens), the lightning indexer and
    the indexer KL loss (loss and gradients) over the same tokens, and decode (``(requests, context)`` pairs)."""
    mla = dict(heads=heads, kv_heads=1, d=576, dv=512, dtype=dtype, causal=True, params={"topk": topk})
    cases = []
    for t in lengths:
        cases.append(Case(name=f"{prefix}-prefill-t{t}-n{heads}-top{topk}-{dtype}", op="dsa_prefill", sq=t, skv=t,
                          baselines=("attnops-dense-mha",), **mla))
        cases.append(Case(name=f"{prefix}-indexer-t{t}-n{index_heads}-top{topk}-{dtype}", op="dsa_indexer", sq=t,
                          skv=t, heads=index_heads, kv_heads=1, d=128, dv=0, dtype=dtype, causal=True,
                          params={"topk": topk, "rope": 0}, baselines=()))
        cases.append(Case(name=f"{prefix}-kl-loss-t{t}-n{heads}-i{index_heads}-top{topk}-{dtype}", op="dsa_kl_loss",
                          sq=t, skv=t, baselines=(), **{**mla, "dv": 0,
                                                        "params": {"topk": topk, "index_heads": index_heads}}))
    for b, ctx in decode:
        cases.append(Case(name=f"{prefix}-decode-b{b}-kv{ctx}-n{heads}-top{topk}-{dtype}", op="dsa_decode", batch=b,
                          sq=1, skv=ctx, baselines=(), **mla))
    return tuple(cases)


register_suite(Suite(
    name="dsa-gpu",
    description="DSA on CUDA: sparse prefill (top-2048) vs dense causal attention at 8k/32k/128k, indexer, paged decode; "
                "bf16",
    details="DeepSeek-V3.2 shapes: 128 query heads, MLA-absorbed latent 512 + rope 64 shared by every head, top-2048 "
            "(each token its own and the preceding positions); baseline attnops-dense-mha: dense causal "
            "attnops.flash_attention of the same tokens in the non-absorbed form (128 heads, D=192, Dv=128). Indexer: "
            "64 heads x 128, weighted ReLU scores and top-2048 per token. KL loss: the indexer's loss and gradients "
            "over the prefill's selection (64 index heads x 128). Decode: one token per request over a paged "
            "cache (blocks of 64). FLOPs: 2*N1*kept*(576+512) with kept = min(2048, causal keys) per token (sparse), "
            "the causal pairs for the dense baseline and the indexer (2*64*128 per pair), the KL loss's attention "
            "scores (2*N1*576 per kept pair; its index products are not counted)",
    cases=_dsa_cases("dsa", (8192, 32768, 131072), ((1, 32768), (64, 8192), (128, 131072)), heads=128,
                     index_heads=64, topk=2048, dtype="bfloat16"),
    device="cuda", repeat=10, warmup=2))

register_suite(Suite(
    name="dsa-smoke",
    description="Tiny DSA cases (seconds on any device): sparse prefill, indexer and decode through the runner",
    cases=_dsa_cases("dsa-smoke", (256,), ((2, 256),), heads=4, index_heads=4, topk=64, dtype="float32"),
    device="cpu", repeat=2, warmup=1))


def _nsa_decode_cases() -> tuple[Case, ...]:
    """Module decode at 16k vs recomputing the layer; prefill + decode at 2k..16k (time, peak memory)."""
    shape = dict(batch=1, heads=8, kv_heads=2, d=64, dv=64, sq=1, dtype="float32",
                 params={"hidden": 512, "block": 64, "count": 16, "window": 512, "stride": 16, "steps": 16,
                         "chunk": 1024})
    decode = Case(name="nsa-module-decode-t16384-n8-kvn2-d64-fp32", op="nsa_decode", skv=16384,
                  baselines=("nsa-recompute",), **shape)
    memory = tuple(Case(name=f"nsa-module-prefill-decode-t{t}-n8-kvn2-d64-fp32", op="nsa_prefill_decode", skv=t,
                        baselines=(), track_memory=True, **shape) for t in (2048, 4096, 8192, 16384))
    return (decode, *memory, *infer_cases())


register_suite(Suite(
    name="nsa-cpu-decode",
    description="NSA decoding on the CPU: the module's step with NSACache vs recomputing, its memory; the decode "
                "operators vs their PyTorch peers",
    details="attnops.nn.NativeSparseAttention(hidden 512, N1=8, N2=2, D=64, compression 32/16, selection 64 x 16, "
            "window 512), fp32, B=1. nsa-module-decode: one token appended to a cache prefilled with 16384 tokens "
            "(each timed call on a fresh copy); baseline nsa-recompute: the module's forward over all 16385 tokens, "
            "its last output compared. nsa-module-prefill-decode: a fresh cache, prefill of T-16 tokens in chunks of "
            "1024, 16 decode steps; time and peak resident memory. nsa-selected-infer / nsa-compress-infer: "
            "the decode operators alone, N1=32, N2=8, D=128, paged caches in shuffled 64-token pages, B=1 x 32k and "
            "B=8 x 4k contexts, every implementation on the case's thread count: 16 selected blocks of 64 per "
            "request and KV head, or the context's compressed keys (stride 16) and the next step's 16 blocks. "
            "Peers, from the same paged caches each call: sdpa-folded-gather (the selected rows gathered, SDPA with "
            "the GQA group folded into the query rows), flex-paged (compiled flex_attention over the paged cache "
            "with a block mask of the selected pages), sdpa-folded-scores / matmul-folded-scores (the compressed "
            "keys gathered, the output by SDPA or from the fp32 probabilities, and the same block scores and top-k; "
            "flex_attention returns no probabilities, so it is no peer there); 'strongest peer' names the fastest "
            "per case. ratio read-bandwidth/attnops = the fraction of the read bandwidth (torch.sum over as many "
            "bytes as the keys and values read); attnops-1t: attnops on one thread in the two-thread cases",
    cases=_nsa_decode_cases(), device="cpu", repeat=2, warmup=1))


_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _dsv4_decode_cases(prefix: str = "dsv4", context: int = 131072, dtype: str = "float32") -> tuple[Case, ...]:
    """A CSA and an HCA decode step (64 heads) vs dense SDPA."""
    return tuple(Case(name=f"{prefix}-decode-{kind}-t{context}-n64-d512-w128-{keys}-{_SHORT_DTYPES[dtype]}",
                      op="dsv4_decode", heads=64, kv_heads=1, sq=1, skv=context, d=512, dv=512, dtype=dtype,
                      baselines=("sdpa-dense-folded",),
                      params={"window": 128, "topk": 512, "block": 64, "cmp_ratio": ratio})
                 for kind, keys, ratio in (("csa", "top512", 4), ("hca", "c128", 128)))


def _dsv4_prefill_cases(lengths=(8192, 16384, 32768), prefix: str = "dsv4", heads: int = 8,
                        dtype: str = "float32") -> tuple[Case, ...]:
    """A CSA layer's prefill with its peak memory."""
    return tuple(Case(name=f"{prefix}-prefill-csa-t{t}-n{heads}-d512-w128-top512-{_SHORT_DTYPES[dtype]}",
                      op="dsv4_prefill", heads=heads, kv_heads=1, sq=t, skv=t, d=512, dv=512, dtype=dtype,
                      baselines=(), track_memory=True, params={"window": 128, "topk": 512, "cmp_ratio": 4})
                 for t in lengths)


_DSV4_SETUP = ("attnops.sparse_flash_mla, fp32, B=1, one shared KV head, D=512, window 128 (the latest tokens, the "
               "new one included), per-head sinks. ")

register_suite(Suite(
    name="dsv4-cpu-decode",
    description="DeepSeek-V4 attention on the CPU: a CSA and an HCA layer's decode step at 128k vs dense SDPA",
    details=_DSV4_SETUP + "One layer's step at a 131072-token context, N1=64, paged caches in shuffled 64-token "
            "blocks: csa = the window + 512 random rows of the 32768 C4A rows, hca = the window + all 1024 C128A "
            "rows; baseline sdpa-dense-folded: one dense step of torch.nn.functional.scaled_dot_product_attention "
            "over all 131072 keys (= values) with the 64 heads folded into 64 query rows of the one KV head (its "
            "strongest CPU configuration). Repeats interleave attnops and the baseline",
    cases=_dsv4_decode_cases(), device="cpu", repeat=15, warmup=2))

register_suite(Suite(
    name="dsv4-cpu-prefill",
    description="DeepSeek-V4 attention on the CPU: a CSA layer's prefill at 8k..32k, time and peak memory",
    details=_DSV4_SETUP + "A CSA layer's causal prefill (BSND, N1=8, C4A rows given), each token reading its window "
            "and min(512, its completed C4A rows) rows spread over them; peak resident memory grows linearly with "
            "the length (no [S, S] or [S, S/4] matrix). Run with --isolate: each case in a fresh process",
    cases=_dsv4_prefill_cases(), device="cpu", repeat=1, warmup=0))

register_suite(Suite(
    name="dsv4-gpu",
    description="DeepSeek-V4 attention on CUDA (Triton kernels): CSA prefill at 8k/32k, CSA and HCA decode at 128k "
                "vs dense SDPA; bf16",
    details="attnops.sparse_flash_mla, bf16, B=1, one shared KV head, D=512, N1=64, window 128, per-head sinks. "
            "Prefill: a CSA layer's causal prefill (BSND), each token reading its window and min(512, its completed "
            "C4A rows) rows; decode: one step at a 131072-token context over paged caches in shuffled 64-token blocks "
            "(csa = the window + 512 of the 32768 C4A rows, hca = the window + all 1024 C128A rows); baseline "
            "sdpa-dense-folded: one dense SDPA step over all 131072 keys with the heads folded into query rows",
    cases=_dsv4_prefill_cases((8192, 32768), heads=64, dtype="bfloat16") + _dsv4_decode_cases(dtype="bfloat16"),
    device="cuda", repeat=10, warmup=2))

register_suite(Suite(
    name="dsv4-smoke",
    description="Tiny DeepSeek-V4 attention cases (seconds on any device): CSA prefill and the decode steps through "
                "the runner",
    cases=_dsv4_prefill_cases((256,), prefix="dsv4-smoke", heads=4) + _dsv4_decode_cases("dsv4-smoke", 1024),
    device="cpu", repeat=2, warmup=1))


def _dsv4_kernel_cases(prefix: str, lengths, *, hidden: int, dim: int, heads: int, topk: int, dtype: str) -> tuple:
    """A C4A compressor prefill and the lightning indexer v2 over the same tokens' compressed keys."""
    cases = []
    for t in lengths:
        cases.append(Case(name=f"{prefix}-compressor-c4a-t{t}-h{hidden}-d{dim}-{dtype}", op="dsv4_compressor",
                          heads=1, kv_heads=1, sq=t, skv=t, d=hidden, dv=0, dtype=dtype, baselines=(),
                          params={"dim": dim, "block": 128}))
        cases.append(Case(name=f"{prefix}-indexer-v2-t{t}-n{heads}-top{topk}-{dtype}", op="dsv4_indexer_v2",
                          heads=heads, kv_heads=1, sq=t, skv=t // 4, d=128, dv=0, dtype=dtype, baselines=(),
                          params={"topk": topk}))
    return tuple(cases)


register_suite(Suite(
    name="dsv4-kernels-gpu",
    description="DeepSeek-V4 compressor (C4A prefill) and lightning indexer v2 (top-512) on CUDA at 8k/32k; bf16",
    details="Compressor: one request's C4A prefill from position 0, hidden size 4096, D=512, coff 2, ratio 4, a paged "
            "fp32 state (blocks of 128); FLOPs = the projection's 2*T*4096*2048. Indexer v2: 64 heads x 128 over the "
            "T/4 compressed keys, mask mode 3 (ratio 4), top-512 as in DSV4-Flash; FLOPs = 2*64*128 per allowed "
            "(token, compressed key) pair",
    cases=_dsv4_kernel_cases("dsv4-kernels", (8192, 32768), hidden=4096, dim=512, heads=64, topk=512,
                             dtype="bfloat16"),
    device="cuda", repeat=10, warmup=2))

register_suite(Suite(
    name="dsv4-kernels-smoke",
    description="Tiny DeepSeek-V4 compressor and indexer v2 cases (seconds on any device) through the runner",
    cases=_dsv4_kernel_cases("dsv4-kernels-smoke", (256,), hidden=64, dim=32, heads=4, topk=16, dtype="float32"),
    device="cpu", repeat=2, warmup=1))


def _host_cases() -> tuple[Case, ...]:
    return host_cases()


register_suite(Suite(
    name="host-overhead",
    description="Host (Python + dispatch) cost of one call on the Triton path, launches recorded on meta tensors",
    details="Each call runs inside attnops.testing.gpu_dry_run on meta tensors: the GPU path is planned and its "
            "launches recorded, not run, so the time is the host work a GPU call does before its asynchronous "
            "launches. Baseline custom-op-floor: a torch.library custom op on the same tensors that only allocates its "
            "output (and gradients): the least any custom-op design pays; ratio custom-op-floor/attnops = that "
            "floor as a fraction of attnops' cost",
    cases=_host_cases(), device="meta", repeat=200, warmup=20))


def _cp_cases() -> tuple[Case, ...]:
    from .context_parallel import cp_cases

    return cp_cases()


register_suite(Suite(
    name="cp-cpu",
    description="Context parallelism on CPU Gloo: time per step and bytes sent per rank, per mode, at 1/2/4 processes",
    details="Ring, Ulysses, KV all-gather (head-tail) and hybrid (2 x 2) causal FlashAttention forward + backward, "
            "BSND fp32, N1=8, N2=2, D=64, 512 tokens per rank (global sequence = 512 x world size); step time: median "
            "over the repetitions on rank 0; bytes: sent per rank per layer, counted around the collectives (the "
            "cross-rank argument check off); the formulas are in docs/distributed.md",
    cases=_cp_cases(), device="cpu", repeat=3, warmup=1, multiprocess=True))


register_suite(Suite(
    name="golden-cpu",
    description="Judging NPU calls on the CPU: attnops compare and the fp64 golden vs msprobe's bench function",
    details="CPU time (user + system, all threads) and peak RSS of fresh subprocesses, medians of the repeats: "
            "'python -m attnops compare' on a dump of one causal npu_fusion_attention call, forward + backward, "
            "BNSD bf16 (golden and NPU emulation of each; the imports included), and msprobe's "
            "npu_fusion_attention + npu_fusion_attention_grad bench functions against attnops' "
            "(attnops.msprobe.bench_functions) on the same arguments (the calls only; msprobe's skipped without "
            "mindstudio-probe)",
    cases=golden_cpu.CASES, device="cpu", repeat=3, warmup=0, runner="golden_cpu"))


def suite_cases(name: str, pattern: str | None = None) -> list[Case]:
    """The cases of suite ``name`` whose name contains ``pattern`` (all when None)."""
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; known: {sorted(SUITES)}")
    return [c for c in SUITES[name].cases if pattern is None or pattern in c.name]
