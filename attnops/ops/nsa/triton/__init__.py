"""Triton NSA kernels, one kernel family (``family.py``: the modules and every kernel's tiles): selected attention
(``selected.py``) and compression (``compress.py``) planned by ``launch.py``; compressed-attention scores
(``compress_attention.py``) and paged decoding (``decode.py``) planned by ``infer_launch.py``; shared
``@triton.jit`` helpers (``common.py``), the verifier (``verify.py``) and the AOT cases (``aot.py``). See
``docs/triton.md``."""
