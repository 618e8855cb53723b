"""Helpers of the FIA tests: inputs in every layout, paged caches, the seed's parameter order, and the check of an
FIA call (aclnn or Pythonic) against the fp64 golden (``attnops.testing.golden_fia``).

Tolerance (``attnops.testing.compare``): float outputs and lse may err at most 2x the golden's formula evaluated
in the input's low precision (fp16 for int8 queries), plus the dtype's rounding floor. Int8 outputs are judged
against the golden's unrounded value ``out*quant_scale2 + quant_offset2``: ``|actual - real| <= 0.5 + 2*base_err``
where ``base_err`` is the low-precision chain's error on that real value (a correct implementation rounds a value
within its own float error of the exact one).
"""
from __future__ import annotations

import inspect
import math

import torch

import attnops
import attnops.aclnn
from attnops.testing.compare import assert_close_to_golden, fia_reduction, max_abs_err
from attnops.testing.golden_fia import fia_forward_detail
from tests.helpers import randn, to_layout

F64 = torch.float64
INT_MAX = 2147483647
TRIU2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)

# The seed's GetWorkspaceSize parameters (outputs, workspaceSize and executor excluded), in order, snake_cased.
SEED_ORDER = ["query", "key", "value", "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv",
              "deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2", "antiquant_scale",
              "antiquant_offset", "block_table", "query_padding_size", "kv_padding_size", "key_antiquant_scale",
              "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset", "key_shared_prefix",
              "value_shared_prefix", "actual_shared_prefix_len", "num_heads", "scale_value", "pre_tokens",
              "next_tokens", "input_layout", "num_key_value_heads", "sparse_mode", "inner_precise", "block_size",
              "antiquant_mode", "softmax_lse_flag", "key_antiquant_mode", "value_antiquant_mode"]
DEFAULTS = dict(num_heads=1, scale_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0,
                softmax_lse_flag=False, key_antiquant_mode=0, value_antiquant_mode=0)


# --------------------------------------------------------------------------------------------- inputs
def layout_of(x_bsnd: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, S, N, D] -> the input layout (BNSD_BSND reads BNSD)."""
    return to_layout(x_bsnd, "BNSD" if layout == "BNSD_BSND" else layout)


def make_inputs(layout="BSH", *, b=2, n=2, nkv=None, sq=5, skv=7, d=16, dv=None, dtype=torch.float16, seed=0,
                scale=1.0):
    """(query, key, value) in ``layout`` from [B, S, N, D] normal samples."""
    nkv = n if nkv is None else nkv
    dv = d if dv is None else dv
    q = randn(b, sq, n, d, dtype=dtype, seed=seed, scale=scale)
    k = randn(b, skv, nkv, d, dtype=dtype, seed=seed + 1, scale=scale)
    v = randn(b, skv, nkv, dv, dtype=dtype, seed=seed + 2)
    return layout_of(q, layout), layout_of(k, layout), layout_of(v, layout)


def randint8(*shape, seed=0, lo=-127, hi=127) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int8)


def randint4(*shape, seed=0) -> torch.Tensor:
    """int4 values in [-8, 7] as int64 (pack with golden_fia.pack_int4)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, shape, generator=g, dtype=torch.int64)


def int8_output_params(shape, seed=3) -> dict:
    """``quant_scale2`` / ``quant_offset2`` of ``shape`` (per tensor or per channel) that spread unit-sized outputs
    over the int8 range."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(shape, generator=g) * 40 + 20
    return dict(quant_scale2=scale, quant_offset2=torch.randn(shape, generator=g) * 3)


def rand_mask(*shape, p=0.3, seed=0, dtype=torch.bool, keep_col0=True) -> torch.Tensor:
    """Random mask (True/1 = masked). ``keep_col0``: column 0 never masked (no fully-masked rows)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < p
    if keep_col0:
        m[..., 0] = False
    return m.to(dtype)


def bnsd(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    """Dense layout -> [B, N, S, D]."""
    if layout in ("BNSD", "BNSD_BSND"):
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    b, s, h = x.shape
    return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)


def from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout in ("BNSD", "BNSD_BSND"):
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    b, n, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()


