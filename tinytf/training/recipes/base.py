"""The recipe hook's base: a recipe that changes nothing (every preset but ``tiny``)."""
from __future__ import annotations


class Recipe:
    """The hook's defaults: a recipe that changes nothing (every preset but ``tiny``)."""

    def fit(self, trainer, cfg):
        """The config to build the batches with: ``cfg`` as it is."""
        return cfg

    def plan(self, trainer) -> None:
        """Settle options for the run once its batches exist: nothing."""

    def before_update(self, trainer) -> None:
        """Act at the start of an update: nothing."""

    def pending(self, trainer) -> str:
        """A decision still to come, for the run's first log lines: none."""
        return ""
