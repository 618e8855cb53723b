"""A flash-attn script, unmodified: run it on the CPU with ``python -m attnops.flash_attn
examples/flash_attn_example.py`` (or call ``attnops.flash_attn.install()`` before ``import flash_attn``).

It checks flash-attn's functions against a plain fp64 PyTorch reference within flash-attn's tolerance rule (at
most twice the error of the same reference in the inputs' precision, plus a small floor)."""
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func

assert tuple(int(part) for part in flash_attn.__version__.split(".")[:2]) >= (2, 6), flash_attn.__version__
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.float32


def reference(q, k, v, causal, softcap, dtype):
    """Dense attention in ``dtype`` ([B, S, H, D], GQA by repeating heads, bottom-right causal)."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = softcap * torch.tanh(s / softcap) if softcap else s
    sq, sk = s.shape[-2:]
    if causal:
        keep = torch.arange(sk, device=s.device)[None] <= torch.arange(sq, device=s.device)[:, None] + sk - sq
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def check(out, q, k, v, causal=False, softcap=0.0):
    golden = reference(q, k, v, causal, softcap, torch.float64)
    baseline = reference(q, k, v, causal, softcap, q.dtype)
    err, base_err = (float((x.double() - golden).abs().max()) for x in (out, baseline))
    assert err <= 2 * base_err + 1e-5, (err, base_err)
    return err


torch.manual_seed(0)
q = torch.randn(2, 128, 8, 64, device=device, dtype=dtype)
k, v = (torch.randn(2, 160, 2, 64, device=device, dtype=dtype) for _ in range(2))  # GQA: 8 query heads on 2
out, lse, _ = flash_attn_func(q, k, v, causal=True, softcap=30.0, return_attn_probs=True)
print(f"flash_attn_func: out {tuple(out.shape)}, lse {tuple(lse.shape)}, "
      f"max error {check(out, q, k, v, causal=True, softcap=30.0):.2e}")

lengths = [100, 28]  # two packed sequences
cu = torch.tensor([0, 100, 128], dtype=torch.int32, device=device)
qv, kv, vv = (x[0, :128] for x in (q, k, v))
out = flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lengths), max(lengths), causal=True)
errors = [check(out[a:b][None], qv[a:b][None], kv[a:b][None], vv[a:b][None], causal=True)
          for a, b in ((0, 100), (100, 128))]
print(f"flash_attn_varlen_func: out {tuple(out.shape)}, max error {max(errors):.2e}")