def to_paged(kv_bnsd, lens, block_size, *, cache_layout="BSH", extra_blocks=1, seed=0, pad=-1, garbage=3.0):
    """Scatter per-batch KV ([B, N, S, D] or list of [N, S_b, D]) into a paged cache.

    Returns (cache, block_table): cache ``(blocknum, blocksize, N*D)`` (``cache_layout="BSH"``) or
    ``(blocknum, N, blocksize, D)`` (``"BNSD"``); blocks in random order, unused slots filled with garbage,
    block_table ``[B, maxblocks + 1]`` int32 padded with ``pad``.
    """
    xs = list(kv_bnsd)
    nb = [math.ceil(n_ / block_size) for n_ in lens]
    total = sum(nb) + extra_blocks
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(total, generator=g)
    nkv, d = xs[0].shape[0], xs[0].shape[-1]
    dtype = xs[0].dtype
    if dtype.is_floating_point:
        cache = (torch.randn(total, nkv, block_size, d, generator=g, dtype=F64) * garbage).to(dtype)
    else:
        cache = torch.randint(-100, 100, (total, nkv, block_size, d), generator=g).to(dtype)
    table = torch.full((len(xs), max(nb, default=0) + 1), pad, dtype=torch.int32)
    nxt = 0
    for b, x in enumerate(xs):
        for i in range(nb[b]):
            blk = int(perm[nxt])
            nxt += 1
            table[b, i] = blk
            lo, hi = i * block_size, min((i + 1) * block_size, lens[b])
            cache[blk, :, :hi - lo] = x[:, lo:hi]
    if cache_layout == "BSH":
        cache = cache.permute(0, 2, 1, 3).reshape(total, block_size, nkv * d).contiguous()
    return cache, table


# --------------------------------------------------------------------------------------------- calling
def aclnn_args(query, key, value, **kw) -> list:
    """Positional arguments of ``aclnn.fused_infer_attention_score_v2`` in the seed's order."""
    unknown = set(kw) - set(SEED_ORDER)
    if unknown:
        raise TypeError(f"unknown FIA parameters {sorted(unknown)}")
    p = dict(DEFAULTS)
    p.update(kw)
    p["query"] = query
    p["key"] = list(key) if isinstance(key, (list, tuple)) else [key]
    p["value"] = list(value) if isinstance(value, (list, tuple)) else [value]
    return [p.get(name) for name in SEED_ORDER]


def run_aclnn(query, key, value, **kw):
    return attnops.aclnn.fused_infer_attention_score_v2(*aclnn_args(query, key, value, **kw))


def run_aclnn_two_phase(query, key, value, **kw):
    ws, ex = attnops.aclnn.fused_infer_attention_score_v2_get_workspace_size(*aclnn_args(query, key, value, **kw))
    return attnops.aclnn.fused_infer_attention_score_v2(None, ws, ex, None)


# The Pythonic spelling of each seed parameter (attnops.fused_infer_attention); filled from its signature.
API_NAMES = {
    "pse_shift": ("pse_shift", "pse"),
    "atten_mask": ("atten_mask", "mask"),
    "actual_seq_lengths": ("actual_seq_lengths", "actual_seq_qlen", "actual_seq_lengths_q"),
    "actual_seq_lengths_kv": ("actual_seq_lengths_kv", "actual_seq_kvlen"),
    "num_heads": ("num_heads", "head_num"),
    "scale_value": ("scale", "scale_value"),
    "input_layout": ("layout", "input_layout"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "kv_head_num"),
    "softmax_lse_flag": ("softmax_lse_flag", "return_lse", "return_softmax_lse"),
}


def _api_params():
    return inspect.signature(attnops.fused_infer_attention).parameters


def api_kwargs(kw: dict) -> dict:
    """Seed-named keywords -> the Pythonic API's keywords (raises if a parameter has no counterpart)."""
    params = _api_params()
    out = {}
    for name, val in kw.items():
        cands = API_NAMES.get(name, (name,))
        for c in cands:
            if c in params:
                out[c] = val
                break
        else:
            raise TypeError(f"attnops.fused_infer_attention has no parameter for {name!r} (tried {cands})")
    return out


