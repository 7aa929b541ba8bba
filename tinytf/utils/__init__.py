"""Plumbing that knows nothing of tensors or models: worker processes (:mod:`workers`),
outputs written whole (:mod:`streams`), the run log (:mod:`log`), atomic pickle-free
checkpoints (:mod:`checkpoint`) and the SVG plot of a run (:mod:`plot`)."""
