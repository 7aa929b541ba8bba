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

A recipe's own options live in the run's ``recipe_options`` (a dict in config.json), never
in :class:`~tinytf.training.config.TrainConfig`'s fields: :func:`resolve_options` fills
them in from the preset (:mod:`presets`) and the user's ``--set``, :func:`check_options`
checks them, and :data:`OPTION_DEFAULTS` tells ``--set`` which keys are a recipe's.
"""
from __future__ import annotations

import dataclasses

from tinytf.training.recipes.base import Recipe
from tinytf.training.recipes.tiny import TinyOptions, TinyRecipe

__all__ = ["Recipe", "recipe_for", "resolve_options", "check_options", "OPTION_DEFAULTS",
           "LEGACY_KEYS", "from_legacy", "fitted_from", "for_new_run"]

OPTION_DEFAULTS = {key: getattr(TinyOptions, key) for key in TinyOptions.SETTABLE}
"""The recipe options a user sets (``--set full_dropout_epochs=0``; ``--budget-min-updates``),
each with the default that turns its rule off (and gives ``--set`` its type)."""

LEGACY_KEYS = frozenset(f.name for f in dataclasses.fields(TinyOptions))
"""Recipe options that runs before ``recipe_options`` stored as top-level options."""


def recipe_for(cfg, model_cfg) -> Recipe:
    """The recipe of a resolved ``cfg`` (a :class:`~tinytf.training.config.TrainConfig`)
    for a model of ``model_cfg``: the tiny recipe's budget rules where its options ask for
    them (the ``tiny`` preset's defaults do), else the plain :class:`Recipe`."""
    return TinyRecipe(cfg, model_cfg) if TinyRecipe.applies(cfg, model_cfg) else Recipe()


def resolve_options(cfg, preset: dict) -> dict:
    """The ``recipe_options`` of the unresolved ``cfg``: the recipe's defaults (every rule
    off), the preset's (``preset["recipe"]``), then the run's own, and what the recipe
    reads of the options as the user gave them (:meth:`TinyOptions.resolved`)."""
    return TinyOptions.resolved(cfg, preset.get("recipe", {}))


def check_options(options: dict) -> tuple | None:
    """What is wrong with a run's ``recipe_options`` (an unknown key, a wrong type, a value
    out of range): (the key, the words that follow its name), or None."""
    return TinyOptions.problem(options)


def for_new_run(recipe_options: dict, users_batch: bool = False) -> dict:
    """A stored run's recipe options as a new run started from its config.json takes them:
    without the record of a fitted batch (fitted again), and, where the user gives
    ``--max-tokens`` (``users_batch``), without the leave to fit the batch."""
    dropped = {"fitted_from", "fit_batch"} if users_batch else {"fitted_from"}
    return {k: v for k, v in recipe_options.items() if k not in dropped}


def fitted_from(options: dict) -> int:
    """The ``--max-tokens`` that the batch of the run with stored ``options`` was fitted
    from (0: not fitted)."""
    return (options.get("recipe_options") or {}).get("fitted_from", 0)


def from_legacy(options: dict) -> dict:
    """A run's stored options with the recipe options that older runs kept at the top
    level (``min_updates``, ``fitted_from``, ...) moved into ``recipe_options``."""
    if not LEGACY_KEYS & set(options):
        return options
    moved = {k: v for k, v in options.items() if k not in LEGACY_KEYS}
    legacy = {k: options[k] for k in LEGACY_KEYS & set(options) if options[k] is not None}
    moved["recipe_options"] = {**legacy, **(options.get("recipe_options") or {})}
    return moved
