"""Adam as one CUDA kernel (or, on the CPU, in threads): :class:`FusedAdam`, named against
:class:`tinytf.optim.adam.Adam`."""
from __future__ import annotations

import numpy as np

from tinytf.fast.cuda import kernels
from tinytf.fast.cpu.threads import parallel_rows
from tinytf.optim.adam import Adam, adam_update


class FusedAdam(Adam):
    """:class:`~tinytf.optim.adam.Adam` whose update is one kernel launch over the flat buffers
    (``kernels.adam_step``: the moments, the bias corrections and the parameter in one
    pass), and whose ``skip`` flag is read by that kernel on the device, not by the host.
    Where the kernels do not run (NumPy arrays, float64) it is :class:`Adam`, with the flat
    NumPy buffers updated by ranges in threads (:mod:`tinytf.fast.cpu.threads`; bitwise equal).
    """

    def _skips_on_device(self) -> bool:
        """Whether every parameter is float32 and the kernels' (see ``kernels.fused``): then
        every update is the kernel's, and the kernel reads the ``skip`` flag."""
        tensors = [p for _, p in self.params]
        return all(p.dtype == np.float32 for p in tensors) and \
            kernels.fused(*(p.data for p in tensors))

    def _update(self, p, g, m, v, skip=None, group=None) -> None:
        group = self.param_groups[0] if group is None else group
        lr, eps = self.step_scalars(group)      # (RAdam's too: only the scalars differ)
        betas = group["betas"]
        if kernels.fused(p, g) and p.dtype == np.float32:
            kernels.adam_step(p, g, m, v, lr, betas, eps, self.step_count, found_inf=skip)
            return
        if all(type(a) is np.ndarray and a.ndim == 1 for a in (p, g, m, v)):
            # The flat buffers on the CPU: Adam is elementwise, so ranges of them update in
            # threads (tinytf.fast.cpu.threads), bitwise as one call would.
            def update(lo, hi):
                adam_update(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], lr, betas, eps,
                            self.step_count)
            parallel_rows(update, p.size)
            return
        super()._update(p, g, m, v, group=group)
