"""The ``meta`` kernel every attnops custom op gets: its fake (shape-only) kernel, except inside
:func:`attnops.testing.gpu_dry_run`, where ``meta`` tensors stand for GPU tensors and the op runs its real
implementation (validation, dispatch, launch planning) with the launches recorded. ``torch.compile`` and
``opcheck`` trace with FakeTensors, which always use the fake kernel."""
from __future__ import annotations

from .triton import dry_run


def register_dry_run_meta(op) -> None:
    """Give custom op ``op`` (a ``torch.library.custom_op`` with its fake registered) the ``meta`` kernel above."""
    implementation, fake = op._init_fn, op._abstract_fn
    if fake is None:
        raise RuntimeError(f"{op._qualname}: register the fake kernel before register_dry_run_meta")

    def meta(*args, **kwargs):
        run = dry_run.active()
        if run is None:
            return fake(*args, **kwargs)
        with run.guard():
            return implementation(*args, **kwargs)

    op.register_kernel("meta", meta)
