"""Recurrent cells and layers: GRU (Cho et al. 2014) and LSTM (Hochreiter & Schmidhuber 1997),
with PyTorch's equations, parameter names, shapes and initialisation (every weight and bias
U(-1/sqrt(H), 1/sqrt(H))), so a ``state_dict`` moves between the two.

GRU, gates in the order r, z, n of ``weight_ih`` (3H, I) and ``weight_hh`` (3H, H)::

    r = s(W_ir x + b_ir + W_hr h + b_hr)        z = s(W_iz x + b_iz + W_hz h + b_hz)
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

LSTM, gates i, f, g, o of ``weight_ih`` (4H, I) and ``weight_hh`` (4H, H)::

    i, f, o = s(W_i. x + b_i. + W_h. h + b_h.)   g = tanh(W_ig x + b_ig + W_hg h + b_hg)
    c' = f * c + i * g                          h' = o * tanh(c')

The layers over time (:class:`GRU`, :class:`LSTM`) project the whole input sequence at once
(one product for W_ih x over all steps), then run the cell's recurrent half step by step;
backward runs through the graph those steps built (backpropagation through time).
"""
from __future__ import annotations

import math

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Tensor
from tinytf.nn import functional as F
from tinytf.nn.modules import Module, Parameter, init


def _uniform(shape, hidden: int) -> Parameter:
    bound = 1.0 / math.sqrt(hidden)
    return init.uniform_(Parameter(np.zeros(shape)), -bound, bound)


def gru_step(gi: Tensor, h: Tensor, w_hh: Tensor, b_hh) -> Tensor:
    """One GRU step from the input's projection ``gi`` = W_ih x + b_ih (B, 3H)."""
    gh = F.linear(h, w_hh, b_hh)
    i_r, i_z, i_n = F.split(gi, h.shape[-1], axis=-1)
    h_r, h_z, h_n = F.split(gh, h.shape[-1], axis=-1)
    r = F.sigmoid(i_r + h_r)
    z = F.sigmoid(i_z + h_z)
    n = F.tanh(i_n + r * h_n)
    return n + z * (h - n)                      # (1 - z) n + z h


def lstm_step(gi: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, b_hh) -> tuple:
    """One LSTM step from the input's projection ``gi`` = W_ih x + b_ih (B, 4H): (h', c')."""
    i, f, g, o = F.split(gi + F.linear(h, w_hh, b_hh), h.shape[-1], axis=-1)
    c = F.sigmoid(f) * c + F.sigmoid(i) * F.tanh(g)
    return F.sigmoid(o) * F.tanh(c), c


def _zero_state(x: Tensor, hidden: int) -> Tensor:
    """A zero state (B, H) for input ``x`` (B, ...), of its dtype and device."""
    xp = backend.get_array_module(x.data)
    return Tensor(xp.zeros((x.shape[0], hidden), dtype=x.dtype))


class _Cell(Module):
    """weight_ih (G*H, I), weight_hh (G*H, H), bias_ih and bias_hh (G*H,) for G gates."""

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True):
        self.input_size, self.hidden_size = input_size, hidden_size
        rows = self.gates * hidden_size
        self.weight_ih = _uniform((rows, input_size), hidden_size)
        self.weight_hh = _uniform((rows, hidden_size), hidden_size)
        self.bias_ih = _uniform((rows,), hidden_size) if bias else None
        self.bias_hh = _uniform((rows,), hidden_size) if bias else None

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias_ih is not None}"


class GRUCell(_Cell):
    """One GRU step: ``cell(x (B, I), h (B, H) or None) -> h' (B, H)``."""

    gates = 3

    def forward(self, x: Tensor, h: Tensor | None = None) -> Tensor:
        h = _zero_state(x, self.hidden_size) if h is None else h
        return gru_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                        self.bias_hh)


class LSTMCell(_Cell):
    """One LSTM step: ``cell(x (B, I), (h, c) or None) -> (h', c')``."""

    gates = 4

    def forward(self, x: Tensor, state: tuple | None = None) -> tuple:
        if state is None:
            state = (_zero_state(x, self.hidden_size),) * 2
        return lstm_step(F.linear(x, self.weight_ih, self.bias_ih), *state, self.weight_hh,
                         self.bias_hh)


