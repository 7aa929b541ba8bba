"""The op table: which class runs each op.

Every op is called through this table, by the name of its reference class::

    from tinytf.engine.dispatch import impl
    y = impl.Softmax.apply(x, axis=-1)

:mod:`tinytf.ops` registers the reference classes (the mathematics, forward and backward
side by side) when it is imported. :mod:`tinytf.fast` may then :meth:`~OpTable.replace` an
entry by a subclass of the reference that computes the same thing faster (fused GPU
kernels, a cache-blocked CPU loop); :meth:`~OpTable.restore` puts the references back
(``TINYTF_FAST=0`` or ``tinytf.fast.set_enabled(False)``). :meth:`OpTable.replaced` lists
what runs instead of what: the one place that says which code a training step executes.

The table sits below the tensor and the ops (it imports nothing from tinytf), so that
``Tensor.__add__`` can find ``Add`` without ``tensor`` and ``ops`` importing each other.
The package's root hands it a loader (:meth:`OpTable.set_loader`) that imports the ops and
the fast paths at the first look-up of an op: ``import tinytf`` itself loads nothing heavy,
so that a program can set up its process (OpenBLAS's environment) before NumPy loads.
"""
from __future__ import annotations


class OpTable:
    """Op name -> the class that implements it (an attribute per op: ``impl.Add``)."""

    def __init__(self):
        self._reference: dict = {}
        self._loader = None

    def set_loader(self, load) -> None:
        """Call ``load()`` (which fills the table) once, at the first look-up of an op."""
        self._loader = load

    def _load(self) -> None:
        load, self._loader = self._loader, None
        if load is not None:
            load()

    def __getattr__(self, name: str) -> type:
        """An op not looked up yet (Python calls this only for a missing attribute): the
        table is loaded first, then the op's reference enters it."""
        if name.startswith("_"):
            raise AttributeError(name)
        self._load()
        if name in self.__dict__:
            return self.__dict__[name]
        if name not in self._reference:
            raise AttributeError(f"dispatch: no op named {name!r}")
        setattr(self, name, self._reference[name])
        return self._reference[name]

    def register(self, cls) -> type:
        """Enter ``cls`` as the reference implementation of the op named after it (it runs
        from the first look-up, unless a faster subclass replaces it before)."""
        self._reference[cls.__name__] = cls
        if self._loader is None:
            setattr(self, cls.__name__, cls)
        return cls

    def reference(self, name: str) -> type:
        """The reference class of op ``name``."""
        self._load()
        return self._reference[name]

    def replace(self, name: str, cls) -> None:
        """Run ``cls`` for op ``name``; it must subclass the op's reference class, so it
        keeps its interface (and falls back to the reference where it does not apply)."""
        ref = self._reference.get(name)
        if ref is None:
            raise KeyError(f"dispatch: no op named {name!r}")
        if not issubclass(cls, ref):
            raise TypeError(f"dispatch: {cls.__name__} must subclass {ref.__name__}")
        setattr(self, name, cls)

    def restore(self, name: str | None = None) -> None:
        """Put the reference class back for op ``name`` (every op when None)."""
        for key in [name] if name else list(self._reference):
            setattr(self, key, self._reference[key])

    def chain(self, name: str) -> list:
        """The classes that op ``name`` runs through, the one the table holds first and its
        reference last: each falls back to the next where it does not apply (a CUDA kernel
        on NumPy arrays, say). ``print(impl.describe("LayerNorm"))`` shows it."""
        ref, cls = self.reference(name), getattr(self, name)
        return [c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, ref)]

    def describe(self, name: str) -> str:
        """Op ``name``'s :meth:`chain`, a line per class (its module and the first line of
        its docstring), the one that runs first."""
        def line(c):
            doc = " ".join((c.__doc__ or "").strip().split("\n\n")[0].split())
            doc = doc.split(". ")[0].rstrip(".")       # its first sentence
            return f"  {c.__name__} ({c.__module__}){': ' + doc if doc else ''}"
        return "\n".join([f"{name} runs, each falling back to the next:"]
                         + [line(c) for c in self.chain(name)])

    def replaced(self) -> dict:
        """{op name: the class now running instead of the reference}."""
        self._load()
        return {name: getattr(self, name) for name, ref in self._reference.items()
                if getattr(self, name) is not ref}


impl = OpTable()
"""The table every caller goes through (``tinytf.nn.functional``, ``Tensor``'s operators)."""
