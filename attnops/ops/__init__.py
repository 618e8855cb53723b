"""Operator families: one folder per family (api, problem, reference, op, triton)."""
