"""Data-parallel training over MPI: one process per device, gradients summed by all-reduce.

Launch with ``mpirun -n 8 python train.py`` (see docs/distributed.md). Every rank holds a
full copy of the model, reads its own share of the batches, runs forward and backward, and
then :meth:`MPICommunicator.allreduce_grads` replaces each rank's gradient with the sum
over ranks, so every rank takes the same optimizer step and the copies never drift apart.

Why the union batch is reproduced exactly: the loss of one step is the summed token loss
divided by the GLOBAL number of target tokens N = sum_r N_r,

    L = (1 / N) sum_r sum_{t in batch_r} l_t      =>      dL/dp = (1 / N) sum_r g_r,

where g_r is rank r's gradient of its *summed* loss. So train.py backpropagates the summed
loss, all-reduces, then scales by 1/N (``allreduce_grads(model, scale=1/N)`` does both in
one pass). Dividing by the number of ranks instead would weight a token on a rank with
short sentences more than one on a rank with long ones.

How (the ChainerMN design): parameters are always walked in sorted-name order
(``Module.named_parameters``), their gradients are packed into a few contiguous buffers of
about ``bucket_bytes`` (25 MB) each, and each buffer is summed with one buffer-based
``Allreduce(MPI.IN_PLACE, ...)`` -- never the lowercase, pickling ``allreduce``, and never
one call per parameter (a Transformer has ~200 of them; each call costs a latency).
When the gradients already share one flat buffer (``optim.Adam`` keeps one, see
``optim.FlatParameters``), that buffer is summed in place in chunks of the same size and
nothing is packed: every rank's buffer has the same layout, checked once like the names.

GPU arrays (CuPy) are handed to MPI in one of three ways, chosen once per job: summed by
NCCL through ``cupy.cuda.nccl`` (MPI only shares NCCL's unique id; the default wherever
every rank can load NCCL and has a GPU of its own), staged through pinned host buffers
(the fallback; works with any MPI), or passed as device memory to a CUDA-aware MPI
(``TINYTF_GPU_TRANSPORT=cuda-aware``). The GPU code is
at the end of this file; the CPU path never touches it.

Failure: a Python exception on one rank would leave the others blocked in their next
collective for ever. :func:`create_communicator` installs an excepthook that prints the
rank's traceback and calls ``COMM_WORLD.Abort(1)``, which makes ``mpirun`` kill every rank
and exit non-zero; :meth:`Communicator.guard` does the same around a block.

Without ``mpirun`` (no launcher variables in the environment) or without mpi4py,
:func:`create_communicator` returns a :class:`SingleCommunicator` whose methods are no-ops,
so train.py runs unchanged in one process and never initialises MPI.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import time
import traceback
import zlib

import numpy as np

from tinytf.engine import backend
from tinytf.optim.adam import flat_gradient, flat_parameters

BUCKET_BYTES = 25 * 2 ** 20
"""Default size of one packed gradient buffer (PyTorch DDP's default bucket size)."""

# Variables that MPI launchers set in every rank: Open MPI, PMIx (Open MPI 5, Slurm),
# MPICH / Intel MPI (PMI), MVAPICH. Their absence means "not started by a launcher".
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK",
                  "MV2_COMM_WORLD_SIZE")

_REDUCE_OPS = ("sum", "max", "min")


# --------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------

