"""Pythonic NSA functions: every tensor on the reference input's device (never copied silently), and under
``torch.autocast`` the floating-point inputs cast to the autocast dtype (as SDPA): the result equals the call on
explicitly cast inputs with autocast off."""
import pytest
import torch

import attnops

from .nsa_helpers import cum, randn

LENS = [16, 16]
T, N1, N2, D = 32, 2, 1, 8
TABLE = torch.tensor([[2, 0, 3], [1, 4, -1]], dtype=torch.int32)
TOPK_INFER = torch.tensor([[[0, 2]], [[1, 0]]], dtype=torch.int32)


def _qkv(dtype=torch.float32):
    return randn(T, N1, D, dtype=dtype, seed=1), randn(T, N2, D, dtype=dtype, seed=2), randn(T, N2, D, dtype=dtype,
                                                                                              seed=3)


def _compress(x, w):
    return attnops.nsa_compress(x, w, block_size=8, stride=4, actual_seq_len=cum(LENS))


def _compress_attention(q, k, v, mask=None):
    return attnops.nsa_compress_attention(q, k, v, compress_block_size=8, compress_stride=4, select_block_size=8,
                                          select_block_count=2, atten_mask=mask, actual_seq_qlen=cum(LENS),
                                          actual_cmp_seq_kvlen=cum([3, 3])).out


def _selected(q, k, v, topk):
    return attnops.nsa_selected_attention(q, k, v, topk, select_block_size=8, actual_seq_qlen=cum(LENS),
                                          actual_seq_kvlen=cum(LENS))


def _native(q, k, v, gates, wk, wv):
    return attnops.native_sparse_attention(q, k, v, gates, wk, wv, actual_seq_len=cum(LENS), compress_block_size=8,
                                           compress_stride=4, select_block_size=8, select_block_count=2,
                                           window_size=5)


def _selected_infer(q, kc, vc, topk, table):
    return attnops.nsa_selected_attention_infer(q, kc, vc, topk, table, [20, 13], select_block_size=8)


def _compress_infer(q, kc, vc, table):
    return attnops.nsa_compress_attention_infer(q, kc, vc, table, [20, 13], compress_block_size=4, compress_stride=2,
                                                select_block_size=4, select_block_count=3)[0]


def _cases(dtype=torch.float32):
    """name -> (function, positional arguments, names of the arguments after the first)."""
    q, k, v = _qkv(dtype)
    topk = torch.zeros(T, N2, 2, dtype=torch.int32)
    topk[:, :, 1] = 1
    gates = torch.sigmoid(randn(T, N1, 3, seed=4))
    wk, wv = randn(8, N2, seed=5, dtype=dtype), randn(8, N2, seed=6, dtype=dtype)
    qd, kc, vc = randn(2, N1, D, dtype=dtype, seed=7), randn(5, 8, N2, D, dtype=dtype, seed=8), randn(
        5, 8, N2, D, dtype=dtype, seed=9)
    k_cmp, v_cmp = randn(6, N2, D, dtype=dtype, seed=10), randn(6, N2, D, dtype=dtype, seed=11)
    return {
        "nsa_compress": (_compress, (k, wk), ["weight"]),
        "nsa_compress_attention": (_compress_attention, (q, k_cmp, v_cmp, torch.zeros(16, 3, dtype=torch.bool)),
                                   ["key", "value", "atten_mask"]),
        "nsa_selected_attention": (_selected, (q, k, v, topk), ["key", "value", "topk_indices"]),
        "native_sparse_attention": (_native, (q, k, v, gates, wk, wv),
                                    ["key", "value", "gates", "compress_weight_k", "compress_weight_v"]),
        "nsa_selected_attention_infer": (_selected_infer, (qd, kc, vc, TOPK_INFER, TABLE),
                                         ["key_cache", "value_cache", "topk_indices", "block_table"]),
        "nsa_compress_attention_infer": (_compress_infer, (qd, kc, vc, TABLE),
                                         ["key_cache", "value_cache", "block_table"]),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_tensor_on_another_device_raises(case):
    fn, args, names = _cases()[case]
    ref = "input" if case == "nsa_compress" else "query"
    for i, name in enumerate(names, start=1):
        moved = list(args)
        moved[i] = moved[i].to("meta")
        with pytest.raises(ValueError, match=rf"{name}: expected a tensor on cpu \(the device of {ref}\)"):
            fn(*moved)


@pytest.mark.parametrize("case", list(_cases()))
def test_numpy_array_is_named_not_a_tensor(case):
    fn, args, names = _cases()[case]
    for i, name in enumerate(["input" if case == "nsa_compress" else "query", *names]):
        converted = list(args)
        converted[i] = converted[i].numpy()
        with pytest.raises(TypeError, match=rf"{name}: expected a torch.Tensor, got numpy.ndarray\. convert it"):
            fn(*converted)


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_float_inputs(case, dtype):
    fn, args, _ = _cases()[case]
    with torch.autocast("cpu", dtype=dtype):
        auto = fn(*args)
    cast = [a.to(dtype) if a.dtype == torch.float32 else a for a in args]
    plain = fn(*cast)
    assert auto.dtype == plain.dtype == dtype
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)


def test_autocast_grads_follow_the_fp32_leaves():
    q, k, v = (t.requires_grad_() for t in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _selected(q, k, v, torch.zeros(T, N2, 2, dtype=torch.int32))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad.dtype == k.grad.dtype == torch.float32
