"""Training from Python: ``tinytf.train(...)`` runs what ``train.py`` runs and returns its
summary.

    import tinytf
    summary = tinytf.train(train_files=["corpus.en", "corpus.de"],
                           valid_files=["dev.en", "dev.de"], out="runs/mine", max_minutes=5)
    summary["test_bleu"], summary["checkpoint"]
    tinytf.Translator.load("runs/mine").translate("A sentence.")

The options are :class:`~tinytf.training.config.TrainConfig`'s fields (a run's
``config.json`` keys) and, by name, the recipe's options (``min_updates=800``: they go into
``recipe_options``); a ``TrainConfig`` may be passed instead. Progress goes to the
``tinytf`` logger and to ``RUNDIR/train.log``; the summary is also ``RUNDIR/summary.json``.
"""
from __future__ import annotations

import dataclasses

from tinytf.training import recipes
from tinytf.training.config import TrainConfig, TrainError
from tinytf.training.run import train as _run


def train(config: TrainConfig | None = None, *, log_stream=None, **options) -> dict:
    """Train a Transformer with ``config`` or the ``options`` (TrainConfig fields or the
    recipe's options; unset ones are the preset's) and return the run's summary dict. ``log_stream``: where the
    progress lines go besides the ``tinytf`` logger (default: the logger only).
    Raises :class:`~tinytf.training.config.TrainError` for options that cannot work."""
    if config is not None and options:
        config = dataclasses.replace(config, **options)
    elif config is None:
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(options) - fields - set(recipes.OPTION_DEFAULTS))
        if unknown:
            raise TrainError(f"unknown option {unknown[0]!r}: the options are TrainConfig's "
                             f"fields ({', '.join(sorted(fields))}) and the recipe's "
                             f"({', '.join(recipes.OPTION_DEFAULTS)})")
        recipe = {**options.pop("recipe_options", {}),
                  **{k: options.pop(k) for k in list(options) if k in recipes.OPTION_DEFAULTS}}
        config = TrainConfig(**options, recipe_options=recipe)
    return _run(config.resolved(), log_stream=log_stream)
