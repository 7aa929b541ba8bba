"""Row-parallel CPU ops (tinytf.fast.cpu.threads, the RowParallel* classes of tinytf.fast.cpu.ops):
bitwise equal to their reference ops with any number of threads."""
import threading

import numpy as np
import pytest

from tinytf import fast, ops
from tinytf.engine import backend
from tinytf.engine.tensor import Tensor
from tinytf.fast.cpu import ops as cpu
from tinytf.fast.cpu import threads
from tinytf.models.transformer import Transformer, TransformerConfig, label_smoothed_loss
from tinytf.utils import workers

rng = np.random.default_rng(0)


@pytest.fixture
def split_everything(monkeypatch):
    """Three threads, and every op split however small (the tests' arrays are small)."""
    monkeypatch.setattr(threads, "MIN_ELEMENTS", 1)
    calls = []

    def counted(fn, n_rows, row_size=1):
        calls.append(n_rows)
        threads.parallel_rows(fn, n_rows, row_size)

    monkeypatch.setattr(cpu, "parallel_rows", counted)   # the ops' calls are counted
    threads.set_threads(3)
    yield calls
    threads.set_threads(None)


def test_parallel_rows_covers_every_row_once_in_contiguous_ranges(split_everything):
    seen, lock, callers = [], threading.Lock(), set()

    def fn(lo, hi):
        with lock:
            seen.append((lo, hi))
            callers.add(threading.get_ident())

    threads.parallel_rows(fn, 10)
    assert sorted(seen) == [(0, 3), (3, 6), (6, 10)]
    # The caller takes the last range; the pool's two threads the others (one of them may
    # take both when the first range is done before the second is handed out).
    assert threading.get_ident() in callers and len(callers) >= 2
    seen.clear()
    threads.parallel_rows(fn, 2)        # fewer rows than threads: one range per row
    assert sorted(seen) == [(0, 1), (1, 2)]


def test_the_pool_keeps_its_size_whatever_the_number_of_ranges(split_everything):
    for n_rows in (2, 10, 2, 10, 1, 7):
        threads.parallel_rows(lambda lo, hi: None, n_rows)
    pool_threads = [t for t in threading.enumerate() if t.name.startswith("tinytf-rows")]
    assert 1 <= len(pool_threads) <= 2        # 3 threads: the caller and two in the pool


def test_parallel_rows_runs_small_work_and_nested_calls_inline(monkeypatch):
    threads.set_threads(2)
    try:
        idents = []
        threads.parallel_rows(lambda lo, hi: idents.append((lo, hi)), 100, 1)  # < MIN_ELEMENTS
        assert idents == [(0, 100)]
        monkeypatch.setattr(threads, "MIN_ELEMENTS", 1)
        inner = []

        def outer(lo, hi):
            threads.parallel_rows(lambda a, b: inner.append((lo, a, b)), 4)

        threads.parallel_rows(outer, 2)
        # The caller's range splits again; the pool thread's runs inline.
        assert sorted(inner) == [(0, 0, 4), (1, 0, 2), (1, 2, 4)]
    finally:
        threads.set_threads(None)


def test_an_error_in_another_thread_reaches_the_caller(split_everything):
    def fn(lo, hi):
        if lo == 0:
            raise ValueError("row 0")

    with pytest.raises(ValueError, match="row 0"):
        threads.parallel_rows(fn, 9)


