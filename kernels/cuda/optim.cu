// Optimizer kernels over the parameter arena (DESIGN.md sections 3.7 and 5): Muon for the
// matrix views, AdamW for the rest, the global gradient norm, and the bf16 compute copy.
// Every kernel reads and writes the f32 arenas (parameters, gradients, optimizer state) in
// place; the Rust side (kernels/src/ops/optim/, model/src/optim/) builds the tables.
//
// Kernels
//   optim_sq_norm_partials_f32  block b sums x[i]^2 over its chunk [b*chunk, (b+1)*chunk) of the
//                               arena: thread t adds elements t, t+256, ... in ascending order,
//                               then a fixed-order block sum. partials[b] = that sum.
//   optim_sum_partials_f32      ONE block sums partials[0..n) the same way: out[0] = sum.
//                               Together: the squared global norm with an order that depends
//                               only on n (no atomics; replaces an atomicAdd per block, whose
//                               order would change the bits from run to run).
//   optim_adamw_f32             AdamW over the AdamW views, one launch: a segment table
//                               (arena start, prefix sum of lengths, weight decay) maps the
//                               compact index i in [0, total) to its view; each element is
//                               updated by one thread (grid-stride), p/m/v in place.
//   optim_gather_blocks_f32     copies n strided 2-D blocks of the arena (head / expert blocks,
//                               or whole matrices) into a dense [n, rows, cols] batch.
//   optim_muon_gather_f32       the same gather fused with Muon's momentum:
//                               m = mu m + s g (in place); out = s g + mu m (Nesterov) or m.
//   optim_muon_apply_f32        scatters the orthogonalised batch back:
//                               p = p (1 - lr wd) - lr scale x.
//   optim_cast_bf16_f32         dst = bf16(src) (round to nearest even): the compute copy.
//
// Every arena element belongs to at most one block or segment, so each element has a single
// writer per launch: elementwise, deterministic and independent of the launch shape.

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace optim_impl {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

using sluice::block_sum;

// The segment holding compact index i: the largest s with cum[s] <= i (cum ascending, cum[0] = 0,
// cum[n_seg] = total). Binary search over at most a few hundred segments.
__device__ __forceinline__ int find_segment(const unsigned long long* __restrict__ cum, int n_seg,
                                            unsigned long long i) {
    int lo = 0;
    int hi = n_seg - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cum[mid] <= i) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Arena index of element e of block b of a [rows, cols] block batch.
__device__ __forceinline__ unsigned long long block_index(
    const unsigned long long* __restrict__ offsets, const unsigned long long* __restrict__ strides,
    int b, long long e, int cols) {
    const long long r = e / cols;
    const long long c = e % cols;
    return offsets[b] + (unsigned long long)r * strides[b] + (unsigned long long)c;
}

// Grid: x strides over the rows*cols elements of a block, y = block index.
template <bool MOMENTUM>
__device__ __forceinline__ void gather(const float* __restrict__ src, float* __restrict__ mom,
                                       float* __restrict__ out,
                                       const unsigned long long* __restrict__ offsets,
                                       const unsigned long long* __restrict__ strides, int rows,
                                       int cols, float mu, float gscale, int nesterov) {
    const int b = blockIdx.y;
    const long long size = (long long)rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    float* dst = out + (long long)b * size;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < size; e += stride) {
        const unsigned long long i = block_index(offsets, strides, b, e, cols);
        if (MOMENTUM) {
            const float g = gscale * src[i];
            const float m = mu * mom[i] + g;
            mom[i] = m;
            dst[e] = nesterov ? g + mu * m : m;
        } else {
            dst[e] = src[i];
        }
    }
}

}  // namespace optim_impl

extern "C" __global__ void __launch_bounds__(256) optim_sq_norm_partials_f32(
    const float* __restrict__ x, float* __restrict__ partials, long long n, long long chunk) {
    using namespace optim_impl;
    __shared__ float scratch[WARPS];
    const long long start = (long long)blockIdx.x * chunk;
    const long long end = start + chunk < n ? start + chunk : n;
    float ss = 0.0f;
    for (long long i = start + threadIdx.x; i < end; i += THREADS) ss = fmaf(x[i], x[i], ss);
    const float total = block_sum<WARPS>(ss, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(256) optim_sum_partials_f32(
    const float* __restrict__ partials, float* __restrict__ out, long long n) {
    using namespace optim_impl;
    __shared__ float scratch[WARPS];
    float s = 0.0f;
    for (long long i = threadIdx.x; i < n; i += THREADS) s += partials[i];
    const float total = block_sum<WARPS>(s, scratch);
    if (threadIdx.x == 0) out[0] = total;
}

// p = p (1 - lr wd_s) - lr (m / bc1) / (sqrt(v / bc2) + eps), with m = b1 m + (1 - b1) g',
// v = b2 v + (1 - b2) g'^2, g' = gscale g; bc1 = 1 - b1^t, bc2 = 1 - b2^t (from the host).
extern "C" __global__ void __launch_bounds__(256) optim_adamw_f32(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
    float* __restrict__ v, const unsigned long long* __restrict__ seg_start,
    const unsigned long long* __restrict__ seg_cum, const float* __restrict__ seg_wd, int n_seg,
    long long total, float lr, float beta1, float beta2, float eps, float bc1, float bc2,
    float gscale) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
        const int s = optim_impl::find_segment(seg_cum, n_seg, (unsigned long long)k);
        const unsigned long long i = seg_start[s] + ((unsigned long long)k - seg_cum[s]);
        const float gi = gscale * g[i];
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        const float step = (mi / bc1) / (sqrtf(vi / bc2) + eps);
        p[i] = p[i] * (1.0f - lr * seg_wd[s]) - lr * step;
    }
}

extern "C" __global__ void __launch_bounds__(256) optim_gather_blocks_f32(
    const float* __restrict__ src, float* __restrict__ out,
    const unsigned long long* __restrict__ offsets, const unsigned long long* __restrict__ strides,
    int rows, int cols) {
    optim_impl::gather<false>(src, nullptr, out, offsets, strides, rows, cols, 0.0f, 1.0f, 0);
}

extern "C" __global__ void __launch_bounds__(256) optim_muon_gather_f32(
    const float* __restrict__ g, float* __restrict__ mom, float* __restrict__ out,
    const unsigned long long* __restrict__ offsets, const unsigned long long* __restrict__ strides,
    int rows, int cols, float mu, float gscale, int nesterov) {
    optim_impl::gather<true>(g, mom, out, offsets, strides, rows, cols, mu, gscale, nesterov);
}

extern "C" __global__ void __launch_bounds__(256) optim_muon_apply_f32(
    float* __restrict__ p, const float* __restrict__ x,
    const unsigned long long* __restrict__ offsets, const unsigned long long* __restrict__ strides,
    int rows, int cols, float lr, float wd, float scale) {
    const int b = blockIdx.y;
    const long long size = (long long)rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const float* xb = x + (long long)b * size;
    const float decay = 1.0f - lr * wd;
    const float step = lr * scale;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < size; e += stride) {
        const unsigned long long i = optim_impl::block_index(offsets, strides, b, e, cols);
        p[i] = p[i] * decay - step * xb[e];
    }
}

extern "C" __global__ void __launch_bounds__(256) optim_cast_bf16_f32(
    const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16(src[i]);
}