def create_communicator(*, bucket_bytes: int = BUCKET_BYTES, gpu_transport: str | None = None,
         install_excepthook: bool = True) -> "Communicator":
    """The communicator for this process: MPI under a launcher with >1 rank, else single.

    Returns :class:`MPICommunicator` when started by ``mpirun``/``srun`` with
    ``COMM_WORLD.size > 1``, otherwise :class:`SingleCommunicator` (also when mpi4py is not
    installed, or when ``TINYTF_DISTRIBUTED=0``). ``TINYTF_DISTRIBUTED=1`` forces the MPI
    import even where no launcher variable is visible. Under MPI, with
    ``TINYTF_DEVICE=gpu``, selects GPU ``local_rank % device_count`` before anything is
    allocated, and (unless ``install_excepthook=False``) installs the abort-on-exception
    hook. ``gpu_transport``: "auto", "host", "cuda-aware" or "nccl" (default: from the
    environment, see :func:`gpu_transport_from_env`).
    """
    forced = os.environ.get("TINYTF_DISTRIBUTED", "")
    if forced == "0" or (forced != "1" and not any(v in os.environ for v in _LAUNCHER_VARS)):
        return SingleCommunicator()
    launched = _launched_size()
    try:
        from mpi4py import MPI  # noqa: PLC0415 - optional dependency, imported on demand
    except ImportError:
        if launched > 1:
            # n copies each training alone on its shard would be silently wrong: refuse.
            raise RuntimeError(f"distributed.py: started by a launcher with {launched} ranks "
                               "but mpi4py is not installed: pip install mpi4py") from None
        return SingleCommunicator()
    if MPI.COMM_WORLD.Get_size() == 1:
        if launched > 1:
            # Each rank would train alone on its shard, silently: the classic symptom of
            # an mpi4py built against another MPI than the mpirun that started it.
            raise RuntimeError(f"distributed.py: the launcher started {launched} ranks but "
                               "MPI.COMM_WORLD has 1: mpi4py uses another MPI library than "
                               f"{shutil.which('mpirun')}; reinstall mpi4py against it")
        return SingleCommunicator()
    comm = MPICommunicator(MPI.COMM_WORLD, bucket_bytes=bucket_bytes,
                           gpu_transport=gpu_transport)
    if install_excepthook:
        comm.install_excepthook()
    if backend.default_device() == "gpu":
        comm.select_gpu()
    return comm


def _launched_size() -> int:
    """The number of ranks the launcher says it started (1 if it says nothing)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


GPU_TRANSPORTS = ("auto", "host", "cuda-aware", "nccl")


def gpu_transport_from_env() -> str:
    """The GPU transport the environment asks for (default "auto").

    ``TINYTF_GPU_TRANSPORT`` = auto | host | cuda-aware | nccl; the older switches still
    work: ``TINYTF_NCCL=1`` means nccl, ``TINYTF_NCCL=0`` host, ``TINYTF_CUDA_AWARE_MPI=1``
    cuda-aware. "auto" means NCCL where every rank can use it, else host staging
    (:meth:`MPICommunicator._resolve_auto`).
    """
    named = os.environ.get("TINYTF_GPU_TRANSPORT", "").strip().lower()
    if named:
        return named
    if os.environ.get("TINYTF_NCCL") == "1":
        return "nccl"
    if os.environ.get("TINYTF_CUDA_AWARE_MPI") == "1":
        return "cuda-aware"
    if os.environ.get("TINYTF_NCCL") == "0":
        return "host"
    return "auto"


def nccl_usable(local_size: int) -> tuple:
    """(usable, why not) for NCCL in this process: CuPy's NCCL binding loads, and this
    node has a GPU for each of its ``local_size`` ranks (NCCL refuses two ranks on one)."""
    try:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - ImportError, or a missing libnccl
        return False, f"cupy.cuda.nccl does not load ({type(exc).__name__}: {exc})"
    if not getattr(nccl, "available", True):
        return False, "CuPy was built without NCCL (cupy.cuda.nccl.available is False)"
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return False, f"no CUDA device ({exc})"
    if gpus < local_size:
        return False, f"{local_size} ranks share this node's {gpus} GPU(s)"
    return True, ""


@functools.lru_cache(maxsize=None)
def _open_mpi_major(mpirun: str) -> int | None:
    """Open MPI's major version from ``mpirun --version``; None for another MPI."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "Open MPI" in line:
            major = line.split()[-1].split(".")[0]
            return int(major) if major.isdigit() else 5
    return None


