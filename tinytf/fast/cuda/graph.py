"""Replaying a training step's forward and backward pass as one CUDA graph.

On a GPU a tinytf step is bound by the host: Python issues about a thousand kernel
launches and cuBLAS calls, at several microseconds each, and the GPU waits for them
(docs/gpu.md). A CUDA graph records the launches of one step once and replays them all
with a single call, the way ``torch.cuda.CUDAGraph`` does. Replaying is valid when every
step does exactly the same work on arrays at the same addresses, which holds here when:

- the batch has one fixed shape, and new batches are copied into the same input arrays;
- no step reads a device value on the host (no ``.item()``, no ``int(array)``): use
  ``F.cross_entropy(..., reduction="sum")`` on device targets, or ``label_smoothed_loss``
  with its ``count`` given (without it, it counts the tokens on the host);
- gradients are written into fixed arrays: ``optim.Adam``'s flat buffers, built by one
  ordinary step before capture;
- random numbers come from ``backend.counter_stream`` (the fused dropout kernel), whose
  seed lives on the device and is advanced before each replay;
- cuBLAS is called through its C API (``kernels.gemm.capturing``): CuPy refuses its own
  cuBLAS calls during capture.

Memory: the captured step allocates from a private CuPy memory pool that nothing else
uses, so the blocks the graph writes stay its own between replays (what PyTorch's graph
pools do). The optimizer step stays outside the graph: with flat buffers it is one
launch, and the learning rate changes every step.

Usage (see ``bench/gpu_train.py --graph``)::

    def forward_backward():            # fixed device inputs src, tgt_in, tgt_out
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, v), tgt_out.reshape(-1),
                               label_smoothing=0.1, ignore_index=0, reduction="sum")
        loss.backward()
        return loss
    forward_backward(); opt.step(); opt.zero_grad()     # one ordinary step first
    step = CapturedStep(forward_backward, [p for _, p in opt.params])
    for batch in batches:
        src[...] = batch.src ...                          # same shapes
        loss = step()                                     # replay: grads are in p.grad
        opt.step(); opt.zero_grad()

Batches of changing shape (``train.py --cuda-graph``): :class:`StepGraphs` pads each batch
to one of a few bucket shapes and keeps one graph per shape, all in one memory pool.

Only on CuPy; verified on a GPU by ``bench/gpu_train.py --graph`` and ``tests/fast/test_gpu.py``
(docs/gpu.md says which runs have been made). :class:`EagerReplay` stands in for a graph in
the CPU tests.
"""
from __future__ import annotations

import collections

import numpy as np

from tinytf.engine import backend
from tinytf.fast.cuda.kernels import gemm


class CapturedStep:  # pragma: no cover - needs a GPU
    """``fn`` (no arguments; forward and backward on fixed device arrays) as a CUDA graph.

    ``params``: the tensors whose ``.grad`` the backward pass fills; after each replay
    their ``.grad`` are the arrays the graph wrote. ``warmup`` ordinary runs inside the
    private memory pool come first, so that capture finds every block it needs there.
    Calling the object replays the graph and returns what ``fn`` returned at capture
    (tensors whose arrays the graph rewrites on every replay).
    """

    def __init__(self, fn, params=(), warmup: int = 2, pool=None, workspace=None):
        cupy = backend.array_module("gpu")
        self.fn, self.params = fn, list(params)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # ``pool``: a CuPy MemoryPool shared with other graphs that are never replayed at
        # the same time (see StepGraphs); by default one of its own.
        self.pool = pool if pool is not None else cupy.cuda.MemoryPool()
        outer = cupy.cuda.get_current_stream()
        self.stream.wait_event(outer.record())
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            for _ in range(warmup):
                self._clear_grads()
                fn()
            self._clear_grads()
            self.stream.synchronize()
            # The dropout seed the captured kernels read: kept here, so that replays advance
            # this very array even if manual_seed later gives tinytf a new stream.
            self.rng = backend.counter_stream(cupy)
            # ``workspace``: cuBLAS's, shared like the pool (StepGraphs), else its own.
            with gemm.capturing(self.stream, workspace=workspace) as workspace:
                self.workspace = workspace      # the graph's cuBLAS calls use it
                self.stream.begin_capture()
                try:
                    self.result = fn()
                except BaseException:
                    try:               # end the broken capture, but report what broke it
                        self.stream.end_capture()
                    except Exception:  # noqa: BLE001 - the first error is the one to see
                        pass
                    raise
                self.graph = self.stream.end_capture()
        self.grads = [p.grad for p in self.params]
        outer.wait_event(self.stream.record())

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def __call__(self, seed: int | None = None):
        """Replay the step; the current stream waits for it. Dropout draws new masks: from
        ``seed`` if given (reproducible), else from the previous seed plus one."""
        cupy = backend.array_module("gpu")
        outer = cupy.cuda.get_current_stream()
        self.stream.wait_event(outer.record())      # inputs written, last update done
        with self.stream:
            if seed is None:
                self.rng.advance()
            else:
                self.rng.seed.fill(np.uint64(seed % 2 ** 64))
            self.graph.launch(self.stream)
        outer.wait_event(self.stream.record())      # the optimizer runs after the graph
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return self.result


