"""Hypothesis profiles of the bad-input suite: ``bad-inputs-ci`` (bounded and reproducible: derandomized, a few
corruptions per entry point, the whole suite in about a minute on two cores) and ``bad-inputs-slow`` (many more
corruptions, random; the tests marked ``slow``)."""
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               database=None, print_blob=True)

settings.register_profile("bad-inputs-ci", max_examples=6, derandomize=True, **_COMMON)
settings.register_profile("bad-inputs-slow", max_examples=150, **_COMMON)
