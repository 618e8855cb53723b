"""``causal`` / ``window_size`` on the Triton backend (they become the band) vs the fp64 golden, forward and
backward; through Triton's interpreter on the CPU (tiny shapes, 16 x 16 tiles)."""
import pytest
import torch

from tests.helpers import make_qkv
from tests.ops.flash_attention.test_causal_window import check_window

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2(-inf) in numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("causal,window_size,sq,skv", [(True, (-1, -1), 18, 33), (False, (5, 3), 33, 18),
                                                       (True, (7, -1), 20, 20)])
def test_triton_causal_window(causal, window_size, sq, skv):
    q, k, v, dy = (t.to(DEVICE) for t in make_qkv("BNSD", b=1, n1=2, sq=sq, skv=skv, d=16, seed=sq + skv))
    check_window(q, k, v, dy, causal=causal, window_size=window_size, backend="triton")


def test_triton_causal_window_tnd():
    q_lens, kv_lens = [17, 3], [5, 20]
    q, k, v, dy = (t.to(DEVICE) for t in make_qkv("TND", n1=2, q_lens=q_lens, kv_lens=kv_lens, d=16, seed=3))
    check_window(q, k, v, dy, causal=False, window_size=(4, 2), q_lens=q_lens, kv_lens=kv_lens, backend="triton")
