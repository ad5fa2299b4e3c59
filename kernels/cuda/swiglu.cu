// SwiGLU gate: h = silu(a) * b elementwise over a[T,f], b[T,f], silu(a) = a * sigmoid(a),
// sigmoid(a) = 1 / (1 + expf(-a)). Backward, with s = sigmoid(a):
//   da = dh * b * (s * (1 + a * (1 - s)))      db = dh * (a * s)
// Inputs F32 or BF16 (widened exactly; dh may be F32 with BF16 a and b); math and outputs f32. Grid-stride, one thread per
// element; no reductions (deterministic and batch-invariant by construction).

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace swiglu_impl {

using sluice::load;

template <typename T>
__device__ __forceinline__ void forward(const T* __restrict__ a, const T* __restrict__ b,
                                        float* __restrict__ h, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float av = load(a, i);
        const float s = 1.0f / (1.0f + expf(-av));
        h[i] = av * s * load(b, i);
    }
}

template <typename T, typename G>
__device__ __forceinline__ void backward(const T* __restrict__ a, const T* __restrict__ b,
                                         const G* __restrict__ dh, float* __restrict__ da,
                                         float* __restrict__ db, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float av = load(a, i);
        const float bv = load(b, i);
        const float g = load(dh, i);
        const float s = 1.0f / (1.0f + expf(-av));
        da[i] = g * bv * (s * (1.0f + av * (1.0f - s)));
        db[i] = g * (av * s);
    }
}

}  // namespace swiglu_impl

extern "C" __global__ void __launch_bounds__(256) swiglu_forward_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ h, long long n) {
    swiglu_impl::forward(a, b, h, n);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_forward_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, float* __restrict__ h, long long n) {
    swiglu_impl::forward(a, b, h, n);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_backward_f32(const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ dh, float* __restrict__ da, float* __restrict__ db, long long n) {
    swiglu_impl::backward(a, b, dh, da, db, n);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_backward_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, const __nv_bfloat16* __restrict__ dh, float* __restrict__ da, float* __restrict__ db, long long n) {
    swiglu_impl::backward(a, b, dh, da, db, n);
}

// BF16 a and b (saved activations) with an F32 dh (a gradient in f32): the MoE backward's form.
extern "C" __global__ void __launch_bounds__(256) swiglu_backward_bf16_f32dh(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, const float* __restrict__ dh, float* __restrict__ da, float* __restrict__ db, long long n) {
    swiglu_impl::backward(a, b, dh, da, db, n);
}
