"""attnops._core.gemm: oneDNN's GEMM where it is fast, torch.mm elsewhere; both give the product, and the
FlashAttention reference matches the golden on either path (tiny shapes normally stay on torch.mm, so the oneDNN
path is forced here)."""
import pytest
import torch

from attnops._core import gemm
from attnops.ops.common import reference_tiles
from tests.helpers import TRIU2048, check_fa, cum, make_qkv, randn

ONEDNN = gemm._onednn() is not None


@pytest.fixture(params=["onednn", "torch.mm"])
def path(request, monkeypatch):
    if request.param == "onednn":
        if not ONEDNN:
            pytest.skip("this PyTorch has no oneDNN linear")
        monkeypatch.setattr(gemm, "ONEDNN_MIN_FLOPS", 0)
    else:
        monkeypatch.setattr(gemm, "_onednn", lambda: None)
    return request.param


def _exact(x, w):
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("w_layout", ["row-major", "transposed"])
def test_mm_nt_and_add_mm_nt_give_the_product(path, w_layout):
    x = randn(37, 24, seed=1)
    w = randn(29, 24, seed=2) if w_layout == "row-major" else randn(24, 29, seed=2).t()
    assert gemm.use_onednn(x, w) == (path == "onednn")
    torch.testing.assert_close(gemm.mm_nt(x, w), _exact(x, w), rtol=1e-5, atol=1e-5)
    acc = randn(37, 29, seed=3)
    expected = acc + _exact(x, w)
    torch.testing.assert_close(gemm.add_mm_nt_(acc, x, w), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc, expected, rtol=1e-5, atol=1e-5)


def test_fallback_writes_into_the_workspace(path):
    x, w = randn(8, 4, seed=1), randn(6, 4, seed=2)
    out = torch.empty(8, 6)
    y = gemm.mm_nt(x, w, out=out)
    assert (y.data_ptr() == out.data_ptr()) == (path == "torch.mm")
    torch.testing.assert_close(y, _exact(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ONEDNN, reason="this PyTorch has no oneDNN linear")
def test_operands_onednn_would_run_slowly_or_cannot_take_stay_on_torch_mm(monkeypatch):
    monkeypatch.setattr(gemm, "ONEDNN_MIN_FLOPS", 0)
    x = randn(8, 16, seed=1)
    w = randn(12, 32, seed=2)
    assert gemm.use_onednn(x, w[:, :16].contiguous())
    assert not gemm.use_onednn(x, w[:, :16])  # strided rows: oneDNN's reference kernel, 1000x slower
    assert not gemm.use_onednn(randn(16, 8, seed=3).t(), w[:, :16].contiguous())  # x with a strided last dim
    assert not gemm.use_onednn(x.double(), w[:, :16].double().contiguous())  # no fp64 in oneDNN
    monkeypatch.setattr(gemm, "ONEDNN_MIN_FLOPS", 1 << 21)
    assert not gemm.use_onednn(x, w[:, :16].contiguous())  # small: torch.mm is as fast


@pytest.mark.parametrize("w_layout", ["row-major", "transposed"])
def test_a_packed_operand_gives_the_product(path, w_layout):
    w = randn(29, 24, seed=2) if w_layout == "row-major" else randn(24, 29, seed=2).t()
    packed = gemm.pack_nt(w, 16)
    assert (packed is not None) == (path == "onednn" and gemm._onednn_pack() is not None)
    for rows in (1, 16, 37):  # any row count, not only the one packed for
        x = randn(rows, 24, seed=rows)
        torch.testing.assert_close(gemm.mm_nt(x, w, packed=packed), _exact(x, w), rtol=1e-5, atol=1e-5)


def test_operands_not_for_onednn_are_not_packed(monkeypatch):
    monkeypatch.setattr(gemm, "ONEDNN_MIN_FLOPS", 0)
    w = randn(12, 32, seed=2)
    assert gemm.pack_nt(w[:, :16], 8) is None  # strided rows
    assert gemm.pack_nt(w.double(), 8) is None
    monkeypatch.setattr(gemm, "ONEDNN_MIN_FLOPS", 1 << 21)
    assert gemm.pack_nt(w, 8) is None  # small: torch.mm


CASES = {
    "bsnd_causal_gqa": lambda: (make_qkv("BSND", b=1, n1=4, n2=2, sq=40, skv=40, seed=1),
                                dict(layout="BSND", head_num=4, atten_mask=TRIU2048, sparse_mode=2)),
    "bsnd_full_gqa": lambda: (make_qkv("BSND", b=1, n1=4, n2=2, sq=40, skv=36, seed=5),
                              dict(layout="BSND", head_num=4)),
    "tnd_band_fp16": lambda: (
        make_qkv("TND", n1=2, q_lens=[9, 0, 17], kv_lens=[12, 3, 17], dtype=torch.float16, seed=2),
        dict(layout="TND", head_num=2, actual_seq_qlen=cum([9, 0, 17]), actual_seq_kvlen=cum([12, 3, 17]),
             atten_mask=TRIU2048, sparse_mode=4, pre_tokens=5, next_tokens=2)),
    "bnsd_pse_dropout_dv": lambda: (make_qkv("BNSD", b=2, n1=2, sq=11, skv=13, d=8, dv=6, seed=3),
                                    dict(layout="BNSD", head_num=2, pse=randn(1, 2, 11, 13, seed=4),
                                         keep_prob=0.7)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attention_matches_the_golden_on_each_gemm_path(case, path):
    (q, k, v, dy), kw = CASES[case]()
    check_fa(q, k, v, dy, scale=q.shape[-1] ** -0.5, **kw)


@pytest.mark.parametrize("case", ["bsnd_full_gqa", "bnsd_pse_dropout_dv"])  # (causal chunks share no key block)
def test_flash_attention_with_packed_keys_matches_the_golden(case, monkeypatch):
    """Row chunks of a few rows, so the forward's jobs read a key block several times and pack it."""
    if not ONEDNN or gemm._onednn_pack() is None:
        pytest.skip("this PyTorch cannot pack oneDNN operands")
    monkeypatch.setattr(gemm, "ONEDNN_MIN_FLOPS", 0)
    monkeypatch.setattr(reference_tiles, "MAX_ROWS", 4)
    monkeypatch.setattr(reference_tiles, "EDGE_ROWS", 4)
    monkeypatch.setattr(reference_tiles, "MIN_ROWS", 4)
    packs = []
    monkeypatch.setattr(reference_tiles, "pack_nt", lambda w, rows: packs.append(w.shape) or gemm.pack_nt(w, rows))
    (q, k, v, dy), kw = CASES[case]()
    check_fa(q, k, v, dy, scale=q.shape[-1] ** -0.5, **kw)
    assert packs