# --------------------------------------------------------------------------------------
# Training steps of varying batch shapes: one graph per padded shape (train.py --cuda-graph)
# --------------------------------------------------------------------------------------

def bucket_shape(b: int, s: int, t: int, multiple: int = 8) -> tuple:
    """The padded (rows, source length, target length) that a (b, s, t) batch runs at.

    Lengths round up to a multiple of ``multiple``; rows round up to one of 8 sizes per
    octave (b in [2^k, 2^(k+1)) to a multiple of 2^(k-3)), at most 12.5 % padding rows.
    Length-grouped batches then fall on a few dozen shapes, each captured once.
    """
    def up(n, m):
        return -(-n // m) * m
    step = 1 << max(0, int(b).bit_length() - 4)
    return up(b, step), up(s, multiple), up(t, multiple)


def pad_batch(batch, shape, pad_id: int = 0) -> tuple:
    """(src, tgt_in, tgt_out) of ``batch`` padded with ``pad_id`` to ``shape`` (B, S, T).

    Padded rows and positions are PAD everywhere: masked as keys, ignored by the loss, so
    the loss and the gradients equal those of the unpadded batch (up to the order of float
    additions)."""
    rows, s, t = shape
    out = []
    for a, length in ((batch.src, s), (batch.tgt_in, t), (batch.tgt_out, t)):
        if a.shape[0] > rows or a.shape[1] > length:
            raise ValueError(f"pad_batch: a {a.shape} array does not fit {(rows, length)}")
        padded = np.full((rows, length), pad_id, dtype=a.dtype)
        padded[:a.shape[0], :a.shape[1]] = a
        out.append(padded)
    return tuple(out)


class EagerReplay:
    """:class:`CapturedStep`'s interface without a GPU: each call simply runs ``fn``.

    What the CPU tests use in place of a graph, so that :class:`StepGraphs` (padding,
    fixed input arrays, gradient slots, accumulation, invalidation) is tested without
    CUDA. ``seed`` reseeds tinytf's generators (CPU dropout draws from them)."""

    def __init__(self, fn, params=(), warmup: int = 2, pool=None, workspace=None):
        self.fn, self.params = fn, list(params)

    def __call__(self, seed: int | None = None):
        if seed is not None:
            backend.manual_seed(seed)
        for p in self.params:
            p.grad = None
        return self.fn()


class StepGraphs:
    """Forward and backward of a training step, replayed as one CUDA graph per batch shape.

    ``loss_fn(src, tgt_in, tgt_out)`` returns the summed loss Tensor of a batch given as
    device arrays. Each batch is padded to :func:`bucket_shape` and copied into that
    shape's fixed input arrays; the first batch of a shape captures its graph (two
    ordinary runs first, then the capture, a few steps' time), every later one replays it.
    All graphs share one memory pool: they are replayed one at a time, and what a replay
    returns (the loss) is used before the next replay, so their scratch memory can be the
    same (PyTorch's shared graph pools). At most ``max_graphs`` are kept (least recently
    used dropped).

    The gradients land in the optimizer's flat gradient buffer (``optim.FlatParameters``),
    which must exist before the first capture (one ordinary step builds it): :meth:`ready`.
    If that buffer or the parameters' arrays are replaced later (``load_state_dict``), the
    graphs would write and read the old addresses; :meth:`run` notices and recaptures.

    ``scale``: an optional function of the loss that backward starts from instead, such
    as ``functools.partial(scaler.scale_loss, on_device=True)`` for fp16 (the scale is
    read from device memory, so each replay uses the current one); the loss returned is
    the unscaled one.

    ``max_len``: the longest sequence the model takes; padding never goes beyond it.

    ``capture``: the graph class, :class:`CapturedStep` (default, CuPy) or
    :class:`EagerReplay` (tests on the CPU). Capturing reseeds tinytf's generators
    (``manual_seed(0)``), so that a graph's dropout depends only on the seeds of its replays.
    """

    def __init__(self, loss_fn, optimizer, device: str, *, scale=None, capture=None,
                 max_graphs: int = 32, multiple: int = 8, pad_id: int = 0,
                 max_len: int | None = None):
        self.loss_fn, self.optimizer, self.device = loss_fn, optimizer, device
        self.scale = scale          # loss -> what backward starts from (fp16's loss * S)
        self.capture = capture or CapturedStep
        self.max_graphs, self.multiple, self.pad_id = int(max_graphs), int(multiple), pad_id
        self.max_len = max_len      # padded lengths never exceed it (the position table)
        self.graphs = collections.OrderedDict()   # (shape, variant) -> (graph, inputs)
        self.pool = self.workspace = None   # shared by all graphs (made at the first capture)
        self.flat = None            # the FlatParameters the graphs were captured with
        self.captures = 0

    def ready(self) -> bool:
        """Whether the optimizer's flat buffers exist and hold the parameters."""
        flat = getattr(self.optimizer, "flat_buffers", None)
        return flat is not None and flat.linked(flat.params)

    def run(self, batch, seed: int | None = None, variant=None):
        """Forward and backward of ``batch`` (a ``data.Batch``); returns the loss Tensor.
        ``variant``: what else the captured step depends on (the trainer passes the model's
        training mode: dropout on or off); each (shape, variant) has its own graph.

        Afterwards every parameter's ``.grad`` is its slot of the flat gradient buffer,
        holding this batch's gradient (not accumulated: see the trainer). The returned
        loss lives in the graphs' shared memory: read or copy it before the next call.
        """
        flat = self.optimizer.flat_buffers
        if flat is not self.flat:          # a new buffer: graphs captured on the old are void
            self.graphs.clear()
            self.flat = flat
        s, t = batch.src.shape[1], batch.tgt_in.shape[1]
        shape = bucket_shape(len(batch.src), s, t, self.multiple)
        if self.max_len is not None:    # a batch that fits the model keeps fitting it
            shape = (shape[0], max(s, min(shape[1], self.max_len)),
                     max(t, min(shape[2], self.max_len)))
        key = (shape, variant)
        entry = self.graphs.pop(key, None)
        padded = pad_batch(batch, shape, self.pad_id)
        if entry is None:
            inputs = tuple(backend.to_device(a, self.device) for a in padded)
            entry = (self._capture(inputs), inputs)
        else:
            for static, host in zip(entry[1], padded):
                static[...] = backend.to_device_pinned(host, self.device)
        self.graphs[key] = entry                      # most recently used last
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return entry[0](seed)

    def _capture(self, inputs):
        src, tgt_in, tgt_out = inputs

        def forward_backward():
            loss = self.loss_fn(src, tgt_in, tgt_out)
            (loss if self.scale is None else self.scale(loss)).backward()
            return loss
        if self.pool is None and self.capture is CapturedStep:  # pragma: no cover - GPU
            cupy = backend.array_module("gpu")
            # The eager steps' activations sit cached in CuPy's default pool; from now on
            # training allocates from the graphs' pool, so give that memory back first.
            cupy.get_default_memory_pool().free_all_blocks()
            self.pool = cupy.cuda.MemoryPool()
            # One cuBLAS workspace for all graphs too (32 MiB each would be 1 GiB at 32).
            self.workspace = cupy.empty(32 << 20, dtype=np.uint8)
        # A fresh random stream: the dropout offsets baked into the graph are then the same
        # whenever it is captured (after a resume too), and its masks depend on the seed
        # given to each replay alone. (This reseeds tinytf; the trainer reseeds every step.)
        backend.manual_seed(0)
        self.captures += 1
        return self.capture(forward_backward, list(self.flat.params), pool=self.pool,
                            workspace=self.workspace)