class _Recurrent(Module):
    """``num_layers`` stacked cells over a sequence; parameters ``weight_ih_l0``,
    ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``, ... as PyTorch's. Input (B, T, I)
    with ``batch_first=True``, else (T, B, I) (PyTorch's default); ``dropout`` between
    layers in training. One direction only."""

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0):
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.batch_first, self.dropout, self.bias = batch_first, dropout, bias
        rows = self.gates * hidden_size
        for layer in range(num_layers):
            width = input_size if layer == 0 else hidden_size
            setattr(self, f"weight_ih_l{layer}", _uniform((rows, width), hidden_size))
            setattr(self, f"weight_hh_l{layer}", _uniform((rows, hidden_size), hidden_size))
            setattr(self, f"bias_ih_l{layer}", _uniform((rows,), hidden_size) if bias else None)
            setattr(self, f"bias_hh_l{layer}", _uniform((rows,), hidden_size) if bias else None)

    def layer(self, i: int) -> tuple:
        """(weight_ih, weight_hh, bias_ih, bias_hh) of layer ``i``."""
        return tuple(getattr(self, f"{name}_l{i}") for name in
                     ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))

    def _batch_first(self, x: Tensor) -> Tensor:
        """The input as (B, T, I)."""
        if x.ndim != 3:
            raise ValueError(f"{type(self).__name__} wants a 3-D input, got shape {x.shape}")
        return x if self.batch_first else x.transpose(0, 1)

    def _output(self, hs: list) -> Tensor:
        """The last layer's states stacked over time, in the input's layout."""
        return F.stack(hs, axis=1 if self.batch_first else 0)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout:g}")


class GRU(_Recurrent):
    """A GRU over a sequence: ``gru(x, h0=None) -> (output, h_n)``, output (B, T, H) (batch
    first) of the last layer's states, h_n (num_layers, B, H) the final state of each."""

    gates = 3

    def forward(self, x: Tensor, h0: Tensor | None = None) -> tuple:
        x = self._batch_first(x)
        finals = []
        for i in range(self.num_layers):
            w_ih, w_hh, b_ih, b_hh = self.layer(i)
            h = _zero_state(x, self.hidden_size) if h0 is None else h0[i]
            gi = F.linear(x, w_ih, b_ih)                              # (B, T, 3H) at once
            hs = []
            for g in F.split(gi, 1, axis=1):
                h = gru_step(g.reshape(g.shape[0], -1), h, w_hh, b_hh)
                hs.append(h)
            finals.append(h)
            x = F.stack(hs, axis=1)
            if i + 1 < self.num_layers:
                x = F.dropout(x, self.dropout, self.training)
        return self._output(hs), F.stack(finals, axis=0)


class LSTM(_Recurrent):
    """An LSTM over a sequence: ``lstm(x, (h0, c0)=None) -> (output, (h_n, c_n))``, shapes
    as :class:`GRU`'s."""

    gates = 4

    def forward(self, x: Tensor, state: tuple | None = None) -> tuple:
        x = self._batch_first(x)
        finals_h, finals_c = [], []
        for i in range(self.num_layers):
            w_ih, w_hh, b_ih, b_hh = self.layer(i)
            if state is None:
                h = c = _zero_state(x, self.hidden_size)
            else:
                h, c = state[0][i], state[1][i]
            gi = F.linear(x, w_ih, b_ih)                              # (B, T, 4H) at once
            hs = []
            for g in F.split(gi, 1, axis=1):
                h, c = lstm_step(g.reshape(g.shape[0], -1), h, c, w_hh, b_hh)
                hs.append(h)
            finals_h.append(h)
            finals_c.append(c)
            x = F.stack(hs, axis=1)
            if i + 1 < self.num_layers:
                x = F.dropout(x, self.dropout, self.training)
        return self._output(hs), (F.stack(finals_h, axis=0), F.stack(finals_c, axis=0))
