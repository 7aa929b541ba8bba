"""The reference ops: each a small :class:`~tinytf.tensor.Function` subclass, its
mathematics written once against ``xp`` (NumPy or CuPy), forward and backward side by side.

- :mod:`.elementwise` — add, mul, neg, pow, exp, log, sqrt, tanh, relu, gelu, cast
- :mod:`.reduce` — sum, max
- :mod:`.shape` — reshape, transpose, getitem, split, split/merge heads, cat, stack, where,
  masked_fill
- :mod:`.matmul` — matmul (batched, broadcast) and linear (x @ W.T + b as one GEMM)
- :mod:`.softmax` — softmax, log_softmax
- :mod:`.norm` — layer_norm
- :mod:`.dropout` — dropout, dropout + residual add
- :mod:`.embedding` — embedding lookup
- :mod:`.loss` — label-smoothed cross-entropy
- :mod:`.attention` — scaled dot-product attention

Importing this package registers every class in the op table (:mod:`tinytf.dispatch`),
through which ``Tensor``'s operators and :mod:`tinytf.functional` call them; the faster
variants in :mod:`tinytf.fast` replace some entries. Composite ops (sub, div, mean) are
built from these in :mod:`tinytf.tensor`.
"""
from ..dispatch import impl
from .attention import Attention
from .dropout import Dropout, DropoutAdd
from .elementwise import Add, Cast, Exp, GELU, Log, Mul, Neg, Pow, ReLU, Sqrt, Tanh, sum_to
from .embedding import Embedding
from .loss import CrossEntropy
from .matmul import Linear, MatMul
from .norm import LayerNorm
from .reduce import Max, Sum
from .shape import (Concatenate, GetItem, MaskedFill, MergeHeads, Reshape, Split, SplitHeads,
                    Stack, Transpose, Where)
from .softmax import LogSoftmax, Softmax

__all__ = [
    "Add", "Cast", "Exp", "GELU", "Log", "Mul", "Neg", "Pow", "ReLU", "Sqrt", "Tanh", "sum_to",
    "Linear", "MatMul", "Attention", "CrossEntropy", "Dropout", "DropoutAdd", "Embedding",
    "LayerNorm", "LogSoftmax", "Softmax", "Max", "Sum", "Concatenate", "GetItem", "MaskedFill",
    "Reshape", "Split", "SplitHeads", "MergeHeads", "Stack", "Transpose", "Where",
]

for _cls in (Add, Cast, Exp, GELU, Log, Mul, Neg, Pow, ReLU, Sqrt, Tanh, Linear, MatMul, Attention,
             CrossEntropy, Dropout, DropoutAdd, Embedding, LayerNorm, LogSoftmax, Softmax, Max,
             Sum, Concatenate, GetItem, MaskedFill, Reshape, Split, SplitHeads, MergeHeads,
             Stack, Transpose, Where):
    impl.register(_cls)
