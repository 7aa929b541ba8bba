"""Adam, the paper's learning-rate schedule, and gradient clipping."""
from __future__ import annotations

import math

import numpy as np

from . import backend, kernels


def noam_lr(step: int, d_model: int, warmup: int = 4000, factor: float = 1.0) -> float:
    """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al. 5.3).

    Rises linearly for ``warmup`` steps, peaks at factor * (d_model * warmup)^-0.5, then
    decays with the inverse square root of the step. ``step`` counts from 1.
    """
    step = max(int(step), 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def _named(params) -> list:
    """[(name, tensor)] from a list of tensors or of (name, tensor) pairs."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        return params
    return [(str(i), p) for i, p in enumerate(params)]


def grad_norm(params) -> float:
    """The L2 norm of all gradients together (parameters without a gradient count as 0).

    The sum of squares is accumulated in float32 where the gradients live and read once:
    on the GPU that is one host round trip per step, not one per parameter.
    """
    total = None
    for _, p in _named(params):
        if p.grad is not None:
            g = p.grad.reshape(-1)
            sq = g @ g
            total = sq if total is None else total + sq
    return 0.0 if total is None else math.sqrt(float(total))


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale all gradients in place so their joint L2 norm is at most ``max_norm``.

    Returns the norm before clipping (like ``torch.nn.utils.clip_grad_norm_``).
    """
    norm = grad_norm(params)
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for _, p in _named(params):
            if p.grad is not None:
                p.grad *= scale
    return norm


class Adam:
    """Adam (Kingma & Ba 2015) with bias correction, as PyTorch implements it.

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
    Defaults are the paper's: betas (0.9, 0.98), eps 1e-9. Moments have the parameter's
    dtype (float32 normally); scalars stay Python floats so nothing is upcast.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9):
        self.params = _named(params)
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.step_count = 0
        self.exp_avg = {n: None for n, _ in self.params}
        self.exp_avg_sq = {n: None for n, _ in self.params}

    def zero_grad(self) -> None:
        """Forget every parameter's gradient."""
        for _, p in self.params:
            p.grad = None

    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        self.step_count += 1
        b1, b2 = self.betas
        t = self.step_count
        step_size = self.lr / (1 - b1 ** t)
        bias2_sqrt = math.sqrt(1 - b2 ** t)
        for name, p in self.params:
            g = p.grad
            if g is None:
                continue
            xp = backend.get_array_module(p.data)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            if m is None:
                m = self.exp_avg[name] = xp.zeros_like(p.data)
                v = self.exp_avg_sq[name] = xp.zeros_like(p.data)
            if kernels.fused(p.data, g) and p.data.dtype == np.float32:
                kernels.adam_step(p.data, g, m, v, self.lr, self.betas, self.eps, t)
                continue
            # In place, with one scratch array (each full pass over the parameters counts).
            m *= b1
            m += (1 - b1) * g
            v *= b2
            scratch = g * g
            scratch *= 1 - b2
            v += scratch
            denom = xp.sqrt(v, out=scratch)
            denom *= 1.0 / bias2_sqrt
            denom += self.eps
            update = xp.divide(m, denom, out=denom)
            update *= step_size
            p.data -= update

    def state_dict(self) -> dict:
        """{"step", "lr", "betas", "eps"} plus "exp_avg.NAME"/"exp_avg_sq.NAME" arrays."""
        state = {"step": self.step_count, "lr": self.lr, "betas": list(self.betas),
                 "eps": self.eps}
        for name, _ in self.params:
            if self.exp_avg[name] is not None:
                state[f"exp_avg.{name}"] = backend.to_numpy(self.exp_avg[name]).copy()
                state[f"exp_avg_sq.{name}"] = backend.to_numpy(self.exp_avg_sq[name]).copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; shapes must match the parameters."""
        self.step_count = int(state["step"])
        self.lr, self.betas, self.eps = float(state["lr"]), tuple(state["betas"]), \
            float(state["eps"])
        for name, p in self.params:
            for key, store in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                arr = state.get(f"{key}.{name}")
                if arr is None:
                    store[name] = None
                    continue
                if tuple(arr.shape) != p.shape:
                    raise ValueError(f"optimizer state {key}.{name} has shape "
                                     f"{tuple(arr.shape)}, parameter has {p.shape}")
                xp = backend.get_array_module(p.data)
                store[name] = xp.asarray(backend.to_device(np.asarray(arr), p.device),
                                         dtype=p.dtype).copy()
