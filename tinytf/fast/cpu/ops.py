"""Faster CPU versions of reference ops, each a subclass named against the one it replaces.

- :class:`BlockedCrossEntropy` replaces :class:`tinytf.ops.loss.CrossEntropy`: the same
  loss and gradient computed in one (N, V) buffer, 64 rows at a time so that its passes
  stay in cache, and that buffer reused by the next step's forward.
- :class:`FlatIndexEmbedding` replaces :class:`tinytf.ops.embedding.Embedding`'s backward:
  NumPy's ``add.at`` with flat element indices instead of row indices, ~3x faster.
- The row-parallel variants of :class:`~tinytf.ops.elementwise.GELU`,
  :class:`~tinytf.ops.norm.LayerNorm`,
  :class:`~tinytf.ops.dropout.DropoutAdd`, :class:`~tinytf.ops.attention.Attention` (its
  masked softmax and that softmax's backward) and :class:`~tinytf.ops.matmul.Linear` (its
  bias and ReLU passes) run the reference's own NumPy calls on ranges of rows in threads
  (:mod:`tinytf.fast.cpu.threads`); ``BlockedCrossEntropy`` hands its blocks out the same way.

The first two agree with their reference to float32 rounding, the row-parallel ones bitwise
(tests/fast/test_fast.py, tests/fast/test_threads.py).
"""
from __future__ import annotations

import sys

import numpy as np

from tinytf.engine import backend
from tinytf.engine.backend import get_array_module, scatter_add
from tinytf.fast.cpu.threads import parallel_rows
from tinytf.fast.cpu.transposed import transposed
from tinytf.ops.attention import Attention, masked_softmax_, masked_softmax_grad_
from tinytf.ops.dropout import DropoutAdd, scaled_keep
from tinytf.ops.elementwise import GELU, gelu_, gelu_grad_
from tinytf.ops.embedding import Embedding
from tinytf.ops.loss import CrossEntropy
from tinytf.ops.matmul import Linear
from tinytf.ops.norm import LayerNorm, affine_, normalize_rows_, normalized_grad_


