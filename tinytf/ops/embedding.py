"""Embedding lookup: rows of a table picked by integer ids."""
from __future__ import annotations

from tinytf.engine.backend import get_array_module, scatter_add
from tinytf.engine.tensor import Function


class Embedding(Function):
    """Rows of ``weight`` picked by integer ``ids``; backward scatter-adds into the rows.

    A repeated id receives the sum of its gradients (``add.at``, not ``g[idx] += ...``).
    """

    def forward(self, weight, ids):
        self.ids, self.shape = ids, weight.shape
        return weight[ids]

    def backward(self, grad):
        gw = get_array_module(grad).zeros(self.shape, dtype=grad.dtype)
        scatter_add(gw, self.ids.reshape(-1), grad.reshape(-1, self.shape[1]))
        return gw, None
