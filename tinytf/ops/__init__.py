"""The primitive ops: each one a small :class:`~tinytf.tensor.Function` subclass.

- :mod:`.elementwise` — add, mul, neg, pow, exp, log, sqrt, tanh, relu, cast
- :mod:`.reduce` — sum, max
- :mod:`.shape` — reshape, transpose, getitem, split, split/merge heads, cat, stack, where,
  masked_fill
- :mod:`.matmul` — matmul (batched, broadcast) and linear (x @ W.T + b as one GEMM)
- :mod:`.nn` — softmax, log_softmax, layer_norm, dropout, dropout + residual add, embedding,
  cross_entropy, attention

Composite ops (sub, div, mean) are built from these in :mod:`tinytf.tensor`.
"""
from .elementwise import Add, Cast, Exp, Log, Mul, Neg, Pow, ReLU, Sqrt, Tanh, sum_to
from .matmul import Linear, MatMul
from .nn import (Attention, CrossEntropy, Dropout, DropoutAdd, Embedding, LayerNorm,
                 LogSoftmax, Softmax)
from .reduce import Max, Sum
from .shape import (Concatenate, GetItem, MaskedFill, MergeHeads, Reshape, Split, SplitHeads,
                    Stack, Transpose, Where)

__all__ = [
    "Add", "Cast", "Exp", "Log", "Mul", "Neg", "Pow", "ReLU", "Sqrt", "Tanh", "sum_to",
    "Linear", "MatMul", "Attention", "CrossEntropy", "Dropout", "DropoutAdd", "Embedding",
    "LayerNorm",
    "LogSoftmax", "Softmax", "Max", "Sum", "Concatenate", "GetItem", "MaskedFill", "Reshape",
    "Split", "SplitHeads", "MergeHeads", "Stack", "Transpose", "Where",
]
