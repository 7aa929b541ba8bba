"""Adam and gradient clipping (the learning-rate schedules are in :mod:`tinytf.optim.schedule`)."""
from __future__ import annotations

import math
import weakref

import numpy as np

from tinytf.engine import backend
from tinytf.optim.optimizer import Optimizer
from tinytf.optim.schedule import noam_lr  # noqa: F401 - re-exported: optim.noam_lr is public API


def _named(params) -> list:
    """[(name, tensor)] from a list of tensors or of (name, tensor) pairs."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        return params
    return [(str(i), p) for i, p in enumerate(params)]


class FlatParameters:
    """Every parameter, its gradient and Adam's two moments, each one contiguous buffer.

    The parameters' ``.data`` become views of one float32 array, and each parameter's
    ``grad_buffer`` a view of a second, into which backward writes the gradient (see
    ``Tensor.accumulate_grad``). Then the whole optimizer step is a handful of passes over four
    flat arrays instead of a dozen array operations per parameter: on the GPU one Adam
    launch instead of one per parameter (65 for the Transformer), one gradient-norm
    reduction, one scaling. The same trick as Apex's and DeepSpeed's flat buffers.

    The links can be cut from outside (``load_state_dict`` and ``Module.to`` give a
    parameter a new array, an all-reduce a new gradient): :meth:`linked` and
    :meth:`grads_linked` check them by identity, and :class:`Adam` rebuilds or re-gathers.

    A gradient is a view of the shared buffer: the next backward after ``zero_grad()``
    overwrites it in place, so keep a copy (``p.grad.copy()``) to hold on to one.
    """

    def __init__(self, params, moments=()):
        """Pack ``params`` (Tensors, one device, float32) and optional ``moments``: lists
        (one per moment) of arrays or None, per parameter, copied into flat buffers too."""
        xp = backend.get_array_module(params[0].data)
        device = backend.device_of(params[0].data)
        self.params = list(params)
        self.ids = frozenset(id(p) for p in self.params)
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append((total, total + p.size))
            total += p.size
        self.data = xp.empty(total, dtype=np.float32)
        self.grad = xp.empty(total, dtype=np.float32)
        self.moments = [xp.zeros(total, dtype=np.float32) for _ in moments]
        self.data_views, self.grad_views, self.moment_views = [], [], []
        for p, (lo, hi) in zip(self.params, self.offsets):
            view = self.data[lo:hi].reshape(p.shape)
            view[...] = p.data
            p.data = view
            g = self.grad[lo:hi].reshape(p.shape)
            if p.grad is not None:
                g[...] = p.grad
                p.grad = g
            p.grad_buffer = g
            self.data_views.append(view)
            self.grad_views.append(g)
        for flat, values in zip(self.moments, moments):
            views = []
            for p, (lo, hi), value in zip(self.params, self.offsets, values):
                view = flat[lo:hi].reshape(p.shape)
                if value is not None:   # (a moment left on another device by Module.to)
                    view[...] = backend.to_device(value, device)
                views.append(view)
            self.moment_views.append(views)

    @staticmethod
    def supported(params) -> bool:
        """Whether ``params`` can share buffers: distinct float32 tensors on one device."""
        if not params or len({id(p) for p in params}) != len(params):
            return False
        xp = backend.get_array_module(params[0].data)
        return all(p.dtype == np.float32 and backend.get_array_module(p.data) is xp
                   for p in params)

    def linked(self, params, moments=()) -> bool:
        """Whether ``params`` (and ``moments``) are still exactly this object's views."""
        return (len(params) == len(self.params)
                and all(p is q and p.data is v
                        for p, q, v in zip(params, self.params, self.data_views))
                and all(a is b for values, views in zip(moments, self.moment_views)
                        for a, b in zip(values, views)))

    def grads_linked(self) -> bool:
        """Whether every parameter's ``.grad`` is its view of :attr:`grad` (so that
        :attr:`grad` holds this step's gradients, all of them)."""
        return all(p.grad is g for p, g in zip(self.params, self.grad_views))

    def gather_grads(self) -> bool:
        """Copy gradients that are not views of :attr:`grad` into it and relink them.

        False (nothing changed) if a parameter has no gradient: its slot would hold a
        stale one.
        """
        if any(p.grad is None for p in self.params):
            return False
        for p, g in zip(self.params, self.grad_views):
            if p.grad is not g:
                g[...] = p.grad
                p.grad = g
        return True


