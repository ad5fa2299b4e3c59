// Elementwise and row ops of the model that need no tensor cores:
//   elementwise_add_{f32,bf16}              y = a + b (the residual add), grid-stride
//   elementwise_softmax_{f32,bf16}          row softmax of x[T,n], one 256-thread block per row
//   elementwise_softmax_backward_{f32,bf16} dx = y * (dy - sum_j dy[j] * y[j]), block per row
//   elementwise_transpose_{f32,bf16}        y[C,R] = x[R,C]^T, 32x32 tiles through shared memory
// Softmax: m = max_j x[j]; e[j] = expf(x[j] - m); y[j] = e[j] / sum_j e[j]. Rows must have a
// finite maximum (a row of all -inf gives NaN, as the math does).
// Inputs F32 or BF16 (widened exactly); math and outputs f32. No atomics; each row's reductions
// have a fixed order that depends only on n and the fixed block size (batch-invariant).

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace elementwise_impl {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

using sluice::load;
using sluice::block_max;
using sluice::block_sum;



template <typename T>
__device__ __forceinline__ void add(const T* __restrict__ a, const T* __restrict__ b,
                                    float* __restrict__ y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = load(a, i) + load(b, i);
}

template <typename T>
__device__ __forceinline__ void softmax_row(const T* __restrict__ x, float* __restrict__ y, int n) {
    __shared__ float scratch[WARPS];
    const long long base = (long long)blockIdx.x * n;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += THREADS) m = fmaxf(m, load(x, base + j));
    m = block_max<WARPS>(m, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += THREADS) sum += expf(load(x, base + j) - m);
    sum = block_sum<WARPS>(sum, scratch);
    for (int j = threadIdx.x; j < n; j += THREADS) y[base + j] = expf(load(x, base + j) - m) / sum;
}

template <typename T>
__device__ __forceinline__ void softmax_backward_row(const T* __restrict__ y, const T* __restrict__ dy,
                                                     float* __restrict__ dx, int n) {
    __shared__ float scratch[WARPS];
    const long long base = (long long)blockIdx.x * n;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < n; j += THREADS) dot += load(dy, base + j) * load(y, base + j);
    dot = block_sum<WARPS>(dot, scratch);
    for (int j = threadIdx.x; j < n; j += THREADS)
        dx[base + j] = load(y, base + j) * (load(dy, base + j) - dot);
}

// Transpose: block (32, 8) moves one 32x32 tile; blockIdx.x is the row tile of x (grid x
// holds up to 2^31-1 tiles, so T-sized row counts fit), blockIdx.y the column tile. Reads of x
// and writes of y are both along rows (coalesced); the tile's +1 padding column keeps the
// column-wise shared reads off a single bank. A copy: the values (and bits) are unchanged.
constexpr int TILE = 32, TILE_ROWS = 8;

template <typename T>
__device__ __forceinline__ void transpose_tile(const T* __restrict__ x, T* __restrict__ y,
                                               int rows, int cols) {
    __shared__ T tile[TILE][TILE + 1];
    const int r0 = static_cast<int>(blockIdx.x) * TILE, c0 = static_cast<int>(blockIdx.y) * TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int i = ty; i < TILE; i += TILE_ROWS) {
        const int r = r0 + i, c = c0 + tx;
        if (r < rows && c < cols) tile[i][tx] = x[static_cast<long long>(r) * cols + c];
    }
    __syncthreads();
    for (int i = ty; i < TILE; i += TILE_ROWS) {
        const int c = c0 + i, r = r0 + tx;  // y[c][r] = x[r][c]
        if (c < cols && r < rows) y[static_cast<long long>(c) * rows + r] = tile[tx][i];
    }
}

}  // namespace elementwise_impl

extern "C" __global__ void __launch_bounds__(256) elementwise_add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, long long n) {
    elementwise_impl::add(a, b, y, n);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_add_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, float* __restrict__ y, long long n) {
    elementwise_impl::add(a, b, y, n);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_softmax_f32(const float* __restrict__ x, float* __restrict__ y, int n) {
    elementwise_impl::softmax_row(x, y, n);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_softmax_bf16(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int n) {
    elementwise_impl::softmax_row(x, y, n);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_softmax_backward_f32(const float* __restrict__ y, const float* __restrict__ dy, float* __restrict__ dx, int n) {
    elementwise_impl::softmax_backward_row(y, dy, dx, n);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_softmax_backward_bf16(const __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ dy, float* __restrict__ dx, int n) {
    elementwise_impl::softmax_backward_row(y, dy, dx, n);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_transpose_f32(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    elementwise_impl::transpose_tile(x, y, rows, cols);
}

extern "C" __global__ void __launch_bounds__(256) elementwise_transpose_bf16(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int rows, int cols) {
    elementwise_impl::transpose_tile(x, y, rows, cols);
}
