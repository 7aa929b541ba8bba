"""Neural-network building blocks: :mod:`tinytf.nn.functional` (``F``: PyTorch-like
functions over the ops) and :mod:`tinytf.nn.modules` (``Module`` and the layers)."""
from tinytf.nn import functional  # noqa: F401
from tinytf.nn.modules import (  # noqa: F401
                               Dropout,
                               Embedding,
                               LayerNorm,
                               Linear,
                               Module,
                               ModuleList,
                               Parameter,
                               ReLU,
                               Sequential,
                               init,
)

__all__ = ["functional", "Module", "ModuleList", "Sequential", "Parameter", "Linear",
           "Embedding", "LayerNorm", "Dropout", "ReLU", "init"]
