"""Adam as one CUDA kernel: :class:`FusedAdam`, named against :class:`tinytf.optim.Adam`."""
from __future__ import annotations

import numpy as np

from .. import backend, kernels
from ..optim import Adam


class FusedAdam(Adam):
    """:class:`~tinytf.optim.Adam` whose update is one kernel launch over the flat buffers
    (``kernels.adam_step``: the moments, the bias corrections and the parameter in one
    pass), and whose ``skip`` flag is read by that kernel on the device, not by the host.
    Where the kernels do not run (NumPy arrays, float64) it is :class:`Adam`.
    """

    def step(self, skip=None) -> None:
        """One update; a nonzero device flag ``skip`` makes it change nothing (see Adam)."""
        if skip is None or not self._kernel_updates():
            return super().step(skip)
        self.step_count += 1
        flat = self._flat_buffers()
        if flat is not None:
            self._update(flat.data, flat.grad, *flat.moments, skip=skip)
            return
        for name, p in self.params:
            if p.grad is None:
                continue
            if self.exp_avg[name] is None:
                xp = backend.get_array_module(p.data)
                self.exp_avg[name] = xp.zeros_like(p.data)
                self.exp_avg_sq[name] = xp.zeros_like(p.data)
            self._update(p.data, p.grad, self.exp_avg[name], self.exp_avg_sq[name], skip=skip)

    def _kernel_updates(self) -> bool:
        """Whether every parameter is float32 and the kernels' (see ``kernels.fused``)."""
        tensors = [p for _, p in self.params]
        return all(p.dtype == np.float32 for p in tensors) and \
            kernels.fused(*(p.data for p in tensors))

    def _update(self, p, g, m, v, skip=None) -> None:
        if kernels.fused(p, g) and p.dtype == np.float32:
            kernels.adam_step(p, g, m, v, self.lr, self.betas, self.eps, self.step_count,
                              found_inf=skip)
            return
        super()._update(p, g, m, v)
