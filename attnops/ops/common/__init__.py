"""Operator math several operators share, owned by none."""
