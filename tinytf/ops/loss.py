"""Losses with a fused backward: label-smoothed cross-entropy (Szegedy et al. 2016; the
paper's section 5.4) and binary cross-entropy on logits."""
from __future__ import annotations

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function
from tinytf.ops.activation import sigmoid


class CrossEntropy(Function):
    """Label-smoothed cross-entropy of logits (N, V) against integer targets (N,).

    With smoothing eps, the target distribution q is (1 - eps) on the true class plus
    eps / V on every class (as in PyTorch), so per row, with logp = log_softmax(x),
    loss = -(1 - eps) * logp[t] - (eps / V) * sum_j logp[j],
    d(loss)/dx = softmax(x) - q.
    Rows whose target is ``ignore_index`` contribute nothing. Reductions: "sum", "mean"
    (over non-ignored rows) or "none". The forward computes the gradient along with the
    loss and keeps it, since softmax(x) is at hand there; backward only scales it.
    """

    def forward(self, logits, target, label_smoothing=0.0, ignore_index=None,
                reduction="mean"):
        xp = get_array_module(logits)
        n, v = logits.shape
        eps = float(label_smoothing)
        t, weights = self.targets(target, ignore_index, logits.dtype)
        rows = xp.arange(n)
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
        loss = -(1.0 - eps) * logp[rows, t]
        if eps:
            loss -= (eps / v) * logp.sum(axis=1)
        grad = xp.exp(logp)                      # softmax(x) ...
        if eps:
            grad -= eps / v
        grad[rows, t] -= 1.0 - eps               # ... - q
        loss *= weights
        return self.reduce(loss, grad, weights, reduction)

    @staticmethod
    def targets(target, ignore_index, dtype):
        """(targets with ignored rows pointed at class 0, each row's weight: 0 for an
        ignored row, else 1)."""
        xp = get_array_module(target)
        if ignore_index is None:
            return target, xp.ones(target.shape[0], dtype=dtype)
        valid = target != ignore_index
        return xp.where(valid, target, 0), valid.astype(dtype)

    def reduce(self, loss, grad, weights, reduction):
        """Keep the per-row gradient and weights for backward; reduce the per-row loss."""
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction, self.probs, self.weights = reduction, grad, weights
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        # The count stays a 0-d array on the device: reading it on the host would stall
        # every GPU step until the forward pass had finished.
        xp = get_array_module(loss)
        self.count = xp.maximum(weights.sum(), 1.0).astype(loss.dtype)
        return loss.sum() / self.count

    def row_scale(self, grad):
        """The factor of each row's gradient: d(output)/d(loss_i) times the upstream grad."""
        if self.reduction == "none":
            return grad * self.weights
        return self.weights * (grad / self.count if self.reduction == "mean" else grad)

    def backward(self, grad):
        scale = self.row_scale(grad)
        return self.probs * scale.astype(self.probs.dtype, copy=False)[:, None], None


class BinaryCrossEntropyWithLogits(Function):
    """-[y log s(x) + (1 - y) log(1 - s(x))] per element, s the logistic function, written
    max(x, 0) - x y + log(1 + e^-|x|) so that no logarithm sees 0 (as PyTorch computes it);
    d/dx = s(x) - y, d/dy = -x. ``reduction``: "mean" over all elements, "sum" or "none"."""

    def forward(self, x, y, reduction="mean"):
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if x.shape != y.shape:
            raise ValueError(f"binary_cross_entropy_with_logits: logits {x.shape} and "
                             f"targets {y.shape} differ in shape")
        xp = get_array_module(x)
        self.reduction = reduction
        self.save_for_backward(x, y)
        loss = xp.maximum(x, 0) - x * y + xp.log1p(xp.exp(-xp.abs(x)))
        if reduction == "none":
            return loss
        return loss.sum() if reduction == "sum" else loss.mean()

    def backward(self, grad):
        x, y = self.saved
        if self.reduction == "mean":
            grad = grad / x.size
        return ((sigmoid(x) - y) * grad if self.needs_input_grad[0] else None,
                -x * grad if self.needs_input_grad[1] else None)
