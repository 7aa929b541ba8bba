"""The engine: arrays on NumPy or CuPy (:mod:`backend`), the op table (:mod:`dispatch`),
``Tensor`` with its reverse-mode ``backward`` (:mod:`tensor`) and the float64 gradient
checker (:mod:`gradcheck`). It knows nothing of the layers above it."""