def test_the_thread_count_follows_the_environment(monkeypatch):
    for var in ("TINYTF_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    try:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
        threads.set_threads(None)
        assert threads.threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        threads.set_threads(None)
        assert threads.threads() == 2
        monkeypatch.setenv("TINYTF_THREADS", "64")
        threads.set_threads(None)
        assert threads.threads() == threads.MAX_THREADS
        assert workers.thread_budget() == 64   # decode workers are not capped
        with pytest.raises(ValueError):
            threads.set_threads(0)
    finally:
        threads.set_threads(None)


def _run(cls, inputs, kwargs, grad_seed=1):
    """Forward and backward of op ``cls`` on copies of ``inputs``: (output, input grads)."""
    tensors = [Tensor(a.copy(), requires_grad=a.dtype.kind == "f") for a in inputs]
    out = cls.apply(*tensors, **kwargs)
    g = np.random.default_rng(grad_seed).standard_normal(out.shape).astype(out.dtype)
    out.backward(g)
    return out.numpy(), [t.grad for t in tensors if t.requires_grad]


def _assert_same(reference, candidate):
    out_r, grads_r = reference
    out_c, grads_c = candidate
    np.testing.assert_array_equal(out_c, out_r)
    assert len(grads_r) == len(grads_c)
    for a, b in zip(grads_r, grads_c):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(split_everything, dtype, affine):
    x = (rng.standard_normal((3, 7, 16)) * 2 + 1).astype(dtype)
    extra = [rng.standard_normal(16).astype(dtype), rng.standard_normal(16).astype(dtype)] \
        if affine else []
    _assert_same(_run(ops.LayerNorm, [x, *extra], {}),
                 _run(cpu.RowParallelLayerNorm, [x, *extra], {}))
    assert split_everything == [21, 21]       # forward and backward, by row


@pytest.mark.parametrize("shape", [(4, 61, 16), (2, 4, 100, 64), (5, 3, 1500)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_with_rows_in_groups(split_everything, shape, affine):
    """Ranges long enough for affine_grouped_'s groups and their leftover rows (81 or 82
    rows of 16 in groups of 16; 266 or 267 rows of 64 in groups of 4) and rows too long to
    group (1500)."""
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    d = shape[-1]
    extra = [rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)] \
        if affine else []
    _assert_same(_run(ops.LayerNorm, [x, *extra], {}),
                 _run(cpu.RowParallelLayerNorm, [x, *extra], {}))


@pytest.mark.parametrize("d", [16, 64, 256, 1024, 1500])
def test_affine_grouped_equals_affine_bitwise(d):
    g = max(1, cpu.ROW_GROUP_WIDTH // d)
    w, b = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    for n in sorted({0, 1, max(g - 1, 1), g, 3 * g + 5}):
        x = rng.standard_normal((n, d)).astype(np.float32)
        for weight, bias in ((w, b), (w, None), (None, b), (None, None)):
            want, got = np.empty_like(x), np.full_like(x, np.nan)
            ops.norm.affine_(x, weight, bias, want)
            cpu.affine_grouped_(x, weight, bias, got)
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu(split_everything, dtype):
    x = (rng.standard_normal((3, 7, 16)) * 3).astype(dtype)
    _assert_same(_run(ops.GELU, [x], {}), _run(cpu.RowParallelGELU, [x], {}))
    assert split_everything == [21, 21]       # forward and backward, by row


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_add_draws_the_same_mask(split_everything, dtype):
    x = rng.standard_normal((5, 6, 12)).astype(dtype)
    r = rng.standard_normal((5, 6, 12)).astype(dtype)
    backend.manual_seed(7)
    reference = _run(ops.DropoutAdd, [x, r], {"p": 0.3})
    backend.manual_seed(7)
    candidate = _run(cpu.RowParallelDropoutAdd, [x, r], {"p": 0.3})
    _assert_same(reference, candidate)
    assert split_everything == [30, 30]
    assert 0 < (candidate[1][0] == 0).mean() < 0.6   # some of x's gradient was dropped


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("mask_kind", [None, "causal", "padding", "full"])
def test_attention(split_everything, mask_kind, small, dropout, monkeypatch):
    """Bitwise the reference op, dropout's masks included (the same draws); with small
    matrices the products are split by sentence too (q k^T with the softmax, P v; dV, dP,
    dQ, dK), else only the softmax, the dropout and the softmax's backward."""
    if not small:
        monkeypatch.setattr(cpu.RowParallelAttention, "SMALL_PRODUCT", 0)
    b, h, t, d = 5, 2, 9, 4
    q, k, v = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(3))
    mask = {None: None,
            "causal": np.tril(np.ones((t, t), bool))[None, None],
            "padding": np.arange(t)[None, None, None, :] < rng.integers(1, t + 1, b)[:, None,
                                                                                     None, None],
            "full": rng.random((b, h, t, t)) < 0.7}[mask_kind]
    if mask_kind == "full":
        mask[0, 0, 0] = False            # a fully masked row: uniform weights, no gradient
    kwargs = {"mask": mask, "dropout": dropout}
    backend.manual_seed(3)
    reference = _run(ops.Attention, [q, k, v], kwargs)
    backend.manual_seed(3)
    candidate = _run(cpu.RowParallelAttention, [q, k, v], kwargs)
    _assert_same(reference, candidate)
    dropped = 1 if dropout else 0
    if small:   # forward: q k^T with the softmax, [dropout,] P v; backward: dV, dP,
        assert split_everything == [b] * (7 + dropped)   # the softmax's, dQ, dK
    else:       # the softmax forward, [dropout,] its backward
        assert split_everything == [b] * (2 + dropped)


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(split_everything, activation, bias):
    x = rng.standard_normal((4, 6, 10)).astype(np.float32)
    w = rng.standard_normal((12, 10)).astype(np.float32)
    extra = [rng.standard_normal(12).astype(np.float32)] if bias else []
    kwargs = {"activation": activation}
    _assert_same(_run(ops.Linear, [x, w, *extra], kwargs),
                 _run(cpu.RowParallelLinear, [x, w, *extra], kwargs))
    assert len(split_everything) == (bias or activation is not None) + (activation is not None)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_blocked_cross_entropy_split_over_threads(split_everything, eps):
    logits = rng.standard_normal((300, 17)).astype(np.float32) * 3  # 5 blocks of 64 rows
    target = rng.integers(0, 17, 300)
    target[:9] = 0
    kwargs = dict(label_smoothing=eps, ignore_index=0)
    threads.set_threads(1)
    one = _run(cpu.BlockedCrossEntropy, [logits, target], kwargs)
    threads.set_threads(3)
    _assert_same(one, _run(cpu.BlockedCrossEntropy, [logits, target], kwargs))
    assert split_everything == [5, 300, 5, 300]  # blocks forward, rows backward; twice


def _train_steps(n_threads: int, activation: str = "relu"):
    """Parameters after two Adam steps of a small dropout-on Transformer."""
    threads.set_threads(n_threads)
    backend.manual_seed(3)
    cfg = TransformerConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64,
                            n_encoder_layers=2, n_decoder_layers=2, dropout=0.1, max_len=64,
                            activation=activation)
    model = Transformer(cfg)
    optimizer = fast.adam(list(model.parameters()), lr=1e-3)
    data = np.random.default_rng(1)
    for _ in range(2):
        src, tgt = data.integers(3, 50, (6, 9)), data.integers(3, 50, (6, 8))
        src[0, 6:] = 0
        tgt[1, 5:] = 0
        optimizer.zero_grad()
        loss, n = label_smoothed_loss(model(src, tgt[:, :-1]), tgt[:, 1:])
        (loss / n).backward()
        optimizer.step()
    return {name: p.data.copy() for name, p in model.named_parameters()}


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_a_training_step_is_bitwise_the_same_with_one_or_three_threads(
        split_everything, activation):
    one, three = _train_steps(1, activation), _train_steps(3, activation)
    assert one.keys() == three.keys()
    for name in one:
        np.testing.assert_array_equal(three[name], one[name], err_msg=name)


def test_set_blas_threads_resizes_openblas_at_run_time():
    """NumPy's OpenBLAS pool resized after NumPy loaded it (what decode workers do)."""
    before = workers.blas_threads()
    if before is None:
        pytest.skip("no OpenBLAS found in this process")
    try:
        assert workers.set_blas_threads(1)
        assert workers.blas_threads() == 1
        a = np.ones((256, 256), dtype=np.float32)
        assert (a @ a == 256).all()
    finally:
        workers.set_blas_threads(before)
    assert workers.blas_threads() == before
