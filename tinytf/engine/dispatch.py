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
"""
from __future__ import annotations


class OpTable:
    """Op name -> the class that implements it (an attribute per op: ``impl.Add``)."""

    def __init__(self):
        self._reference: dict = {}

    def register(self, cls) -> type:
        """Enter ``cls`` as the reference implementation of the op named after it."""
        self._reference[cls.__name__] = cls
        setattr(self, cls.__name__, cls)
        return cls

    def reference(self, name: str) -> type:
        """The reference class of op ``name``."""
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

    def replaced(self) -> dict:
        """{op name: the class now running instead of the reference}."""
        return {name: getattr(self, name) for name, ref in self._reference.items()
                if getattr(self, name) is not ref}


impl = OpTable()
"""The table every caller goes through (``tinytf.nn.functional``, ``Tensor``'s operators)."""
