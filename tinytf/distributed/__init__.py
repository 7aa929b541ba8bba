"""Data parallelism over MPI: the communicator (broadcast, bucketed all-reduce, NCCL or
CUDA-aware transports on GPUs) in :mod:`tinytf.distributed.communicator`.

    from tinytf import distributed
    comm = distributed.create_communicator()   # MPICommunicator under mpirun, else single
"""
from tinytf.distributed.communicator import (  # noqa: F401
    BUCKET_BYTES,
    GPU_TRANSPORTS,
    Communicator,
    MPICommunicator,
    SingleCommunicator,
    create_communicator,
    gpu_transport_from_env,
    mpirun_command,
    nccl_usable,
)

__all__ = ["create_communicator", "Communicator", "SingleCommunicator", "MPICommunicator",
           "mpirun_command", "gpu_transport_from_env", "nccl_usable", "BUCKET_BYTES",
           "GPU_TRANSPORTS"]
