"""The shim: ``import flash_attn`` (its submodules: ``flash_attn_interface``, ``bert_padding``, ``layers.rotary``)
and FlashAttention-3's top-level ``flash_attn_interface`` load :mod:`attnops.flash_attn` where the real packages are
absent. Nothing happens on import, only when :func:`install` is called."""
from __future__ import annotations

import importlib

from .._core.module_alias import install_aliases, real_package_present
from .fa3_ops import register as register_fa3_ops

_FA2 = {"flash_attn": "attnops.flash_attn"}
_FA3 = {"flash_attn_interface": "attnops.flash_attn.fa3"}


def install(force: bool = False) -> bool:
    """Make ``import flash_attn`` (flash-attn 2, ``__version__`` "2.x.y") and ``import flash_attn_interface``
    (FlashAttention-3's names; with it FA3's ``torch.ops.flash_attn_3`` operators) return attnops' stand-ins, each
    only where the real package is absent (``force``: also where it is present, as long as it was not imported yet;
    the peer-test runner does so).

    Runs on the CPU (reference) and on CUDA GPUs (Triton kernels). Returns True when at least one stand-in is
    installed (idempotent), False, changing nothing, when both real packages are importable.
    """
    installed = False
    for prefixes in (_FA2, _FA3):
        (alias,) = prefixes
        if force or not real_package_present(alias):
            install_aliases(prefixes)
            importlib.import_module(alias)
            installed = True
            if prefixes is _FA3:
                register_fa3_ops()
    return installed
