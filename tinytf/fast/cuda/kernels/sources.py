"""CUDA C source of tinytf's fused GPU kernels, as one string compiled once by NVRTC.

Nothing here imports CuPy: the source is plain text, so the CPU test suite can compile
it with NVRTC alone (no GPU needed) and :mod:`tinytf.fast.cuda.kernels` hands it to
``cupy.RawModule`` the first time a CuPy array asks for a fused kernel.

Design, for a reader coming from the reference ops in :mod:`tinytf.ops`:

- **Optional pointers are passed as ``unsigned long long`` addresses** (0 = absent), so
  the Python side passes a plain ``numpy.uint64``.
- **No CUDA headers.** 16-bit values are stored as raw bits (``bf16_t``, ``f16_t``) and
  converted with a few lines of bit arithmetic / one PTX instruction each, so the source
  compiles with a bare NVRTC (no include path) and the bf16 rounding below is the same
  round-to-nearest-even that :func:`tinytf.nn.cast.round_to_bf16` emulates on NumPy.
- **Arithmetic is float32** whatever the storage type: every kernel loads with
  ``to_f32``, computes, and stores with ``from_f32<T>``.
- **One warp per row** for the row-wise ops (softmax, layer norm, cross-entropy): rows
  here are 32..40k long, and a warp reduces with shuffles alone (no shared memory, no
  ``__syncthreads``). Blocks hold ``ROWS_PER_BLOCK`` warps.
- ``TINYTF_HOST_EMULATION`` swaps the two float16 PTX instructions for C++ ``_Float16``
  so that tests can build this very source with g++ and run it on the CPU
  (:mod:`tinytf.fast.cuda.kernels.host`); nothing else differs.
- Each kernel follows the float32 formula of the NumPy op it replaces, in the same order,
  so the two agree to float32 rounding (tests/fast/test_kernels.py checks it on a GPU).
"""

ROWS_PER_BLOCK = 8          # warps (rows) per block of 256 threads in the row-wise kernels
ELEMENTWISE_THREADS = 256   # threads per block of the grid-stride elementwise kernels

