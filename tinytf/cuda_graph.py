"""Replaying a training step's forward and backward pass as one CUDA graph.

On a GPU a tinytf step is bound by the host: Python issues about a thousand kernel
launches and cuBLAS calls, at several microseconds each, and the GPU waits for them
(docs/gpu.md). A CUDA graph records the launches of one step once and replays them all
with a single call, the way ``torch.cuda.CUDAGraph`` does. Replaying is valid when every
step does exactly the same work on arrays at the same addresses, which holds here when:

- the batch has one fixed shape, and new batches are copied into the same input arrays;
- no step reads a device value on the host (no ``.item()``, no ``int(array)``): use
  ``F.cross_entropy(..., reduction="sum")`` on device targets, not ``label_smoothed_loss``,
  which counts the tokens on the host;
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

Only on CuPy; verified on a GPU by ``bench/gpu_train.py --graph`` (docs/gpu.md says
which runs have been made).
"""
from __future__ import annotations

from . import backend
from .kernels import gemm


class CapturedStep:  # pragma: no cover - needs a GPU
    """``fn`` (no arguments; forward and backward on fixed device arrays) as a CUDA graph.

    ``params``: the tensors whose ``.grad`` the backward pass fills; after each replay
    their ``.grad`` are the arrays the graph wrote. ``warmup`` ordinary runs inside the
    private memory pool come first, so that capture finds every block it needs there.
    Calling the object replays the graph and returns what ``fn`` returned at capture
    (tensors whose arrays the graph rewrites on every replay).
    """

    def __init__(self, fn, params=(), warmup: int = 2):
        cupy = backend.array_module("gpu")
        self.fn, self.params = fn, list(params)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
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
            with gemm.capturing(self.stream) as workspace:
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

    def __call__(self):
        """Replay the step (new dropout masks); the current stream waits for it."""
        cupy = backend.array_module("gpu")
        outer = cupy.cuda.get_current_stream()
        self.stream.wait_event(outer.record())      # inputs written, last update done
        with self.stream:
            self.rng.advance()
            self.graph.launch(self.stream)
        outer.wait_event(self.stream.record())      # the optimizer runs after the graph
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return self.result