_FLAT_OF = weakref.WeakKeyDictionary()
"""Parameter tensor -> the :class:`FlatParameters` that holds it (set by :class:`Adam`)."""


def flat_parameters(params):
    """The :class:`FlatParameters` whose parameters are exactly ``params`` (in any order:
    the all-reduce sorts them by name), or None. Whether their arrays and gradients are
    still its views is for the caller to ask (:meth:`FlatParameters.linked`,
    :meth:`FlatParameters.grads_linked`)."""
    tensors = [p for _, p in _named(params)]
    flat = _FLAT_OF.get(tensors[0]) if tensors else None
    if flat is None or len(tensors) != len(flat.params) or {id(p) for p in tensors} != flat.ids:
        return None
    return flat


def flat_gradient(params):
    """The one flat array holding every gradient of ``params``, or None.

    Not None only when ``params`` are exactly the parameters of a :class:`FlatParameters`
    (:func:`flat_parameters`) and every gradient is its view: then a sum or a scaling over
    all gradients is one operation on this array.
    """
    flat = flat_parameters(params)
    return flat.grad if flat is not None and flat.grads_linked() else None


def gradient_arrays(params) -> list:
    """The arrays holding every gradient of ``params``: the one flat buffer when there is
    one (:func:`flat_gradient`: a pass over all gradients is then one operation), else each
    parameter's ``.grad`` (parameters without one left out)."""
    flat = flat_gradient(params)
    return [flat] if flat is not None else \
        [p.grad for _, p in _named(params) if p.grad is not None]


def grad_norm_array(params):
    """The L2 norm of all gradients together, as a 0-d float32 array on their device.

    Nothing is read back to the host, so a training step can decide on the device what
    the norm implies (clip, skip) and read the number later (docs/checkpoints.md, "One step
    in flight"). Parameters without a gradient count as 0; None when none has one.
    """
    total = None
    for g in gradient_arrays(params):
        g = g.reshape(-1)
        sq = g @ g
        total = sq if total is None else total + sq
    if total is None:
        return None
    xp = backend.get_array_module(total)
    return xp.asarray(xp.sqrt(total))     # NumPy gives a scalar, CuPy a 0-d array


def grad_norm(params) -> float:
    """The L2 norm of all gradients together, as a Python float (one host read)."""
    norm = grad_norm_array(params)
    return 0.0 if norm is None else float(norm)


