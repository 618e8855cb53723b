"""Triton kernel tests run on CUDA when there is a GPU, else through Triton's CPU interpreter.

The interpreter must be on before Triton is first imported (``TRITON_INTERPRET`` is read then), so it is switched
on here, at collection, before any test runs; without a GPU nothing else in the suite needs compiled Triton.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["ATTNOPS_TRITON_INTERPRET"] = "1"
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
