"""The integer codes the decode kernels take as constexprs, for host code that must not import Triton (``kernels``
wraps each in ``tl.constexpr``)."""

KV_FLOAT, KV_INT8, KV_INT4 = 0, 1, 2  # KV storage (K_QUANT / V_QUANT)
KV_DENSE, KV_PAGED, KV_NZ = 0, 1, 2  # KV addressing (KV_LAYOUT)
OUT_FLOAT, OUT_ROUND, OUT_INT8 = 0, 1, 2  # output conversion (OUT_KIND)
