"""Pythonic FlashAttention: inputs that used to give a silent wrong answer (or an obscure crash) raise a clear
attnops error naming the argument."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamDtypeError, ParamInvalidError
from tests.helpers import TRIU2048, make_qkv


def _qkv():
    return make_qkv("BNSD", b=1, n1=2, sq=4, skv=4, seed=1)


@pytest.mark.parametrize("mode", range(2, 9))
def test_sparse_mode_without_mask_raises_and_names_causal(mode):
    q, k, v, _ = _qkv()
    with pytest.raises(ParamInvalidError, match=f"atten_mask: expected a mask for sparse_mode {mode}.*causal=True"):
        attnops.flash_attention(q, k, v, sparse_mode=mode)


def test_backward_sparse_mode_without_mask_raises():
    q, k, v, dy = _qkv()
    res = attnops.flash_attention(q, k, v, return_stats=True)
    with pytest.raises(ParamInvalidError, match="atten_mask"):
        attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, sparse_mode=3)


@pytest.mark.parametrize("scale,error", [("0.1", ParamDtypeError), (True, ParamDtypeError), (0, None),
                                         (float("nan"), ParamInvalidError), (float("inf"), ParamInvalidError),
                                         (-float("inf"), ParamInvalidError)])
def test_bad_scale_raises(scale, error):
    q, k, v, _ = _qkv()
    if error is None:  # 0 is a valid (uniform attention) scale
        attnops.flash_attention(q, k, v, scale=scale)
        return
    with pytest.raises(error, match="scale: expected a finite float"):
        attnops.flash_attention(q, k, v, scale=scale)


def test_zero_head_dim_raises():
    q, k, v = (torch.zeros(1, 2, 4, 0) for _ in range(3))
    with pytest.raises(ParamInvalidError, match="query: expected a head dim D >= 1"):
        attnops.flash_attention(q, k, v)


@pytest.mark.parametrize("name", ["key", "value", "atten_mask", "pse"])
def test_tensor_on_another_device_raises(name):
    q, k, v, _ = _qkv()
    kw = dict(key=k, value=v, atten_mask=torch.zeros(4, 4, dtype=torch.bool), pse=torch.zeros(1, 2, 4, 4))
    kw[name] = kw[name].to("meta")
    with pytest.raises(ParamInvalidError, match=f"{name}: expected a tensor on cpu"):
        attnops.flash_attention(q, kw.pop("key"), kw.pop("value"), **kw)


@pytest.mark.parametrize("name", ["query", "key", "value", "atten_mask"])
def test_numpy_array_is_named_not_a_tensor(name):
    q, k, v, _ = _qkv()
    kw = dict(query=q, key=k, value=v, atten_mask=torch.zeros(4, 4, dtype=torch.bool))
    kw[name] = kw[name].numpy()
    with pytest.raises(ParamDtypeError, match=rf"{name}: expected a torch.Tensor, got numpy.ndarray\. convert it"):
        attnops.flash_attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)


def test_backward_tensor_on_another_device_raises():
    q, k, v, dy = _qkv()
    res = attnops.flash_attention(q, k, v, return_stats=True)
    with pytest.raises(ParamInvalidError, match="dy: expected a tensor on cpu"):
        attnops.flash_attention_backward(dy.to("meta"), q, k, v, res.out, res.softmax_max, res.softmax_sum)


def test_causal_flag_is_not_silently_ignored():
    """The report that started this: causal requested, full attention computed."""
    q, k, v, _ = _qkv()
    assert not torch.allclose(attnops.flash_attention(q, k, v, causal=True), attnops.flash_attention(q, k, v))
    assert torch.equal(attnops.flash_attention(q, k, v, causal=True),
                       attnops.flash_attention(q, k, v, atten_mask=TRIU2048, sparse_mode=3))
