// RMSNorm over rows: y[t,j] = x[t,j] * r[t] * w[j], r[t] = 1 / sqrt(mean_j x[t,j]^2 + eps).
//
// Kernels
//   rmsnorm_forward_{f32,bf16}      one 256-thread block per row
//   rmsnorm_backward_dx_{f32,bf16}  one block per row: dx and r[t] (saved for dw)
//   rmsnorm_backward_dw_partial_{f32,bf16}  dw partial sums over fixed 64-row chunks
//   rmsnorm_backward_dw_reduce      sums the chunk partials in ascending chunk order
//
// Inputs are F32 or BF16 (widened exactly on load); all math and every output is f32.
// Determinism: no atomics anywhere. dw is a reduction over T; instead of atomically adding each
// row's contribution (order depends on scheduling), each (chunk, column) partial is summed over
// its rows in ascending order by one thread, and a second pass adds the chunks in ascending
// order. Batch invariance: a row's reduction order depends only on d and the fixed block size,
// never on T or on where the row sits.
// r uses 1 / sqrtf (both IEEE correctly rounded) rather than rsqrtf (approximate), so it is the
// same float on every device for the same sum of squares.

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace rmsnorm_impl {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
// Rows per dw partial. Fixed (not derived from T or the grid) so the summation order of dw
// depends only on T; the CPU reference uses the same chunking.
constexpr int DW_CHUNK_ROWS = 64;

using sluice::load;
using sluice::block_sum;


template <typename T>
__device__ __forceinline__ void forward_row(const T* __restrict__ x, const T* __restrict__ w,
                                            float* __restrict__ y, int d, float eps) {
    __shared__ float scratch[WARPS];
    const long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += THREADS) {
        const float v = load(x, base + j);
        ss += v * v;
    }
    ss = block_sum<WARPS>(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += THREADS) y[base + j] = load(x, base + j) * r * load(w, j);
}

// dx[j] = r * dy[j] * w[j] - x[j] * (r^3 / d) * sum_k dy[k] * w[k] * x[k]
template <typename T>
__device__ __forceinline__ void backward_dx_row(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ dy, float* __restrict__ dx,
                                                float* __restrict__ rstd, int d, float eps) {
    __shared__ float scratch[WARPS];
    const long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < d; j += THREADS) {
        const float xv = load(x, base + j);
        ss += xv * xv;
        dot += load(dy, base + j) * load(w, j) * xv;
    }
    ss = block_sum<WARPS>(ss, scratch);
    dot = block_sum<WARPS>(dot, scratch);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    const float c = dot * r * r * r / (float)d;
    for (int j = threadIdx.x; j < d; j += THREADS) {
        const float g = load(dy, base + j) * load(w, j);
        dx[base + j] = r * g - c * load(x, base + j);
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// partial[chunk, j] = sum over the chunk's rows t, ascending, of dy[t,j] * x[t,j] * r[t].
// grid: (number of chunks, ceil(d / THREADS)); one thread per column of one chunk.
template <typename T>
__device__ __forceinline__ void backward_dw_partial(const T* __restrict__ x,
                                                    const T* __restrict__ dy,
                                                    const float* __restrict__ rstd,
                                                    float* __restrict__ partial, int rows, int d) {
    const int j = blockIdx.y * THREADS + threadIdx.x;
    if (j >= d) return;
    const int chunk = blockIdx.x;
    const int t0 = chunk * DW_CHUNK_ROWS;
    const int t1 = min(t0 + DW_CHUNK_ROWS, rows);
    float acc = 0.0f;
    for (int t = t0; t < t1; ++t) {
        const long long i = (long long)t * d + j;
        acc += load(dy, i) * load(x, i) * rstd[t];
    }
    partial[(long long)chunk * d + j] = acc;
}

}  // namespace rmsnorm_impl

extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
    rmsnorm_impl::forward_row(x, w, y, d, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, float* __restrict__ y, int d, float eps) {
    rmsnorm_impl::forward_row(x, w, y, d, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dx_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ dy, float* __restrict__ dx, float* __restrict__ rstd, int d, float eps) {
    rmsnorm_impl::backward_dx_row(x, w, dy, dx, rstd, d, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dx_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ dy, float* __restrict__ dx, float* __restrict__ rstd, int d, float eps) {
    rmsnorm_impl::backward_dx_row(x, w, dy, dx, rstd, d, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dw_partial_f32(const float* __restrict__ x, const float* __restrict__ dy, const float* __restrict__ rstd, float* __restrict__ partial, int rows, int d) {
    rmsnorm_impl::backward_dw_partial(x, dy, rstd, partial, rows, d);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dw_partial_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy, const float* __restrict__ rstd, float* __restrict__ partial, int rows, int d) {
    rmsnorm_impl::backward_dw_partial(x, dy, rstd, partial, rows, d);
}

// dw[j] = sum over chunks c, ascending, of partial[c, j]. grid: ceil(d / 256).
extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dw_reduce(const float* __restrict__ partial, float* __restrict__ dw, int chunks, int d) {
    const int j = blockIdx.x * rmsnorm_impl::THREADS + threadIdx.x;
    if (j >= d) return;
    float acc = 0.0f;
    for (int c = 0; c < chunks; ++c) acc += partial[(long long)c * d + j];
    dw[j] = acc;
}
