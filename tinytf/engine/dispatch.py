"""The op table: which class runs each op, on each device.

Every op is called through this table, by the name of its reference class::

    from tinytf.engine.dispatch import impl
    y = impl.Softmax.apply(x, axis=-1)

The table holds one entry per op and, in it, one class per device ("cpu" for NumPy
arrays, "gpu" for CuPy's), the way early tinygrad registered the same op names from
``ops_cpu.py`` and ``ops_gpu.py``. ``apply`` picks the class by the device of the op's
first array input. :mod:`tinytf.ops` registers the reference classes (the mathematics,
forward and backward side by side), which run on every device; :mod:`tinytf.fast`
:meth:`~OpTable.install` s each device's faster subclasses of them (``fast.CPU_OPS``,
``fast.GPU_OPS``), and :meth:`~OpTable.uninstall` puts the references back
(``TINYTF_FAST=0`` or ``tinytf.fast.set_enabled(False)``). :meth:`OpTable.describe` prints
what runs for an op on each device: the one place that says which code a step executes.

The table sits below the tensor and the ops (it imports nothing from tinytf),
so that ``Tensor.__add__`` can find ``Add`` without ``tensor`` and ``ops`` importing each
other. The package's root hands it a loader (:meth:`OpTable.set_loader`) that imports the
ops and the fast paths at the first look-up of an op: ``import tinytf`` itself loads
nothing heavy, so that a program can set up its process (OpenBLAS's environment) before
NumPy loads.
"""
from __future__ import annotations

import sys

DEVICES = ("cpu", "gpu")


def first_on_gpu(inputs) -> bool:
    """Whether the first array among ``inputs`` (a Tensor's ``.data``, or a bare array;
    numbers and None are skipped) is a CuPy array. False at once while CuPy is not loaded
    (without NumPy either: the table loads before NumPy does)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    for x in inputs:
        if isinstance(x, cupy.ndarray) or isinstance(getattr(x, "data", None), cupy.ndarray):
            return True
        if hasattr(x, "dtype"):     # the first array, or Tensor, is not CuPy's
            return False
    return False


class Op:
    """One op's entry in the table: the class that runs it on each device."""

    __slots__ = ("name", "reference", "cpu", "gpu")

    def __init__(self, reference: type):
        self.name, self.reference = reference.__name__, reference
        self.cpu = self.gpu = reference

    def runs_on(self, device: str) -> type:
        """The class that runs this op on ``device`` ("cpu" or "gpu")."""
        return getattr(self, device)

    def for_inputs(self, inputs) -> type:
        """The class that runs this op on ``inputs``: the GPU's when the first array among
        them (a Tensor's, or a bare one) is a CuPy array, else the CPU's."""
        if self.gpu is not self.cpu and first_on_gpu(inputs):
            return self.gpu
        return self.cpu

    def apply(self, *inputs, **kwargs):
        """Run the op on ``inputs`` with the class of their device (``Function.apply``)."""
        return self.for_inputs(inputs).apply(*inputs, **kwargs)

    def __repr__(self) -> str:
        return f"<op {self.name}: cpu {self.cpu.__name__}, gpu {self.gpu.__name__}>"


class OpTable:
    """Op name -> its :class:`Op` entry (an attribute per op: ``impl.Add``)."""

    def __init__(self):
        self._ops: dict = {}
        self._loader = None

    def set_loader(self, load) -> None:
        """Call ``load()`` (which fills the table) once, at the first look-up of an op."""
        self._loader = load

    def _load(self) -> None:
        load, self._loader = self._loader, None
        if load is not None:
            load()

    def __getattr__(self, name: str) -> Op:
        """An op not looked up yet (Python calls this only for a missing attribute): the
        table is loaded first, then the op's entry becomes an attribute."""
        if name.startswith("_"):
            raise AttributeError(name)
        self._load()
        if name not in self._ops:
            raise AttributeError(f"dispatch: no op named {name!r}")
        setattr(self, name, self._ops[name])
        return self._ops[name]

    def register(self, cls) -> type:
        """Enter ``cls`` as the reference implementation of the op named after it, the
        class that runs on every device until a faster one is installed."""
        op = Op(cls)
        self._ops[op.name] = op
        if self._loader is None:
            setattr(self, op.name, op)
        return cls

    def _op(self, name: str) -> Op:
        self._load()
        if name not in self._ops:
            raise KeyError(f"dispatch: no op named {name!r}")
        return self._ops[name]

    def reference(self, name: str) -> type:
        """The reference class of op ``name``."""
        return self._op(name).reference

    def install(self, device: str, table: dict) -> None:
        """Run ``table[name]`` for op ``name`` on ``device``. Each class must subclass the
        op's reference, so it keeps its interface (and falls back to the reference where it
        does not apply: float64 gradient checks on the GPU, say)."""
        if device not in DEVICES:
            raise ValueError(f"dispatch: device must be one of {DEVICES}, got {device!r}")
        for name, cls in table.items():
            op = self._op(name)
            if not issubclass(cls, op.reference):
                raise TypeError(f"dispatch: {cls.__name__} must subclass {op.reference.__name__}")
        for name, cls in table.items():
            setattr(self._ops[name], device, cls)

    def uninstall(self, device: str | None = None) -> None:
        """Put the reference classes back on ``device`` (every device when None)."""
        self._load()
        for op in self._ops.values():
            for d in [device] if device else DEVICES:
                setattr(op, d, op.reference)

    def installed(self, device: str) -> dict:
        """{op name: the class running on ``device`` instead of the reference}."""
        self._load()
        return {name: op.runs_on(device) for name, op in self._ops.items()
                if op.runs_on(device) is not op.reference}

    def chain(self, name: str, device: str = "cpu") -> list:
        """The classes that op ``name`` runs through on ``device``, the installed one first
        and the reference last: each falls back to the next where it does not apply."""
        op = self._op(name)
        return [c for c in op.runs_on(device).__mro__
                if isinstance(c, type) and issubclass(c, op.reference)]

    def describe(self, name: str) -> str:
        """What runs for op ``name``, a line per device: its :meth:`chain` of classes, each
        with its module. ``print(impl.describe("LayerNorm"))`` shows it."""
        lines = [f"{name} runs, each class falling back to the next:"]
        for device in DEVICES:
            lines.append(f"  {device}: " + " -> ".join(
                f"{c.__name__} ({c.__module__})" for c in self.chain(name, device)))
        return "\n".join(lines)


impl = OpTable()
"""The table every caller goes through (``tinytf.nn.functional``, ``Tensor``'s operators)."""
