"""Triton NSA kernels: selected attention (``selected.py``) and compression (``compress.py``) with their launcher
(``launch.py``), verifier (``verify.py``) and AOT cases (``aot.py``); compressed attention with importance scores
(``compress_attention.py``) and paged decoding (``decode.py``) with ``infer_launch.py``, ``infer_verify.py`` and
``infer_aot.py``. See ``docs/triton.md``."""
