"""The fused GPU kernels: checked on the CPU as far as a CPU can, and on a GPU when present.

Without a GPU:
- the CUDA source compiles with NVRTC for sm_90 (needs libnvrtc, e.g. ``pip install
  nvidia-cuda-nvrtc-cu12``; skipped with the reason otherwise);
- the very same source, built with g++ under ``tinytf.fast.cuda.kernels.host``, runs
  through the real Python wrappers and matches the NumPy ops in float32, float16 and
  bfloat16 storage;
- the cuBLAS call plans (row-major to column-major, transposed views, batch strides) are
  executed by a NumPy model of column-major GEMM and match ``a @ b``.
With a GPU (CuPy and a device): every wrapper, every op's forward and backward, and the
cuBLAS products in float32 / tf32 / bf16 / fp16 against NumPy on the CPU.
"""
import ctypes
import ctypes.util
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import tinytf
from tinytf import functional as F
from tinytf.engine.tensor import Tensor
from tinytf.fast import FusedAdam
from tinytf.fast.cuda import kernels
from tinytf.fast.cuda.kernels import _runtime, gemm, host, sources
from tinytf.fast.loss_scaler import DynamicLossScaler
from tinytf.nn import amp
from tinytf.ops import cast
from tinytf.optim.adam import Adam

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # NumPy < 2
    byte_bounds = np.byte_bounds


def _gpu():
    """(cupy, "") when a GPU is usable, else (None, why not)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library missing
        return None, f"CuPy is not installed ({type(e).__name__})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no GPU"
    except Exception as e:
        return None, f"no usable GPU: {e}"
    return cupy, ""


cp, NO_GPU = _gpu()
gpu = pytest.mark.skipif(cp is None, reason=f"needs a GPU: {NO_GPU}")
needs_cxx = pytest.mark.skipif(host.compiler() is None,
                               reason="needs g++ to run the kernel source on the CPU")


# ----- packaging ---------------------------------------------------------------------------

def test_import_does_not_need_cupy():
    code = ("import sys, tinytf, tinytf.fast.cuda.kernels, tinytf.nn.amp; "
            "assert 'cupy' not in sys.modules, 'tinytf imported cupy'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_arrays_take_the_plain_path():
    x = np.ones((2, 3), dtype=np.float32)
    assert not kernels.fused(x)
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(kernels.matmul(a, b), a @ b)


def test_every_instantiation_has_a_parsed_signature():
    sigs = _runtime.signatures()
    names = {i.split("<")[0] for i in sources.INSTANTIATIONS}
    assert names == set(sigs)
    for name, (tnames, params) in sigs.items():
        assert tnames and params, name


def test_launch_arguments_are_checked():
    x = np.zeros((4, 8), dtype=np.float32)
    no_mask = (0, 1, 1, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="needs float, got an array of float64"):
        _runtime.convert_args("softmax_bwd", ["float"],
                              (x.astype(np.float64), x, x, 4, 8, *no_mask, 0))
    with pytest.raises(ValueError, match="C-contiguous"):
        _runtime.convert_args("softmax_bwd", ["float"], (x.T, x, x, 4, 8, *no_mask, 0))
    with pytest.raises(TypeError, match="takes 13 arguments"):
        _runtime.convert_args("softmax_bwd", ["float"], (x, x))
    args = _runtime.convert_args("softmax_bwd", ["float"], (x, x, x, 4, 8, *no_mask, 0))
    assert [type(a) for a in args[3:6]] == [np.int64, np.int32, np.uint64]
    assert type(args[-1]) is np.int32


# ----- NVRTC: the source compiles for Hopper --------------------------------------------

def _load_nvrtc():
    """ctypes handle on libnvrtc, or None."""
    candidates = []
    try:
        import nvidia.cuda_nvrtc as pkg  # pip install nvidia-cuda-nvrtc-cu12
        for root in pkg.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates += sorted(glob.glob(os.path.join(os.environ[var], "lib64", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    candidates += [found] if found else []
    for path in candidates:
        if "builtins" in os.path.basename(path) or ".alt." in path:
            continue
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _nvrtc_compile(lib, source, names, options):
    """(ok, log) of compiling ``source`` with name expressions ``names``."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"tinytf_kernels.cu",
                                  0, None, None) == 0
    for n in names:
        assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return status == 0, log.value.decode(errors="replace")


_NVRTC = _load_nvrtc()


@pytest.mark.skipif(_NVRTC is None, reason="libnvrtc not found (pip install "
                    "nvidia-cuda-nvrtc-cu12, or a CUDA toolkit): source not compile-checked")
def test_source_compiles_with_nvrtc_for_hopper():
    ok, log = _nvrtc_compile(_NVRTC, sources.SOURCE, sources.INSTANTIATIONS,
                             ["-arch=compute_90", *sources.NVRTC_OPTIONS])
    assert ok, log
    assert "warning" not in log.lower(), log
    # The check is real: a broken kernel does not compile.
    bad, log = _nvrtc_compile(_NVRTC, sources.SOURCE.replace("warp_sum(s1)", "warp_sum(s9)"),
                              sources.INSTANTIATIONS, ["-arch=compute_90"])
    assert not bad and "s9" in log


# ----- the kernels on the CPU (g++ build of the same source) -----------------------------

