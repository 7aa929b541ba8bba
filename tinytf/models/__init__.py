"""Models built on :mod:`tinytf.nn`: the Transformer of Vaswani et al. (2017) and its
decoder cache."""
