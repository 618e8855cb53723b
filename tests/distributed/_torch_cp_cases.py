"""attnops inside PyTorch's ``context_parallel()`` (run inside spawned workers): the Pythonic and torch_npu entry
points, ``F.scaled_dot_product_attention`` and ``torch_npu.npu_fusion_attention`` through the shim as an unmodified
script calls them, both rotate methods, causal with PyTorch's head-tail load balancing and full attention without
it; the unsharded output and gradients must equal the single-device call."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import (_cp_options, context_parallel_unshard,
                                                               set_rotate_method)

import attnops
import attnops.distributed  # noqa: F401 - registers the region runner and the CPU SDPA handlers
from attnops.torch_npu import npu_fusion_attention, npu_fusion_attention_grad
from tests.helpers import TRIU2048, randn

SEQ = 2  # BNSD


def _attnops(q, k, v, causal):
    return attnops.flash_attention(q, k, v, causal=causal, scale=0.3)


class _ExplicitGrad(torch.autograd.Function):
    """torch_npu's forward and its explicit ``npu_fusion_attention_grad`` (as MindSpeed's CP code calls them)."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        mask = dict(atten_mask=TRIU2048, sparse_mode=2) if causal else {}
        out, smax, ssum = npu_fusion_attention(q, k, v, q.shape[1], "BNSD", scale=0.3, **mask)[:3]
        ctx.save_for_backward(q, k, v, out, smax, ssum)
        ctx.mask = mask
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k, v, out, smax, ssum = ctx.saved_tensors
        dq, dk, dv = npu_fusion_attention_grad(q, k, v, dy, q.shape[1], "BNSD", softmax_max=smax, softmax_sum=ssum,
                                               attention_in=out, scale_value=0.3, **ctx.mask)[:3]
        return dq, dk, dv, None


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)


def _torch_npu(q, k, v, causal):
    """``torch_npu.npu_fusion_attention`` as a script calls it, after the shim's ``install()``."""
    attnops.torch_npu.install()
    import torch_npu

    mask = dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=2) if causal else {}
    return torch_npu.npu_fusion_attention(q, k, v, q.shape[1], "BNSD", scale=0.3, **mask)[0]


ENTRIES = {"attnops": _attnops, "torch_npu": _torch_npu, "torch_npu_grad": _ExplicitGrad.apply, "sdpa": _sdpa}
SAME_HEAD_SIZE = ("sdpa",)  # PyTorch's CPU flash kernel (the one run as a ring) needs Dv == D


def run_one(world: int, entry: str, rotate: str, causal: bool) -> None:
    mesh = init_device_mesh("cpu", (world,))
    s, dv = 4 * world, 8 if entry in SAME_HEAD_SIZE else 4
    q, k, v, dy = randn(1, 4, s, 8, seed=1), randn(1, 2, s, 8, seed=2), randn(1, 2, s, dv, seed=3), randn(1, 4, s, dv,
                                                                                                          seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = ENTRIES[entry](*leaves, causal)
    ref.backward(dy)
    set_rotate_method(rotate)
    old = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = causal  # PyTorch's ring requires causal attention for load balancing
    try:
        buffers = [x.clone() for x in (q, k, v, dy)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[SEQ] * 4):
            local = [x.detach().clone().requires_grad_() for x in buffers[:3]]
            out = ENTRIES[entry](*local, causal)
            out.backward(buffers[3])
            tensors = [out.detach(), *(x.grad for x in local)]
        full = context_parallel_unshard(mesh, tensors, [SEQ] * 4)
    finally:
        _cp_options.enable_load_balance = old
    for name, mine, single in zip(("out", "dq", "dk", "dv"), full, (ref, *(x.grad for x in leaves))):
        torch.testing.assert_close(mine, single.detach(), rtol=1e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")


def torch_cp_checks(world: int) -> list[tuple[str, object]]:
    """``(name, check)`` of every entry point, rotate method and mask at the world size (world size 4: the Pythonic
    entry, the explicit torch_npu grad and SDPA)."""
    runs = [(f"torch_cp_{entry}_{rotate}_{'causal' if causal else 'full'}", (entry, rotate, causal))
            for entry in ENTRIES for rotate in ("allgather", "alltoall") for causal in (True, False)
            if world == 2 or entry != "torch_npu"]
    return [(name, functools.partial(run_one, world, *args)) for name, args in runs]
