"""Inverted dropout (Srivastava et al. 2014), alone and fused with the residual sum."""
from __future__ import annotations

import numpy as np

from tinytf.engine import backend
from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function


def keep_mask(xp, shape, p: float, dtype):
    """The scaled keep mask: 1 / (1 - p) with probability 1 - p, else 0, drawn from the
    global generator (``backend.rng``) as float32 uniforms."""
    return scaled_keep(backend.rng(xp).random(shape, dtype=np.float32), p, dtype)


def scaled_keep(uniform, p: float, dtype, out=None):
    """1 / (1 - p) where ``uniform`` >= p, else 0, as ``dtype`` (written into ``out`` if
    given)."""
    mask = get_array_module(uniform).empty(uniform.shape, dtype) if out is None else out
    mask[...] = uniform >= p
    mask *= 1.0 / (1.0 - p)
    return mask


class Dropout(Function):
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    The scaled mask is saved; backward multiplies by the same mask.
    """

    def forward(self, x, p):
        self.mask = keep_mask(get_array_module(x), x.shape, p, x.dtype)
        return x * self.mask

    def backward(self, grad):
        return grad * self.mask


class DropoutAdd(Function):
    """residual + dropout(x): the residual connection around a sub-layer, one node.

    ``x`` and ``residual`` have one shape; the result has NumPy's dtype of the sum (a bf16
    sub-layer output added to the float32 residual stream is float32). The random mask
    is drawn as :class:`Dropout` draws it. Backward: d(residual) = g, dx = g * mask.
    """

    def forward(self, x, residual, p):
        if x.shape != residual.shape:
            raise ValueError(f"dropout_add: x {x.shape} and residual {residual.shape} "
                             f"must have one shape")
        self.mask = keep_mask(get_array_module(x), x.shape, p, x.dtype)
        out = x * self.mask
        if out.dtype == np.result_type(out, residual):
            out += residual          # in place: no second array of the activations' size
            return out
        return residual + out

    def backward(self, grad):
        return self.dropped_grad(grad) if self.needs_input_grad[0] else None, grad

    def dropped_grad(self, grad):
        """dL/dx = grad * mask."""
        return grad * self.mask
