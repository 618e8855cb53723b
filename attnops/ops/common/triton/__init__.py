"""Triton FlashAttention kernels (``fwd.py``, ``bwd.py``), their host launchers (``launch.py``) and the verifier
(``verify.py``) that says why a call cannot run on them. See ``docs/triton.md``."""
