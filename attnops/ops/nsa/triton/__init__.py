"""Triton kernels of the NSA operators."""
