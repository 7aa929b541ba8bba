"""Shared test set-up: Hypothesis profiles, and the ``data_dir`` fixture of the training tests.

Profiles: "ci" (default) keeps the suite fast on 2 cores; "dev" searches harder. Select one
with HYPOTHESIS_PROFILE=dev. "ci" keeps no example database, so every run starts
fresh; a failure prints the falsifying example and a reproduction blob.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "ende")

settings.register_profile(
    "ci", max_examples=30, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("dev", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _head(src, dst, n):
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    with open(dst, "w", encoding="utf-8") as f:
        f.writelines(lines)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The first 120 training and 6 dev pairs of the shipped corpus (training tests)."""
    d = tmp_path_factory.mktemp("data")
    for lang in ("en", "de"):
        _head(os.path.join(SHIPPED, f"train.{lang}"), d / f"train.{lang}", 120)
        _head(os.path.join(SHIPPED, f"dev.{lang}"), d / f"dev.{lang}", 6)
    return str(d)