rng = np.random.default_rng(0)
STORAGES = ["float32", "float16", "bfloat16"]
TOL = {"float32": dict(rtol=2e-5, atol=2e-6), "float16": dict(rtol=2e-3, atol=2e-3),
       "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2)}


def to_storage(x, kind):
    """float32 values -> an array in ``kind`` storage (bf16 as uint16 bits on the CPU)."""
    x = np.asarray(x, dtype=np.float32)
    if kind == "float16":
        return x.astype(np.float16)
    if kind == "bfloat16":
        return cast.bf16_bits(x)
    return x


def to_f32(a, kind):
    """The float32 values held by a storage array."""
    return cast.bf16_from_bits(a) if kind == "bfloat16" else np.asarray(a, dtype=np.float32)


def rounded(x, kind):
    """float32 values rounded to ``kind`` (what a kernel input really holds)."""
    return to_f32(to_storage(x, kind), kind)


@pytest.fixture(scope="module")
def on_cpu():
    if host.compiler() is None:
        pytest.skip("needs g++ to run the kernel source on the CPU")
    with host.install():
        yield


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_matches_numpy(on_cpu, kind, log):
    x = rounded(rng.standard_normal((3, 5, 37)) * 3, kind)
    g = rounded(rng.standard_normal(x.shape), kind)
    y = kernels.softmax_forward(to_storage(x, kind), axis=-1, log=log)
    t = Tensor(x, requires_grad=True)
    ref = t.log_softmax(-1) if log else t.softmax(-1)
    ref.backward(g)
    np.testing.assert_allclose(to_f32(y, kind), ref.data, **TOL[kind])
    # Backward from the kernel's own output, as the op would call it.
    dx = kernels.softmax_backward(y, to_storage(g, kind), axis=-1, log=log)
    np.testing.assert_allclose(to_f32(dx, kind), t.grad, **TOL[kind])


@needs_cxx
def test_softmax_other_axis_and_float32_exactness(on_cpu):
    x = rng.standard_normal((6, 40, 3)).astype(np.float32)
    y = kernels.softmax_forward(x, axis=1)
    np.testing.assert_allclose(y, Tensor(x).softmax(1).data, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-6)


@needs_cxx
@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 9), (1, 1, 5, 9), (2, 3, 5, 9), (5, 9)])
def test_masked_softmax_matches_attention_masking(on_cpu, mask_shape):
    x = rng.standard_normal((2, 3, 5, 9)).astype(np.float32)
    mask = rng.random(mask_shape) > 0.4
    mask[..., 0, :] = False                      # a fully masked row: uniform, not NaN
    y = kernels.softmax_forward(x, mask=mask)
    # The NumPy path of ops.attention.attention_weights: fill with the most negative float32.
    filled = np.where(np.broadcast_to(mask, x.shape), x, np.finfo(np.float32).min)
    ref = Tensor(filled).softmax(-1).data
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=1e-7)
    assert (y[~np.broadcast_to(mask, x.shape) & np.broadcast_to(mask.any(-1, keepdims=True),
                                                                x.shape)] == 0).all()
    # Backward with the same mask: the NumPy op's y * (g - sum(g y)), then times the mask
    # (a fully masked row's uniform weights send no gradient back).
    g = rng.standard_normal(x.shape).astype(np.float32)
    dx = kernels.softmax_backward(y, g, mask=mask)
    ref_dx = y * (g - (g * y).sum(-1, keepdims=True)) * np.broadcast_to(mask, x.shape)
    np.testing.assert_allclose(dx, ref_dx, rtol=2e-5, atol=1e-6)
    assert (dx[:, :, 0] == 0).all() if mask.ndim == 4 else (dx[..., 0, :] == 0).all()


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_numpy(on_cpu, kind, affine):
    x = rounded(rng.standard_normal((4, 7, 48)) * 2 + 1, kind)
    w = Tensor(rng.standard_normal(48).astype(np.float32), requires_grad=True) if affine else None
    b = Tensor(rng.standard_normal(48).astype(np.float32), requires_grad=True) if affine else None
    t = Tensor(x, requires_grad=True)
    ref = F.layer_norm(t, w, b, eps=1e-5)
    g = rng.standard_normal(x.shape).astype(np.float32)
    ref.backward(g)
    y, x_hat, rstd = kernels.layer_norm_forward(to_storage(x, kind), None if w is None else w.data,
                                                None if b is None else b.data, 1e-5)
    out_kind = "float32" if affine else kind      # x (16-bit) * w (float32) promotes
    assert y.dtype == to_storage(x, out_kind).dtype and rstd.shape == (4, 7, 1)
    np.testing.assert_allclose(to_f32(y, out_kind), ref.data, **TOL[kind])
    dx, dw, db = kernels.layer_norm_backward(to_storage(g, out_kind), x_hat, rstd,
                                             None if w is None else w.data)
    np.testing.assert_allclose(to_f32(dx, out_kind), t.grad, **TOL[kind])
    if affine:
        np.testing.assert_allclose(dw, w.grad, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(db, b.grad, rtol=1e-4, atol=1e-3)


@needs_cxx
def test_layer_norm_parameter_grads_span_several_row_chunks(on_cpu, monkeypatch):
    monkeypatch.setattr(kernels, "_COLUMN_CHUNK", 16)  # 3 partial sums (256 on a GPU)
    x = rng.standard_normal((40, 40)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    y, x_hat, rstd = kernels.layer_norm_forward(x, np.ones(40, np.float32),
                                                np.zeros(40, np.float32))
    _, dw, db = kernels.layer_norm_backward(g, x_hat, rstd, np.ones(40, np.float32),
                                            need_x=False)
    np.testing.assert_allclose(dw, (g * x_hat).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, g.sum(0), rtol=1e-4, atol=1e-4)


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
def test_dropout_residual_matches_numpy(on_cpu, kind):
    x = rounded(rng.standard_normal((7, 33)), kind)
    res = rounded(rng.standard_normal((7, 33)), kind)
    u = rng.random(x.shape, dtype=np.float32)
    p = 0.3
    out, mask = kernels.dropout_forward(to_storage(x, kind), p, to_storage(res, kind), uniform=u)
    # The NumPy op: mask = keep.astype(T) * (1/(1-p)) in T, out = x * mask, then + residual.
    dtype = np.float16 if kind == "float16" else np.float32
    ref_mask = rounded((u >= p).astype(dtype) * dtype(1.0 / (1.0 - p)), kind)
    np.testing.assert_array_equal(to_f32(mask, kind), ref_mask)
    np.testing.assert_allclose(to_f32(out, kind), rounded(rounded(x * ref_mask, kind) + res, kind),
                               rtol=0, atol=0)
    plain, _ = kernels.dropout_forward(to_storage(x, kind), p, uniform=u)
    np.testing.assert_array_equal(to_f32(plain, kind), rounded(x * ref_mask, kind))


@needs_cxx
def test_dropout_draws_its_own_random_numbers(on_cpu):
    # Without ``uniform`` the kernel hashes (seed, offset + i): about p of the elements
    # dropped, independent draws from call to call, the same draws after manual_seed.
    x = np.ones((40, 250), np.float32)
    tinytf.manual_seed(7)
    out1, mask1 = kernels.dropout_forward(x, 0.3)
    out2, _ = kernels.dropout_forward(x, 0.3)
    dropped = (out1 == 0).mean()
    assert abs(dropped - 0.3) < 0.02                 # 10k draws: sd 0.0046
    assert set(np.unique(out1)) == {np.float32(0), np.float32(1 / 0.7)}
    np.testing.assert_array_equal(out1, x * mask1)
    agree = ((out1 == 0) == (out2 == 0)).mean()
    assert abs(agree - (0.3 ** 2 + 0.7 ** 2)) < 0.02  # what independent masks agree on
    tinytf.manual_seed(7)
    np.testing.assert_array_equal(kernels.dropout_forward(x, 0.3)[0], out1)
    # A new seed on the device gives new numbers at the same offsets (CUDA-graph replays).
    tinytf.manual_seed(7)
    stream = tinytf.engine.backend.counter_stream(np)
    stream.advance()
    again, _ = kernels.dropout_forward(x, 0.3)
    assert abs(((again == 0) == (out1 == 0)).mean() - 0.58) < 0.02
    # The numbers are uniform: every tenth of [0, 1) gets its share of draws.
    u_kept = [(kernels.dropout_forward(x, q)[0] != 0).mean() for q in np.arange(0.1, 1.0, 0.1)]
    np.testing.assert_allclose(u_kept, 1 - np.arange(0.1, 1.0, 0.1), atol=0.02)


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
def test_dropout_backward_of_a_float32_gradient(on_cpu, kind):
    # The residual stream's float32 gradient times x's 16-bit mask, stored in x's dtype:
    # what NumPy's grad * mask and the engine's cast to x's dtype give, in one launch.
    g = rng.standard_normal((6, 50)).astype(np.float32)
    mask = rounded((rng.random((6, 50)) >= 0.3) * np.float32(1 / 0.7), kind)
    dx = kernels.dropout_backward(g, to_storage(mask, kind))
    assert dx.dtype == to_storage(mask, kind).dtype
    np.testing.assert_array_equal(to_f32(dx, kind), rounded(g * mask, kind))
    same = kernels.dropout_backward(to_storage(g, kind), to_storage(mask, kind))
    np.testing.assert_array_equal(to_f32(same, kind), rounded(rounded(g, kind) * mask, kind))


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
@pytest.mark.parametrize("relu", [False, True])
def test_add_bias_matches_numpy(on_cpu, kind, relu):
    # y += b (float32) in place: NumPy's sum in float32, stored rounded to y's dtype; with
    # relu then max(y, 0) in the same pass (a NaN stays NaN, as np.maximum keeps it).
    y = rounded(rng.standard_normal((6, 37)), kind)
    y[2, 3] = np.nan
    b = rng.standard_normal(37).astype(np.float32)
    out = to_storage(y, kind).copy()   # (float32 storage is y itself)
    kernels.add_bias_(out, b, relu=relu)
    ref = rounded(y + b, kind)
    np.testing.assert_array_equal(to_f32(out, kind), np.maximum(ref, 0) if relu else ref)


@needs_cxx
def test_a_transformer_step_through_the_kernel_source_equals_the_numpy_step(on_cpu):
    """The whole model with every fused kernel in place (the CUDA source run on the CPU):
    softmax with the padding and causal masks, layer norm, the linear layers' bias (and
    the FFN's bias + ReLU), cross-entropy, the column sums of the bias and layer-norm
    gradients. Loss and every parameter gradient equal the NumPy ops'. (Dropout is off:
    the kernel draws other random numbers than NumPy; it has tests of its own here.)"""
    from tinytf.models.transformer import Transformer, TransformerConfig, label_smoothed_loss
    cfg = TransformerConfig.preset("tiny", d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                                   n_decoder_layers=2, vocab_size=61, dropout=0.0)
    g = np.random.default_rng(4)
    src, tgt = g.integers(4, 61, (3, 7)), g.integers(4, 61, (3, 6))
    src[1, 4:] = 0
    tgt[2, 3:] = 0
    runs = []
    for fused in (False, True):
        kernels.use_fused_kernels(fused)
        try:
            tinytf.manual_seed(0)
            model = Transformer(cfg).train()
            before = dict(kernels.calls)
            loss, _ = label_smoothed_loss(model(src, tgt[:, :-1]), tgt[:, 1:])
            loss.backward()
            calls = {k: v - before.get(k, 0) for k, v in kernels.calls.items()}
        finally:
            kernels.use_fused_kernels(True)
        runs.append((float(loss.data), {n: p.grad for n, p in model.named_parameters()}, calls))
    (ref_loss, ref_grads, _), (loss, grads, calls) = runs
    for name in ("softmax_forward", "softmax_backward", "layer_norm_forward",
                 "layer_norm_backward", "cross_entropy_forward", "add_bias", "bias_grad",
                 "relu_backward"):
        assert calls.get(name, 0) > 0, (name, calls)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, ref in ref_grads.items():
        np.testing.assert_allclose(grads[name], ref, rtol=2e-4, atol=2e-6, err_msg=name)


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
def test_dropout_residual_of_another_dtype(on_cpu, kind):
    # A 16-bit sub-layer output plus the float32 residual stream, in one launch: the result
    # is float32 = residual + (x * mask rounded to x's dtype), as NumPy computes it.
    x = rounded(rng.standard_normal((5, 40)), kind)
    res = rng.standard_normal((5, 40)).astype(np.float32)
    u = rng.random(x.shape, dtype=np.float32)
    out, mask = kernels.dropout_forward(to_storage(x, kind), 0.2, res, uniform=u)
    assert out.dtype == np.float32
    dtype = np.float16 if kind == "float16" else np.float32
    ref_mask = rounded((u >= 0.2).astype(dtype) * dtype(1.0 / 0.8), kind)
    np.testing.assert_array_equal(out, rounded(x * ref_mask, kind) + res)


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
@pytest.mark.parametrize("eps,ignore", [(0.0, None), (0.1, 0), (0.2, 3)])
def test_cross_entropy_matches_numpy(on_cpu, kind, eps, ignore):
    n, v = 11, 301
    logits = rounded(rng.standard_normal((n, v)) * 4, kind)
    target = rng.integers(0, v, n)
    if ignore is not None:
        target[[1, 5]] = ignore
    t = Tensor(logits, requires_grad=True)
    ref = F.cross_entropy(t, target, label_smoothing=eps, ignore_index=ignore, reduction="none")
    ref.backward(np.ones(n, dtype=np.float32))
    loss, dlogits, weights = kernels.cross_entropy_forward(to_storage(logits, kind), target,
                                                           eps, ignore)
    assert loss.dtype == np.float32 and dlogits.dtype == to_storage(logits, kind).dtype
    np.testing.assert_allclose(loss, ref.data, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(to_f32(dlogits, kind) * weights[:, None], t.grad, **TOL[kind])
    if ignore is not None:
        assert loss[1] == 0 and weights[1] == 0 and weights[0] == (target[0] != ignore)


@needs_cxx
def test_cross_entropy_bad_target_is_nan_not_a_wild_read(on_cpu):
    loss, _, _ = kernels.cross_entropy_forward(np.zeros((2, 5), np.float32), np.array([1, 9]))
    assert np.isfinite(loss[0]) and np.isnan(loss[1])


@needs_cxx
@pytest.mark.parametrize("kind", ["float32", "float16"])  # bf16 here is uint16 bits
@pytest.mark.parametrize("shape", [(7, 33), (3, 300, 40), (0, 5)])
def test_bias_grad_sums_every_row(on_cpu, kind, shape, monkeypatch):
    monkeypatch.setattr(kernels, "_COLUMN_CHUNK", 64)   # several row chunks
    g = rounded(rng.standard_normal(shape), kind)
    gb = kernels.bias_grad(to_storage(g, kind))
    assert gb.dtype == np.dtype(kind) and gb.shape == shape[-1:]
    want = g.reshape(-1, shape[-1]).astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(gb.astype(np.float64), want, rtol=2e-3 if kind == "float16"
                               else 1e-5, atol=1e-2 if kind == "float16" else 1e-4)


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
def test_bias_relu_matches_numpy(on_cpu, kind):
    x = rounded(rng.standard_normal((9, 31)), kind)
    bias = rng.standard_normal(31).astype(np.float32)
    y = kernels.relu_forward(to_storage(x, kind), bias)
    np.testing.assert_array_equal(to_f32(y, kind), np.maximum(rounded(x + bias, kind), 0))
    g = rounded(rng.standard_normal(x.shape), kind)
    dx = kernels.relu_backward(y, to_storage(g, kind))
    t = Tensor(rounded(x + bias, kind), requires_grad=True)
    t.relu().backward(g)
    np.testing.assert_array_equal(to_f32(dx, kind), t.grad)


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
def test_unscale_flags_inf_and_nan(on_cpu, kind):
    clean = to_storage(np.array([2.0, -4.0, 8.0]), kind)
    flag = kernels.unscale_([clean], 0.25)
    assert flag[0] == 0
    np.testing.assert_array_equal(to_f32(clean, kind), [0.5, -1.0, 2.0])
    for bad in (np.inf, np.nan):
        g = to_storage(np.array([1.0, bad, 3.0]), kind)
        assert kernels.unscale_([clean.copy(), g], 0.5)[0] == 1


@needs_cxx
@pytest.mark.parametrize("kind", STORAGES)
def test_adam_step_matches_optim_adam(on_cpu, kind):
    p0 = rng.standard_normal(50).astype(np.float32)
    ref = tinytf.nn.Parameter(p0.copy())
    opt = Adam([ref], lr=1e-2)
    p, m, v = p0.copy(), np.zeros(50, np.float32), np.zeros(50, np.float32)
    for step in range(1, 4):
        g = rounded(rng.standard_normal(50) * 8, kind)
        ref.grad = g / 8
        opt.step()
        kernels.adam_step(p, to_storage(g, kind), m, v, lr=1e-2, betas=opt.betas, eps=opt.eps,
                          step=step, grad_scale=1 / 8)
    np.testing.assert_allclose(p, ref.data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, opt.exp_avg["0"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, opt.exp_avg_sq["0"], rtol=1e-5, atol=1e-7)
    # A flagged overflow leaves everything untouched.
    before = p.copy(), m.copy(), v.copy()
    kernels.adam_step(p, to_storage(np.ones(50), kind), m, v, lr=1.0, betas=opt.betas,
                      eps=opt.eps, step=4, found_inf=np.ones(1, np.int32))
    for a, b in zip((p, m, v), before):
        np.testing.assert_array_equal(a, b)


@needs_cxx
def test_the_adam_kernel_takes_radams_scalars(on_cpu):
    """FusedAdam(rectify=True) with the kernel running: RAdam's lr * r_t and eps reach the
    kernel, and it matches Adam(rectify=True) in NumPy over the first 12 updates."""
    params = [tinytf.nn.Parameter(rng.standard_normal(s).astype(np.float32))
              for s in ((4, 3), (5,))]
    twins = [tinytf.nn.Parameter(p.data.copy()) for p in params]
    fused, ref = FusedAdam(params, lr=1e-2, rectify=True), Adam(twins, lr=1e-2, rectify=True)
    calls = kernels.calls.get("adam_step", 0)
    for _ in range(12):
        for p, q in zip(params, twins):
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
            q.grad = p.grad.copy()
        fused.step(skip=np.zeros(1, np.int32))
        ref.step()
    assert kernels.calls["adam_step"] > calls
    for p, q in zip(params, twins):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-5, atol=1e-6)


@needs_cxx
@pytest.mark.parametrize("flat", [True, False])
def test_adam_hands_the_skip_flag_to_the_kernel(on_cpu, flat):
    """FusedAdam.step(skip=flag) with the kernels running passes the device flag to the
    Adam kernel instead of reading it (the trainer's step decided on the device): a set
    flag leaves parameters and moments as they were, a clear one steps."""
    params = [tinytf.nn.Parameter(rng.standard_normal(s).astype(np.float32))
              for s in ((4, 3), (5,))]
    opt = FusedAdam(params, lr=1e-2, flat=flat)
    assert opt._skips_on_device()
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(np.float32)
    opt.step(skip=np.zeros(1, np.int32))             # builds the flat buffers, steps
    stepped = [p.data.copy() for p in params]
    moments = [m.copy() for m in opt.exp_avg.values()]
    calls = kernels.calls.get("adam_step", 0)
    for p in params:
        p.grad = np.full(p.shape, np.nan, np.float32)
    opt.step(skip=np.ones(1, np.int32))
    assert kernels.calls["adam_step"] > calls and opt.step_count == 2
    for p, before in zip(params, stepped):
        np.testing.assert_array_equal(p.data, before)
    for m, before in zip(opt.exp_avg.values(), moments):
        np.testing.assert_array_equal(m, before)


@needs_cxx
def test_scaler_uses_the_fused_unscale_when_kernels_run(on_cpu):
    params = [tinytf.nn.Parameter(np.zeros(3)), tinytf.nn.Parameter(np.zeros(2))]
    params[0].grad = np.array([4.0, 8.0, 12.0], np.float32)
    params[1].grad = np.array([1.0, np.inf], np.float32)
    before = kernels.calls.get("unscale_", 0)
    assert DynamicLossScaler(init_scale=4.0).unscale_(params)
    assert kernels.calls["unscale_"] == before + 1
    np.testing.assert_array_equal(params[0].grad, [1.0, 2.0, 3.0])


# ----- cuBLAS plans, executed by a NumPy model of column-major GEMM -----------------------

def run_plan(p, a, b):
    """What cuBLAS computes for plan ``p``: column-major reads from each operand's start."""
    def read(x, opnd, rows, cols):  # cuBLAS's op(X), rows x cols, for every batch entry
        item = x.itemsize
        inner = (item, opnd.ld * item) if opnd.op == gemm.OP_N else (opnd.ld * item, item)
        view = np.lib.stride_tricks.as_strided(
            x, shape=(p.batch, rows, cols), strides=(opnd.batch_stride * item, *inner))
        root = x
        while root.base is not None:
            root = root.base
        lo, hi = byte_bounds(view)
        base_lo, base_hi = byte_bounds(root)
        assert base_lo <= lo and hi <= base_hi, "the plan reads outside the operand's memory"
        return view
    c_col = read(b, p.first, p.m, p.k) @ read(a, p.second, p.k, p.n)   # (batch, m, n) col-major
    return c_col.transpose(0, 2, 1).reshape(p.out_shape)


def _layouts():
    g = np.random.default_rng(1)
    r = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    qkv = r(2, 5, 3 * 8)
    q = qkv[..., :8].reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)  # split_heads of a slice
    k = r(2, 2, 6, 4)
    return {
        "contiguous": (r(5, 7), r(7, 3)),
        "linear x @ W.T": (r(2, 5, 7).reshape(-1, 7), r(3, 7).T),
        "grad.T @ x": (r(10, 3).T, r(10, 7)),
        "column slices": (r(5, 12)[:, 2:9], r(9, 7)[2:, 1:4]),
        "transposed slices": (r(9, 8)[1:8, :5].T, r(6, 8)[:, 1:].T),
        "batched": (r(2, 3, 5, 4), r(2, 3, 4, 6)),
        "scores q @ k^T": (r(2, 2, 5, 4), k.swapaxes(-1, -2)),
        "broadcast weight": (r(3, 5, 4), r(4, 6)),
        "broadcast batch": (r(1, 3, 5, 4), r(2, 1, 4, 6)),
        "decode step (1 row)": (r(2, 2, 1, 4), k.swapaxes(-1, -2)),
        "one column": (r(5, 4), r(4, 1)),
        "one by one": (r(1, 4), r(4, 1)),
        "heads of a slice": (q, k.swapaxes(-1, -2)[..., :5]),
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_cublas_plan_equals_numpy_matmul(name):
    a, b = _layouts()[name]
    p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    copied = []
    while isinstance(p, tuple):          # as kernels.matmul does: copy the named operand
        assert p[1] not in copied, "copying did not make the operand usable"
        copied.append(p[1])
        a, b = (np.ascontiguousarray(a), b) if p[1] == "a" else (a, np.ascontiguousarray(b))
        p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    if p is None:  # broadcast batches that no single stride describes: cupy.matmul's job
        assert name == "broadcast batch"
        return
    assert copied == (["a"] if name == "heads of a slice" else [])
    np.testing.assert_allclose(run_plan(p, a, b), a @ b, rtol=1e-5, atol=1e-5)


# A stand-in libcublas (plain C, float32 only) with the four functions graph capture calls:
# it checks that the ctypes bindings pass every argument where cuBLAS expects it.
_CUBLAS_STUB = r"""
#include <stddef.h>
static float at(const float* M, int op, int ld, int r, int c) {
    return op == 0 ? M[r + (long long)c * ld] : M[c + (long long)r * ld];
}
static void gemm1(int ta, int tb, int m, int n, int k, float alpha, const float* A, int lda,
                  const float* B, int ldb, float* C, int ldc) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double acc = 0.0;
            for (int l = 0; l < k; ++l) acc += (double)at(A, ta, lda, i, l) * at(B, tb, ldb, l, j);
            C[i + (long long)j * ldc] = (float)(alpha * acc);          /* beta = 0 */
        }
}
void* last_stream; size_t workspace_size;
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha,
                 const void* A, int at_, int lda, const void* B, int bt, int ldb,
                 const void* beta, void* C, int ct, int ldc, int compute, int algo) {
    if (at_ || bt || ct || *(const float*)beta != 0.0f || compute != 68 || algo != -1) return 7;
    gemm1(ta, tb, m, n, k, *(const float*)alpha, A, lda, B, ldb, C, ldc);
    return 0;
}
int cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha,
                               const void* A, int at_, int lda, long long sa,
                               const void* B, int bt, int ldb, long long sb, const void* beta,
                               void* C, int ct, int ldc, long long sc, int batch,
                               int compute, int algo) {
    if (at_ || bt || ct || *(const float*)beta != 0.0f || compute != 68 || algo != -1) return 7;
    for (int i = 0; i < batch; ++i)
        gemm1(ta, tb, m, n, k, *(const float*)alpha, (const float*)A + i * sa, lda,
              (const float*)B + i * sb, ldb, (float*)C + i * sc, ldc);
    return 0;
}
int cublasSetStream_v2(void* h, void* s) { last_stream = s; return 0; }
int cublasSetWorkspace_v2(void* h, void* w, size_t n) { workspace_size = n; return 0; }
"""


class _Ptr:
    """Stands for a CuPy array in ``_gemm``: ``.data.ptr`` is the first element's address."""

    def __init__(self, a):
        self.data = type("Mem", (), {"ptr": a.ctypes.data})()


@needs_cxx
def test_cublas_c_api_path_computes_every_layout(tmp_path, monkeypatch):
    # The products of a captured step go through cuBLAS's C API by ctypes (CuPy's wrappers
    # refuse capture). Run that very path against a C stand-in of libcublas: every layout
    # tinytf produces, 2-D and strided-batched, with alpha, must equal NumPy.
    import ctypes
    import subprocess
    stub = tmp_path / "libcublas.so.99"
    src = tmp_path / "stub.c"
    src.write_text(_CUBLAS_STUB)
    subprocess.run([host.compiler(), "-x", "c", "-shared", "-fPIC", "-O1", str(src),
                    "-o", str(stub)],
                   check=True)
    if gemm.loaded_library_path("libcublas.so") not in (None, str(stub)):
        pytest.skip("a real libcublas is loaded in this process")
    lib = ctypes.CDLL(str(stub))
    assert gemm.loaded_library_path("libcublas.so") == str(stub)
    c = gemm._CublasC()
    c.check(c.set_stream(None, ctypes.c_void_p(1234)), "cublasSetStream")
    assert ctypes.c_void_p.in_dll(lib, "last_stream").value == 1234
    monkeypatch.setattr(gemm, "_capture", (c, None))
    monkeypatch.setattr(gemm, "_cuda_type", lambda dtype: 0)      # CUDA_R_32F
    for name, (a, b) in _layouts().items():
        for alpha in (1.0, 0.125):
            p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
            while isinstance(p, tuple):
                a, b = (np.ascontiguousarray(a), b) if p[1] == "a" else (a, np.ascontiguousarray(b))
                p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
            if p is None:
                continue
            out = np.full(p.out_shape, np.nan, np.float32)
            gemm._gemm(p, _Ptr(b), _Ptr(a), _Ptr(out), 0, 0, alpha)
            np.testing.assert_allclose(out, alpha * (a @ b), rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(RuntimeError, match="cublasGemmEx failed during graph capture"):
        p = gemm.plan((2, 3), (12, 4), (3, 2), (8, 4), 4)
        gemm._gemm(p, _Ptr(np.ones((3, 2), np.float32)), _Ptr(np.ones((2, 3), np.float32)),
                   _Ptr(np.empty((2, 2), np.float32)), 0, 2)    # a float16 result: refused


def test_cublas_plan_random_layouts():
    g = np.random.default_rng(2)
    for _ in range(200):
        m, k, n = (int(v) for v in g.integers(1, 6, 3))
        batch = tuple(int(v) for v in g.integers(1, 3, int(g.integers(0, 3))))

        def make(rows, cols):
            pad = int(g.integers(0, 3))
            if g.random() < 0.5:   # row-major, maybe a column slice of a wider array
                return g.standard_normal(batch + (rows, cols + pad)).astype(np.float32)[..., :cols]
            full = g.standard_normal(batch + (cols, rows + pad)).astype(np.float32)
            return full[..., :rows].swapaxes(-1, -2)  # a transposed view
        a, b = make(m, k), make(k, n)
        p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
        if isinstance(p, tuple):
            a, b = (np.ascontiguousarray(a), b) if p[1] == "a" else (a, np.ascontiguousarray(b))
            p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
        if isinstance(p, tuple):
            a, b = (np.ascontiguousarray(a), b) if p[1] == "a" else (a, np.ascontiguousarray(b))
            p = gemm.plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
        assert isinstance(p, gemm.Plan), (a.shape, a.strides, b.shape, b.strides)
        np.testing.assert_allclose(run_plan(p, a, b), a @ b, rtol=1e-5, atol=1e-5)


def test_matrix_layout_rejects_what_cublas_cannot_read():
    assert gemm.matrix_layout(4, 3, 3, 1) == (gemm.OP_N, 3)
    assert gemm.matrix_layout(4, 3, 1, 4) == (gemm.OP_T, 4)
    assert gemm.matrix_layout(4, 3, 6, 2) is None           # every other column
    assert gemm.matrix_layout(4, 3, -3, 1) is None          # reversed rows
    assert gemm.matrix_layout(4, 3, 0, 1) is None           # broadcast rows


# ----- on a GPU ---------------------------------------------------------------------------

def _bf16_on_gpu():
    dtype = amp.bfloat16_dtype()
    if cp is None or dtype is None:
        return None
    try:
        cp.zeros(2, dtype=dtype) + cp.ones(2, dtype=dtype)
    except Exception:
        return None
    return dtype


GPU_KINDS = ["float32", "float16"] + (["bfloat16"] if _bf16_on_gpu() is not None else [])


def to_gpu(x, kind):
    """float32 NumPy values -> a CuPy array of ``kind`` (real bfloat16 via ml_dtypes)."""
    if kind == "bfloat16":
        return cp.asarray(np.asarray(x, np.float32)).astype(_bf16_on_gpu())
    return cp.asarray(np.asarray(x, np.float32).astype(kind))


def from_gpu(a):
    return cp.asnumpy(a.astype(np.float32))


@gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_fused_kernels_match_numpy(kind):
    x = rounded(rng.standard_normal((4, 9, 64)) * 2, kind)
    g = rounded(rng.standard_normal(x.shape), kind)
    for log in (False, True):
        t = Tensor(x, requires_grad=True)
        ref = t.log_softmax(-1) if log else t.softmax(-1)
        ref.backward(g)
        y = kernels.softmax_forward(to_gpu(x, kind), log=log)
        np.testing.assert_allclose(from_gpu(y), ref.data, **TOL[kind])
        dx = kernels.softmax_backward(y, to_gpu(g, kind), log=log)
        np.testing.assert_allclose(from_gpu(dx), t.grad, **TOL[kind])
    w = Tensor(rng.standard_normal(64).astype(np.float32), requires_grad=True)
    b = Tensor(rng.standard_normal(64).astype(np.float32), requires_grad=True)
    t = Tensor(x, requires_grad=True)
    ref = F.layer_norm(t, w, b)
    ref.backward(g)
    y, xh, rstd = kernels.layer_norm_forward(to_gpu(x, kind), cp.asarray(w.data),
                                             cp.asarray(b.data))
    np.testing.assert_allclose(from_gpu(y), ref.data, **TOL[kind])
    dx, dw, db = kernels.layer_norm_backward(cp.asarray(g), xh, rstd, cp.asarray(w.data))
    np.testing.assert_allclose(from_gpu(dx), t.grad, **TOL[kind])
    np.testing.assert_allclose(from_gpu(dw), w.grad, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(from_gpu(db), b.grad, rtol=1e-4, atol=1e-3)
    logits = rounded(rng.standard_normal((50, 1000)) * 3, kind)
    target = rng.integers(0, 1000, 50)
    target[3] = 0
    t = Tensor(logits, requires_grad=True)
    ref = F.cross_entropy(t, target, label_smoothing=0.1, ignore_index=0, reduction="none")
    ref.backward(np.ones(50, np.float32))
    loss, dl, wts = kernels.cross_entropy_forward(to_gpu(logits, kind), cp.asarray(target), 0.1, 0)
    np.testing.assert_allclose(cp.asnumpy(loss), ref.data, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(from_gpu(dl) * cp.asnumpy(wts)[:, None], t.grad, **TOL[kind])
    u = rng.random(x.shape, dtype=np.float32)
    out, mask = kernels.dropout_forward(to_gpu(x, kind), 0.1, uniform=cp.asarray(u))
    np.testing.assert_allclose(from_gpu(out), x * (u >= 0.1) / np.float32(0.9), **TOL[kind])
    y = kernels.relu_forward(to_gpu(x, kind))
    np.testing.assert_array_equal(from_gpu(y), np.maximum(x, 0))
    y, bias = to_gpu(x, kind), rng.standard_normal(64).astype(np.float32)
    kernels.add_bias_(y, cp.asarray(bias))
    np.testing.assert_allclose(from_gpu(y), rounded(x + bias, kind), **TOL[kind])
    y = to_gpu(x, kind)
    kernels.add_bias_(y, cp.asarray(bias), relu=True)
    np.testing.assert_allclose(from_gpu(y), np.maximum(rounded(x + bias, kind), 0), **TOL[kind])


@gpu
def test_gpu_adam_and_unscale_match():
    p0 = rng.standard_normal(1000).astype(np.float32)
    ref = tinytf.nn.Parameter(p0.copy())
    opt = Adam([ref], lr=1e-3)
    p, m, v = cp.asarray(p0), cp.zeros(1000, cp.float32), cp.zeros(1000, cp.float32)
    for step in range(1, 4):
        g = rng.standard_normal(1000).astype(np.float32)
        ref.grad = g
        opt.step()
        gg = cp.asarray(g)
        assert int(kernels.unscale_([gg], 1.0)[0]) == 0
        kernels.adam_step(p, gg, m, v, lr=1e-3, betas=opt.betas, eps=opt.eps, step=step)
    np.testing.assert_allclose(cp.asnumpy(p), ref.data, rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("mode", ["float32", "tf32", "float16"] +
                         (["bfloat16"] if _bf16_on_gpu() is not None else []))
def test_gpu_cublas_matmul_matches_numpy(mode):
    kind = "float32" if mode == "tf32" else mode
    tol = {"float32": 1e-5, "tf32": 3e-3, "float16": 3e-3, "bfloat16": 2e-2}[mode]
    kernels.set_tf32(mode == "tf32")
    try:
        for name, (a, b) in _layouts().items():
            a, b = rounded(a, kind), rounded(b, kind)
            ga, gb = to_gpu(np.ascontiguousarray(a), kind), to_gpu(np.ascontiguousarray(b), kind)
            # Rebuild the same views on the GPU where the layout is a plain transpose.
            got = from_gpu(kernels.matmul(ga, gb))
            want = a.astype(np.float64) @ b.astype(np.float64)
            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            assert err < tol, (name, err)
        big_a, big_b = rng.standard_normal((256, 512)), rng.standard_normal((384, 512))
        got = from_gpu(kernels.matmul(to_gpu(big_a, kind), to_gpu(big_b, kind).T))
        want = rounded(big_a, kind).astype(np.float64) @ rounded(big_b, kind).astype(np.float64).T
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
        # alpha inside the cuBLAS call (attention's 1/sqrt(d_k)), 2-D and batched.
        got = from_gpu(kernels.matmul(to_gpu(big_a, kind), to_gpu(big_b, kind).T, alpha=0.125))
        assert np.linalg.norm(got - want * 0.125) / np.linalg.norm(want * 0.125) < tol
        qa = rounded(rng.standard_normal((2, 3, 5, 8)), kind)
        ka = rounded(rng.standard_normal((2, 3, 7, 8)), kind)
        got = from_gpu(kernels.matmul(to_gpu(qa, kind), to_gpu(ka, kind).swapaxes(-1, -2),
                                      alpha=0.5))
        want = 0.5 * (qa.astype(np.float64) @ ka.astype(np.float64).swapaxes(-1, -2))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    finally:
        kernels.set_tf32(False)


@gpu
@pytest.mark.parametrize("kind", ["float16"] + (["bfloat16"] if _bf16_on_gpu() is not None
                                                else []))
def test_gpu_cublas_float32_result_of_16_bit_operands(kind):
    # How Linear forms a float32 weight gradient from 16-bit operands: cuBLAS writes the
    # float32 accumulators (C type float32), more accurate than the 16-bit product.
    a = rounded(rng.standard_normal((300, 64)), kind)
    b = rounded(rng.standard_normal((300, 48)), kind)
    want = a.T.astype(np.float64) @ b.astype(np.float64)
    got = kernels.matmul(to_gpu(a, kind).T, to_gpu(b, kind), out_dtype=np.float32)
    assert got.dtype == np.float32
    err32 = np.abs(cp.asnumpy(got) - want).max()
    err16 = np.abs(from_gpu(kernels.matmul(to_gpu(a, kind).T, to_gpu(b, kind))) - want).max()
    assert err32 < 1e-3 < err16
    for shape_a, shape_b in (((3, 5, 8), (3, 8, 4)), ((7, 8), (8, 4))):   # batched and 2-D
        x = rounded(rng.standard_normal(shape_a), kind)
        y = rounded(rng.standard_normal(shape_b), kind)
        got = kernels.matmul(to_gpu(x, kind), to_gpu(y, kind), out_dtype=np.float32)
        np.testing.assert_allclose(cp.asnumpy(got), x.astype(np.float64) @ y, rtol=1e-5, atol=1e-5)


def _op_cases():
    """(name, f(d, *Tensors) -> Tensor, input arrays) for every op in tinytf.ops.

    ``d`` puts an auxiliary array (ids, masks, conditions) on the device under test.
    """
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    pos = lambda *s: (rng.random(s) + 0.5).astype(np.float32)  # noqa: E731
    ids = rng.integers(0, 10, (3, 4))
    mask = rng.random((2, 1, 5, 5)) > 0.3
    causal = np.tril(np.ones((5, 5), bool))[None, None]
    cond = np.arange(6).reshape(2, 3) % 2 == 0
    target = np.array([1, 0, 3, 0])
    qkv = [r(2, 2, 5, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)]
    return [
        ("add", lambda d, a, b: a + b, [r(3, 4), r(4)]),
        ("mul", lambda d, a, b: a * b, [r(3, 4), r(3, 1)]),
        ("neg/sub", lambda d, a, b: a - b, [r(3, 4), r(3, 4)]),
        ("div", lambda d, a, b: a / b, [r(3, 4), pos(3, 4)]),
        ("pow", lambda d, a: a ** 3, [r(3, 4)]),
        ("exp", lambda d, a: a.exp(), [r(3, 4)]),
        ("log", lambda d, a: a.log(), [pos(3, 4)]),
        ("sqrt", lambda d, a: a.sqrt(), [pos(3, 4)]),
        ("tanh", lambda d, a: a.tanh(), [r(3, 4)]),
        ("relu", lambda d, a: a.relu(), [r(3, 4) + 0.05]),
        ("cast", lambda d, a: a.astype(np.float16).astype(np.float32) * 2, [r(3, 4)]),
        ("sum", lambda d, a: a.sum(axis=1), [r(3, 4, 2)]),
        ("mean", lambda d, a: a.mean(axis=(0, 2), keepdims=True), [r(3, 4, 2)]),
        ("max", lambda d, a: a.max(axis=-1), [r(3, 7)]),
        ("reshape/transpose", lambda d, a: a.reshape(4, 6).T.permute(1, 0) * 1.0, [r(2, 3, 4)]),
        ("getitem", lambda d, a: a[1:, ::2] * 2, [r(4, 6)]),
        ("getitem ints", lambda d, a: a[d(np.array([0, 2, 2]))], [r(4, 6)]),
        ("split", lambda d, a: tinytf.cat([p * float(i + 1) for i, p in
                                           enumerate(F.split(a, [1, 3, 2], axis=1))], axis=1),
         [r(3, 6)]),
        ("split_heads", lambda d, a: tinytf.cat([p * float(i + 1) for i, p in
                                                 enumerate(F.split_heads(a, 2, parts=3))], axis=3),
         [r(2, 5, 12)]),
        ("merge_heads", lambda d, a: F.merge_heads(a * 1.0) * 2.0, [r(2, 3, 5, 4)]),
        ("cat", lambda d, a, b: tinytf.cat([a, b], axis=1), [r(2, 3), r(2, 5)]),
        ("stack", lambda d, a, b: tinytf.stack([a, b], axis=0), [r(2, 3), r(2, 3)]),
        ("where", lambda d, a, b: tinytf.where(d(cond), a, b), [r(2, 3), r(2, 3)]),
        ("masked_fill", lambda d, a: a.masked_fill(d(np.eye(3, dtype=bool)), -1.0), [r(3, 3)]),
        ("matmul", lambda d, a, b: a @ b, [r(2, 3, 4), r(4, 5)]),
        ("linear", lambda d, x, w, b: F.linear(x, w, b), [r(2, 3, 4), r(5, 4), r(5)]),
        ("softmax", lambda d, a: a.softmax(-1), [r(3, 8)]),
        ("log_softmax", lambda d, a: a.log_softmax(0), [r(3, 8)]),
        ("layer_norm", lambda d, x, w, b: F.layer_norm(x, w, b), [r(2, 3, 16), r(16), r(16)]),
        ("embedding", lambda d, w: F.embedding(d(ids), w), [r(10, 6)]),
        ("cross_entropy", lambda d, a: F.cross_entropy(a, d(target), label_smoothing=0.1,
                                                       ignore_index=0), [r(4, 6)]),
        ("attention", lambda d, q, k, v: F.attention(q, k, v, mask=d(mask)), qkv),
        ("attention causal", lambda d, q, k, v: F.attention(q, k, v, mask=d(causal)), qkv),
    ]


@gpu
@pytest.mark.parametrize("case", _op_cases(), ids=lambda c: c[0])
def test_gpu_every_op_forward_backward_equals_numpy(case):
    _, fn, arrays = case
    outs = {}
    for device in ("cpu", "gpu"):
        ts = [Tensor(tinytf.backend.to_device(a, device), requires_grad=True) for a in arrays]
        y = fn(lambda aux: tinytf.engine.backend.to_device(aux, device), *ts)
        g = np.random.default_rng(5).standard_normal(y.shape).astype(y.dtype)
        y.backward(tinytf.engine.backend.to_device(g, device))
        outs[device] = (y.numpy(), [tinytf.engine.backend.to_numpy(t.grad) for t in ts])
    (y_cpu, g_cpu), (y_gpu, g_gpu) = outs["cpu"], outs["gpu"]
    np.testing.assert_allclose(y_gpu, y_cpu, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_gpu, g_cpu):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_dropout_add_of_a_16_bit_sublayer(kind):
    x = rounded(rng.standard_normal((64, 96)), kind)
    res = rng.standard_normal((64, 96)).astype(np.float32)
    u = rng.random(x.shape, dtype=np.float32)
    out, mask = kernels.dropout_forward(to_gpu(x, kind), 0.1, cp.asarray(res),
                                        uniform=cp.asarray(u))
    assert out.dtype == np.float32
    ref_mask = rounded((u >= 0.1).astype(np.float32) * np.float32(1 / 0.9), kind)  # in x's dtype
    ref = rounded(x * ref_mask, kind) + res
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-6, atol=1e-6)
    t = Tensor(to_gpu(x, kind), requires_grad=True)
    r = Tensor(cp.asarray(res), requires_grad=True)
    y = F.dropout_add(t, r, 0.1)
    y.backward(cp.ones(y.shape, dtype=y.dtype))
    assert y.dtype == np.float32 and t.grad.dtype == t.dtype and r.grad.dtype == np.float32
    kept = cp.asnumpy((y.data - r.data) != 0)
    np.testing.assert_allclose(from_gpu(t.grad), kept / np.float32(0.9), rtol=1e-2)


@gpu
def test_gpu_dropout_is_consistent():
    x = Tensor(cp.asarray(rng.standard_normal((64, 64)).astype(np.float32)), requires_grad=True)
    y = F.dropout(x, 0.25, training=True)
    y.backward(cp.ones_like(y.data))
    kept = cp.asnumpy(y.data != 0)
    assert 0.65 < kept.mean() < 0.85
    np.testing.assert_allclose(cp.asnumpy(x.grad), kept / np.float32(0.75), rtol=1e-6)
