"""The reference ops: each a small :class:`~tinytf.engine.tensor.Function` subclass, its
mathematics written once against ``xp`` (NumPy or CuPy), forward and backward side by side.

- :mod:`.elementwise` — add, mul, neg, pow, exp, log, sqrt, tanh, relu, gelu, abs, clamp
- :mod:`.cast` — conversion between float types, bfloat16 emulated on NumPy
- :mod:`.activation` — sigmoid, softplus, silu
- :mod:`.reduce` — sum, max
- :mod:`.shape` — reshape, transpose, getitem, split, split/merge heads, cat, stack, where,
  masked_fill
- :mod:`.matmul` — matmul (batched, broadcast) and linear (x @ W.T + b as one GEMM)
- :mod:`.softmax` — softmax, log_softmax, logsumexp
- :mod:`.conv` — convolution (im2col and one product); :mod:`.pool` — max and average pooling
- :mod:`.norm` — layer_norm
- :mod:`.dropout` — dropout, dropout + residual add
- :mod:`.embedding` — embedding lookup
- :mod:`.loss` — label-smoothed cross-entropy, binary cross-entropy on logits
- :mod:`.attention` — scaled dot-product attention

Importing this package registers every class in the op table (:mod:`tinytf.engine.dispatch`),
through which ``Tensor``'s operators and :mod:`tinytf.nn.functional` call them; the faster
variants in :mod:`tinytf.fast` are installed beside some of them, per device. Composite
ops (sub, div, mean) are built from these in :mod:`tinytf.engine.tensor`.
"""
from tinytf.engine.dispatch import impl
from tinytf.ops.activation import SiLU, Sigmoid, Softplus
from tinytf.ops.attention import Attention
from tinytf.ops.cast import Cast
from tinytf.ops.conv import Conv
from tinytf.ops.dropout import Dropout, DropoutAdd
from tinytf.ops.elementwise import (
    GELU,
    Abs,
    Add,
    Clamp,
    Exp,
    Log,
    Mul,
    Neg,
    Pow,
    ReLU,
    Sqrt,
    Tanh,
    sum_to,
)
from tinytf.ops.embedding import Embedding
from tinytf.ops.loss import BinaryCrossEntropyWithLogits, CrossEntropy
from tinytf.ops.matmul import Linear, MatMul
from tinytf.ops.norm import LayerNorm
from tinytf.ops.pool import AvgPool, MaxPool
from tinytf.ops.reduce import Max, Sum
from tinytf.ops.shape import (
    Concatenate,
    GetItem,
    MaskedFill,
    MergeHeads,
    Reshape,
    Split,
    SplitHeads,
    Stack,
    Transpose,
    Where,
)
from tinytf.ops.softmax import LogSoftmax, LogSumExp, Softmax

__all__ = [
    "Add", "Cast", "Exp", "GELU", "Log", "Mul", "Neg", "Pow", "ReLU", "Sqrt", "Tanh", "sum_to",
    "Linear", "MatMul", "Attention", "CrossEntropy", "Dropout", "DropoutAdd", "Embedding",
    "LayerNorm", "LogSoftmax", "Softmax", "Max", "Sum", "Concatenate", "GetItem", "MaskedFill",
    "Reshape", "Split", "SplitHeads", "MergeHeads", "Stack", "Transpose", "Where",
    "Abs", "Clamp", "Sigmoid", "Softplus", "SiLU", "LogSumExp", "Conv", "MaxPool", "AvgPool",
    "BinaryCrossEntropyWithLogits",
]

for _cls in (Add, Cast, Exp, GELU, Log, Mul, Neg, Pow, ReLU, Sqrt, Tanh, Linear, MatMul, Attention,
             CrossEntropy, Dropout, DropoutAdd, Embedding, LayerNorm, LogSoftmax, Softmax, Max,
             Sum, Concatenate, GetItem, MaskedFill, Reshape, Split, SplitHeads, MergeHeads,
             Stack, Transpose, Where, Abs, Clamp, Sigmoid, Softplus, SiLU, LogSumExp, Conv,
             MaxPool, AvgPool, BinaryCrossEntropyWithLogits):
    impl.register(_cls)
