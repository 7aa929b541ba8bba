"""The GPU's fast paths: :mod:`.ops` (the op table's GPU classes), :mod:`.kernels` (the CUDA
source, its launch wrappers and the cuBLAS products) and :mod:`.graph` (a training step
captured once and replayed as a CUDA graph)."""
