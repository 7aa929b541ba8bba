"""cupy.cuda.runtime of the stand-in: devices named "CPU stand-in", one unless
``$TINYTF_STANDIN_GPUS`` says how many (what a rank's choice of its GPU sees)."""
import os

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
current = 0     # the device that cupy.cuda.Device(i).use() made current


def getDeviceCount():  # noqa: N802  (CuPy's name)
    return int(os.environ.get("TINYTF_STANDIN_GPUS", "1"))


def getDevice():  # noqa: N802
    return current


def runtimeGetVersion():  # noqa: N802
    return 0


def driverGetVersion():  # noqa: N802
    return 0


def getDeviceProperties(index):  # noqa: N802
    return {"name": b"CPU stand-in", "multiProcessorCount": 1,
            "totalGlobalMem": 0, "major": 0, "minor": 0}
