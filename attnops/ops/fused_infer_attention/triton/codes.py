"""The integer codes the FIA kernels take as constexprs, for host code that must not import Triton (``kv_tiles`` and
``rounding`` wrap each in ``tl.constexpr``)."""

KV_FLOAT, KV_INT8, KV_INT4 = 0, 1, 2  # K/V storage (K_QUANT / V_QUANT): as the query, int8, int4 packed in int32
OUT_CAST, OUT_CAST_ROUND, OUT_INT8 = 0, 1, 2  # output conversion (OUT_MODE): fp32, fp16/bf16 CAST_ROUND, int8
