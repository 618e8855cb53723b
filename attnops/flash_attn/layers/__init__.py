"""``flash_attn.layers``: the layers attention code imports from flash-attn (``layers.rotary``)."""
