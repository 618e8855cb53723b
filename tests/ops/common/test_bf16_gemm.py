"""The bf16 x bf16 -> fp32 GEMM of the CPU attention engine (``cpu_kernels/gemm_bf16.cpp``): products against fp64
ones of the same operands (odd sizes, register-tile and panel tails, strided operands, both layouts of B, alpha,
accumulation, non-finite values), argument checks, the dS formed in the dP GEMM's registers, the operands'
transpose, the choice of the bf16 products (only where the build and the CPU have AVX512-BF16), and the
FlashAttention engine on its bf16 and fp32 products against the fp64 golden."""
import os
from pathlib import Path

import pytest
import torch

import attnops
from attnops.ops.common import bf16_gemm, cpu_kernels, fused_softmax, tile_products
from attnops.ops.common import reference_tiles as tiling
from tests.helpers import TRIU2048, check_fa, make_qkv

BF16, F32 = torch.bfloat16, torch.float32
needs_gemm = pytest.mark.skipif(not bf16_gemm.bf16_gemm(torch.device("cpu")),
                                reason="no AVX512-BF16 in this CPU or the kernels library")


def _operands(m: int, n: int, k: int, nt: bool, seed: int, pad: int = 0):
    """``a`` [m, k], ``b`` ([n, k] when ``nt``, else [k, n]) in bf16, as views with ``pad`` extra columns per row."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k + pad, generator=g).to(BF16)[:, :k]
    rows, cols = (n, k) if nt else (k, n)
    b = torch.randn(rows, cols + pad, generator=g).to(BF16)[:, :cols]
    return a, b


def _check(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, nt: bool, alpha: float = 1.0,
           c0: torch.Tensor | None = None) -> None:
    """``c`` equals ``alpha * a @ b (+ c0)`` up to the rounding of an fp32 sum: the products of bf16 pairs are
    exact, so each element may differ from the fp64 result by at most (terms) * eps * the sum of |terms|."""
    b2 = b.double().t() if nt else b.double()
    ref = alpha * (a.double() @ b2)
    bound = abs(alpha) * (a.double().abs() @ b2.abs())
    if c0 is not None:
        ref, bound = ref + c0.double(), bound + c0.double().abs()
    terms = a.shape[1] + 2
    err = (c.double() - ref).abs()
    assert bool((err <= terms * torch.finfo(F32).eps * bound + 1e-30).all()), float(err.max())


@needs_gemm
@pytest.mark.parametrize("nt", [True, False], ids=["nt", "nn"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 5, 3), (6, 64, 2), (13, 70, 33), (19, 130, 300),
                                     (64, 16, 513)])
def test_products(nt, m, n, k):
    """Odd and even reduction lengths (a last unpaired step), several reduction blocks (k > 256), row tails of
    the 6-row register tile, column tails of the 64-column panels; strided rows of every operand."""
    a, b = _operands(m, n, k, nt, seed=m * 1000 + n + k, pad=3)
    store = torch.full((m, n + 5), 7.0)
    c = store[:, 2:2 + n]  # strided output: the columns around it must stay untouched
    bf16_gemm.gemm_(c, a, b, b_nt=nt)
    _check(c, a, b, nt)
    assert bool((store[:, :2] == 7.0).all() and (store[:, 2 + n:] == 7.0).all())
    torch.testing.assert_close(c, a.float() @ (b.float().t() if nt else b.float()),
                               rtol=(k + 2) * torch.finfo(F32).eps, atol=1e-5 * k)


@needs_gemm
@pytest.mark.parametrize("nt", [True, False], ids=["nt", "nn"])
def test_alpha_and_accumulate(nt):
    a, b = _operands(11, 37, 21, nt, seed=5)
    c0 = torch.randn(11, 37)
    c = c0.clone()
    bf16_gemm.gemm_(c, a, b, b_nt=nt, alpha=0.125, accumulate=True)
    _check(c, a, b, nt, alpha=0.125, c0=c0)
    bf16_gemm.gemm_(c, a, b, b_nt=nt, alpha=-3.0)  # without accumulate the old content is overwritten
    _check(c, a, b, nt, alpha=-3.0)


@needs_gemm
def test_empty_reduction_and_nonfinite_values():
    a, b = _operands(4, 9, 0, True, seed=1)
    c = torch.full((4, 9), 3.0)
    bf16_gemm.gemm_(c, a, b, b_nt=True)
    assert bool((c == 0).all())
    a, b = _operands(8, 70, 5, False, seed=2)
    a[3, 1] = float("inf")
    b[2, 4] = float("nan")
    c = torch.empty(8, 70)
    bf16_gemm.gemm_(c, a, b, b_nt=False)
    assert bool(c[:, 4].isnan().all()) and bool(c[3].isinf().logical_or(c[3].isnan()).all())
    rest = torch.ones_like(c, dtype=torch.bool)
    rest[:, 4] = False
    rest[3] = False
    assert bool(c[rest].isfinite().all())  # zero padding of the panels spreads nothing


@needs_gemm
def test_argument_checks():
    a, b = _operands(4, 6, 8, True, seed=3)
    bad = [(torch.empty(4, 7), a, b, True), (torch.empty(4, 6), a.t().contiguous().t(), b, True),
           (torch.empty(4, 6), a.float(), b, True), (torch.empty(4, 6), a, b, False),
           (torch.empty(4, 6, dtype=BF16), a, b, True), (torch.empty(6, 4).t(), a, b, True)]
    for out, a_, b_, nt in bad:
        with pytest.raises(ValueError, match="bf16 GEMM: .* expected a"):
            bf16_gemm.gemm_(out, a_, b_, b_nt=nt)



@needs_gemm
@pytest.mark.parametrize("unit_zero", [False, True])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 70, 33), (13, 130, 64), (19, 17, 256)])
def test_score_gradient(m, n, k, unit_zero):
    """dS from the dP GEMM's registers equals, bit for bit, the dP GEMM followed by the fused softmax's dS pass and
    its bf16 copy (strided tiles; entries with P == 1, zeroed under unit_zero; register-tile and panel tails)."""
    a, b = _operands(m, n, k, True, seed=m + n + k, pad=3)
    g = torch.Generator().manual_seed(k)
    p = torch.rand(m, n + 2, generator=g)[:, 1:1 + n]
    p[::3, ::4] = 1.0
    delta = torch.randn(m, 1, generator=g)
    ds16 = torch.full((m, n + 4), 5.0, dtype=BF16)
    bf16_gemm.grad_gemm_(ds16[:, 2:2 + n], a, b, p, delta, unit_zero)
    dp = bf16_gemm.gemm_(torch.empty(m, n), a, b, b_nt=True)
    expected = torch.empty(m, n, dtype=BF16)
    fused_softmax.grad_(p.clone(), dp, delta, unit_zero, expected)
    assert torch.equal(ds16[:, 2:2 + n], expected)
    assert bool((ds16[:, :2] == 5.0).all() and (ds16[:, 2 + n:] == 5.0).all())
    with pytest.raises(ValueError, match=r"bf16 GEMM \(dS\): .* 0 < K <= 256"):
        a, b = _operands(m, n, 257, True, seed=0)
        bf16_gemm.grad_gemm_(torch.empty(m, n, dtype=BF16), a, b, p, delta, unit_zero)


@needs_gemm
@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 70), (33, 16), (512, 64)])
def test_transpose(rows, cols):
    """The blocked transpose of the dK/dV GEMMs' operands: every element moved (block tails, strided rows), the
    columns beside the output untouched, bad shapes refused."""
    x = torch.randn(rows, cols + 3).to(BF16)[:, 1:1 + cols]
    store = torch.full((cols, rows + 4), 9.0, dtype=BF16)
    bf16_gemm.transpose_(store[:, 2:2 + rows], x)
    assert torch.equal(store[:, 2:2 + rows], x.t())
    assert bool((store[:, :2] == 9.0).all() and (store[:, 2 + rows:] == 9.0).all())
    with pytest.raises(ValueError, match="bf16 transpose: .* expected x"):
        bf16_gemm.transpose_(torch.empty(cols + 1, rows, dtype=BF16), x)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {w for line in text.splitlines() if line.startswith("flags") for w in line.partition(":")[2].split()}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo to read the CPU's features from")
def test_chosen_only_with_avx512_bf16():
    """The bf16 products serve bf16 calls only where the CPU has AVX512-BF16, and there whenever the kernels
    library is a native build (AVX2-only and aarch64 machines, portable builds and ATTNOPS_CPU_KERNELS=0 keep the
    fp32 products)."""
    cpu = torch.device("cpu")
    has = "avx512_bf16" in _cpu_flags()
    native = (os.environ.get("ATTNOPS_CPU_ARCH") or "native") == "native"
    assert not bf16_gemm.bf16_gemm(cpu) or has
    assert bf16_gemm.bf16_gemm(cpu) or not (has and native and cpu_kernels.library() is not None)
    assert bf16_gemm.bf16_gemm(torch.device("meta")) is False


_EITHER_UNIT = """
import torch
from attnops.ops.common import bf16_gemm
from tests.ops.common.test_bf16_gemm import _check, _operands
for m, n, k, nt in ((1, 1, 1, True), (13, 70, 33, False), (19, 130, 300, True), (40, 64, 513, False)):
    a, b = _operands(m, n, k, nt, seed=m + n + k, pad=3)
    c = bf16_gemm.gemm_(torch.full((m, n), 7.0), a, b, b_nt=nt, alpha=0.5)
    _check(c, a, b, nt, alpha=0.5)
