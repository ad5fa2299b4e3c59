// THE row log-sum-exp of sluice on the device; kernels/src/ops/row_reduce.rs is the same routine
// on the CPU (read its module comment for the order). The sampler (sample.cu) and the policy
// loss (is_gate_loss.cu) both call row_lse_pass + block_tree(lse_combine) + lse_value +
// row_logprob from here, so a row's sampler log-prob at temperature 1 equals the loss's logp
// bit for bit on each device (DESIGN.md 3.3, 3.6, 6.6).
//
// Fixed order: ROW_THREADS = 256 threads per row; thread t visits t, t + 256, ... in order with
// an online (max, sum) pair, then the fixed shared-memory tree (stride 128, 64, ..., 1).
// Exponentials are expf (not __expf); products and sums are rounded separately (rr_mul/rr_add)
// so no fused multiply-add can make two call sites differ.
#pragma once
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace sluice {

constexpr int ROW_THREADS = 256;
#define SLUICE_NEG_INF (-INFINITY)

// Separately rounded multiply and add. On the GPU the _rn intrinsics forbid contraction into an
// FMA; under the emulator a volatile keeps the host compiler from fusing.
#ifdef SLUICE_EMU
__device__ __forceinline__ float rr_mul(float a, float b) {
    volatile float p = a * b;
    return p;
}
__device__ __forceinline__ float rr_add(float a, float b) {
    volatile float s = a + b;
    return s;
}
#else
__device__ __forceinline__ float rr_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float rr_add(float a, float b) { return __fadd_rn(a, b); }
#endif

__device__ __forceinline__ float load_logit(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_logit(const __nv_bfloat16* p, long long i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store_logit(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_logit(__nv_bfloat16* p, long long i, float v) {
    p[i] = __float2bfloat16(v);  // round to nearest even, as half::bf16::from_f32
}

// One lane's online (max m, sum s of exp(x - m)).
struct LseState {
    float m;
    float s;
};

__device__ __forceinline__ LseState lse_empty() { return LseState{SLUICE_NEG_INF, 0.0f}; }

// The CPU writes s = s * exp(m - m') + exp(x - m'); with exp(0) = 1 and s * 1 = s this is the
// same arithmetic with one exponential per element.
__device__ __forceinline__ void lse_push(LseState& st, float x) {
    if (x > st.m) {
        st.s = rr_add(rr_mul(st.s, expf(st.m - x)), 1.0f);
        st.m = x;
    } else if (st.m != SLUICE_NEG_INF) {
        st.s = rr_add(st.s, expf(x - st.m));
    }
}

__device__ __forceinline__ LseState lse_combine(LseState a, LseState b) {
    const float m = fmaxf(a.m, b.m);
    if (m == SLUICE_NEG_INF) return lse_empty();
    return LseState{m, rr_add(rr_mul(a.s, expf(a.m - m)), rr_mul(b.s, expf(b.m - m)))};
}

// m + log(s), or -inf for a row with no mass (all -inf).
__device__ __forceinline__ float lse_value(LseState st) {
    return st.m == SLUICE_NEG_INF ? SLUICE_NEG_INF : rr_add(st.m, logf(st.s));
}

// The log-prob of an entry with scaled logit z: z - lse, or -inf in a row with no mass.
__device__ __forceinline__ float row_logprob(float z, float lse) {
    return lse == SLUICE_NEG_INF ? SLUICE_NEG_INF : z - lse;
}

// The fixed tree over the block's ROW_THREADS values: every thread passes its value and gets
// the total. `sh` is a __shared__ array of ROW_THREADS; reusable when this returns.
template <typename T, typename F>
__device__ __forceinline__ T block_tree(T v, T* sh, F f) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
#pragma unroll
    for (int stride = ROW_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) sh[t] = f(sh[t], sh[t + stride]);
        __syncthreads();
    }
    const T total = sh[0];
    __syncthreads();
    return total;
}

// This thread's part of the row pass over z_j = row[j] * scale, j = t, t + 256, ...;
// visit(j, z_j) sees every element in that order (the sampler fuses its argmax here).
template <typename T, typename Visit>
__device__ __forceinline__ LseState row_lse_pass(const T* row, int V, float scale, Visit&& visit) {
    LseState st = lse_empty();
    // Unrolled so several loads are in flight per thread (the order of the pushes is unchanged).
#pragma unroll 4
    for (int j = threadIdx.x; j < V; j += ROW_THREADS) {
        const float z = rr_mul(load_logit(row, j), scale);
        lse_push(st, z);
        visit(j, z);
    }
    return st;
}

struct LseCombine {
    __device__ __forceinline__ LseState operator()(LseState a, LseState b) const {
        return lse_combine(a, b);
    }
};
struct AddF32 {
    __device__ __forceinline__ float operator()(float a, float b) const { return rr_add(a, b); }
};
struct AddI32 {
    __device__ __forceinline__ int operator()(int a, int b) const { return a + b; }
};

__device__ __forceinline__ uint32_t float_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

}  // namespace sluice
