// attention.cu — training attention: forward and backward over varlen packed batches.
//
// Shapes (row-major): q[T,H,D], k[T,Hkv,D], v[T,Hkv,D], cu_seqlens[B+1] (sequence b holds tokens
// cu_seqlens[b] .. cu_seqlens[b+1]-1), out[T,H,D] f32, lse[T,H] f32. GQA: head h reads kv head
// h / (H / Hkv). Causal: query at position i of its sequence sees keys 0..i of its sequence.
//
// Kernels
//   attention_forward_{f32,bf16}     one warp per (query row, head); the row's keys in the fixed
//                                    chunk order of common/attention_chunk.cuh (shared with the
//                                    paged decode kernel, so both give the same bits).
//   attention_bwd_delta_{f32,bf16}   delta[t,h] = sum_d dout*out (ascending d, fmaf).
//   attention_bwd_dq_{f32,bf16}      one warp per (query row, head): dq = scale * sum_j dS_j k_j,
//                                    keys ascending.
//   attention_bwd_dkdv_{f32,bf16}    one warp per (key row, kv head): dk, dv summed over the GQA
//                                    group's heads (ascending) and the queries that see the key
//                                    (ascending). Each output row has exactly one owner, so no
//                                    atomics: the llm.c lesson (atomics made backward
//                                    nondeterministic) applied to dK/dV.
// Every reduction has a fixed order, and a row's result depends only on its own sequence, so the
// kernels are deterministic and batch-invariant. The backward recomputes P = exp(s - lse) from the
// forward's saved logsumexp instead of storing P.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_chunk.cuh"

namespace sluice_attention {

// Warps per block of every kernel here (each warp works alone; the block only groups them).
constexpr int WARPS = 4;

// The sequence holding packed token t: the last b with cu_seqlens[b] <= t (binary search).
__device__ __forceinline__ int sequence_of(const int* cu_seqlens, int B, int t) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_seqlens[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ void forward_impl(const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, const int* __restrict__ cu_seqlens, int B,
                             int T_tokens, int H, int Hkv, int D, int causal, float scale,
                             float* __restrict__ out, float* __restrict__ lse) {
    __shared__ float q_s[WARPS][MAX_HEAD_DIM];
    __shared__ ChunkScratch<T> scratch[WARPS];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y;
    if (t < T_tokens) {  // warp-uniform
        const int b = sequence_of(cu_seqlens, B, t);
        const int s0 = cu_seqlens[b];
        const int n_keys = (causal ? t + 1 : cu_seqlens[b + 1]) - s0;
        const int g = h / (H / Hkv);
        load_row_f32(q_s[warp], q + ((size_t)t * H + h) * D, D, lane);
        RowState st;
        row_init(st);
        for (int c0 = 0; c0 < n_keys; c0 += KEY_CHUNK) {
            const int j = c0 + lane;
            const T* kp = nullptr;
            const T* vp = nullptr;
            if (j < n_keys) {
                const size_t row = ((size_t)(s0 + j) * Hkv + g) * D;
                kp = k + row;
                vp = v + row;
            }
            chunk_step(st, q_s[warp], kp, vp, D, scale, &scratch[warp], lane);
        }
        const float row_lse = row_finish(st, out + ((size_t)t * H + h) * D, D, lane);
        if (lane == 0) lse[(size_t)t * H + h] = row_lse;
    }
}

// One thread per (t, h): delta = sum_d dout[d] * out[d], ascending d.
template <typename T>
__device__ void delta_impl(const T* __restrict__ dout, const float* __restrict__ out, int rows,
                           int D, float* __restrict__ delta) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) {
        float acc = 0.0f;
        for (int d = 0; d < D; ++d)
            acc = fmaf(load_f32(dout + (size_t)r * D + d), out[(size_t)r * D + d], acc);
        delta[r] = acc;
    }
}

template <typename T>
struct DqScratch {
    float ds[KEY_CHUNK];
    const T* k[KEY_CHUNK];
};

