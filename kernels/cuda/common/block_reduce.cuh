// Small device helpers shared by the row and elementwise families (rmsnorm, rope, swiglu,
// embedding, elementwise, newton_schulz): widening loads and fixed-order block reductions.
#pragma once
#include <cuda_bf16.h>
#include <math.h>

namespace sluice {

// Element i as f32: F32 as is, BF16 widened (exact).
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, long long i) {
    return __bfloat162float(p[i]);
}

// Sum of `v` over a block of WARPS full warps, the same bits in every thread: each warp reduces
// by a xor butterfly (a + b == b + a in IEEE, so all lanes agree), then every thread adds the
// warp sums in ascending warp order. `scratch` holds WARPS floats of shared memory; it may be
// reused by the caller's next reduction (the trailing barrier makes that safe).
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

// Max over the block (exact, so the order does not change the value). Same contract as
// block_sum.
template <int WARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float total = scratch[0];
    for (int w = 1; w < WARPS; ++w) total = fmaxf(total, scratch[w]);
    __syncthreads();
    return total;
}

}  // namespace sluice
