"""cupy.cuda of the stand-in: devices that all run on the CPU (one, or
``$TINYTF_STANDIN_GPUS``: ``runtime.getDevice()`` tells which one ``Device(i).use()`` made
current), one stream, events that have always passed."""
import contextlib as _contextlib

from . import device, runtime  # noqa: F401


class Device:
    def __init__(self, index=0):
        self.id = index

    def use(self):
        runtime.current = self.id

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def done(self):
        return True

    @property
    def done_(self):
        return True


class Stream:
    ptr = 0

    def __init__(self, non_blocking=False, null=False):
        pass

    def synchronize(self):
        pass

    def record(self, event=None):
        return event or Event()

    def wait_event(self, event):
        pass

    def begin_capture(self, *args, **kwargs):
        raise NotImplementedError("the CuPy stand-in cannot capture CUDA graphs")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_null = Stream()


def get_current_stream():
    return _null


class MemoryPool:
    def malloc(self, size):
        raise NotImplementedError("the CuPy stand-in has no device memory pool")

    def free_all_blocks(self):
        pass

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0


@_contextlib.contextmanager
def using_allocator(allocator=None):
    yield
