"""What every optimizer shares, as ``torch.optim.Optimizer``: parameter groups, per-parameter
state, ``zero_grad`` and the learning rate that schedules drive.

``params`` is a list of Tensors, of (name, Tensor) pairs (``model.named_parameters()``), or of
groups ``{"params": [...], "lr": ..., ...}``: a group's own settings override the optimizer's
defaults for its parameters. Settings live in ``optimizer.param_groups``; a scheduler
(:mod:`tinytf.optim.lr_scheduler`) changes each group's ``"lr"`` there.
"""
from __future__ import annotations

from tinytf.engine.tensor import Tensor


class Optimizer:
    """Base class: ``param_groups`` (dicts with "params" and the settings of
    ``defaults``), ``params`` ([(name, Tensor)] over all groups), :meth:`zero_grad`, and
    :meth:`step` in the subclass."""

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        self.param_groups: list = []
        self.params: list = []
        groups = list(params)
        if not groups:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group: dict) -> None:
        """Add a group: its "params" (Tensors or (name, Tensor) pairs) and any settings of
        ``defaults`` it overrides; a parameter may belong to one group only."""
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("a parameter group is a dict with a 'params' list")
        unknown = sorted(set(group) - set(self.defaults) - {"params"})
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown setting(s) {unknown} in a "
                             f"parameter group (known: {sorted(self.defaults)})")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        named = []
        for p in params:
            name, p = p if isinstance(p, tuple) else (str(len(self.params) + len(named)), p)
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__}: a parameter must be a Tensor, got "
                                f"{type(p).__name__}")
            named.append((name, p))
        seen = {id(p) for _, p in self.params}
        if any(id(p) in seen for _, p in named) or len({id(p) for _, p in named}) < len(named):
            raise ValueError("a parameter appears in more than one place of the groups")
        self.param_groups.append({**self.defaults, **group, "params": [p for _, p in named]})
        self.params += named

    def named_groups(self):
        """(group, [(name, Tensor)]) for every group, in order."""
        i = 0
        for group in self.param_groups:
            n = len(group["params"])
            yield group, self.params[i:i + n]
            i += n

    @property
    def lr(self) -> float:
        """The first group's learning rate; setting it sets every group's."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = value

    def zero_grad(self) -> None:
        """Forget every parameter's gradient."""
        for _, p in self.params:
            p.grad = None

    def group_settings(self) -> list:
        """Each group's settings without its parameters (for ``state_dict``)."""
        return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                 if k != "params"} for g in self.param_groups]

    def load_group_settings(self, settings: list) -> None:
        """Restore what :meth:`group_settings` returned (one entry per group)."""
        if len(settings) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(settings)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, settings):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(value, list) else value