def mpirun_command(n: int, argv: list, *, single_node: bool = True) -> list:
    """The argv that runs ``argv`` on ``n`` ranks of this machine; used by tests and bench.

    For Open MPI it adds ``--allow-run-as-root`` when running as root (containers, CI),
    ``--oversubscribe`` (more ranks than cores is allowed: slow but correct), and with
    ``single_node`` restricts the transports to shared memory (``--mca btl self,sm``;
    ``vader`` before Open MPI 5), which skips probing network devices and halves start-up
    in a container. Other MPIs get a plain ``mpirun -n N``.
    """
    mpirun = shutil.which("mpirun") or "mpirun"
    cmd = [mpirun, "-n", str(int(n))]
    major = _open_mpi_major(mpirun)
    if major is not None:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
        if single_node:
            cmd += ["--mca", "btl", "self,sm" if major >= 5 else "self,vader"]
    return cmd + [str(a) for a in argv]


def _named_parameters(model) -> list:
    """[(name, tensor)] sorted by name from a Module or an iterable of (name, tensor)."""
    if hasattr(model, "named_parameters"):
        named = list(model.named_parameters())
    else:
        named = list(model)
        if named and not isinstance(named[0], tuple):
            raise TypeError("distributed.py: expected a Module or (name, tensor) pairs; "
                            "plain tensor lists have no names to sort by")
    return sorted(named, key=lambda item: item[0])


# --------------------------------------------------------------------------------------
# Communicators
# --------------------------------------------------------------------------------------

