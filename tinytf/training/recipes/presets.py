"""The presets' training defaults, as data: what ``--config NAME`` fills in where the user
left an option unset (:meth:`tinytf.training.config.TrainConfig.resolved`). The model's
sizes are :attr:`tinytf.models.transformer.TransformerConfig.PRESETS`."""

PRESET_DEFAULTS = {
    # Measured on 2 CPU cores and the shipped corpus (docs/experiments/2026-12-tiny-recipe.md):
    # warm up to 2e-3 over 30 % of the budget (the paper's 4,000 updates cap it only in runs
    # of over 13,333), then decay to zero at its end; 2,048-token batches, halved (to 1,024
    # at least) where the machine's pace gives a time budget fewer than 1,500 updates of
    # them; a 4k BPE (and the tiny preset's pre-LN); the model's dropout (0.1) only from the
    # 5th epoch on ("late dropout"), or from the 3rd where the budget holds 8 epochs or
    # more, raised by 0.02 for each epoch of the budget past 10 (0.1 to 0.3: a budget of many
    # passes overfits at the paper's 0.1); Adam with RAdam's rectifier, which keeps a user's
    # short --warmup from costing BLEU (docs/training.md, "The tiny recipe"). The adaptive
    # parts are applied by tinytf.training.recipes.tiny.
    "tiny": dict(optimizer="radam", max_tokens=2048, lr_schedule="linear", lr=2e-3,
                 warmup=4000, vocab_size=4000, save_interval=200, dropout_from_epoch=5,
                 recipe=dict(min_updates=1500, full_dropout_epochs=8, long_dropout_from_epoch=3,
                             dropout_per_epoch=0.02, dropout_rises_after=10)),
    # The paper: warmup 4000, factor 1 (its batches held ~25k tokens per side).
    "default": dict(optimizer="adam", max_tokens=4096, lr_schedule="noam", lr_factor=1.0,
                    warmup=4000, vocab_size=8000, save_interval=1000, dropout_from_epoch=1),
}
"""Per preset (``default``: small, base and big), the training options it fills in; under
``recipe`` the options of its recipe (:class:`~tinytf.training.recipes.tiny.TinyOptions`,
whose defaults turn the rules off)."""
