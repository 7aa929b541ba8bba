"""cupy.cuda.runtime of the stand-in: one device named "CPU stand-in"."""
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14


def getDeviceCount():  # noqa: N802  (CuPy's name)
    return 1


def runtimeGetVersion():  # noqa: N802
    return 0


def driverGetVersion():  # noqa: N802
    return 0


def getDeviceProperties(index):  # noqa: N802
    return {"name": b"CPU stand-in", "multiProcessorCount": 1,
            "totalGlobalMem": 0, "major": 0, "minor": 0}