class Communicator:
    """What train.py needs from a group of ranks; see the two implementations below.

    Attributes: ``rank`` (0..size-1), ``size``, ``local_rank`` (rank among the processes on
    this node: picks the GPU), ``local_size``, ``is_root`` (rank 0: logs, validates,
    writes checkpoints). ``allreduce_seconds`` / ``allreduce_bytes`` accumulate the time
    spent in, and the bytes handed to, gradient all-reduces (for logging and benchmarks).
    """

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1

    def __init__(self):
        self.allreduce_seconds = 0.0
        self.allreduce_bytes = 0

    @property
    def is_root(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank (collective stop decisions)."""
        return self.allreduce_scalars([1.0 if flag else 0.0], op="max")[0] > 0

    @contextlib.contextmanager
    def guard(self):
        """Context manager: an exception inside aborts the whole job (never a hang).

        With one process it does nothing (the exception propagates as usual). Under MPI it
        prints the traceback with the rank and calls ``abort``; ``SystemExit(0)`` passes.
        """
        if self.size == 1:
            yield self
            return
        try:
            yield self
        except SystemExit as e:
            if e.code in (None, 0):
                raise
            self.abort(f"SystemExit({e.code!r})", code=e.code if isinstance(e.code, int) else 1)
        except BaseException:  # noqa: BLE001 - KeyboardInterrupt must not hang the job either
            self.abort(traceback.format_exc())

    # Overridden below.
    def broadcast_params(self, model, root: int = 0) -> None:
        """Copy rank ``root``'s parameter values into every rank's model."""

    def broadcast_object(self, obj, root: int = 0):
        """Rank ``root``'s (small, picklable) ``obj`` on every rank."""
        return obj

    def allreduce_grads(self, model, scale: float | None = None) -> None:
        """Replace every ``.grad`` with its sum over ranks, times ``scale`` if given.

        A gradient that is None counts as zeros; it stays None only if it is None on every
        rank. One process: only the scaling happens.
        """
        if scale is None:
            return
        named = _named_parameters(model)
        flat = flat_gradient(named)
        if flat is not None:   # every gradient in one buffer (optim.FlatParameters)
            flat *= scale
            return
        for _, p in named:
            if p.grad is not None:
                p.grad = _store(p.grad, p.grad, scale, own=_owns(p))

    def allreduce_scalars(self, values, op: str = "sum"):
        """Combine numbers over ranks with ``op`` ("sum", "max", "min"), elementwise.

        ``values``: a sequence of numbers -> a list of floats (float64 arithmetic), or a
        single number -> a float. For token counts, loss sums and stop decisions.
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"distributed.py: op must be one of {_REDUCE_OPS}, got {op!r}")
        if np.ndim(values) == 0:
            return float(values)
        return [float(v) for v in values]

    def param_divergence(self, model) -> float:
        """max |p - p_root| over all parameters and ranks (0.0 when the copies agree)."""
        return 0.0

    def barrier(self) -> None:
        """Wait until every rank has arrived."""

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` (with the rank) to stderr and end the whole job with ``code``."""
        sys.stdout.flush()
        print(f"tinytf.distributed: rank {self.rank} of {self.size} aborting: {message}",
              file=sys.stderr, flush=True)
        raise SystemExit(code)


class SingleCommunicator(Communicator):
    """One process, no MPI: every collective is the identity."""


class MPICommunicator(Communicator):
    """Collectives over an mpi4py communicator (``MPI.COMM_WORLD``) on packed buffers."""

    def __init__(self, mpi_comm, *, bucket_bytes: int = BUCKET_BYTES,
                 gpu_transport: str | None = None):
        super().__init__()
        from mpi4py import MPI  # noqa: PLC0415
        self._MPI = MPI
        self.comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        # Ranks sharing this node's memory: portable across MPI implementations, unlike
        # OMPI_COMM_WORLD_LOCAL_RANK (Open MPI only).
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        self.bucket_bytes = int(bucket_bytes)
        self.gpu_transport = gpu_transport or gpu_transport_from_env()
        if self.gpu_transport not in GPU_TRANSPORTS:
            raise ValueError(f"distributed.py: gpu_transport must be one of "
                             f"{', '.join(GPU_TRANSPORTS)}, got {self.gpu_transport!r}")
        self._plans: dict = {}
        self._host = _MPITransport(mpi_comm, MPI)
        self._gpu = None  # a _GpuTransport, created on the first CuPy buffer

    # ----- small collectives -----------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank has arrived, sleeping rather than spinning.

        Ranks wait here while rank 0 validates or writes a checkpoint, which can take
        minutes; MPI's blocking ``Barrier`` busy-polls a core all that time (taking it from
        rank 0 when ranks share cores), so poll a non-blocking one with growing sleeps.
        """
        request, pause = self.comm.Ibarrier(), 1e-4
        while not request.Test():
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def broadcast_object(self, obj, root: int = 0):
        """Rank ``root``'s (small, picklable) ``obj`` on every rank (lowercase ``bcast``)."""
        return self.comm.bcast(obj, root=root)

    def allreduce_scalars(self, values, op: str = "sum"):
        """Combine numbers over ranks with ``op`` ("sum", "max", "min"), elementwise.

        ``values``: a sequence of numbers -> a list of floats (float64 arithmetic), or a
        single number -> a float. For token counts, loss sums and stop decisions.
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"distributed.py: op must be one of {_REDUCE_OPS}, got {op!r}")
        scalar = np.ndim(values) == 0
        buf = np.array(values, dtype=np.float64).reshape(-1)
        mpi_op = {"sum": self._MPI.SUM, "max": self._MPI.MAX, "min": self._MPI.MIN}[op]
        self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=mpi_op)
        return float(buf[0]) if scalar else buf.tolist()

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` (with the rank) and ``COMM_WORLD.Abort(code)``: mpirun kills all."""
        try:
            sys.stdout.flush()
            print(f"tinytf.distributed: rank {self.rank} of {self.size} aborting: {message}",
                  file=sys.stderr, flush=True)
        finally:
            self._MPI.COMM_WORLD.Abort(code)

    def install_excepthook(self) -> None:
        """Make an uncaught exception abort the job (after printing it) instead of hanging.

        Without this, the failing rank would wait in ``MPI_Finalize`` at exit and the others
        in their next collective, for ever. ``python -m mpi4py train.py`` does the same.
        """
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            try:
                previous(exc_type, exc, tb)
            finally:
                self.abort(f"uncaught {exc_type.__name__}: {exc}")

        sys.excepthook = hook

    def select_gpu(self) -> int:
        """Use GPU ``local_rank % device_count`` in this process; returns its id."""
        import cupy  # noqa: PLC0415
        device = self.local_rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(device).use()
        return device

    # ----- packed parameter collectives ------------------------------------------------

    def broadcast_params(self, model, root: int = 0) -> None:
        """Copy rank ``root``'s parameter values into every rank's model (packed ``Bcast``).

        Parameters that share one flat buffer (``optim.FlatParameters``, made by Adam) are
        broadcast in place, chunk by chunk, with no packing.
        """
        named = _named_parameters(model)
        plan = self._plan(named)
        transport = self._transport(plan.xp)
        if plan.flat is not None:
            for chunk in plan.chunks(plan.flat.data):
                transport.bcast(chunk, root)
            return
        for bucket in plan.buckets:
            params = [p for _, p in named[bucket.start:bucket.stop]]
            transport.bcast(bucket.pack([p.data for p in params]), root)
            if self.rank != root:
                for p, view in zip(params, bucket.views()):
                    p.data[...] = view

    def allreduce_grads(self, model, scale: float | None = None) -> None:
        """Replace every ``.grad`` with its sum over ranks, times ``scale`` if given.

        Which parameters have a gradient is agreed first: one small host ``Allreduce`` of
        a presence flag per parameter (no device memory, so no wait for the GPU). A
        gradient that is None counts as zeros and stays None only if it is None on every
        rank. Then the gradients themselves:

        - parameters that share one flat buffer (``optim.FlatParameters``: Adam's default)
          are summed in place in that buffer, in chunks of about ``bucket_bytes``, and
          scaled by one pass over it: no packing, no unpacking, and every ``.grad`` stays
          the parameter's slot of the buffer;
        - otherwise they are packed in sorted-name order into buckets of about
          ``bucket_bytes``, each summed by one ``Allreduce(IN_PLACE)`` and copied back.
        """
        named = _named_parameters(model)
        plan = self._plan(named)
        transport = self._transport(plan.xp)
        start = time.perf_counter()
        present = np.array([p.grad is not None for _, p in named], dtype=np.int32)
        self.comm.Allreduce(self._MPI.IN_PLACE, present, op=self._MPI.SUM)
        if plan.flat is not None:
            self._allreduce_flat(plan, named, present, transport, scale)
        else:
            for bucket in plan.buckets:
                params = [p for _, p in named[bucket.start:bucket.stop]]
                buf = bucket.pack([p.grad for p in params])
                transport.allreduce(buf)
                self.allreduce_bytes += buf.nbytes
                for i, (p, view) in enumerate(zip(params, bucket.views()), start=bucket.start):
                    if present[i]:
                        p.grad = _store(view, p.grad, scale, own=_owns(p))
        self.allreduce_seconds += time.perf_counter() - start

    def _allreduce_flat(self, plan, named, present, transport, scale) -> None:
        """The flat-buffer case of :meth:`allreduce_grads`: sum the buffer in place."""
        flat = plan.flat
        slots = {id(p): g for p, g in zip(flat.params, flat.grad_views)}
        for (_, p), wanted in zip(named, present):
            slot = slots[id(p)]
            if p.grad is None:
                if wanted:          # another rank has one: this rank adds zeros
                    slot[...] = 0
            elif p.grad is not slot:  # a gradient set from outside: gather it in
                slot[...] = p.grad
        for chunk in plan.chunks(flat.grad):
            transport.allreduce(chunk)
            self.allreduce_bytes += chunk.nbytes
        if scale is not None:
            backend.get_array_module(flat.grad).multiply(flat.grad, float(scale),
                                                         out=flat.grad)
        for (_, p), wanted in zip(named, present):
            p.grad = slots[id(p)] if wanted else None

    def param_divergence(self, model) -> float:
        """max |p - p_root| over all parameters and ranks (0.0 when the copies agree).

        Costs one broadcast of the parameters: for tests and occasional checks.
        """
        named = _named_parameters(model)
        plan = self._plan(named)
        transport = self._transport(plan.xp)
        worst = 0.0
        if plan.flat is not None:      # root's chunks into copies, compared with ours
            pairs = []
            for chunk in plan.chunks(plan.flat.data):
                root_values = chunk.copy()
                transport.bcast(root_values, 0)
                pairs.append((chunk, root_values))
        else:
            pairs = []
            for bucket in plan.buckets:
                params = [p for _, p in named[bucket.start:bucket.stop]]
                mine = bucket.pack([p.data for p in params]).copy()
                transport.bcast(bucket.buffer, 0)
                pairs.append((mine, bucket.buffer))
        for mine, root_values in pairs:
            if mine.size:
                worst = max(worst, float(abs(mine - root_values).max()))
        return self.allreduce_scalars(worst, op="max")

    # ----- plumbing --------------------------------------------------------------------

    def _plan(self, named) -> "_BucketPlan":
        """The cached layout for these parameters, checked equal on every rank.

        The layout is the names, shapes and dtypes in sorted-name order, and, when the
        parameters share one flat buffer, the order of the names in that buffer: every
        rank must sum the same bytes with the same bytes.
        """
        flat = _flat_buffer(named)
        key = tuple((name, p.shape, str(p.dtype), backend.device_of(p.data))
                    for name, p in named)
        if flat is not None:
            names = {id(p): name for name, p in named}
            key += (("flat",) + tuple(names[id(p)] for p in flat.params), id(flat))
        plan = self._plans.get(key)
        if plan is None:
            # Ranks that disagree on names, shapes or dtypes would sum unrelated numbers
            # (or crash inside MPI): compare a checksum of the layout once, up front.
            layout = [k[:3] for k in key[:len(named)]] + ([key[len(named)]] if flat else [])
            crc = float(zlib.crc32(repr(layout).encode()))
            lo, neg_hi = self.allreduce_scalars([crc, -crc], op="min")
            if lo != -neg_hi:
                self.abort("parameter names, shapes or dtypes (or their order in the flat "
                           "buffer) differ between ranks")
            xp = backend.get_array_module(named[0][1].data) if named else np
            if flat is not None:
                # A plan per flat buffer: forget the one a rebuilt buffer replaced.
                self._plans = {k: v for k, v in self._plans.items() if v.flat is None}
            plan = self._plans[key] = _BucketPlan(named, self.bucket_bytes, xp, flat=flat)
        return plan

    def _transport(self, xp):
        """Who moves ``xp`` buffers: MPI directly for NumPy, the GPU transport for CuPy."""
        if xp is np:
            return self._host
        if self._gpu is None:
            if self.gpu_transport == "auto":
                self.gpu_transport = self._resolve_auto()
            self._gpu = _GpuTransport.create(self.gpu_transport, self.comm, self._MPI)
        return self._gpu

    def _resolve_auto(self) -> str:
        """"nccl" if NCCL is usable on every rank, else "host"; the same answer everywhere.

        Decided together (one small all-reduce, at the first GPU collective, which every
        rank reaches): ranks that chose different transports would wait for each other in
        different collectives for ever. Rank 0 says which it took and, if not NCCL, why.
        """
        usable, why = nccl_usable(self.local_size)
        everywhere = self.allreduce_scalars(float(usable), op="min") == 1.0
        if self.is_root:
            reason = "" if everywhere else f" ({why or 'NCCL is not usable on another rank'})"
            print(f"tinytf.distributed.communicator: GPU gradients go through "
                  f"{'NCCL' if everywhere else 'pinned host buffers and MPI'}{reason}; "
                  f"TINYTF_GPU_TRANSPORT=host|cuda-aware|nccl chooses", flush=True)
        return "nccl" if everywhere else "host"


