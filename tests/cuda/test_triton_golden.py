"""The compiled Triton FlashAttention kernels on CUDA vs the fp64 golden in fp16, bf16 and fp32 (forward and
backward: out, softmax statistics, dq/dk/dv, dpse), at shapes large enough to use the GPU tile configurations."""
import pytest
import torch

from tests.helpers import TRIU2048, check_fa, make_qkv

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_dense_bsnd(dtype, d, causal):
    q, k, v, dy = _cuda(*make_qkv("BSND", b=2, n1=4, n2=2, sq=300, skv=333, d=d, dtype=dtype, seed=5))
    kw = dict(atten_mask=TRIU2048.cuda(), sparse_mode=3) if causal else {}
    check_fa(q, k, v, dy, backend="triton", layout="BSND", head_num=4, scale=d ** -0.5, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_pse_dropout(dtype):
    q_lens = kv_lens = [130, 1, 77]
    from tests.helpers import cum

    q, k, v, dy = _cuda(*make_qkv("TND", n1=4, n2=1, d=64, dv=32, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype,
                                  seed=6))
    check_fa(q, k, v, dy, backend="triton", layout="TND", head_num=4, scale=0.125, actual_seq_qlen=cum(q_lens),
             actual_seq_kvlen=cum(kv_lens), atten_mask=TRIU2048.cuda(), sparse_mode=3,
             pse=torch.rand(3, 4, device="cuda"), pse_type=2, keep_prob=0.9, drop="seed", drop_seed=11)
