"""The dK/dV pass in head-dim parts (``GRAD_PARTS``): above D=128 with 16-bit inputs, dQ in the pass and no
per-element feature, two programs per key block each compute dK, dV and dQ for half of the head-dim columns
(sm_90's 64-key wgmma blocks then fit the registers). Gradients against the fp64 golden through the split pass
(padded head dims: a part partly past D or Dv), the unsplit pass where the rule says so, and the rule itself."""
import pytest
import torch

from attnops._core.triton.launch import KernelFamily
from attnops.ops.common.triton import autotune
from tests.helpers import TRIU2048, check_fa, make_qkv

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2(-inf) in numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLAIN = dict(PSE=0, HAS_EXPLICIT=False, DROPOUT=0)


@pytest.fixture
def pass_parts(monkeypatch):
    """The ``GRAD_PARTS`` of every dK/dV pass launched."""
    parts = []
    run = KernelFamily.run

    def recording(self, launch, device):
        if launch.kernel == "dkdv_kernel":
            parts.append(launch.kwargs["GRAD_PARTS"])
        return run(self, launch, device)

    monkeypatch.setattr(KernelFamily, "run", recording)
    return parts


@pytest.mark.parametrize("d,dv,dtype,parts", [(256, 256, torch.float16, 2), (192, 128, torch.float16, 2),
                                              (256, 256, torch.float32, 1)], ids=["fp16-256", "fp16-192-128",
                                                                                  "fp32-256"])
def test_wide_head_dims_match_the_golden(pass_parts, d, dv, dtype, parts):
    """Causal GQA 4:2 with 70 keys (several dQ partials per query head)."""
    q, k, v, dy = (t.to(DEVICE) for t in make_qkv("BNSD", b=1, n1=4, n2=2, sq=37, skv=70, d=d, dv=dv,
                                                    dtype=dtype, seed=41))
    check_fa(q, k, v, dy, backend="triton", layout="BNSD", head_num=4, scale=d ** -0.5,
             atten_mask=TRIU2048.to(DEVICE), sparse_mode=3)
    assert pass_parts == [parts]


@pytest.mark.parametrize("d,dv,element_size,dq_in_pass,features,parts", [
    (256, 256, 2, True, PLAIN, 2),
    (192, 128, 2, True, PLAIN, 2),
    (128, 256, 2, True, PLAIN, 2),
    (128, 128, 2, True, PLAIN, 1),  # 64-key blocks fit without the split
    (256, 256, 4, True, PLAIN, 1),  # fp32: no tensor cores
    (256, 256, 2, False, PLAIN, 1),  # before sm_90: the dQ kernel, 32 x 32 blocks (mma.sync)
    (256, 256, 2, True, dict(PLAIN, PSE=1), 1),  # per-element features: the split still spills
    (256, 256, 2, True, dict(PLAIN, DROPOUT=1), 1),
])
def test_grad_parts_rule(d, dv, element_size, dq_in_pass, features, parts):
    assert autotune.grad_parts(d, dv, element_size, dq_in_pass, features) == parts
