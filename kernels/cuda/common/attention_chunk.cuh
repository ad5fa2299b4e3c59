// attention_chunk.cuh — the one online-softmax key-chunk step shared by the training attention
// kernel (attention.cu) and the paged decode kernel (paged_attention.cu).
//
// THE ORDER (docs/perf/attention.md, "The order"). A query row visits its keys in chunks of
// KEY_CHUNK = 32 consecutive keys, counted from the first key of its sequence (so a chunk never
// depends on where the sequence sits in a packed batch, nor on paged-cache block boundaries), in
// ascending order. One warp advances one row; lane j owns key j of the chunk. Per chunk:
//   1. lane j: s_j = (sum over d = 0..D-1 ascending, fmaf, from 0) q[d]*k_j[d], then s_j *= scale;
//      missing keys (past the row's last key) have s_j = -inf.
//   2. every lane: cm = max_j s_j (j ascending); m' = max(m, cm);
//      alpha = exp(m - m') (0 while m = -inf); lane j: p_j = exp(s_j - m') (0 for missing keys).
//   3. every lane: csum = the pairwise tree sum of p_0..p_31 (halves 16, 8, 4, 2, 1: t_i = t_i + t_{i+h});
//      l' = fmaf(l, alpha, csum);
//      lane owning dim d: a = acc[d] * alpha; for present keys j ascending: a = fmaf(p_j, v_j[d], a).
// At the end out[d] = acc[d] / l and lse = m + log(l). Inputs are widened to f32 on load (bf16 is
// exact in f32); all arithmetic is f32. Every product that is not inside an fmaf is an explicit
// round-to-nearest multiply (__fmul_rn on the GPU), so no compiler contraction can make the two
// kernels that inline this function round differently: a query's output is bit-identical whichever
// kernel computed it. The Rust reference (kernels/src/ops/attention/row.rs, `RowState`) performs the
// same operations in the same order.
#pragma once

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

namespace sluice_attention {

// Keys per online-softmax step; equal to the warp size so that lane j owns key j of the chunk.
constexpr int KEY_CHUNK = 32;
// The largest head dimension the kernels take (8 dims per lane).
constexpr int MAX_HEAD_DIM = 256;
constexpr int DIMS_PER_LANE = MAX_HEAD_DIM / 32;

__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// A multiply the compiler may not fuse into a neighbouring add (see the header comment).
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef SLUICE_EMU
    return a * b;
#else
    return __fmul_rn(a, b);
#endif
}

// The online-softmax state of one query row, spread over one warp: m and l replicated in every
// lane, acc[i] holding output dim d = lane + 32 * i.
struct RowState {
    float m;
    float l;
    float acc[DIMS_PER_LANE];
};

// One warp's shared scratch for one chunk.
template <typename T>
struct ChunkScratch {
    float s[KEY_CHUNK];
    float p[KEY_CHUNK];
    const T* v[KEY_CHUNK];
};

__device__ __forceinline__ void row_init(RowState& st) {
    st.m = -INFINITY;
    st.l = 0.0f;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) st.acc[i] = 0.0f;
}

// s = scale * (q . k), the dot product in ascending d with fmaf from 0. `a` is an f32 row (shared
// memory), `b` a row of T anywhere.
template <typename T>
__device__ __forceinline__ float dot_row(const float* a, const T* b, int D) {
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) dot = fmaf(a[d], load_f32(b + d), dot);
    return dot;
}

// The pairwise tree sum of 32 values (halves 16, 8, 4, 2, 1), the same in every lane.
__device__ __forceinline__ float tree_sum32(const float* x) {
    float t[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) t[i] = x[i] + x[i + 16];
    // Halves 8, 4, 2, 1 written out, so the array lives in registers.
#pragma unroll
    for (int i = 0; i < 8; ++i) t[i] = t[i] + t[i + 8];
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
    t[0] = t[0] + t[2];
    t[1] = t[1] + t[3];
    return t[0] + t[1];
}

// Advances one row (one warp) over one chunk. q_s: the row's query in shared memory as f32 (D
// values). my_k / my_v: lane j's key and value rows, nullptr when key j is past the row's last
// key (every lane of the warp must call this, with at least lane 0's key present). sc: this warp's
// scratch. Starts and ends with the warp converged; ends with a __syncwarp so the scratch may be
// reused at once.
template <typename T>
__device__ __forceinline__ void chunk_step(RowState& st, const float* q_s, const T* my_k,
                                           const T* my_v, int D, float scale,
                                           ChunkScratch<T>* sc, int lane) {
    float s = -INFINITY;
    if (my_k != nullptr) s = mul_rn(dot_row(q_s, my_k, D), scale);
    sc->s[lane] = s;
    sc->v[lane] = my_v;
    __syncwarp();

    float cm = -INFINITY;
    for (int j = 0; j < KEY_CHUNK; ++j) cm = fmaxf(cm, sc->s[j]);
    const float m_new = fmaxf(st.m, cm);
    const float alpha = (st.m == -INFINITY) ? 0.0f : expf(st.m - m_new);
    sc->p[lane] = (my_k != nullptr) ? expf(s - m_new) : 0.0f;
    __syncwarp();

    const float csum = tree_sum32(sc->p);
    st.l = fmaf(st.l, alpha, csum);
    st.m = m_new;
    // Per output dim: the alpha rescale, then the keys ascending (the loops are nested keys
    // outside, dims inside, so each key's pointer and weight are loaded once; every dim still
    // sees the same sequence of operations).
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) st.acc[i] = mul_rn(st.acc[i], alpha);
    for (int j = 0; j < KEY_CHUNK; ++j) {
        const T* vj = sc->v[j];
        if (vj == nullptr) break;  // absent keys are the chunk's tail
        const float pj = sc->p[j];
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < D) st.acc[i] = fmaf(pj, load_f32(vj + d), st.acc[i]);
        }
    }
    __syncwarp();
}

// Writes out[d] = acc[d] / l for the lane's dims; returns lse = m + log(l).
__device__ __forceinline__ float row_finish(const RowState& st, float* out_row, int D, int lane) {
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < D) out_row[d] = st.acc[i] / st.l;
    }
    return st.m + logf(st.l);
}

// Loads a row of T into shared memory as f32, lane-strided; ends with __syncwarp.
template <typename T>
__device__ __forceinline__ void load_row_f32(float* dst, const T* src, int D, int lane) {
    for (int d = lane; d < D; d += 32) dst[d] = load_f32(src + d);
    __syncwarp();
}

}  // namespace sluice_attention
