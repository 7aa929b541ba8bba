"""Hypothesis profiles: "ci" (default) keeps the suite fast on 2 cores; "dev" searches harder.

Select one with HYPOTHESIS_PROFILE=dev. "ci" keeps no example database, so every run starts
fresh; a failure prints the falsifying example and a reproduction blob.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=30, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("dev", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
