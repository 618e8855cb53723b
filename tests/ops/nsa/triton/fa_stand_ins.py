"""Temporary: sync-free stand-ins for the FlashAttention-side host reads that NSA's compressed attention and window
branch go through (the canonical causal mask uploaded and compared on the host, explicit masks searched for a band
on the host, the per-batch metadata uploaded with a blocking copy). The NSA dry-run tests run each such case twice:
against the real FlashAttention code (an expected failure, strict, until FlashAttention reads nothing back) and with
these stand-ins, so the NSA side is proven sync-free meanwhile. Remove this module and the ``fa`` parameter of those
tests when the FlashAttention side is fixed."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from attnops._core import masks, staging
from attnops.ops.flash_attention.triton import launch as fa_launch
from attnops.testing import HostSyncError, gpu_dry_run

FA_FILES = ("attnops/_core/masks.py", "attnops/ops/flash_attention/")


class FlashAttentionSideSync(HostSyncError):
    """A host read :func:`gpu_dry_run` found in FlashAttention's code (not NSA's)."""


FA_SIDE = pytest.mark.xfail(strict=True, raises=FlashAttentionSideSync,
                            reason="FlashAttention reads its masks / stages its batch metadata on the host (fixed on "
                                   "the FlashAttention side of issue 27); remove this mark when it reads nothing back")
FA_MODES = ("stand-in", pytest.param("real", marks=FA_SIDE))


def _stand_ins(monkeypatch) -> None:
    canonical = functools.lru_cache(maxsize=8)(
        lambda device: staging.upload(masks._canonical_compressed(2048), torch.bool, device))
    check, band, meta = masks._check_compressed, masks._explicit_band, fa_launch.batch_meta
    monkeypatch.setattr(masks, "compressed_causal_mask", canonical)
    monkeypatch.setattr(masks, "_check_compressed",
                        lambda m, rows, mode: check(m, rows, mode) if m.device.type == "cpu" else None)
    monkeypatch.setattr(masks, "_explicit_band", lambda e, seq: band(e, seq) if e.device.type == "cpu" else None)

    def batch_meta(p, device):
        rows = meta(p, torch.device("cpu"))
        return staging.cached_upload(("fa-stand-in", tuple(rows.flatten().tolist())), lambda: rows, torch.int64,
                                     device).view(rows.shape)
    monkeypatch.setattr(fa_launch, "batch_meta", batch_meta)


@contextlib.contextmanager
def dry_run(fa: str, monkeypatch):
    """:func:`gpu_dry_run` yielding the launches; ``fa="stand-in"`` replaces FlashAttention's host reads by
    sync-free stand-ins, ``fa="real"`` reports a host read in FlashAttention's code as
    :class:`FlashAttentionSideSync` (any other stays a plain :class:`HostSyncError`), ``fa=None`` (an operator
    without FlashAttention) is the plain dry run."""
    if fa == "stand-in":
        _stand_ins(monkeypatch)
    try:
        with gpu_dry_run() as launches:
            yield launches
    except HostSyncError as error:
        if fa == "real" and any(f" at {path}" in str(error) for path in FA_FILES):
            raise FlashAttentionSideSync(str(error)) from error
        raise
