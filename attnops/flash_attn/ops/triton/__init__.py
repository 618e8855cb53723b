"""``flash_attn.ops.triton``: flash-attn's functional operators (``rotary``), here in plain PyTorch."""
