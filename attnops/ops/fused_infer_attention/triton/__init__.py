"""Triton split-KV decode kernels of FusedInferAttentionScore (``kernels.py``), their launcher (``launch.py``) and
the verifier that says which calls they serve (``verify.py``)."""
