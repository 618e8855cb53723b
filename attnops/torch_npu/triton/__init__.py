"""Triton kernels of the torch_npu paged-KV-cache ops, one kernel family: the cache write (``kv_cache.py``), its
launcher (``launch.py``) and the AOT cases (``aot.py``). See ``docs/porting.md``."""
