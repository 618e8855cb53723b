"""flash-attn's Python API on attnops' core: ``from attnops import flash_attn`` or, after :func:`install`,
``import flash_attn`` in unmodified code, on the CPU (reference) or a CUDA GPU (attnops' Triton kernels).

Names, arguments, defaults, shapes and return values follow flash-attn 2 (FlashAttention-3's names:
:mod:`attnops.flash_attn.fa3`); see ``docs/flash_attn.md``.
"""
from . import fa3, flash_attn_interface, layers
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .shim import install

# The version reported to code that checks ``flash_attn.__version__`` (flash-attn 2's API level it implements).
__version__ = "2.7.4"

__all__ = [
    "__version__",
    "fa3",
    "flash_attn_func",
    "flash_attn_interface",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "install",
    "layers",
]

# --- kv-cache, bert_padding and layers.rotary ------------------------------------------------------------------
# flash_attn_with_kvcache (kvcache.py), the bert_padding module and layers.rotary are exported here.
# --- end kv-cache, bert_padding and layers.rotary -------------------------------------------------------------
