"""Modules: containers of parameters and sub-modules, as in ``torch.nn``.

A :class:`Module` finds its parameters by looking at its attributes: every
:class:`Parameter` is one, every sub-:class:`Module` contributes its own under a dotted
prefix. ``named_parameters()`` is sorted by name, so every process (and every MPI rank)
walks parameters in the same order. State that is not learned but belongs in the
``state_dict`` (a running statistic) is a buffer (:meth:`Module.register_buffer`); arrays
that are neither (a positional-encoding table, say) are plain ndarray attributes:
``to(device)`` moves both. ``repr(module)`` prints the tree, as PyTorch's does.
"""
from __future__ import annotations

import math

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Tensor
from tinytf.nn import functional as F


class Parameter(Tensor):
    """A Tensor that a Module learns: requires_grad is True, float32 unless ``dtype`` says."""

    def __init__(self, data, dtype=np.float32):
        super().__init__(data, requires_grad=True, dtype=dtype)


class Module:
    """Base class: set Parameters and sub-Modules as attributes, define ``forward``."""

    training = True

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        # A plain list or dict of modules would be silently skipped by named_parameters
        # (never trained, never saved): refuse it and name the container to use.
        if isinstance(value, (list, tuple, dict)) and not name.startswith("_"):
            items = value.values() if isinstance(value, dict) else value
            if any(isinstance(v, (Module, Parameter)) for v in items):
                kind = "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"
                raise TypeError(f"{type(self).__name__}.{name}: a {type(value).__name__} of "
                                f"modules or parameters is not registered (its parameters "
                                f"would be neither trained nor saved); use {kind}, or one "
                                "attribute per parameter")
        object.__setattr__(self, name, value)

    def extra_repr(self) -> str:
        """This module's settings for its repr, e.g. ``in_features=4, out_features=3``."""
        return ""

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({self.extra_repr()}"
        children = [(n, m) for n, m in self._children() if isinstance(m, Module)]
        if not children:
            return head + ")"
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in children]
        return "\n".join([head] + lines) + "\n)"

    def register_buffer(self, name: str, value) -> None:
        """Keep ``value`` (an array or Tensor, or None) as attribute ``name``: saved in the
        ``state_dict`` and moved by ``to``, but never a parameter (no gradient, not trained)."""
        if value is not None:
            value = value.detach() if isinstance(value, Tensor) else Tensor(value)
        self.__dict__.setdefault("_buffers", set()).add(name)
        setattr(self, name, value)

    def named_buffers(self) -> list:
        """[(dotted name, buffer Tensor)] of this module and its sub-modules, by name."""
        found = []
        for prefix, module in self.named_modules():
            for name in sorted(vars(module).get("_buffers", ())):
                if getattr(module, name) is not None:
                    found.append((prefix + name, getattr(module, name)))
        return found

    def _children(self):
        """(name, value) for every attribute that is a Parameter or Module, by name."""
        return sorted((k, v) for k, v in vars(self).items() if isinstance(v, (Parameter, Module)))

    def named_modules(self, prefix: str = ""):
        """[(dotted name, module)] for this module and every sub-module, depth first."""
        out = [(prefix, self)]
        for name, child in self._children():
            if isinstance(child, Module):
                out += child.named_modules(f"{prefix}{name}.")
        return out

    def named_parameters(self) -> list:
        """[(dotted name, Parameter)] sorted by name; each parameter listed once."""
        found, seen = [], set()
        for prefix, module in self.named_modules():
            for name, child in module._children():
                if isinstance(child, Parameter) and id(child) not in seen:
                    seen.add(id(child))
                    found.append((prefix + name, child))
        return sorted(found, key=lambda item: item[0])

    def parameters(self) -> list:
        """The parameters in ``named_parameters`` order."""
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        """Total number of learned scalars."""
        return sum(p.size for p in self.parameters())

    def zero_grad(self) -> None:
        """Forget every parameter's gradient."""
        for p in self.parameters():
            p.grad = None

    def train(self, mode: bool = True) -> "Module":
        """Switch this module and its sub-modules to training (dropout on) or evaluation."""
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self) -> "Module":
        """Evaluation mode: same as ``train(False)``."""
        return self.train(False)

    def state_dict(self) -> dict:
        """{name: NumPy copy}: the parameters in sorted order, then the buffers."""
        return {name: backend.to_numpy(p.data).copy()
                for name, p in self.named_parameters() + self.named_buffers()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays from ``state`` into the parameters (keeping each parameter's dtype).

        Raises KeyError listing missing / unexpected names (when ``strict``) and ValueError
        naming a parameter whose shape differs.
        """
        params = dict(self.named_parameters() + self.named_buffers())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if strict and (missing or unexpected):
            raise KeyError(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != p.shape:
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, "
                                 f"the parameter has shape {p.shape}")
            xp = backend.get_array_module(p.data)
            p.data = xp.asarray(backend.to_device(value, p.device), dtype=p.dtype).copy()

    def to(self, device: str) -> "Module":
        """Move every parameter and array attribute to ``device`` ("cpu" or "gpu")."""
        for _, module in self.named_modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, Tensor) and (isinstance(value, Parameter)
                                                  or name in vars(module).get("_buffers", ())):
                    value.data = backend.to_device(value.data, device)
                    if value.grad is not None:
                        value.grad = backend.to_device(value.grad, device)
                elif hasattr(value, "shape") and hasattr(value, "dtype") and \
                        not isinstance(value, Tensor):
                    setattr(module, name, backend.to_device(value, device))
        return self

    def astype(self, dtype) -> "Module":
        """Cast every floating parameter and array attribute (float64 for gradient checks)."""
        for _, module in self.named_modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, Parameter) or (isinstance(value, Tensor) and name in vars(
                        module).get("_buffers", ()) and value.dtype.kind == "f"):
                    value.data = value.data.astype(dtype)
                elif hasattr(value, "dtype") and not isinstance(value, Tensor) and \
                        getattr(value.dtype, "kind", "") == "f":
                    setattr(module, name, value.astype(dtype))
        return self


class ModuleList(Module):
    """A list of modules, registered as children "0", "1", ..."""

    def __init__(self, modules=()):
        self._items = []
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        """Add ``module`` at the end."""
        setattr(self, str(len(self._items)), module)
        self._items.append(module)

    def _children(self):
        # Numeric order for readability of names; the parameter list is sorted anyway.
        return [(str(i), m) for i, m in enumerate(self._items)]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]


class Sequential(ModuleList):
    """Modules applied one after another."""

    def __init__(self, *modules):
        super().__init__(modules)

    def forward(self, x):
        for m in self:
            x = m(x)
        return x


class ModuleDict(Module):
    """Modules by name, registered as children under their keys (insertion order kept)."""

    def __init__(self, modules=None):
        self._items = {}
        for key, module in dict(modules or {}).items():
            self[key] = module

    def __setitem__(self, key: str, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"ModuleDict[{key!r}]: {type(module).__name__} is not a Module")
        self._items[str(key)] = module

    def _children(self):
        return list(self._items.items())

    def __getitem__(self, key: str) -> Module:
        return self._items[key]

    def __contains__(self, key) -> bool:
        return key in self._items

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def keys(self):
        """The names."""
        return self._items.keys()

    def values(self):
        """The modules."""
        return self._items.values()

    def items(self):
        """(name, module) pairs."""
        return self._items.items()


# ----- initialisation ----------------------------------------------------------------

def _random_like(t: Tensor, sample) -> None:
    xp = backend.get_array_module(t.data)
    t.data = xp.asarray(sample(backend.rng(np), t.shape), dtype=t.dtype)


class init:
    """In-place initialisers drawing from tinytf's seeded generator (``manual_seed``)."""

    @staticmethod
    def uniform_(t: Tensor, low: float, high: float) -> Tensor:
        """Fill with U(low, high)."""
        _random_like(t, lambda g, s: g.uniform(low, high, s))
        return t

    @staticmethod
    def normal_(t: Tensor, std: float = 1.0, mean: float = 0.0) -> Tensor:
        """Fill with N(mean, std^2)."""
        _random_like(t, lambda g, s: g.normal(mean, std, s))
        return t

    @staticmethod
    def xavier_uniform_(t: Tensor, gain: float = 1.0) -> Tensor:
        """U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio 2010)."""
        fan_out, fan_in = t.shape[0], t.shape[1]
        a = gain * math.sqrt(6.0 / (fan_in + fan_out))
        return init.uniform_(t, -a, a)

    @staticmethod
    def zeros_(t: Tensor) -> Tensor:
        """Fill with 0."""
        t.data[...] = 0
        return t

    @staticmethod
    def ones_(t: Tensor) -> Tensor:
        """Fill with 1."""
        t.data[...] = 1
        return t


# ----- layers --------------------------------------------------------------------------

class Linear(Module):
    """y = x W^T + b, W (out, in). Init as PyTorch: U(-1/sqrt(in), 1/sqrt(in)) for W and b."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features)
        self.weight = init.uniform_(Parameter(np.zeros((out_features, in_features))),
                                    -bound, bound)
        self.bias = init.uniform_(Parameter(np.zeros(out_features)), -bound, bound) \
            if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    """A lookup table of ``num`` vectors of size ``dim``; init N(0, std^2), std = dim^-0.5."""

    def __init__(self, num: int, dim: int, std: float | None = None):
        self.weight = init.normal_(Parameter(np.zeros((num, dim))),
                                   dim ** -0.5 if std is None else std)

    def forward(self, ids) -> Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class LayerNorm(Module):
    """Layer normalisation over the last axis, learned gain (ones) and bias (zeros; none
    with ``bias=False``)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        self.eps = eps
        self.weight = Parameter(np.ones(dim, dtype=np.float32))
        self.bias = Parameter(np.zeros(dim, dtype=np.float32)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"({self.weight.shape[0]},), eps={self.eps:g}"


class Dropout(Module):
    """Inverted dropout with probability ``p``, active only in training mode."""

    def __init__(self, p: float = 0.1):
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p:g}"


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class Sigmoid(Module):
    """1 / (1 + e^-x)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class GELU(Module):
    """GELU in its tanh form (:func:`~tinytf.nn.functional.gelu`)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


class SiLU(Module):
    """x * sigmoid(x)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Flatten(Module):
    """Merge dimensions ``start_dim`` .. ``end_dim`` (by default all but the batch's)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"