def _flat_buffer(named):
    """The ``optim.FlatParameters`` of exactly these parameters while they are still its
    views, or None (arrays replaced since, by ``load_state_dict``: then they are packed)."""
    flat = flat_parameters(named)
    return flat if flat is not None and flat.linked(flat.params) else None


def _owns(p) -> bool:
    """Whether ``p.grad`` is the parameter's own slot of a flat gradient buffer."""
    return p.grad is not None and p.grad is p.grad_buffer


def _store(summed, grad, scale, own: bool = False):
    """``summed * scale`` written over ``grad`` when that is safe, else a new array.

    The engine's gradients are fresh arrays that own their memory: overwriting them saves
    an allocation of the model's size per step. So are views that the parameter owns
    (``own``: its slot of a flat gradient buffer, which must stay linked). Anything else
    (None, another view, read-only, another dtype) is replaced; ``summed`` itself is never
    kept, its buffer is reused.
    """
    flags = getattr(grad, "flags", None)
    if (flags is not None and flags.c_contiguous and (flags.owndata or own) and
            getattr(flags, "writeable", True) and grad.shape == summed.shape and
            grad.dtype == summed.dtype):
        if scale is None:
            grad[...] = summed
        else:
            backend.get_array_module(grad).multiply(summed, float(scale), out=grad)
        return grad
    return summed * float(scale) if scale is not None else summed.copy()