def clip_grad_norm_array(params, max_norm: float):
    """Scale all gradients in place so their joint L2 norm is at most ``max_norm``; return
    the norm before clipping as a device scalar (:func:`grad_norm_array`).

    The factor min(1, max_norm / (norm + 1e-6)) is computed and applied on the device,
    always (times exactly 1 when the norm is small enough), so nothing waits for the GPU.
    A non-finite norm makes the gradients non-finite too: such a step is to be skipped.
    """
    norm = grad_norm_array(params)
    if norm is None:
        return None
    xp = backend.get_array_module(norm)
    kind = norm.dtype.type     # scalars of the norm's dtype: float32 stays float32 on NumPy
    factor = xp.minimum(xp.divide(kind(max_norm), norm + kind(1e-6)), kind(1.0))
    for g in gradient_arrays(params):
        g *= factor.astype(g.dtype, copy=False)
    return norm


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale all gradients in place so their joint L2 norm is at most ``max_norm``.

    Returns the norm before clipping as a float (like ``torch.nn.utils.clip_grad_norm_``,
    which also scales by min(1, max_norm / (norm + 1e-6))).
    """
    norm = clip_grad_norm_array(params, max_norm)
    return 0.0 if norm is None else float(norm)


def clip_grad_value_(params, clip_value: float) -> None:
    """Clamp every gradient of ``params`` into [-clip_value, clip_value], in place (as
    ``torch.nn.utils.clip_grad_value_``)."""
    xp = None
    for g in gradient_arrays(params):
        xp = xp or backend.get_array_module(g)
        xp.clip(g, -clip_value, clip_value, out=g)


def adam_update(p, g, m, v, lr: float, betas, eps: float, t: int) -> None:
    """Adam's update of one parameter array ``p`` at step ``t`` (1, 2, ...), in place:

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).

    Written with one scratch array, since each full pass over the parameters counts.
    """
    xp = backend.get_array_module(p)
    b1, b2 = betas
    step_size = lr / (1 - b1 ** t)
    bias2_sqrt = math.sqrt(1 - b2 ** t)
    m *= b1
    m += (1 - b1) * g
    v *= b2
    scratch = g * g
    scratch *= 1 - b2
    v += scratch
    denom = xp.sqrt(v, out=scratch)
    denom *= 1.0 / bias2_sqrt
    denom += eps
    update = xp.divide(m, denom, out=denom)
    update *= step_size
    p -= update


RECTIFY_FROM_RHO = 5.0
"""RAdam adapts the step only once rho_t (:func:`radam_rectifier`) is past this: 5, as in
PyTorch's ``RAdam`` and the official implementation. The paper's Algorithm 2 writes 4, which
at beta2 0.98 would adapt the 5th update too (rho_5 is 4.95, r_5 0.08)."""


def radam_rectifier(t: int, beta2: float) -> float:
    """RAdam's rectification r_t of Adam's step at update ``t`` (Liu et al. 2020, "On the
    Variance of the Adaptive Learning Rate and Beyond")::

        rho_inf = 2 / (1 - beta2) - 1                   # length of the SMA that v imitates
        rho_t   = rho_inf - 2 t beta2^t / (1 - beta2^t)  # ... after t updates
        r_t     = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))

    r_t is the square root of the ratio of the adaptive rate's variance in the limit to its
    variance at t (so that r_t times the rate has the limit's variance): a warm-up that
    Adam's second moment itself asks for (at beta2 0.98: 0.22 at update 10, 0.62 at 50,
    0.82 at 100, 0.99 at 300). That variance is infinite while rho_t <= 4; while rho_t <=
    :data:`RECTIFY_FROM_RHO` r_t is 0 here (no step: the official implementation's
    ``degenerated_to_sgd=False``; the paper and PyTorch take an un-adapted momentum-SGD step
    lr * m_hat there instead, which a warming-up schedule makes negligible).
    """
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    b2t = beta2 ** t
    rho_t = rho_inf - 2.0 * t * b2t / (1.0 - b2t)
    if rho_t <= RECTIFY_FROM_RHO:
        return 0.0
    return math.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                     / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) with bias correction, as PyTorch implements it
    (:func:`adam_update`). Defaults are the paper's: betas (0.9, 0.98), eps 1e-9 (PyTorch's
    are (0.9, 0.999), 1e-8). Moments have the parameter's dtype (float32 normally); scalars
    stay Python floats so nothing is upcast.

    ``weight_decay`` adds weight_decay * p to the gradient (an L2 penalty, as
    ``torch.optim.Adam``); :class:`AdamW` decays the weights apart from the gradient instead.
    Parameter groups (``[{"params": [...], "lr": ...}, ...]``) may set ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` of their own. The update count is one for the optimizer
    (PyTorch keeps one per parameter: the same while every parameter gets a gradient).

    ``rectify=True`` is RAdam (Liu et al. 2020), as PyTorch's ``RAdam`` computes it past its
    first updates: the step times :func:`radam_rectifier`, with eps added to sqrt(v) before
    the bias correction, i.e. :func:`adam_update` with lr * r_t and eps / sqrt(1 - b2^t)
    (:meth:`step_scalars`); the moments are Adam's. The tiny preset trains with it
    (docs/training.md, "RAdam").

    ``flat=True`` (the default) keeps parameters, gradients and moments in
    :class:`FlatParameters` buffers, built at the first step, and updates them all with one
    :func:`adam_update` call: the same arithmetic on the same numbers, in a few passes over
    four arrays instead of a dozen operations per parameter (with one parameter group).
    ``flat=False`` is the per-parameter loop; tests/optim/test_optim.py proves the two equal.
    ``tinytf.fast.FusedAdam`` runs the update as one CUDA kernel.
    """

    decoupled = False     # AdamW: decay the weights apart from the gradient

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9,
                 weight_decay: float = 0.0, flat: bool = True, rectify: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.rectify = rectify
        self.step_count = 0
        self.exp_avg = {n: None for n, _ in self.params}
        self.exp_avg_sq = {n: None for n, _ in self.params}
        self.flat = flat and len(self.param_groups) == 1 and \
            FlatParameters.supported([p for _, p in self.params])
        self.flat_buffers = None
        """The :class:`FlatParameters` in use (``flat=True``, after the first step), or None."""

    betas = property(lambda self: self.param_groups[0]["betas"],
                     lambda self, v: self._set_all("betas", tuple(v)),
                     doc="The first group's (beta1, beta2); setting sets every group's.")
    eps = property(lambda self: self.param_groups[0]["eps"],
                   lambda self, v: self._set_all("eps", v),
                   doc="The first group's eps; setting sets every group's.")

    def _set_all(self, key, value) -> None:
        for group in self.param_groups:
            group[key] = value

    def step(self, skip=None) -> None:
        """One update of every parameter that has a gradient.

        ``skip``: an optional flag array of one element on the parameters' device; when it
        is nonzero the update changes nothing. Here it is read on the host; ``FusedAdam``
        hands it to its kernel, so that the decision (a non-finite gradient norm, say)
        needs no host round trip. The update is counted in :attr:`step_count` either way:
        a caller that learns later that it was skipped subtracts it (``tinytf.training.trainer``).
        """
        self.step_count += 1
        # A decay scales the weights before the update: a skipped step must not, so with
        # weight decay the flag is read here, not by a kernel.
        decays = any(g["weight_decay"] for g in self.param_groups)
        if skip is not None and (decays or not self._skips_on_device()):
            if bool(skip.any()):
                return
            skip = None
        flat = self._flat_buffers()
        if flat is not None:
            group = self.param_groups[0]
            self._update(flat.data, self._decayed(flat.data, flat.grad, group), *flat.moments,
                         skip=skip)
            return
        for group, named in self.named_groups():   # the reference loop, one parameter at a time
            for name, p in named:
                if p.grad is None:
                    continue
                xp = backend.get_array_module(p.data)
                if self.exp_avg[name] is None:
                    self.exp_avg[name] = xp.zeros_like(p.data)
                    self.exp_avg_sq[name] = xp.zeros_like(p.data)
                self._update(p.data, self._decayed(p.data, p.grad, group), self.exp_avg[name],
                             self.exp_avg_sq[name], skip=skip, group=group)

    def _decayed(self, p, g, group):
        """The gradient to use: ``g + wd * p`` for Adam's L2 penalty, or ``g`` after scaling
        ``p`` by 1 - lr * wd in place for AdamW's decoupled decay; ``g`` when wd is 0."""
        wd = group["weight_decay"]
        if not wd:
            return g
        if self.decoupled:
            p *= 1 - group["lr"] * wd
            return g
        return g + wd * p

    def _skips_on_device(self) -> bool:
        """Whether :meth:`_update` reads the ``skip`` flag itself (``FusedAdam``'s kernel);
        here it does not, so :meth:`step` reads it on the host."""
        return False

    def describe(self) -> str:
        """What this optimizer runs, with its numbers, for the run's first log lines:
        ``Adam(0.9, 0.98, 1e-9)``, with ``rectify`` prefixed by ``RAdam:``."""
        def number(x):
            return f"{x:g}".replace("e-0", "e-")
        adam = f"Adam({number(self.betas[0])}, {number(self.betas[1])}, {number(self.eps)})"
        return f"RAdam: {adam} with its rectifier" if self.rectify else adam

    def step_scalars(self, group: dict | None = None) -> tuple:
        """(lr, eps) that :func:`adam_update` takes at this step (:attr:`step_count`) for
        ``group`` (the first when None): its own, or with ``rectify`` RAdam's, lr * r_t and
        eps / sqrt(1 - b2^t).

        The latter puts eps where RAdam puts it: lr r_t m_hat sqrt(1 - b2^t) / (sqrt(v) +
        eps) = lr r_t m_hat / (sqrt(v_hat) + eps / sqrt(1 - b2^t)).
        """
        group = self.param_groups[0] if group is None else group
        lr, eps = group["lr"], group["eps"]
        if not self.rectify:
            return lr, eps
        b2, t = group["betas"][1], self.step_count
        return lr * radam_rectifier(t, b2), eps / math.sqrt(1.0 - b2 ** t)

    def _update(self, p, g, m, v, skip=None, group=None) -> None:
        """:func:`adam_update` with the settings of ``group`` (the first when None; ``skip``
        is always None here: :meth:`step` has read it; ``FusedAdam`` runs a kernel that
        reads it)."""
        group = self.param_groups[0] if group is None else group
        lr, eps = self.step_scalars(group)
        adam_update(p, g, m, v, lr, group["betas"], eps, self.step_count)

    def _flat_buffers(self):
        """The :class:`FlatParameters` to update at once, or None (then one at a time).

        Built at the first step, rebuilt when a parameter or moment array was replaced
        (``load_state_dict``, ``Module.to``); None while some parameter has no gradient.
        """
        if not self.flat or len(self.param_groups) != 1:
            return None
        tensors = [p for _, p in self.params]
        if any(p.grad is None for p in tensors):
            return None
        names = [n for n, _ in self.params]
        moments = ([self.exp_avg[n] for n in names], [self.exp_avg_sq[n] for n in names])
        flat = self.flat_buffers
        if flat is None or not flat.linked(tensors, moments):
            if not FlatParameters.supported(tensors):   # e.g. moved to two devices
                return None
            for p in tensors:    # an old buffer's views must not catch new gradients
                p.grad_buffer = None
            flat = self.flat_buffers = FlatParameters(tensors, moments)
            for p in tensors:
                _FLAT_OF[p] = flat
            for n, m, v in zip(names, *flat.moment_views):
                self.exp_avg[n], self.exp_avg_sq[n] = m, v
        elif not flat.gather_grads():
            return None
        return flat

    def state_dict(self) -> dict:
        """{"step", "lr", "betas", "eps"} plus "exp_avg.NAME"/"exp_avg_sq.NAME" arrays; with
        weight decay or several groups also "groups", every group's settings."""
        state = {"step": self.step_count, "lr": self.lr, "betas": list(self.betas),
                 "eps": self.eps}
        if len(self.param_groups) > 1 or any(g["weight_decay"] for g in self.param_groups):
            state["groups"] = self.group_settings()
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
        if "groups" in state:
            self.load_group_settings(state["groups"])
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


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), as ``torch.optim.AdamW``:
    p = p (1 - lr wd) before Adam's update of p. PyTorch's defaults: lr 1e-3, betas
    (0.9, 0.999), eps 1e-8, weight_decay 1e-2."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, flat: bool = True, rectify: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, flat, rectify)

    def describe(self) -> str:
        """``AdamW(0.9, 0.999, 1e-8) with weight decay 0.01``."""
        wd = self.param_groups[0]["weight_decay"]
        return super().describe().replace("Adam(", "AdamW(") + f" with weight decay {wd:g}"
