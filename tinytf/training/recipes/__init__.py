"""Recipes: the presets' defaults as data (:mod:`presets`) and the hook through which a
recipe adapts a run to its budget (:class:`Recipe`).

The trainer calls the hook at four points and knows nothing of what a recipe decides:

==================  ======================================================================
``fit(t, cfg)``     after the model and optimizer are built, before the batches: may
                    return another config (the tiny recipe fits the batch to the pace)
``plan(t)``         once the batches exist (and a resumed run is restored): may settle
                    options for the whole run (the tiny recipe's dropout for a step budget)
``before_update(t)``  at the start of every update, before its dropout is chosen
``pending(t)``      a line for the run's first log lines: a decision still to come
==================  ======================================================================

A recipe changes the run only through :meth:`Trainer.set_config`, which writes the choice
into the run's options (config.json and every checkpoint), so a resumed run keeps it.
"""
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


def recipe_for(cfg, model_cfg) -> Recipe:
    """The recipe of a resolved ``cfg`` (a :class:`~tinytf.training.config.TrainConfig`)
    for a model of ``model_cfg``: the tiny recipe's budget rules where its options ask for
    them (the ``tiny`` preset's defaults do), else the plain :class:`Recipe`."""
    from tinytf.training.recipes.tiny import TinyRecipe  # noqa: PLC0415 - it subclasses Recipe
    return TinyRecipe(cfg, model_cfg) if TinyRecipe.applies(cfg, model_cfg) else Recipe()