class _MPITransport:
    """Host buffers straight to MPI's buffer-based, in-place collectives."""

    def __init__(self, comm, MPI):
        self.comm, self.MPI = comm, MPI

    def allreduce(self, buf) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def bcast(self, buf, root: int) -> None:
        self.comm.Bcast(buf, root=root)


class _Bucket:
    """Parameters ``start:stop`` (in sorted-name order) of one dtype, packed in one buffer.

    Holds only the layout and the reused buffer, never the tensors: the caller passes the
    current arrays each time, so a model with the same layout can use the same plan.
    """

    def __init__(self, index: int, start: int, shapes: list, dtype, xp):
        self.index, self.start, self.stop = index, start, start + len(shapes)
        self.shapes, self.xp = shapes, xp
        self.offsets, total = [], 0
        for shape in shapes:
            self.offsets.append((total, total + int(np.prod(shape, dtype=np.int64))))
            total = self.offsets[-1][1]
        self.buffer = xp.empty(total, dtype=dtype)  # allocated once, reused every step

    def pack(self, arrays):
        """Copy ``arrays`` (None -> zeros) into the buffer."""
        buf = self.buffer
        for (lo, hi), a in zip(self.offsets, arrays):
            if a is None:
                buf[lo:hi] = 0
            else:
                buf[lo:hi] = a.reshape(-1)
        return buf

    def views(self) -> list:
        """The parameter-shaped views of the buffer, in order."""
        return [self.buffer[lo:hi].reshape(shape)
                for (lo, hi), shape in zip(self.offsets, self.shapes)]


