"""Stochastic gradient descent with momentum, as ``torch.optim.SGD`` computes it::

    g = grad + weight_decay * p                           (L2 penalty, when weight_decay > 0)
    b = g at the first step, else momentum * b + (1 - dampening) * g
    g = g + momentum * b  (nesterov)   or   g = b          (when momentum > 0)
    p = p - lr * g
"""
from __future__ import annotations

from tinytf.engine import backend
from tinytf.optim.optimizer import Optimizer


class SGD(Optimizer):
    """SGD(params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False); the
    settings may differ per parameter group."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))
        self.momentum_buffer = {name: None for name, _ in self.params}

    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for group, named in self.named_groups():
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for name, p in named:
                if p.grad is None:
                    continue
                g = p.grad if not wd else p.grad + wd * p.data
                if mu:
                    b = self.momentum_buffer[name]
                    if b is None:
                        b = self.momentum_buffer[name] = g.copy()
                    else:
                        b *= mu
                        b += (1 - group["dampening"]) * g
                    g = g + mu * b if group["nesterov"] else b
                p.data -= lr * g

    def state_dict(self) -> dict:
        """{"groups": each group's settings, "momentum_buffer.NAME": arrays}."""
        state = {"groups": self.group_settings()}
        for name, b in self.momentum_buffer.items():
            if b is not None:
                state[f"momentum_buffer.{name}"] = backend.to_numpy(b).copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.load_group_settings(state["groups"])
        for name, p in self.params:
            b = state.get(f"momentum_buffer.{name}")
            if b is not None and tuple(b.shape) != p.shape:
                raise ValueError(f"optimizer state momentum_buffer.{name} has shape "
                                 f"{tuple(b.shape)}, parameter has {p.shape}")
            self.momentum_buffer[name] = None if b is None else \
                backend.to_device(b, p.device).astype(p.dtype, copy=True)