SOURCE = r"""
// ---------------------------------------------------------------------------------
// Storage types and conversions (header-free: bits in, float out).
// ---------------------------------------------------------------------------------
struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);   // bf16 is float32's top half
}
__device__ __forceinline__ float to_f32(f16_t x) {
#ifdef TINYTF_HOST_EMULATION
    _Float16 h;
    memcpy(&h, &x.bits, 2);
    return (float)h;
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {          // NaN: keep it a (quiet) NaN
        r.bits = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);                  // round to nearest, ties to even
    r.bits = (unsigned short)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
    f16_t r;
#ifdef TINYTF_HOST_EMULATION
    _Float16 h = (_Float16)x;                          // round to nearest even, as cvt.rn
    memcpy(&r.bits, &h, 2);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
#endif
    return r;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ bool not_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// ---------------------------------------------------------------------------------
// Warp reductions: after the loop every lane holds the result.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// The row this warp owns (blocks of ROWS_PER_BLOCK warps), and the lane in it.
// Counter-based random numbers (dropout): uniform(key, i) is a hash of (key, i), so each
// element draws its own number with no generator state and no separate launch, and a
// captured CUDA graph draws new numbers when the key in device memory changes.
// SplitMix64 (Steele, Lea & Flood 2014) finaliser; 24 bits make a float in [0, 1).
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float uniform_at(unsigned long long key, unsigned long long i) {
    return (float)(splitmix64(key + i) >> 40) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ long long warp_row() {
    return (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

// ---------------------------------------------------------------------------------
// Softmax / log-softmax over contiguous rows of length n, optional boolean mask.
// y = exp(x - max) / sum(exp(x - max));  log: y = (x - max) - log(sum(exp(x - max))).
// The mask (True = keep) is indexed like a 4-D array broadcast against the rows:
// row r = (b, h, q) with r = (b * mH + h) * mQ + q, element k at
// b*sb + h*sh + q*sq + k*sk (stride 0 on a broadcast axis). A masked element gets
// weight exactly 0; a row with every element masked is uniform (1/n), which is what
// the NumPy op's "fill with the most negative finite value" gives.
// ---------------------------------------------------------------------------------
template <typename T>
__global__ void softmax_fwd(const T* __restrict__ x, T* __restrict__ y, long long rows, int n,
                            unsigned long long mask_addr, long long mH, long long mQ,
                            long long sb, long long sh, long long sq, long long sk, int log_out) {
    long long row = warp_row();
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * n;
    T* yr = y + row * n;
    const unsigned char* mask = (const unsigned char*)mask_addr;
    const unsigned char* mr = 0;
    if (mask) {
        long long b = row / (mH * mQ), h = (row / mQ) % mH, q = row % mQ;
        mr = mask + b * sb + h * sh + q * sq;
    }
    float m = neg_inf();
    for (int k = lane; k < n; k += 32)
        if (!mr || mr[k * sk]) m = fmaxf(m, to_f32(xr[k]));
    m = warp_max(m);
    if (m == neg_inf()) {                       // everything masked: uniform weights
        float u = log_out ? -logf((float)n) : 1.0f / (float)n;
        for (int k = lane; k < n; k += 32) yr[k] = from_f32<T>(u);
        return;
    }
    float s = 0.0f;
    for (int k = lane; k < n; k += 32)
        if (!mr || mr[k * sk]) s += expf(to_f32(xr[k]) - m);
    s = warp_sum(s);
    if (log_out) {
        float log_s = logf(s);
        for (int k = lane; k < n; k += 32) yr[k] = from_f32<T>((to_f32(xr[k]) - m) - log_s);
    } else {
        for (int k = lane; k < n; k += 32) {
            bool keep = !mr || mr[k * sk];
            yr[k] = from_f32<T>(keep ? expf(to_f32(xr[k]) - m) / s : 0.0f);
        }
    }
}

// softmax:     dx = y * (g - sum(g * y))
// log-softmax: dx = g - exp(y) * sum(g)
template <typename T>
__global__ void softmax_bwd(const T* __restrict__ y, const T* __restrict__ g, T* __restrict__ dx,
                            long long rows, int n, unsigned long long mask_addr, long long mH,
                            long long mQ, long long sb, long long sh, long long sq, long long sk,
                            int log_out) {
    long long row = warp_row();
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* yr = y + row * n;
    const T* gr = g + row * n;
    T* dr = dx + row * n;
    // The forward's mask (optional): masked scores were constants, so their gradient is 0
    // (it matters in a fully masked row, whose weights are uniform, not 0).
    const unsigned char* mask = (const unsigned char*)mask_addr;
    const unsigned char* mr = 0;
    if (mask) {
        long long b = row / (mH * mQ), h = (row / mQ) % mH, q = row % mQ;
        mr = mask + b * sb + h * sh + q * sq;
    }
    float s = 0.0f;
    for (int k = lane; k < n; k += 32)
        s += log_out ? to_f32(gr[k]) : to_f32(gr[k]) * to_f32(yr[k]);
    s = warp_sum(s);
    for (int k = lane; k < n; k += 32) {
        float yk = to_f32(yr[k]), gk = to_f32(gr[k]);
        float d = log_out ? gk - expf(yk) * s : yk * (gk - s);
        dr[k] = from_f32<T>(mr && !mr[k * sk] ? 0.0f : d);
    }
}

// ---------------------------------------------------------------------------------
// Layer norm over contiguous rows of length d (biased variance, eps inside the sqrt).
// mean = sum(x)/d; var = sum((x - mean)^2)/d (two passes, as NumPy); rstd = 1/sqrt(var+eps)
// x_hat = (x - mean) * rstd; y = x_hat * w + b.  w, b: float32 or null.
// ---------------------------------------------------------------------------------
template <typename TX, typename TY>
__global__ void layer_norm_fwd(const TX* __restrict__ x, unsigned long long w_addr,
                               unsigned long long b_addr, TY* __restrict__ y,
                               TY* __restrict__ x_hat, float* __restrict__ rstd,
                               long long rows, int d, float eps) {
    long long row = warp_row();
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* w = (const float*)w_addr;
    const float* b = (const float*)b_addr;
    const TX* xr = x + row * d;
    float s = 0.0f;
    for (int k = lane; k < d; k += 32) s += to_f32(xr[k]);
    float mean = warp_sum(s) / (float)d;
    float ss = 0.0f;
    for (int k = lane; k < d; k += 32) {
        float c = to_f32(xr[k]) - mean;
        ss += c * c;
    }
    float r = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
    for (int k = lane; k < d; k += 32) {
        float h = (to_f32(xr[k]) - mean) * r;
        x_hat[row * d + k] = from_f32<TY>(h);
        float out = w ? h * w[k] : h;
        if (b) out += b[k];
        y[row * d + k] = from_f32<TY>(out);
    }
    if (lane == 0) rstd[row] = r;
}

// dx = rstd * (dxh - mean(dxh) - x_hat * mean(dxh * x_hat)),  dxh = g * w.
template <typename T>
__global__ void layer_norm_bwd(const T* __restrict__ g, const T* __restrict__ x_hat,
                               const float* __restrict__ rstd, unsigned long long w_addr,
                               T* __restrict__ dx, long long rows, int d) {
    long long row = warp_row();
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* w = (const float*)w_addr;
    const T* gr = g + row * d;
    const T* hr = x_hat + row * d;
    float s1 = 0.0f, s2 = 0.0f;
    for (int k = lane; k < d; k += 32) {
        float dxh = w ? to_f32(gr[k]) * w[k] : to_f32(gr[k]);
        s1 += dxh;
        s2 += dxh * to_f32(hr[k]);
    }
    float mean1 = warp_sum(s1) / (float)d, mean2 = warp_sum(s2) / (float)d;
    float r = rstd[row];
    for (int k = lane; k < d; k += 32) {
        float dxh = w ? to_f32(gr[k]) * w[k] : to_f32(gr[k]);
        dx[row * d + k] = from_f32<T>((dxh - mean1 - to_f32(hr[k]) * mean2) * r);
    }
}

// Column sums for the layer-norm parameter gradients, first stage:
// dw_part[c, j] = sum over rows i of chunk c of g[i, j] * x_hat[i, j]; db_part likewise of g.
// Block (32, 8) covers 32 columns x `chunk` rows; column_sums_finish sums the partials over c.
template <typename T>
__global__ void column_sums(const T* __restrict__ g, unsigned long long x_hat_addr,
                            unsigned long long dw_part_addr, float* __restrict__ db_part,
                            long long rows, int d, int chunk) {
    float* dw_part = (float*)dw_part_addr;  // 0 (no x_hat): only the sums of g
    __shared__ float sw[8][33];
    __shared__ float sb[8][33];
    const T* x_hat = (const T*)x_hat_addr;
    int col = blockIdx.x * 32 + threadIdx.x;
    long long start = (long long)blockIdx.y * chunk;
    long long stop = start + chunk < rows ? start + chunk : rows;
    float aw = 0.0f, ab = 0.0f;
    if (col < d) {
        for (long long i = start + threadIdx.y; i < stop; i += 8) {
            float gv = to_f32(g[i * d + col]);
            ab += gv;
            if (x_hat) aw += gv * to_f32(x_hat[i * d + col]);
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && col < d) {
        for (int j = 1; j < 8; ++j) {
            aw += sw[j][threadIdx.x];
            ab += sb[j][threadIdx.x];
        }
        if (dw_part) dw_part[(long long)blockIdx.y * d + col] = aw;
        db_part[(long long)blockIdx.y * d + col] = ab;
    }
}

// Second stage of column_sums: out[j] = sum over chunks c of part[c, j], in chunk order
// (deterministic), for db and, when given, dw; stored as T (the gradient's dtype).
template <typename T>
__global__ void column_sums_finish(unsigned long long dw_part_addr, const float* __restrict__ db_part,
                                   int chunks, int d, unsigned long long dw_out_addr,
                                   T* __restrict__ db_out) {
    const float* dw_part = (const float*)dw_part_addr;
    T* dw_out = (T*)dw_out_addr;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < d; j += gridDim.x * blockDim.x) {
        float aw = 0.0f, ab = 0.0f;
        for (int c = 0; c < chunks; ++c) {
            ab += db_part[(long long)c * d + j];
            if (dw_part) aw += dw_part[(long long)c * d + j];
        }
        db_out[j] = from_f32<T>(ab);
        if (dw_out) dw_out[j] = from_f32<T>(aw);
    }
}

// ---------------------------------------------------------------------------------
// Dropout (+ residual): mask = (u >= p) / (1 - p), rounded to T as NumPy's
// keep.astype(T) * scale is; out = x * mask (+ residual). One pass instead of four.
// ---------------------------------------------------------------------------------
template <typename T, typename TR>
__global__ void dropout_fwd(const T* __restrict__ x, unsigned long long u_addr,
                            const unsigned long long* __restrict__ seed, long long offset,
                            unsigned long long residual_addr, TR* __restrict__ out,
                            T* __restrict__ mask, long long n, float p, float scale) {
    const float* u = (const float*)u_addr;   // given numbers (tests), or 0: draw them here
    const TR* residual = (const TR*)residual_addr;
    const unsigned long long key = splitmix64(seed[0]) + (unsigned long long)offset;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float ui = u ? u[i] : uniform_at(key, (unsigned long long)i);
        float m = to_f32(from_f32<T>(ui >= p ? scale : 0.0f));
        mask[i] = from_f32<T>(m);
        float v = to_f32(from_f32<T>(to_f32(x[i]) * m));   // x * mask in x's dtype
        if (residual) v += to_f32(residual[i]);           // + residual, in out's dtype TR
        out[i] = from_f32<TR>(v);
    }
}

// Dropout's backward: dx = g * mask, stored in the mask's (= x's) dtype TM: a float32
// gradient from the residual stream and a bf16 mask give the bf16 dx NumPy's g * mask
// followed by the cast to x's dtype would, in one launch.
template <typename TG, typename TM>
__global__ void dropout_bwd(const TG* __restrict__ g, const TM* __restrict__ mask,
                            TM* __restrict__ dx, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dx[i] = from_f32<TM>(to_f32(g[i]) * to_f32(mask[i]));
}

// ---------------------------------------------------------------------------------
// Label-smoothed cross-entropy, one warp per row of logits (N, V):
// loss = -(1 - eps) * logp[t] - (eps / V) * sum_j logp[j]   (0 for an ignored row)
// dlogits = softmax - eps / V - (1 - eps) * onehot(t)       (not yet scaled, as the op)
// A target outside [0, V) gives a NaN loss instead of reading out of bounds.
// ---------------------------------------------------------------------------------
template <typename T>
__global__ void xent_fwd(const T* __restrict__ logits, const long long* __restrict__ target,
                         float* __restrict__ loss, T* __restrict__ dlogits,
                         float* __restrict__ weight,
                         long long rows, int v, float eps, long long ignore_index, int has_ignore) {
    long long row = warp_row();
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = logits + row * (long long)v;
    long long t = target[row];
    bool valid = !(has_ignore && t == ignore_index);
    long long ts = valid ? t : 0;                     // the op's "safe target"
    bool in_range = ts >= 0 && ts < v;
    float m = neg_inf();
    for (int k = lane; k < v; k += 32) m = fmaxf(m, to_f32(xr[k]));
    m = warp_max(m);
    float s = 0.0f, sx = 0.0f;
    for (int k = lane; k < v; k += 32) {
        float z = to_f32(xr[k]) - m;
        s += expf(z);
        sx += z;
    }
    s = warp_sum(s);
    sx = warp_sum(sx);
    float log_s = logf(s);
    if (lane == 0) {
        float w = valid ? 1.0f : 0.0f;
        float l;
        if (in_range) {
            float logp_t = (to_f32(xr[ts]) - m) - log_s;
            l = -(1.0f - eps) * logp_t;
            if (eps != 0.0f) l -= (eps / (float)v) * (sx - (float)v * log_s);
        } else {
            l = __int_as_float(0x7fc00000);            // NaN marks a bad target id
        }
        loss[row] = l * w;
        weight[row] = w;
    }
    float off = eps / (float)v;
    for (int k = lane; k < v; k += 32) {
        float p = expf(to_f32(xr[k]) - m) / s - off;
        if (k == ts) p -= 1.0f - eps;
        dlogits[row * (long long)v + k] = from_f32<T>(p);
    }
}

// ---------------------------------------------------------------------------------
// ReLU (+ bias): y = max(x + b[col], 0) over rows of length n; backward g * (y > 0);
// a bias alone, in place.
// ---------------------------------------------------------------------------------
template <typename T>
__global__ void bias_relu_fwd(const T* __restrict__ x, unsigned long long bias_addr,
                              T* __restrict__ y, long long total, int n) {
    const float* bias = (const float*)bias_addr;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float v = to_f32(x[i]);
        if (bias) v = to_f32(from_f32<T>(v + bias[i % n]));   // x + b is rounded to T first
        y[i] = from_f32<T>(v <= 0.0f ? 0.0f : v);       // NaN stays NaN, as in NumPy
    }
}

// y += b[col] in place (a linear layer's bias, float32, added to its T output), then
// max(y, 0) when relu is set (a linear layer with a ReLU: max of the rounded sum and 0,
// which is the rounded max, so this equals add_bias followed by relu).
template <typename T>
__global__ void add_bias(T* __restrict__ y, const float* __restrict__ bias, long long total,
                         int n, int relu) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float v = to_f32(y[i]) + bias[i % n];
        y[i] = from_f32<T>(relu && v <= 0.0f ? 0.0f : v);   // NaN stays NaN, as in NumPy
    }
}

template <typename T>
__global__ void relu_bwd(const T* __restrict__ y, const T* __restrict__ g, T* __restrict__ dx,
                         long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dx[i] = to_f32(y[i]) > 0.0f ? g[i] : from_f32<T>(0.0f);
}

// ---------------------------------------------------------------------------------
// Mixed precision: scale gradients in place and flag any inf/NaN (seen before scaling).
// ---------------------------------------------------------------------------------
template <typename T>
__global__ void unscale_check(T* __restrict__ g, long long n, float scale,
                              int* __restrict__ found_inf) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = to_f32(g[i]);
        if (not_finite(v)) *found_inf = 1;           // a benign race: every writer writes 1
        g[i] = from_f32<T>(v * scale);
    }
}

// ---------------------------------------------------------------------------------
// Adam on float32 master weights and moments, gradient of any storage type, as
// tinytf.optim.adam.Adam: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= step_size * m / (sqrt(v) / sqrt(1 - b2^t) + eps), step_size = lr / (1 - b1^t).
// g is multiplied by grad_scale first; nothing changes when *found_inf is set, so a
// skipped fp16 step needs no host round trip.
// ---------------------------------------------------------------------------------
template <typename G>
__global__ void adam_step(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                          float* __restrict__ v, long long n, float step_size, float b1, float b2,
                          float inv_bias2_sqrt, float eps, float grad_scale,
                          unsigned long long found_inf_addr) {
    const int* found_inf = (const int*)found_inf_addr;
    if (found_inf && *found_inf) return;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float gi = to_f32(g[i]) * grad_scale;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) * inv_bias2_sqrt + eps;
        p[i] -= (mi / denom) * step_size;
    }
}
"""