// One warp per (query row t, head h). Over the row's keys in ascending chunks:
// lane j: p = exp(scale*q.k_j - lse), dp = dout.v_j, ds_j = p*(dp - delta); then the lane owning
// dim d adds ds_j * k_j[d] for j ascending. dq = scale * that sum.
template <typename T>
__device__ void dq_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const int* __restrict__ cu_seqlens, const T* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta, int B,
                        int T_tokens, int H, int Hkv, int D, int causal, float scale,
                        float* __restrict__ dq) {
    __shared__ float q_s[WARPS][MAX_HEAD_DIM];
    __shared__ float do_s[WARPS][MAX_HEAD_DIM];
    __shared__ DqScratch<T> scratch[WARPS];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y;
    if (t < T_tokens) {
        const int b = sequence_of(cu_seqlens, B, t);
        const int s0 = cu_seqlens[b];
        const int n_keys = (causal ? t + 1 : cu_seqlens[b + 1]) - s0;
        const int g = h / (H / Hkv);
        const size_t qrow = ((size_t)t * H + h) * D;
        for (int d = lane; d < D; d += 32) {
            q_s[warp][d] = load_f32(q + qrow + d);
            do_s[warp][d] = load_f32(dout + qrow + d);
        }
        __syncwarp();
        const float row_lse = lse[(size_t)t * H + h];
        const float row_delta = delta[(size_t)t * H + h];
        float acc[DIMS_PER_LANE];
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.0f;
        DqScratch<T>* sc = &scratch[warp];
        for (int c0 = 0; c0 < n_keys; c0 += KEY_CHUNK) {
            const int j = c0 + lane;
            float ds = 0.0f;
            const T* kp = nullptr;
            if (j < n_keys) {
                const size_t row = ((size_t)(s0 + j) * Hkv + g) * D;
                kp = k + row;
                const float s = mul_rn(dot_row(q_s[warp], kp, D), scale);
                const float p = expf(s - row_lse);
                const float dp = dot_row(do_s[warp], v + row, D);
                ds = mul_rn(p, dp - row_delta);
            }
            sc->ds[lane] = ds;
            sc->k[lane] = kp;
            __syncwarp();
            for (int jj = 0; jj < KEY_CHUNK; ++jj) {
                const T* kj = sc->k[jj];
                if (kj == nullptr) break;  // absent keys are the chunk's tail
                const float dsj = sc->ds[jj];
#pragma unroll
                for (int i = 0; i < DIMS_PER_LANE; ++i) {
                    const int d = lane + 32 * i;
                    if (d < D) acc[i] = fmaf(dsj, load_f32(kj + d), acc[i]);
                }
            }
            __syncwarp();
        }
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < D) dq[qrow + d] = mul_rn(acc[i], scale);
        }
    }
}

template <typename T>
struct DkvScratch {
    float p[KEY_CHUNK];
    float ds[KEY_CHUNK];
    const T* q[KEY_CHUNK];
    const T* dout[KEY_CHUNK];
};

