"""The CPU's fast paths: :mod:`.ops` (the op table's CPU classes: blocked cross-entropy, flat
embedding gradients, row-parallel ops), :mod:`.threads` (rows of NumPy passes in threads),
:mod:`.transposed` (W.T copied once per search) and :mod:`.memory` (glibc keeps freed memory
for the next step)."""
