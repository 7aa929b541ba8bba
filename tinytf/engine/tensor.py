"""Tensor and the reverse-mode autograd engine.

A :class:`Tensor` wraps an array (NumPy or CuPy) and, when it was produced by an op while
gradients are enabled, a reference ``_ctx`` to the :class:`Function` node that made it.
That node holds its input tensors and the arrays its backward needs, so the tensors and
nodes form a DAG: the history of the computation. ``Tensor.backward`` sorts that DAG
topologically (iteratively, so deep graphs cannot overflow the Python stack), walks it from
the output back to the leaves, calls each node's ``backward`` with the gradient of its
output, and accumulates the results into the ``.grad`` of leaf tensors that require one.
Each node is dropped as soon as backward has passed it, which frees its saved arrays.

The ops themselves live in :mod:`tinytf.ops`; this file only knows the base class, and
finds the ops for its operators in the op table (:mod:`tinytf.engine.dispatch`).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from tinytf.engine import backend
from tinytf.engine.dispatch import impl
from tinytf.engine.tensor_methods import TensorMethods

_grad_enabled = True


def is_grad_enabled() -> bool:
    """Whether ops currently record their history for backward."""
    return _grad_enabled


class no_grad(contextlib.ContextDecorator):
    """Context manager / decorator that turns off graph recording (for inference)."""

    def __enter__(self):
        global _grad_enabled
        self._prev, _grad_enabled = _grad_enabled, False
        return self

    def __exit__(self, *exc):
        global _grad_enabled
        _grad_enabled = self._prev
        return False


class Function:
    """One primitive op: ``forward`` on arrays and ``backward`` side by side.

    Subclasses implement ``forward(self, *arrays, **kwargs) -> array`` and
    ``backward(self, grad) -> tuple`` (one gradient array or ``None`` per input; a single
    input may return the array itself). Arrays that backward needs are saved explicitly
    with :meth:`save_for_backward` (or as attributes). ``self.needs_input_grad[i]`` says
    whether input ``i`` wants a gradient, so backward can skip work nobody needs.
    ``backward`` must never modify ``grad`` in place: it may be shared with other nodes.

    An op with several outputs (:class:`~tinytf.ops.Split`) returns a tuple of arrays from
    ``forward``; ``apply`` then returns a tuple of Tensors sharing the one node, and
    ``backward`` receives a tuple with one gradient per output (``None`` for an output that
    got none), once, after every output's gradient is complete.
    """

    n_outputs = 1  # set by ``apply`` when forward returns a tuple
    changes_dtype = False  # True for an op whose output may be wider than its inputs (Cast)

    def __init__(self, *inputs: "Tensor"):
        self.inputs = inputs
        self.needs_input_grad = tuple(isinstance(t, Tensor) and t.requires_grad
                                      for t in inputs)
        self.saved: tuple = ()

    def save_for_backward(self, *arrays) -> None:
        """Keep ``arrays`` for backward; they are released when the node is freed."""
        self.saved = arrays

    def forward(self, *arrays, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, grad):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs: "Tensor", **kwargs) -> "Tensor":
        """Run the op on ``inputs`` and record it when a gradient is needed.

        Positional inputs are Tensors, or constants (``None``, arrays, numbers) that get no
        gradient; keyword arguments are options, never Tensors. A TypeError names the op
        when ``forward`` returns a Tensor instead of an array, or a float64 array from
        narrower floating inputs (an accidental upcast; ``changes_dtype`` allows it), and,
        in backward, when ``backward`` returns another number of gradients than inputs."""
        for key, value in kwargs.items():
            if isinstance(value, Tensor):
                raise TypeError(f"{cls.__name__}.apply: keyword argument {key!r} is a Tensor; "
                                "pass tensors positionally (or its .data as a constant)")
        ctx = cls(*inputs)
        out = ctx.forward(*(t.data if isinstance(t, Tensor) else t for t in inputs), **kwargs)
        _check_outputs(cls, out, inputs)
        requires_grad = _grad_enabled and any(ctx.needs_input_grad)
        if isinstance(out, tuple):  # several outputs: each records its place in the tuple
            results = tuple(Tensor._of_op(o, ctx if requires_grad else None) for o in out)
            if requires_grad:
                ctx.n_outputs = len(results)
                for i, result in enumerate(results):
                    result._output_index = i
            return results
        return Tensor._of_op(out, ctx if requires_grad else None)


_FLOAT64 = np.dtype(np.float64)


def _check_outputs(cls, out, inputs) -> None:
    """What ``apply`` refuses of ``cls.forward``'s result ``out``: a Tensor (it would nest
    and lose its gradient), or a float64 array where every floating input is narrower.
    (Runs for every op: a few hundred nanoseconds.)"""
    for o in out if type(out) is tuple else (out,):
        if isinstance(o, Tensor):
            raise TypeError(f"{cls.__name__}.forward returned a Tensor; forward works on "
                            "arrays and must return arrays (use .data)")
        if getattr(o, "dtype", None) is _FLOAT64 and not cls.changes_dtype:
            widths = [t.dtype.itemsize for t in inputs if isinstance(t, Tensor)
                      and t.dtype.kind == "f"]
            if widths and max(widths) < 8:
                raise TypeError(f"{cls.__name__}.forward returned float64 from float"
                                f"{8 * max(widths)} inputs: an upcast (a float64 constant?); "
                                "set changes_dtype = True on the op if it is meant")


def _as_array(data, dtype=None):
    """Turn ``data`` into an array; Python floats and lists default to float32."""
    xp = backend.get_array_module(data)
    if isinstance(data, (np.ndarray, np.generic)) or xp is not np:
        return data.astype(dtype, copy=False) if dtype is not None else xp.asarray(data)
    arr = np.asarray(data, dtype=dtype)
    if dtype is None and arr.dtype == np.float64:
        arr = arr.astype(np.float32)  # the default float type, as in PyTorch
    return arr


class Tensor(TensorMethods):
    """An array with an optional gradient and the history needed to compute it.

    ``Tensor(data, requires_grad=False, dtype=None)``: NumPy/CuPy arrays keep their dtype;
    Python numbers and lists of floats become float32. Operators broadcast as in NumPy.
    """

    __array_priority__ = 1000  # make ndarray (op) Tensor call Tensor's reflected operator

    def __init__(self, data, requires_grad: bool = False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        self.data = _as_array(data, dtype)
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx: Function | None = None
        self._output_index = None  # which output of a several-output node (Split) this is
        self._freed = False  # set when backward has released the node that made this tensor
        # Where accumulate_grad writes this leaf's first gradient, if set: a preallocated
        # array of the tensor's shape and dtype (a flat-buffer optimizer's slot, say).
        self.grad_buffer = None
        if self.requires_grad and not backend.is_float(self.data.dtype):
            raise TypeError(f"only floating-point tensors can require a gradient, "
                            f"got dtype {self.data.dtype}")

    @classmethod
    def _of_op(cls, data, ctx) -> "Tensor":
        """An op's output: ``data`` is already an array of the right dtype, so the checks of
        ``__init__`` are skipped (this runs for every node of every step). ``ctx`` is the
        node that made it when a gradient is needed, else None."""
        if isinstance(data, np.generic) or not hasattr(data, "ndim"):
            data = _as_array(data)   # a NumPy scalar from a full reduction: a 0-d array
        t = cls.__new__(cls)
        t.data, t.grad = data, None
        t.requires_grad = ctx is not None
        t._ctx, t._output_index, t._freed, t.grad_buffer = ctx, None, False, None
        if ctx is not None and not backend.is_float(data.dtype):
            raise TypeError(f"{type(ctx).__name__} returned {data.dtype}: only floating-point "
                            f"tensors can require a gradient")
        return t

    # ----- properties ---------------------------------------------------------------
    shape = property(lambda self: self.data.shape, doc="The array's shape.")
    dtype = property(lambda self: self.data.dtype, doc="The array's dtype.")
    ndim = property(lambda self: self.data.ndim, doc="Number of dimensions.")
    size = property(lambda self: self.data.size, doc="Number of elements.")
    device = property(lambda self: backend.device_of(self.data), doc='"cpu" or "gpu".')
    is_leaf = property(lambda self: self._ctx is None, doc="Not produced by a recorded op.")

    def _constant(self, array) -> "Tensor":
        """A Tensor of ``array`` that no gradient reaches (an index, a mask)."""
        return Tensor(array)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def __len__(self) -> int:
        return len(self.data)

    # ----- conversions --------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (copied from the GPU if needed)."""
        return backend.to_numpy(self.data)

    def item(self) -> float:
        """The single value of a one-element tensor as a Python number."""
        return self.data.item()

    def detach(self) -> "Tensor":
        """A tensor sharing the data but cut from the graph (no gradient)."""
        return Tensor(self.data)

    def to(self, device: str) -> "Tensor":
        """A copy on ``device`` ("cpu" or "gpu"), cut from the graph; self if already there."""
        if device == self.device:
            return self
        return Tensor(backend.to_device(self.data, device), requires_grad=self.requires_grad)

    def astype(self, dtype) -> "Tensor":
        """The values cast to ``dtype`` (differentiable)."""
        return impl.Cast.apply(self, dtype=np.dtype(dtype))

    def zero_grad(self) -> None:
        """Forget the accumulated gradient."""
        self.grad = None

    # ----- autograd -----------------------------------------------------------------
    def backward(self, grad=None) -> None:
        """Accumulate d(self)/d(leaf) * grad into ``.grad`` of every leaf requiring one.

        ``grad`` defaults to 1 for a one-element tensor. The graph is freed as it is
        walked: calling backward twice through the same graph is an error.
        """
        grads = {id(self): self._seed_grad(grad)}   # id(tensor) -> gradient so far
        order = _topological_order(self)
        waiting = _several_output_nodes(order)
        for node in reversed(order):                # outputs before the inputs they used
            g = grads.pop(id(node), None)
            ctx = node._ctx
            if node._output_index is not None:      # one output of a several-output node
                g = _gather_outputs(waiting, node, g)
                if g is None:
                    continue                        # other outputs still to come, or no grad
            elif g is None:
                continue
            if ctx is None:                         # a leaf
                node.accumulate_grad(g)
                continue
            in_grads = ctx.backward(g)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if len(in_grads) != len(ctx.inputs):
                raise TypeError(f"{type(ctx).__name__}.backward returned {len(in_grads)} "
                                f"gradients for {len(ctx.inputs)} inputs (None for an input "
                                "without one)")
            for inp, ig, needed in zip(ctx.inputs, in_grads, ctx.needs_input_grad):
                if needed and ig is not None:
                    assert ig.shape == inp.shape, \
                        f"{type(ctx).__name__}.backward: grad shape {ig.shape} != {inp.shape}"
                    # A gradient has its tensor's dtype (as in PyTorch), so a mixed sum's
                    # float32 gradient reaches a float16 input as float16.
                    ig = ig if ig.dtype == inp.dtype else ig.astype(inp.dtype)
                    prev = grads.get(id(inp))
                    grads[id(inp)] = ig if prev is None else prev + ig
            node._ctx, node._freed = None, True     # free the node and the arrays it saved

    def accumulate_grad(self, g) -> None:
        """Add gradient array ``g`` into this leaf's ``.grad`` (what backward does at a leaf).

        The first gradient is copied (leaves never alias the graph's arrays), into
        :attr:`grad_buffer` when one is set: an optimizer that keeps every gradient in one
        flat array points each parameter's ``grad_buffer`` at its slot (``optim.FlatParameters``).
        """
        buf = self.grad_buffer
        if self.grad is None and buf is not None:
            buf[...] = g
            self.grad = buf
        elif self.grad is None:
            self.grad = g.astype(self.dtype, copy=True)
        elif self.grad is buf:
            buf += g
        else:
            self.grad = self.grad + g

    def _seed_grad(self, grad):
        """The gradient backward starts from, checked: 1 for a scalar when None."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        xp = backend.get_array_module(self.data)
        if grad is None:
            if self.size != 1:
                raise RuntimeError("backward() needs an explicit gradient for a "
                                   f"non-scalar tensor of shape {self.shape}")
            grad = xp.ones(self.shape, dtype=self.dtype)
        grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad, dtype=self.dtype)
        if grad.shape != self.shape:
            raise ValueError(f"gradient shape {grad.shape} != tensor shape {self.shape}")
        return grad

    # ----- operators (through the op table: tinytf.engine.dispatch) ----------------------------
    def coerce(self, other) -> "Tensor":
        """``other`` as a Tensor; Python numbers take this tensor's dtype (no upcast)."""
        if isinstance(other, Tensor):
            return other
        xp = backend.get_array_module(self.data)
        if not hasattr(other, "dtype") or isinstance(other, np.generic):
            # Python numbers, NumPy scalars and lists take this tensor's dtype (no upcast)
            other = np.asarray(other)
            dtype = self.dtype if other.dtype.kind in "fib" else other.dtype
            if xp is not np and other.ndim == 0:
                # On the GPU a scalar is filled in by a kernel, not copied from host memory:
                # a host-to-device copy per scalar costs more and cannot be graph-captured.
                return Tensor(xp.full((), other.item(), dtype=dtype))
            return Tensor(xp.asarray(other, dtype=dtype))
        return Tensor(xp.asarray(other))

    def __add__(self, other): return impl.Add.apply(self, self.coerce(other))
    def __radd__(self, other): return impl.Add.apply(self.coerce(other), self)
    def __sub__(self, other): return self + (-self.coerce(other))
    def __rsub__(self, other): return self.coerce(other) + (-self)
    def __mul__(self, other): return impl.Mul.apply(self, self.coerce(other))
    def __rmul__(self, other): return impl.Mul.apply(self.coerce(other), self)
    def __truediv__(self, other): return self * self.coerce(other).reciprocal()
    def __rtruediv__(self, other): return self.coerce(other) * self.reciprocal()
    def __neg__(self): return impl.Neg.apply(self)
    def __pow__(self, exponent): return impl.Pow.apply(self, exponent=exponent)
    def __matmul__(self, other): return impl.MatMul.apply(self, self.coerce(other))
    def __rmatmul__(self, other): return impl.MatMul.apply(self.coerce(other), self)
    def __getitem__(self, index):
        # A Tensor index (a mask, integer ids) is a constant: its array goes to the op.
        index = tuple(array_of(i) for i in index) if type(index) is tuple else array_of(index)
        return impl.GetItem.apply(self, index=index)

    def __rpow__(self, base): return (self * math.log(base)).exp()   # base ** t = e^(t ln base)
    def __abs__(self): return self.abs()
    def __float__(self): return float(self.item())
    def __int__(self): return int(self.item())

    def reciprocal(self):
        """1 / self."""
        return self ** -1.0

    def exp(self):
        """Elementwise e**x."""
        return impl.Exp.apply(self)

    def log(self):
        """Elementwise natural logarithm."""
        return impl.Log.apply(self)

    def sqrt(self):
        """Elementwise square root."""
        return impl.Sqrt.apply(self)

    def tanh(self):
        """Elementwise hyperbolic tangent."""
        return impl.Tanh.apply(self)

    def relu(self):
        """Elementwise max(x, 0)."""
        return impl.ReLU.apply(self)

    def sigmoid(self):
        """Elementwise 1 / (1 + e^-x)."""
        return impl.Sigmoid.apply(self)

    def abs(self):
        """Elementwise |x| (gradient sign(x), 0 at 0)."""
        return impl.Abs.apply(self)

    def clamp(self, min=None, max=None):  # noqa: A002 - PyTorch's names
        """Elementwise min(max(x, min), max), either bound optional; the gradient passes
        where min <= x <= max."""
        return impl.Clamp.apply(self, low=min, high=max)

    def masked_fill(self, mask, value):
        """``value`` where ``mask`` is True, self elsewhere (mask broadcasts)."""
        return impl.MaskedFill.apply(self, mask=array_of(mask), value=value)

    def softmax(self, axis=-1, *, dim=None):
        """exp(x) / sum(exp(x)) along ``axis`` (or PyTorch's ``dim``)."""
        return impl.Softmax.apply(self, axis=axis if dim is None else dim)

    def log_softmax(self, axis=-1, *, dim=None):
        """x - logsumexp(x) along ``axis`` (or PyTorch's ``dim``)."""
        return impl.LogSoftmax.apply(self, axis=axis if dim is None else dim)