def run_api(query, key, value, **kw):
    """The Pythonic call; returns (out, lse) whatever the result type is."""
    kw = dict(kw)
    params = _api_params()
    want_lse = kw.pop("softmax_lse_flag", False)
    kw.setdefault("scale_value", 1.0)  # the Pythonic default is 1/sqrt(D); the golden's is 1.0
    kw.setdefault("input_layout", "BSH")
    kw.setdefault("num_heads", 1)
    a = api_kwargs(kw)
    lse_name = next((c for c in API_NAMES["softmax_lse_flag"] if c in params), None)
    if lse_name is not None:
        a[lse_name] = want_lse
    res = attnops.fused_infer_attention(query, key, value, **a)
    if isinstance(res, tuple):
        out, lse = res[0], (res[1] if len(res) > 1 else None)
    else:
        out = getattr(res, "out", getattr(res, "attention_out", res))
        lse = getattr(res, "softmax_lse", getattr(res, "lse", None))
    return out, lse


def run(via, query, key, value, **kw):
    if via == "aclnn":
        return run_aclnn(query, key, value, **kw)
    if via == "two_phase":
        return run_aclnn_two_phase(query, key, value, **kw)
    if via == "api":
        return run_api(query, key, value, **kw)
    raise ValueError(via)


# --------------------------------------------------------------------------------------------- judging
def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(y) for y in x)
    return x


def baseline_dtype(query) -> torch.dtype:
    return torch.float16 if query.dtype == torch.int8 else query.dtype


def expected_out_dtype(query, kw) -> torch.dtype:
    if kw.get("quant_scale2") is not None:
        return torch.int8
    return torch.float16 if query.dtype == torch.int8 else query.dtype


def assert_int8_close(name, actual, golden_real, base_real, *, factor=2.0):
    """|actual - clamp(real)| <= 0.5 + factor * base_err (+1e-6): a correct rounding of the exact value."""
    assert actual.dtype == torch.int8, (name, actual.dtype)
    g = golden_real.clamp(-128, 127)
    err = max_abs_err(actual, g)
    base = max_abs_err(base_real.clamp(-128, 127), g)
    bound = 0.5 + factor * base + 1e-6
    assert err <= bound, f"{name}: err={err:.6g} > 0.5 + {factor}*{base:.6g} = {bound:.6g}"


def golden(query, key, value, dtype=F64, **kw):
    return fia_forward_detail(_clone(query), _clone(key), _clone(value), dtype=dtype,
                              **{k_: _clone(v_) for k_, v_ in kw.items()})


def check_fia(query, key, value, *, via="aclnn", **kw):
    """Run FIA (``via`` = "aclnn", "two_phase" or "api") and judge out (and lse with softmax_lse_flag) against the
    fp64 golden. Returns dict(out=, lse=, golden=)."""
    g = golden(query, key, value, **kw)
    base = golden(query, key, value, dtype=baseline_dtype(query), **kw)
    out, lse = run(via, query, key, value, **kw)
    want = expected_out_dtype(query, kw)
    red = fia_reduction(query, key, **kw)
    assert out.dtype == want, f"attention_out dtype {out.dtype}, expected {want}"
    assert tuple(out.shape) == tuple(g.out.shape), f"attention_out shape {tuple(out.shape)}, expected " \
                                                   f"{tuple(g.out.shape)}"
    if want == torch.int8:
        assert_int8_close("attention_out", out, g.out_real, base.out_real)
    else:
        assert_close_to_golden("attention_out", out, g.out, base.out, factor=2, reduction=red)
    if kw.get("softmax_lse_flag"):
        assert lse is not None and lse.dtype == torch.float32, lse
        assert tuple(lse.shape) == tuple(g.lse.shape), f"softmax_lse shape {tuple(lse.shape)}, expected " \
                                                       f"{tuple(g.lse.shape)}"
        assert_close_to_golden("softmax_lse", lse, g.lse, base.lse, factor=2, reduction=red)
    return dict(out=out, lse=lse, golden=g)
