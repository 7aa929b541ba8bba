"""Data parallelism over MPI: the communicator (broadcast, bucketed all-reduce, NCCL or
CUDA-aware transports on GPUs) in :mod:`tinytf.distributed.communicator`.

    from tinytf import distributed
    comm = distributed.init()    # MPICommunicator under mpirun with >1 rank, else single
"""
from tinytf.distributed.communicator import (  # noqa: F401
    BUCKET_BYTES,
    GPU_TRANSPORTS,
    Communicator,
    MPICommunicator,
    SingleCommunicator,
    gpu_transport_from_env,
    init,
    mpirun_command,
    nccl_usable,
)

__all__ = ["init", "Communicator", "SingleCommunicator", "MPICommunicator", "mpirun_command",
           "gpu_transport_from_env", "nccl_usable", "BUCKET_BYTES", "GPU_TRANSPORTS"]
