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

// One lane's (max m, sum s, sum t of exp(x - m) * (x - m)): the LseState with one more online
// sum, for the entropy H = log(s) - t / s of the softmax (is_gate_loss's entropy bonus;
// kernels/src/ops/row_reduce.rs EntState). t is kept relative to the running max, so H needs no
// difference of two large numbers. m and s take exactly lse_push's and lse_combine's steps, so
// lse (and every log-prob) is the same bits with or without t.
struct EntState {
    float m;
    float s;
    float t;
};

__device__ __forceinline__ void state_empty(LseState& st) { st = lse_empty(); }
__device__ __forceinline__ void state_empty(EntState& st) { st = EntState{SLUICE_NEG_INF, 0.0f, 0.0f}; }
__device__ __forceinline__ void state_push(LseState& st, float x) { lse_push(st, x); }

// lse_push plus t. A new max x rescales t to it: sum e^(y - x)(y - x) = e^(m - x)(t + (m - x) s)
// (the new entry adds (x - x) * 1 = 0); an entry below the max adds e^(x - m)(x - m), nothing
// for x = -inf (its weight is 0; 0 * -inf would be NaN).
__device__ __forceinline__ void state_push(EntState& st, float x) {
    if (x > st.m) {
        const float e = expf(st.m - x);
        st.t = st.m == SLUICE_NEG_INF ? 0.0f : rr_mul(e, rr_add(st.t, rr_mul(st.m - x, st.s)));
        st.s = rr_add(rr_mul(st.s, e), 1.0f);
        st.m = x;
    } else if (st.m != SLUICE_NEG_INF) {
        const float d = x - st.m;
        const float e = expf(d);
        st.s = rr_add(st.s, e);
        if (x != SLUICE_NEG_INF) st.t = rr_add(st.t, rr_mul(e, d));
    }
}

// A lane's t moved to the max m of a merge (0 for an empty lane).
__device__ __forceinline__ float ent_rescale(EntState a, float m, float e) {
    return a.m == SLUICE_NEG_INF ? 0.0f : rr_mul(e, rr_add(a.t, rr_mul(a.m - m, a.s)));
}

__device__ __forceinline__ EntState ent_combine(EntState a, EntState b) {
    const float m = fmaxf(a.m, b.m);
    if (m == SLUICE_NEG_INF) return EntState{SLUICE_NEG_INF, 0.0f, 0.0f};
    const float ea = expf(a.m - m), eb = expf(b.m - m);
    return EntState{m, rr_add(rr_mul(a.s, ea), rr_mul(b.s, eb)),
                    rr_add(ent_rescale(a, m, ea), ent_rescale(b, m, eb))};
}

// The softmax entropy -sum p log p = log(s) - t / s (0 for a row with no mass).
__device__ __forceinline__ float ent_value(EntState st) {
    return st.m == SLUICE_NEG_INF ? 0.0f : rr_add(logf(st.s), -(st.t / st.s));
}

__device__ __forceinline__ LseState lse_of(LseState st) { return st; }
__device__ __forceinline__ LseState lse_of(EntState st) { return LseState{st.m, st.s}; }

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

// 16-byte loads: a thread loads ROW_VEC = 8 consecutive entries, so a block covers a tile of
// ROW_TILE = 2048 entries per step.
constexpr int ROW_VEC = 8;
constexpr int ROW_TILE = ROW_THREADS * ROW_VEC;

__device__ __forceinline__ float float_of_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

// Entries p[0..8) as f32; p 16-byte aligned.
__device__ __forceinline__ void load_vec8(const float* p, float v[ROW_VEC]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load_vec8(const __nv_bfloat16* p, float v[ROW_VEC]) {
    // A bf16 is the top half of an f32: widening by a shift is exact (= __bfloat162float).
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = float_of_bits(w[k] << 16);
        v[2 * k + 1] = float_of_bits(w[k] & 0xffff0000u);
    }
}
__device__ __forceinline__ void store_vec8(float* p, const float v[ROW_VEC]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store_vec8(__nv_bfloat16* p, const float v[ROW_VEC]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const __nv_bfloat16 lo = __float2bfloat16(v[2 * k]), hi = __float2bfloat16(v[2 * k + 1]);
        uint16_t bl, bh;
        memcpy(&bl, &lo, sizeof bl);
        memcpy(&bh, &hi, sizeof bh);
        w[k] = (uint32_t)bl | ((uint32_t)bh << 16);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// This thread's part of the row pass over z_j = row[j] * scale, j = t, t + 256, ...;
// visit(j, z_j) sees every element in that order (the sampler fuses its argmax here).
// Where the row is 16-byte aligned, full tiles of 2048 entries are loaded 8 consecutive entries
// per thread (16-byte loads), staged in shared memory, and read back by each thread in ITS order
// (t, t + 256, ..., t + 1792 of the tile): the same pushes in the same order as the scalar loop,
// so the same bits whichever path a row takes. Called by all threads of the block (barriers).
// State: LseState (the sampler, the loss) or EntState (the loss with its entropy sum).
template <typename State, typename T, typename Visit>
__device__ __forceinline__ State row_state_pass(const T* row, int V, float scale, Visit&& visit) {
    __shared__ float tile[ROW_TILE];
    State st;
    state_empty(st);
    const int t = threadIdx.x;
    int done = 0;
    if (aligned16(row)) {
        done = (V / ROW_TILE) * ROW_TILE;
        for (int base = 0; base < done; base += ROW_TILE) {
            float v[ROW_VEC];
            load_vec8(row + base + t * ROW_VEC, v);
            store_vec8(tile + t * ROW_VEC, v);
            __syncthreads();
#pragma unroll
            for (int k = 0; k < ROW_VEC; ++k) {
                const float z = rr_mul(tile[t + k * ROW_THREADS], scale);
                state_push(st, z);
                visit(base + t + k * ROW_THREADS, z);
            }
            __syncthreads();
        }
    }
    // The rest (or a misaligned row): scalar loads, unrolled so several are in flight.
#pragma unroll 4
    for (int j = done + t; j < V; j += ROW_THREADS) {
        const float z = rr_mul(load_logit(row, j), scale);
        state_push(st, z);
        visit(j, z);
    }
    return st;
}

template <typename T, typename Visit>
__device__ __forceinline__ LseState row_lse_pass(const T* row, int V, float scale, Visit&& visit) {
    return row_state_pass<LseState>(row, V, scale, visit);
}

struct LseCombine {
    __device__ __forceinline__ LseState operator()(LseState a, LseState b) const {
        return lse_combine(a, b);
    }
};
struct EntCombine {
    __device__ __forceinline__ EntState operator()(EntState a, EntState b) const {
        return ent_combine(a, b);
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