class _BucketPlan:
    """How the parameters travel: chunks of their flat buffer, or packed buckets.

    ``flat``: the parameters' ``optim.FlatParameters``, or None. With one, the collectives
    run on :meth:`chunks` of its buffers (views, about ``bucket_bytes`` each) and no
    bucket is allocated. Without, the parameters in sorted-name order are cut into
    buckets of about ``bucket_bytes``: a parameter is never split, and a bucket closes
    when the next parameter would overflow it or has another dtype.
    """

    def __init__(self, named, bucket_bytes: int, xp=np, flat=None):
        self.xp = xp  # numpy or cupy: where the parameters (and so the buffers) live
        self.flat = flat
        self.bucket_bytes = int(bucket_bytes)
        self.buckets = []
        if flat is not None:
            return
        start, nbytes = 0, 0
        for i, (_, p) in enumerate(named):
            size = p.size * p.dtype.itemsize
            if i > start and (nbytes + size > bucket_bytes or p.dtype != named[start][1].dtype):
                self._close(named, start, i)
                start, nbytes = i, 0
            nbytes += size
        if start < len(named) or not self.buckets:
            self._close(named, start, len(named))

    def _close(self, named, start: int, stop: int) -> None:
        dtype = named[start][1].dtype if stop > start else np.dtype(np.float32)
        shapes = [p.shape for _, p in named[start:stop]]
        self.buckets.append(_Bucket(len(self.buckets), start, shapes, dtype, self.xp))

    def chunks(self, buffer) -> list:
        """Contiguous views of a flat ``buffer``, about ``bucket_bytes`` each (at least one)."""
        step = max(1, self.bucket_bytes // buffer.itemsize)
        return [buffer[lo:lo + step] for lo in range(0, buffer.size, step)] or [buffer]

    @property
    def nbytes(self) -> int:
        """Bytes handed to MPI per all-reduce of the whole model."""
        if self.flat is not None:
            return self.flat.grad.nbytes
        return sum(b.buffer.nbytes for b in self.buckets)


# --------------------------------------------------------------------------------------
# GPU transports (CuPy buffers). Never imported or run on the CPU path.
# --------------------------------------------------------------------------------------

class _GpuTransport:
    """Moves CuPy buffers: staged through pinned host memory, CUDA-aware MPI, or NCCL."""

    @staticmethod
    def create(kind: str, comm, MPI) -> "_GpuTransport":
        """The transport named ``kind`` ("host", "cuda-aware", "nccl")."""
        return {"host": _HostStaging, "cuda-aware": _CudaAwareMPI, "nccl": _Nccl}[kind](
            comm, MPI)

    def __init__(self, comm, MPI):
        import cupy  # noqa: PLC0415
        self.cupy, self.comm, self.MPI = cupy, comm, MPI


class _HostStaging(_GpuTransport):
    """Device -> pinned host buffer -> MPI -> device. Works with any MPI build.

    One pinned buffer (grown to the largest bucket) is enough: every device-to-host copy
    is blocking, and the host-to-device copy of bucket i is ordered on the stream before
    the device-to-host copy of bucket i + 1 that would overwrite it.
    """

    def __init__(self, comm, MPI):
        super().__init__(comm, MPI)
        self._pinned = None

    def _host(self, buf):
        if self._pinned is None or self._pinned.nbytes < buf.nbytes:
            import cupyx  # noqa: PLC0415
            self._pinned = cupyx.empty_pinned(buf.nbytes, dtype=np.uint8)
        return self._pinned[:buf.nbytes].view(buf.dtype)

    def allreduce(self, buf) -> None:
        host = buf.get(out=self._host(buf))      # blocking: the stream is synchronised
        self.comm.Allreduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM)
        buf.set(host)

    def bcast(self, buf, root: int) -> None:
        host = buf.get(out=self._host(buf))
        self.comm.Bcast(host, root=root)
        buf.set(host)


