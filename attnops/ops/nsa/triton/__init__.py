"""Triton NSA kernels: selected attention (``selected.py``) and compression (``compress.py``), their host launchers
(``launch.py``), the verifier (``verify.py``) that says why a call cannot run on them, and their AOT cases
(``aot.py``). See ``docs/triton.md``."""