def array_of(x):
    """The array inside ``x`` if it is a Tensor, else ``x``."""
    return x.data if isinstance(x, Tensor) else x


def _topological_order(root: Tensor) -> list:
    """Tensors reachable from ``root`` that need a gradient, inputs before outputs.

    Iterative depth-first post-order: a recursive version overflows the Python stack
    on a graph a few thousand ops deep.
    """
    order, visited = [], set()
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        if node._freed:  # its history is gone: treating it as a leaf would lose gradients
            raise RuntimeError("backward() through a graph that an earlier backward() freed; "
                               "run the forward pass again (there is no retain_graph)")
        visited.add(id(node))
        stack.append((node, True))
        if node._ctx is not None:
            for parent in node._ctx.inputs:
                if isinstance(parent, Tensor) and parent.requires_grad \
                        and id(parent) not in visited:
                    stack.append((parent, False))
    return order


def _several_output_nodes(order) -> dict:
    """A node with several outputs (``Split``) runs its backward once, when the last of its
    outputs in the walk is reached, with every output's gradient complete. Returns
    {id(node): [outputs not yet reached, gradient of each output]}."""
    waiting = {}
    for t in order:
        if t._output_index is not None:
            entry = waiting.setdefault(id(t._ctx), [0, [None] * t._ctx.n_outputs])
            entry[0] += 1
    return waiting


def _gather_outputs(waiting, t: Tensor, g):
    """Record output ``t``'s gradient ``g``; the tuple of all of them once the last output
    of its node is reached (None before, or when no output got a gradient)."""
    ctx = t._ctx
    entry = waiting[id(ctx)]
    entry[0] -= 1
    entry[1][t._output_index] = g
    t._freed = True
    if entry[0]:
        t._ctx = None
        return None
    del waiting[id(ctx)]
    if all(o is None for o in entry[1]):
        t._ctx = None
        return None
    return tuple(entry[1])


def tensor(data, requires_grad: bool = False, dtype=None) -> Tensor:
    """Make a Tensor (see :class:`Tensor`)."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)