class _CudaAwareMPI(_GpuTransport):
    """Device buffers straight to a CUDA-aware MPI (mpi4py reads __cuda_array_interface__).

    MPI knows nothing of CUDA streams: the packing kernels must have finished first.
    """

    def allreduce(self, buf) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def bcast(self, buf, root: int) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.comm.Bcast(buf, root=root)


class _Nccl(_GpuTransport):
    """NCCL collectives on the current stream; MPI only broadcasts NCCL's unique id.

    Created lazily at the first GPU collective, which every rank reaches together, so the
    (collective) communicator set-up cannot deadlock.
    """

    def __init__(self, comm, MPI):
        super().__init__(comm, MPI)
        from cupy.cuda import nccl  # noqa: PLC0415
        self.nccl = nccl
        uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nccl_comm = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.dtypes = {np.dtype(np.float16): nccl.NCCL_FLOAT16,
                       np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64}

    def allreduce(self, buf) -> None:
        stream = self.cupy.cuda.get_current_stream().ptr
        self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self.dtypes[buf.dtype],
                                 self.nccl.NCCL_SUM, stream)

    def bcast(self, buf, root: int) -> None:
        stream = self.cupy.cuda.get_current_stream().ptr
        self.nccl_comm.bcast(buf.data.ptr, buf.size, self.dtypes[buf.dtype], root, stream)
