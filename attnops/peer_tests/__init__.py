"""``python -m attnops peer-tests``: run a peer project's own test files, unmodified, against attnops' stand-ins on
the CPU (flash-attn's tests through :mod:`attnops.flash_attn`, op-plugin's through :mod:`attnops.torch_npu`); see
``docs/peer_tests.md``."""
