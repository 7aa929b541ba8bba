"""cupy.cuda.device of the stand-in."""


def get_cublas_handle():
    return 0