class BlockedCrossEntropy(CrossEntropy):
    """:class:`CrossEntropy` in one reused (N, V) buffer, a block of rows at a time.

    With lse = log sum exp(z), z = x - max(x), logp = z - lse, so the two loss terms need
    only z[t] and sum(z), taken before z is overwritten:
    loss = -(1 - eps) (z[t] - lse) - (eps / V) (sum(z) - V lse).
    Then z becomes exp(z), and exp(z) / sum becomes the gradient softmax - q, in place.
    """

    ROWS_PER_BLOCK = 64  # 64 rows x 8k classes x 4 bytes = 2 MB: one block fits in cache

    # The (N, V) buffer is large (130 MB for 4k tokens x 8k classes), and in a training step
    # writing fresh memory costs more than the arithmetic done in it (page faults: measured
    # ~250 ms of CPU per step, against ~30 ms to rewrite memory already in use). So the buffer
    # that backward hands out is kept here and reused by the next forward, provided nothing
    # else refers to it by then (the engine drops a gradient once it has been used).
    _spare = None

    @classmethod
    def _buffer_like(cls, logits):
        """An uninitialised array like ``logits``: the last backward's buffer if it is free."""
        buf, BlockedCrossEntropy._spare = BlockedCrossEntropy._spare, None
        # 2 references when free: ``buf`` here and getrefcount's own argument (a view of
        # the buffer, or a caller holding it, adds one).
        if (buf is not None and type(buf) is type(logits) and buf.shape == logits.shape
                and buf.dtype == logits.dtype and sys.getrefcount(buf) == 2):
            return buf
        return get_array_module(logits).empty_like(logits)

    def forward(self, logits, target, label_smoothing=0.0, ignore_index=None,
                reduction="mean"):
        xp = get_array_module(logits)
        n, v = logits.shape
        eps = float(label_smoothing)
        safe_target, weights = self.targets(target, ignore_index, logits.dtype)
        rows = xp.arange(min(n, self.ROWS_PER_BLOCK))
        grad = self._buffer_like(logits)
        loss = xp.empty(n, dtype=logits.dtype)

        def blocks(first, last):   # blocks first..last-1 of ROWS_PER_BLOCK rows
            for lo in range(first * self.ROWS_PER_BLOCK, min(last * self.ROWS_PER_BLOCK, n),
                            self.ROWS_PER_BLOCK):
                hi = min(lo + self.ROWS_PER_BLOCK, n)
                r, t = rows[:hi - lo], safe_target[lo:hi]
                buf = grad[lo:hi]
                xp.subtract(logits[lo:hi], logits[lo:hi].max(axis=1, keepdims=True), out=buf)
                z_target = buf[r, t]
                z_sum = buf.sum(axis=1) if eps else None
                xp.exp(buf, out=buf)
                total = buf.sum(axis=1, keepdims=True)
                lse = xp.log(total[:, 0])
                block_loss = (lse - z_target) * (1.0 - eps)
                if eps:
                    block_loss += (lse - z_sum * (1.0 / v)) * eps
                loss[lo:hi] = block_loss
                # buf becomes d(loss_i)/d(logits_i) = softmax - smoothed one-hot.
                buf *= 1.0 / total
                if eps:
                    buf -= eps / v
                buf[r, t] -= 1.0 - eps

        n_blocks = -(-n // self.ROWS_PER_BLOCK)
        if xp is np:
            parallel_rows(blocks, n_blocks, self.ROWS_PER_BLOCK * v)
        else:
            blocks(0, n_blocks)
        loss *= weights
        return self.reduce(loss, grad, weights, reduction)

    def backward(self, grad):
        # The node is freed after this single backward, so its buffer is scaled in place
        # instead of allocating another (N, V) array, and kept for the next forward.
        probs, self.probs = self.probs, None
        scale = self.row_scale(grad).astype(probs.dtype, copy=False)[:, None]
        if get_array_module(probs) is np:  # (CuPy keeps freed memory in its own pool)
            def scale_rows(lo, hi):
                probs[lo:hi] *= scale[lo:hi]
            parallel_rows(scale_rows, probs.shape[0], probs.shape[1])
            BlockedCrossEntropy._spare = probs
        else:
            probs *= scale
        return probs, None


class FlatIndexEmbedding(Embedding):
    """:class:`Embedding` whose backward scatters element by element into the flat table.

    Element j of row i goes to i * d + j: NumPy's ``add.at`` is ~3x faster with such flat
    indices than with row indices. CuPy's ``scatter_add`` takes rows at full speed, so
    CuPy arrays take the reference backward.
    """

    def backward(self, grad):
        if get_array_module(grad) is not np:
            return super().backward(grad)
        v, d = self.shape
        flat = (self.ids.reshape(-1, 1).astype(np.intp) * d + np.arange(d)).reshape(-1)
        gw = np.zeros(v * d, dtype=grad.dtype)
        scatter_add(gw, flat, grad.reshape(-1))
        return gw.reshape(v, d), None


# --------------------------------------------------------------------------------------
# Row-parallel variants: the reference's own NumPy calls, on ranges of rows in threads
# (tinytf.fast.cpu.threads), so each is bitwise equal to its reference with any thread count.
# They take NumPy float32/float64 arrays; anything else runs the reference.
# --------------------------------------------------------------------------------------

def _rows_of(*arrays):
    """True if every array is a NumPy array of one float dtype (the row-parallel case)."""
    dtypes = {a.dtype for a in arrays if a is not None}
    return len(dtypes) == 1 and dtypes <= {np.dtype(np.float32), np.dtype(np.float64)} and \
        all(type(a) is np.ndarray for a in arrays if a is not None)


class RowParallelGELU(GELU):
    """:class:`GELU` forward and backward (``gelu_``, ``gelu_grad_``) by range of rows in
    threads."""

    def forward(self, x):
        if not _rows_of(x) or x.ndim < 1:
            return super().forward(x)
        x2 = x.reshape(-1, x.shape[-1])
        t, y = np.empty(x2.shape, x.dtype), np.empty(x2.shape, x.dtype)

        def rows(lo, hi):
            gelu_(x2[lo:hi], t[lo:hi], y[lo:hi])

        parallel_rows(rows, x2.shape[0], x2.shape[1])
        self.save_for_backward(x, t.reshape(x.shape))
        return y.reshape(x.shape)

    def backward(self, grad):
        x, t = self.saved
        if not _rows_of(x, t, grad) or grad.shape != x.shape or x.ndim < 1:
            return super().backward(grad)
        d = x.shape[-1]
        x2, t2, g2 = x.reshape(-1, d), t.reshape(-1, d), grad.reshape(-1, d)
        out = np.empty(g2.shape, grad.dtype)

        def rows(lo, hi):
            gelu_grad_(x2[lo:hi], t2[lo:hi], g2[lo:hi], out[lo:hi])

        parallel_rows(rows, g2.shape[0], d)
        return out.reshape(grad.shape)


ROW_GROUP_WIDTH = 256   # rows shorter than this are grouped by `affine_grouped_`


def affine_grouped_(x_hat, weight, bias, out) -> None:
    """``affine_`` of contiguous (n, d) arrays, bitwise the same: rows shorter than 256 taken
    in groups of g = 256 // d, as (n / g, g * d) arrays against w and b tiled g times, the
    remainder as they are. NumPy's product with a broadcast row vector costs per row: over
    (4096, 64) arrays grouping makes ``affine_`` 1.2x faster; longer groups, or grouping rows
    of 256, make it slower."""
    n, d = x_hat.shape
    g = max(1, ROW_GROUP_WIDTH // d)
    m = n - n % g if g > 1 else 0
    if m:
        tile = (lambda v: None if v is None else np.tile(v, g))
        affine_(x_hat[:m].reshape(-1, g * d), tile(weight), tile(bias),
                out[:m].reshape(-1, g * d))
    affine_(x_hat[m:], weight, bias, out[m:])


class RowParallelLayerNorm(LayerNorm):
    """:class:`LayerNorm` with the per-row statistics, normalisation and input gradient
    (``normalize_rows_``, ``affine_``, ``normalized_grad_``) by range of rows in threads, and
    the products with w and b by groups of rows (`affine_grouped_`); the parameter
    gradients' column sums stay whole."""

    def forward(self, x, weight=None, bias=None, eps=1e-5):
        if not _rows_of(x, weight, bias):
            return super().forward(x, weight, bias, eps)
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        x_hat, out = np.empty(x2.shape, x.dtype), np.empty(x2.shape, x.dtype)
        rstd = np.empty((x2.shape[0], 1), x.dtype)

        def rows(lo, hi):
            normalize_rows_(x2[lo:hi], x_hat[lo:hi], rstd[lo:hi], eps)
            affine_grouped_(x_hat[lo:hi], weight, bias, out[lo:hi])

        parallel_rows(rows, x2.shape[0], d)
        self.save_for_backward(x_hat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1), weight)
        return out.reshape(x.shape)

    def backward(self, grad):
        x_hat, rstd, weight = self.saved
        if not (self.needs_input_grad[0] and _rows_of(grad, x_hat, weight)):
            return super().backward(grad)
        d = x_hat.shape[-1]
        g2, x_hat2, rstd2 = grad.reshape(-1, d), x_hat.reshape(-1, d), rstd.reshape(-1, 1)
        gx = np.empty(g2.shape, grad.dtype)
        dx_hat = np.empty(g2.shape, grad.dtype) if weight is not None else g2

        def rows(lo, hi):
            if weight is not None:   # dx_hat = grad * w
                affine_grouped_(g2[lo:hi], weight, None, dx_hat[lo:hi])
            normalized_grad_(dx_hat[lo:hi], x_hat2[lo:hi], rstd2[lo:hi], gx[lo:hi])

        parallel_rows(rows, g2.shape[0], d)
        return (gx.reshape(grad.shape), *self.param_grads(grad, x_hat))


class RowParallelDropoutAdd(DropoutAdd):
    """:class:`DropoutAdd` with the mask, product and sum by range of rows in threads. The
    uniform numbers are drawn in one call, as the reference draws them (same stream)."""

    def forward(self, x, residual, p):
        if not (_rows_of(x, residual) and x.shape == residual.shape and x.ndim):
            return super().forward(x, residual, p)
        uniform = backend.rng(np).random(x.shape, dtype=np.float32)
        d = x.shape[-1]
        x2, r2, u2 = x.reshape(-1, d), residual.reshape(-1, d), uniform.reshape(-1, d)
        mask, out = np.empty(x2.shape, x.dtype), np.empty(x2.shape, x.dtype)

        def rows(lo, hi):
            m = scaled_keep(u2[lo:hi], p, x.dtype, out=mask[lo:hi])   # keep_mask's rows
            o = out[lo:hi]
            np.multiply(x2[lo:hi], m, out=o)
            o += r2[lo:hi]

        parallel_rows(rows, x2.shape[0], d)
        self.mask = mask.reshape(x.shape)
        return out.reshape(x.shape)

    def dropped_grad(self, grad):
        if not _rows_of(grad, self.mask) or grad.shape != self.mask.shape or not grad.ndim:
            return super().dropped_grad(grad)
        d = grad.shape[-1]
        g2, m2 = grad.reshape(-1, d), self.mask.reshape(-1, d)
        out = np.empty(g2.shape, grad.dtype)

        def rows(lo, hi):
            np.multiply(g2[lo:hi], m2[lo:hi], out=out[lo:hi])

        parallel_rows(rows, g2.shape[0], d)
        return out.reshape(grad.shape)


class RowParallelAttention(Attention):
    """:class:`Attention` with the masked softmax and its backward (``masked_softmax_``,
    ``masked_softmax_grad_``), the dropout on the weights (its uniforms drawn in one call,
    as the reference draws them) and the batched products of small matrices by range of
    the leading (batch) axis in threads.

    NumPy computes ``a @ b`` on (B, h, T, d) stacks as one BLAS call per matrix, in a loop
    on one core, and OpenBLAS runs a call of fewer than about ``SMALL_PRODUCT``
    multiply-adds on one core as well: at 25 and 64 tokens a sentence's attention products
    leave the second core idle. Those products go by range of sentences to the threads,
    each range's matrices the same BLAS calls as in the single loop (bitwise equal); the
    scores are then masked and soft-maxed in the same range while they are in cache.
    Larger matrices stay single calls over all sentences (BLAS already uses every core).
    """

    SMALL_PRODUCT = 1 << 18   # multiply-adds of one matrix product (64 x 64 x 64)

    def _mask_rows(self, ndim, n):
        """``mask_rows(lo, hi)``: the mask for rows lo..hi of an ``ndim``-axis score array of
        ``n`` rows, or None if the mask cannot be cut so."""
        mask = self.mask
        if mask is None or mask.ndim < ndim or mask.shape[0] == 1:
            return lambda lo, hi: mask
        if mask.shape[0] == n:
            return lambda lo, hi: mask[lo:hi]
        return None

    def _split_product(self, a, b):
        """The (B, ..., m, n) output of ``a @ b`` and ``product(lo, hi)`` that computes its
        sentences lo..hi, if the product is a stack of small matrices to split by
        sentence; else None."""
        if a.ndim < 3 or a.shape[:-2] != b.shape[:-2] or not _rows_of(a, b):
            return None
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        if m * k * n > self.SMALL_PRODUCT:
            return None
        out = np.empty(a.shape[:-1] + (n,), dtype=a.dtype)

        def product(lo, hi):
            np.matmul(a[lo:hi], b[lo:hi], out=out[lo:hi])
        return out, product

    @staticmethod
    def _product_rows(out, a):
        """The row size handed to `parallel_rows` for a product into ``out`` (B, ..., m, n)
        from ``a`` (B, ..., m, k): its multiply-adds per sentence, counted as an eighth of
        an element of a memory-bound pass (2^21 multiply-adds on one core take about as
        long as the 2^18 elements below which a pass stays in one thread)."""
        return out[0].size * a.shape[-1] // 8

    def weights_of(self, q, k, mask):
        self.mask = mask
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])   # the scores' leading axes
        mask_rows = self._mask_rows(len(lead) + 2, lead[0]) if lead else None
        if mask_rows is None or not _rows_of(q, k):
            return super().weights_of(q, k, mask)
        split = self._split_product(q, k.swapaxes(-1, -2))
        if split is not None:
            scores, product = split

            def rows(lo, hi):
                product(lo, hi)
                masked_softmax_(scores[lo:hi], mask_rows(lo, hi), self.scale)

            parallel_rows(rows, scores.shape[0], self._product_rows(scores, q))
            return scores
        scores = q @ k.swapaxes(-1, -2)

        def rows(lo, hi):
            masked_softmax_(scores[lo:hi], mask_rows(lo, hi), self.scale)

        parallel_rows(rows, scores.shape[0], scores[0].size)
        return scores

    def product(self, a, b, alpha: float = 1.0):
        split = self._split_product(a, b)
        if split is None:
            return super().product(a, b, alpha)
        out, product = split

        def rows(lo, hi):
            product(lo, hi)
            if alpha != 1.0:
                out[lo:hi] *= alpha

        parallel_rows(rows, out.shape[0], self._product_rows(out, a))
        return out

    def drop(self, weights, p: float):
        if not _rows_of(weights):
            return super().drop(weights, p)
        uniform = backend.rng(np).random(weights.shape, dtype=np.float32)  # keep_mask's draw
        mask, dropped = np.empty_like(weights), np.empty_like(weights)

        def rows(lo, hi):
            scaled_keep(uniform[lo:hi], p, weights.dtype, out=mask[lo:hi])
            np.multiply(weights[lo:hi], mask[lo:hi], out=dropped[lo:hi])

        parallel_rows(rows, weights.shape[0], weights[0].size)
        return mask, dropped

    def scores_grad(self, weights, dp):
        mask_rows = self._mask_rows(weights.ndim, weights.shape[0]) if weights.ndim >= 3 \
            else None
        drop = self.drop_mask
        if mask_rows is None or not _rows_of(weights, dp, drop) or dp.shape != weights.shape \
                or (drop is not None and drop.shape != dp.shape):
            return super().scores_grad(weights, dp)

        def rows(lo, hi):
            if drop is not None:
                dp[lo:hi] *= drop[lo:hi]
            masked_softmax_grad_(dp[lo:hi], weights[lo:hi], mask_rows(lo, hi))

        parallel_rows(rows, dp.shape[0], dp[0].size)
        return dp


class RowParallelLinear(Linear):
    """:class:`Linear` with the bias (and ReLU) pass and the ReLU's backward by range of
    rows in threads; the products are single BLAS calls, the forward's by a contiguous
    copy of W.T inside a search (:func:`tinytf.fast.cpu.transposed.transposed_weights`)."""

    def product(self, x2, weight):
        return x2 @ transposed(weight)

    def add_bias(self, out, bias, relu: bool) -> None:
        if bias is None and not relu:
            return
        if not _rows_of(out, bias) or out.ndim != 2:
            return super().add_bias(out, bias, relu)
        parent = super()

        def rows(lo, hi):
            parent.add_bias(out[lo:hi], bias, relu)

        parallel_rows(rows, out.shape[0], out.shape[1])

    def relu_grad(self, relu_out, grad):
        if not _rows_of(relu_out, grad) or grad.ndim != 2 or grad.shape != relu_out.shape:
            return super().relu_grad(relu_out, grad)
        out = np.empty(grad.shape, grad.dtype)

        def rows(lo, hi):
            np.multiply(grad[lo:hi], relu_out[lo:hi] > 0, out=out[lo:hi])

        parallel_rows(rows, grad.shape[0], grad.shape[1])
        return out
