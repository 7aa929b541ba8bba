"""Convolution and pooling layers over one or two spatial dimensions, as ``torch.nn``'s:
the same parameter names, shapes and initialisation, so a ``state_dict`` moves between the
two. The arithmetic is :mod:`tinytf.ops.conv` and :mod:`tinytf.ops.pool`."""
from __future__ import annotations

import math

import numpy as np

from tinytf.engine.tensor import Tensor
from tinytf.nn import functional as F
from tinytf.nn.modules import Module, Parameter, init


class _ConvNd(Module):
    """weight (out, in / groups, *kernel) and bias (out,), both U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), fan_in = in / groups * prod(kernel): PyTorch's default (its
    kaiming_uniform_ with a = sqrt(5) comes to that bound)."""

    dims = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True):
        d = self.dims
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels {in_channels} and out_channels {out_channels} must "
                             f"be divisible by groups {groups}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = F.as_tuple(kernel_size, d, "kernel_size")
        self.stride = F.as_tuple(stride, d, "stride")
        self.dilation = F.as_tuple(dilation, d, "dilation")
        self.padding = padding if isinstance(padding, str) else F.as_tuple(padding, d, "padding")
        fan_in = in_channels // groups * math.prod(self.kernel_size)
        bound = 1.0 / math.sqrt(fan_in)
        shape = (out_channels, in_channels // groups) + self.kernel_size
        self.weight = init.uniform_(Parameter(np.zeros(shape)), -bound, bound)
        self.bias = init.uniform_(Parameter(np.zeros(out_channels)), -bound, bound) \
            if bias else None

    def forward(self, x: Tensor) -> Tensor:
        conv = F.conv1d if self.dims == 1 else F.conv2d
        return conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                    self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}"
                f", padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}")


class Conv1d(_ConvNd):
    """1-D convolution over x (N, C_in, L) -> (N, C_out, L_out)."""

    dims = 1


class Conv2d(_ConvNd):
    """2-D convolution over x (N, C_in, H, W) -> (N, C_out, H_out, W_out)."""

    dims = 2


class _Pool(Module):
    """A pool's settings; ``stride`` defaults to the kernel size."""

    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride or self.kernel_size}, "
                f"padding={self.padding}")


class MaxPool1d(_Pool):
    """The maximum of each window of x (N, C, L)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool1d(x, self.kernel_size, self.stride, self.padding)


class MaxPool2d(_Pool):
    """The maximum of each window of x (N, C, H, W)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)


class AvgPool1d(_Pool):
    """The mean of each window of x (N, C, L), padding counted."""

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool1d(x, self.kernel_size, self.stride, self.padding)


class AvgPool2d(_Pool):
    """The mean of each window of x (N, C, H, W), padding counted."""

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding)
