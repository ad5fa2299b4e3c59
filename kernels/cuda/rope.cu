// Rotary position embedding (RoPE) on x[T,H,D] with positions[T] (I32), the half-split
// (GPT-NeoX) pairing: element i and element i + D/2 of each head vector form one pair,
// i in [0, D/2):
//   angle    = (float)positions[t] * inv_freq[i]            (one f32 multiply)
//   y[i]       = x[i] * cos(angle) - x[i + D/2] * sin(angle)
//   y[i + D/2] = x[i + D/2] * cos(angle) + x[i] * sin(angle)
// inv_freq[i] = theta^(-2i/D) is computed once on the host (in f64, rounded to f32) and passed
// as a table, so every device multiplies by the same float; cosf/sinf are the full-range f32
// functions (not the __sinf fast intrinsics), whose results differ across devices by an ulp or
// two, well inside the f32 tolerance.
// The backward is the rotation by -angle (sign = -1): the transpose of a rotation.
// Positions restart per sequence in a packed batch; the caller passes them.
//
// Kernels: rope_{f32,bf16}: a grid-stride loop, one thread per (t, i), looping over the heads.
// No reductions: every output is a function of its own pair and position (batch-invariant).

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace rope_impl {

using sluice::load;

template <typename T>
__device__ __forceinline__ void rotate(const T* __restrict__ x, const int* __restrict__ positions,
                                       const float* __restrict__ inv_freq, float* __restrict__ y,
                                       int rows, int heads, int dim, float sign) {
    const int half = dim / 2;
    // One thread per (t, i): the angle and its cos/sin are computed once and applied to all
    // heads (the full-range sinf/cosf cost tens of instructions; per head they would rival the
    // memory time). Consecutive threads take consecutive i, so each head's loads coalesce.
    const long long items = (long long)rows * half;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < items; p += stride) {
        const int i = (int)(p % half);
        const long long t = p / half;
        const float angle = (float)positions[t] * inv_freq[i];
        const float c = cosf(angle);
        const float s = sign * sinf(angle);
        for (int h = 0; h < heads; ++h) {
            const long long base = (t * heads + h) * dim;
            const float x1 = load(x, base + i);
            const float x2 = load(x, base + i + half);
            y[base + i] = x1 * c - x2 * s;
            y[base + i + half] = x2 * c + x1 * s;
        }
    }
}

}  // namespace rope_impl

// sign = +1 for the forward rotation, -1 for the backward (rotation by -angle).
extern "C" __global__ void __launch_bounds__(256) rope_f32(const float* __restrict__ x, const int* __restrict__ positions, const float* __restrict__ inv_freq, float* __restrict__ y, int rows, int heads, int dim, float sign) {
    rope_impl::rotate(x, positions, inv_freq, y, rows, heads, dim, sign);
}

extern "C" __global__ void __launch_bounds__(256) rope_bf16(const __nv_bfloat16* __restrict__ x, const int* __restrict__ positions, const float* __restrict__ inv_freq, float* __restrict__ y, int rows, int heads, int dim, float sign) {
    rope_impl::rotate(x, positions, inv_freq, y, rows, heads, dim, sign);
}
