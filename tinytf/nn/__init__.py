"""Neural-network building blocks, as ``torch.nn``: :mod:`tinytf.nn.functional` (``F``:
functions over the ops), :mod:`tinytf.nn.modules` (``Module``, the containers, the basic
layers, ``init``), :mod:`tinytf.nn.conv` (convolution, pooling) and :mod:`tinytf.nn.recurrent`
(GRU and LSTM cells and layers), and :mod:`tinytf.nn.amp` (mixed precision: ``autocast``)."""
from tinytf.nn import functional  # noqa: F401
from tinytf.nn.conv import AvgPool1d, AvgPool2d, Conv1d, Conv2d, MaxPool1d, MaxPool2d  # noqa: F401
from tinytf.nn.modules import (  # noqa: F401
    GELU,
    Dropout,
    Embedding,
    Flatten,
    LayerNorm,
    Linear,
    Module,
    ModuleDict,
    ModuleList,
    Parameter,
    ReLU,
    Sequential,
    Sigmoid,
    SiLU,
    Tanh,
    init,
)
from tinytf.nn.recurrent import GRU, LSTM, GRUCell, LSTMCell  # noqa: F401

__all__ = ["functional", "Module", "ModuleList", "ModuleDict", "Sequential", "Parameter",
           "Linear", "Embedding", "LayerNorm", "Dropout", "ReLU", "Sigmoid", "Tanh", "GELU",
           "SiLU", "Flatten", "Conv1d", "Conv2d", "MaxPool1d", "MaxPool2d", "AvgPool1d",
           "AvgPool2d", "GRUCell", "LSTMCell", "GRU", "LSTM", "init"]
