"""Training: the options (:mod:`config`), the loop of section 5 (:mod:`trainer`), its GPU
variant with one update in flight (:mod:`pipelined`), and around them the run directory,
evaluation, progress, budget and stop signals. :func:`tinytf.training.run.train` runs one."""