STORAGE = ("float", "bf16_t", "f16_t")   # C++ names of float32, bfloat16, float16 storage

# Every instantiation the Python side launches ("name<types>", as NVRTC's name expressions).
INSTANTIATIONS = (
    [f"softmax_fwd<{t}>" for t in STORAGE]
    + [f"softmax_bwd<{t}>" for t in STORAGE]
    + [f"layer_norm_fwd<{tx}, {ty}>" for tx in STORAGE for ty in STORAGE]
    + [f"layer_norm_bwd<{t}>" for t in STORAGE]
    + [f"column_sums<{t}>" for t in STORAGE]
    + [f"column_sums_finish<{t}>" for t in STORAGE]
    + [f"dropout_fwd<{t}, {tr}>" for t in STORAGE for tr in STORAGE]
    + [f"dropout_bwd<{tg}, {tm}>" for tg in STORAGE for tm in STORAGE]
    + [f"xent_fwd<{t}>" for t in STORAGE]
    + [f"bias_relu_fwd<{t}>" for t in STORAGE]
    + [f"add_bias<{t}>" for t in STORAGE]
    + [f"relu_bwd<{t}>" for t in STORAGE]
    + [f"unscale_check<{t}>" for t in STORAGE]
    + [f"adam_step<{t}>" for t in STORAGE]
)

# Options for NVRTC. No include path: the source needs no header.
NVRTC_OPTIONS = ("-std=c++14",)
