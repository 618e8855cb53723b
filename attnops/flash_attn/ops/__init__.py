"""``flash_attn.ops``: the operator modules flash-attn code imports (``ops.triton.rotary``)."""