// One warp per (key row t, kv head g). For each head h of the group (ascending) and the queries
// that see this key (ascending, in chunks of 32, lane i owning query i of the chunk):
// p = exp(scale*q_i.k - lse_i), dp = dout_i.v, ds = p*(dp - delta_i); then the lane owning dim d
// adds p*dout_i[d] to dv and ds*q_i[d] to dk, queries ascending. dk = scale * that sum.
template <typename T>
__device__ void dkdv_impl(const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const int* __restrict__ cu_seqlens,
                          const T* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, int B, int T_tokens, int H, int Hkv,
                          int D, int causal, float scale, float* __restrict__ dk,
                          float* __restrict__ dv) {
    __shared__ float k_s[WARPS][MAX_HEAD_DIM];
    __shared__ float v_s[WARPS][MAX_HEAD_DIM];
    __shared__ DkvScratch<T> scratch[WARPS];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * WARPS + warp;
    const int g = blockIdx.y;
    if (t < T_tokens) {
        const int b = sequence_of(cu_seqlens, B, t);
        const int q_begin = causal ? t : cu_seqlens[b];
        const int n_q = cu_seqlens[b + 1] - q_begin;
        const int group = H / Hkv;
        const size_t krow = ((size_t)t * Hkv + g) * D;
        for (int d = lane; d < D; d += 32) {
            k_s[warp][d] = load_f32(k + krow + d);
            v_s[warp][d] = load_f32(v + krow + d);
        }
        __syncwarp();
        float acc_k[DIMS_PER_LANE], acc_v[DIMS_PER_LANE];
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            acc_k[i] = 0.0f;
            acc_v[i] = 0.0f;
        }
        DkvScratch<T>* sc = &scratch[warp];
        for (int h = g * group; h < (g + 1) * group; ++h) {
            for (int c0 = 0; c0 < n_q; c0 += KEY_CHUNK) {
                const int i_q = c0 + lane;
                float p = 0.0f, ds = 0.0f;
                const T* qp = nullptr;
                const T* dop = nullptr;
                if (i_q < n_q) {
                    const size_t r = (size_t)(q_begin + i_q) * H + h;
                    qp = q + r * D;
                    dop = dout + r * D;
                    const float s = mul_rn(dot_row(k_s[warp], qp, D), scale);
                    p = expf(s - lse[r]);
                    const float dp = dot_row(v_s[warp], dop, D);
                    ds = mul_rn(p, dp - delta[r]);
                }
                sc->p[lane] = p;
                sc->ds[lane] = ds;
                sc->q[lane] = qp;
                sc->dout[lane] = dop;
                __syncwarp();
                for (int jj = 0; jj < KEY_CHUNK; ++jj) {
                    const T* qj = sc->q[jj];
                    if (qj == nullptr) break;  // absent queries are the chunk's tail
                    const T* doj = sc->dout[jj];
                    const float pj = sc->p[jj], dsj = sc->ds[jj];
#pragma unroll
                    for (int i = 0; i < DIMS_PER_LANE; ++i) {
                        const int d = lane + 32 * i;
                        if (d < D) {
                            acc_v[i] = fmaf(pj, load_f32(doj + d), acc_v[i]);
                            acc_k[i] = fmaf(dsj, load_f32(qj + d), acc_k[i]);
                        }
                    }
                }
                __syncwarp();
            }
        }
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < D) {
                dk[krow + d] = mul_rn(acc_k[i], scale);
                dv[krow + d] = acc_v[i];
            }
        }
    }
}

}  // namespace sluice_attention

using namespace sluice_attention;

// grid (ceil(T / 4), H), block 128.
extern "C" __global__ void __launch_bounds__(128) attention_forward_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_impl<float>(q, k, v, cu_seqlens, B, T_tokens, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(128) attention_forward_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_impl<__nv_bfloat16>(q, k, v, cu_seqlens, B, T_tokens, H, Hkv, D, causal, scale, out, lse);
}

// grid (ceil(rows / 128)), block 128; rows = T * H.
extern "C" __global__ void __launch_bounds__(128) attention_bwd_delta_f32(const float* __restrict__ dout, const float* __restrict__ out, int rows, int D, float* __restrict__ delta) {
    delta_impl<float>(dout, out, rows, D, delta);
}

extern "C" __global__ void __launch_bounds__(128) attention_bwd_delta_bf16(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ out, int rows, int D, float* __restrict__ delta) {
    delta_impl<__nv_bfloat16>(dout, out, rows, D, delta);
}

// grid (ceil(T / 4), H), block 128. No __launch_bounds__ on dq/dkdv: with it ptxas 13.0 spills
// a few registers on sm_90a (at 40-48 registers); without it they use 48-62 and none spill.
extern "C" __global__ void attention_bwd_dq_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ cu_seqlens, const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_impl<float>(q, k, v, cu_seqlens, dout, lse, delta, B, T_tokens, H, Hkv, D, causal, scale, dq);
}

extern "C" __global__ void attention_bwd_dq_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_impl<__nv_bfloat16>(q, k, v, cu_seqlens, dout, lse, delta, B, T_tokens, H, Hkv, D, causal, scale, dq);
}

// grid (ceil(T / 4), Hkv), block 128.
extern "C" __global__ void attention_bwd_dkdv_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ cu_seqlens, const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_impl<float>(q, k, v, cu_seqlens, dout, lse, delta, B, T_tokens, H, Hkv, D, causal, scale, dk, dv);
}

extern "C" __global__ void attention_bwd_dkdv_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_impl<__nv_bfloat16>(q, k, v, cu_seqlens, dout, lse, delta, B, T_tokens, H, Hkv, D, causal, scale, dk, dv);
}
