"""The attention engine's Triton library: the attention-tile helpers (``common.py``), the FlashAttention forward and
backward kernels (``fwd.py``, ``bwd.py``, ``prepare.py``), their host launchers (``launch.py``), the verifier
(``verify.py``) that says why a call cannot run on them, and their AOT cases (``aot.py``). See ``docs/triton.md``."""
