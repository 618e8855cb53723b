"""The forward kernel's split of the key tiles (tiles every row keeps, run without a mask, and the masked edge tiles
around them) under other tile shapes than the interpreter's 16 x 16: rectangular tiles move the split's boundaries
(``common.full_cols``), so bands, bottom-right causal, prefixes and sequence ends land inside, between and across
tiles. Forward outputs and statistics against the fp64 golden (``check_fa`` without the backward)."""
import pytest
import torch
import triton

from attnops.ops.common.triton import autotune
from tests.helpers import PREFIX3072, TRIU2048, check_fa, cum, make_qkv, random_keep

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

if torch.cuda.is_available():
    pytest.skip("the interpreter's tiles are set here; on a GPU the launch tables are", allow_module_level=True)


@pytest.fixture(params=[(32, 16), (16, 32)], ids=lambda t: f"{t[0]}x{t[1]}")
def forward_tiles(request, monkeypatch):
    """Run the forward kernel under the interpreter with ``BLOCK_M x BLOCK_N`` tiles (other kernels unchanged)."""
    fixed = autotune._fixed_config
    m, n = request.param

    def tiles(kernel, interpret, block_dv=0):
        if kernel == "fwd_kernel" and interpret:
            return [triton.Config({"BLOCK_M": m, "BLOCK_N": n})]
        return fixed(kernel, interpret, block_dv)

    monkeypatch.setattr(autotune, "_fixed_config", tiles)
    return request.param


CASES = {
    "causal": dict(sq=45, skv=45, atten_mask=TRIU2048, sparse_mode=3),
    "bottom_right_causal": dict(sq=37, skv=70, atten_mask=TRIU2048, sparse_mode=3),
    "band": dict(sq=70, skv=61, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=21, next_tokens=5),
    "prefix": dict(sq=40, skv=66, atten_mask=PREFIX3072, sparse_mode=6, prefix=[33, 47]),
    "explicit_pse_dropout": dict(sq=32, skv=64, explicit=True, pse=True, keep_prob=0.8),
    "negative_scale": dict(sq=33, skv=50, scale=-0.2),
}


@pytest.mark.parametrize("case", CASES)
def test_forward_tiles(forward_tiles, case):
    kw = dict(CASES[case])
    b, n1, sq, skv = 1, 2, kw.pop("sq"), kw.pop("skv")
    q, k, v, _ = make_qkv("BNSD", b=b, n1=n1, n2=1, sq=sq, skv=skv, d=16, dtype=torch.float16, seed=31)
    if kw.pop("explicit", False):
        kw.update(atten_mask=random_keep(b * n1 * sq * skv, 0.2, seed=32).reshape(b, n1, sq, skv), sparse_mode=0)
    if kw.pop("pse", False):
        kw.update(pse=torch.randn(1, n1, sq, skv, generator=torch.Generator().manual_seed(33)).half(), pse_type=1)
    # packed dropout of 1 * 2 * 32 * 64 bits: whole int32 words, read in place
    check_fa(q, k, v, backward=False, backend="triton", head_num=n1, scale=kw.pop("scale", 0.3), **kw)


def test_alibi_compressed_copies(forward_tiles):
    """The ALiBi-compressed pse read from its row's 8 shifted copies (``launch_args.alibi_copies``): every row's diagonal
    run starts at another alignment, a pse width that is not a multiple of 8, batch-broadcast and per-batch pse."""
    lens, n1 = [37, 20, 45], 2
    q, k, v, _ = make_qkv("TND", n1=n1, n2=1, d=16, q_lens=lens, kv_lens=lens, dtype=torch.float16, seed=34)
    for pse_b, pse_type in ((1, 1), (3, 0)):
        pse = torch.randn(pse_b, n1, 1024, 51, generator=torch.Generator().manual_seed(35)).half()
        check_fa(q, k, v, backward=False, backend="triton", layout="TND", head_num=n1, scale=0.3, pse=pse,
                 pse_type=pse_type, atten_mask=TRIU2048, sparse_mode=3, actual_seq_qlen=cum(lens),
                 actual_seq_kvlen=cum(lens))