print(bf16_gemm.unit())
"""


@needs_gemm
@pytest.mark.skipif("amx_bf16" not in _cpu_flags(), reason="no AMX-BF16 in this CPU")
def test_products_on_either_unit():
    """Where the CPU has AMX-BF16 the products run on the tile unit, and on AVX512-BF16 with ATTNOPS_CPU_AMX=0 (read
    once per process, so each in a fresh one): both give the fp64 products within an fp32 sum's rounding (register
    and tile-block tails, several reduction blocks, both layouts of B)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    for setting, unit in (("1", "AMX-BF16"), ("0", "AVX512-BF16")):
        env = {**os.environ, "ATTNOPS_CPU_AMX": setting}
        done = subprocess.run([sys.executable, "-c", _EITHER_UNIT], cwd=root, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [unit]


def test_operand_dtype(monkeypatch):
    """bf16 operands only for bf16 inputs (with or without an NPU rounding), and only where the GEMM runs."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(tile_products, "bf16_gemm", lambda device: True)
    assert tile_products.operand_dtype(BF16, cpu) == BF16
    for dtype, acc in ((torch.float16, F32), (F32, F32), (torch.float64, torch.float64)):
        assert tile_products.operand_dtype(dtype, cpu) == acc
    monkeypatch.setattr(tile_products, "bf16_gemm", lambda device: False)
    assert tile_products.operand_dtype(BF16, cpu) == F32


@pytest.mark.parametrize("products", ["bf16", "fp32"])
def test_engine_bf16_on_both_products(monkeypatch, products):
    """bf16 FlashAttention forward and backward against the fp64 golden with the bf16 products (where the CPU has
    them) and with the fp32 products of the widened operands: GQA, causal rows of several chunks, a band wider than
    one forward block (the online softmax), head dims with tails, a strided (BSND) layout."""
    if products == "bf16" and not bf16_gemm.bf16_gemm(torch.device("cpu")):
        pytest.skip("no AVX512-BF16 in this CPU or the kernels library")
    if products == "fp32":
        monkeypatch.setenv("ATTNOPS_CPU_BF16_GEMM", "0")
    calls = []
    for name in ("gemm_", "ForwardTiles", "BackwardTiles"):  # the bf16 products, one by one or in one call
        real = getattr(tile_products, name)
        monkeypatch.setattr(tile_products, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(tiling, "FWD_COL_BLOCK", 48)
    q, k, v, dy = make_qkv("BSND", b=2, n1=4, n2=2, sq=150, skv=130, d=40, dtype=BF16, seed=11)
    check_fa(q, k, v, dy, layout="BSND", head_num=4, scale=40 ** -0.5, sparse_mode=3,
             atten_mask=TRIU2048)
    assert bool(calls) == (products == "bf16")


@needs_gemm
def test_error_is_the_npu_rounding(monkeypatch):
    """The bf16 products round P as the NPU does (to the input dtype before P V), so their error against the fp64
    golden is the NPU emulation's (precision="npu"), about 1.35x the RMSE of fp32 products then cast: over several
    key blocks with a causal mask (docs/precision.md)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 128, generator=g).to(BF16) for s in (256, 1300, 1300))
    s = (q.double() @ k.double().transpose(-1, -2)) * 128 ** -0.5
    golden = s.masked_fill(torch.ones(256, 1300, dtype=torch.bool).triu(1300 - 256 + 1), float("-inf")).softmax(-1)
    golden = golden @ v.double()

    def rmse(**kw):
        return float((attnops.flash_attention(q, k, v, causal=True, **kw).double() - golden).pow(2).mean().sqrt())

    fast, npu = rmse(), rmse(precision="npu")
    monkeypatch.setenv("ATTNOPS_CPU_BF16_GEMM", "0")
    exact = rmse()
    assert 1.15 < fast / exact < 1.6
    assert 0.8 < fast / npu < 1.1
