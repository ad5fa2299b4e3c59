// paged_attention.cu — the paged KV cache: kv_append and the decode attention kernel.
//
// Cache layout (DESIGN.md 3.5): k_cache and v_cache are [NB, BS, Hkv, D] (NB blocks of BS token
// slots; BS = 16 by default, any BS >= 1 works). Token slot s = block * BS + offset.
//
// Kernels
//   paged_attention_kv_append_{f32,bf16}  one warp per (new token, kv head): copies its K and V
//                                         rows into slot slot_mapping[t] (slots < 0 are skipped:
//                                         padding). Each destination row has one writer when the
//                                         slots are distinct (the Rust side checks).
//   paged_attention_decode_{f32,bf16}     one warp per (sequence, head): the query's online
//                                         softmax over its context_lens[b] keys, through the SAME
//                                         chunk_step as attention_forward (common/attention_chunk.cuh),
//                                         with the same chunks (32 keys from the sequence start).
//                                         Lane j finds key j's slot through the block table by
//                                         itself, so a chunk may span two (or, for BS < 32,
//                                         several) cache blocks: chunks never depend on block
//                                         boundaries, and the output equals the training
//                                         forward's for that query bit for bit.
//   paged_attention_prefill_{f32,bf16}    chunked prefill: several new queries per sequence (a
//                                         prompt, an observation turn) over the cache, one warp per
//                                         (token, head), the same chunk_step and chunks.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_chunk.cuh"

namespace sluice_paged {

using namespace sluice_attention;

template <typename T>
__device__ void kv_append_impl(const T* __restrict__ k_new, const T* __restrict__ v_new,
                               const int* __restrict__ slot_mapping, int T_tokens, int Hkv, int D,
                               long long n_slots, T* __restrict__ k_cache,
                               T* __restrict__ v_cache) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * (blockDim.x / 32) + warp;
    const int g = blockIdx.y;
    if (t < T_tokens) {
        const long long slot = slot_mapping[t];
        if (slot >= 0 && slot < n_slots) {
            const size_t src = ((size_t)t * Hkv + g) * D;
            const size_t dst = ((size_t)slot * Hkv + g) * D;
            for (int d = lane; d < D; d += 32) {
                k_cache[dst + d] = k_new[src + d];
                v_cache[dst + d] = v_new[src + d];
            }
        }
    }
}

template <typename T>
__device__ void decode_impl(const T* __restrict__ q, const T* __restrict__ k_cache,
                            const T* __restrict__ v_cache, const int* __restrict__ block_table,
                            const int* __restrict__ context_lens, int H, int Hkv, int D, int BS,
                            int MB, float scale, float* __restrict__ out) {
    __shared__ float q_s[MAX_HEAD_DIM];
    __shared__ ChunkScratch<T> scratch;
    const int lane = threadIdx.x;
    const int b = blockIdx.x;
    const int h = blockIdx.y;
    const int g = h / (H / Hkv);
    const int n_keys = context_lens[b];
    const size_t qrow = ((size_t)b * H + h) * D;
    float* out_row = out + qrow;
    if (n_keys <= 0) {
        // An empty context (a padding entry of the batch) has no keys: its output is zero.
        for (int d = lane; d < D; d += 32) out_row[d] = 0.0f;
    } else {
        load_row_f32(q_s, q + qrow, D, lane);
        RowState st;
        row_init(st);
        const int* table = block_table + (size_t)b * MB;
        for (int c0 = 0; c0 < n_keys; c0 += KEY_CHUNK) {
            const int j = c0 + lane;
            const T* kp = nullptr;
            const T* vp = nullptr;
            if (j < n_keys) {
                const size_t slot = (size_t)table[j / BS] * BS + (j % BS);
                const size_t row = (slot * Hkv + g) * D;
                kp = k_cache + row;
                vp = v_cache + row;
            }
            chunk_step(st, q_s, kp, vp, D, scale, &scratch, lane);
        }
        row_finish(st, out_row, D, lane);
    }
}

// Chunked prefill: several new queries per sequence over the cache (which already holds their own
// keys, appended by kv_append). Sequence b's new tokens are cu_seqlens[b] .. cu_seqlens[b+1]-1 of
// q; its cache holds context_lens[b] keys, the last n_b of them the new tokens', so new token i
// sits at position context_lens[b] - n_b + i and sees keys 0 ..= that position (causal). One warp
// per (token, head), the same chunk_step: a row's bits equal attention_forward's for that token.
template <typename T>
__device__ void prefill_impl(const T* __restrict__ q, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const int* __restrict__ block_table,
                             const int* __restrict__ cu_seqlens,
                             const int* __restrict__ context_lens, int B, int T_tokens, int H,
                             int Hkv, int D, int BS, int MB, float scale,
                             float* __restrict__ out) {
    constexpr int WARPS = 4;
    __shared__ float q_s[WARPS][MAX_HEAD_DIM];
    __shared__ ChunkScratch<T> scratch[WARPS];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y;
    if (t < T_tokens) {  // warp-uniform
        int lo = 0, hi = B - 1;  // the last b with cu_seqlens[b] <= t
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (cu_seqlens[mid] <= t) lo = mid;
            else hi = mid - 1;
        }
        const int b = lo;
        const int n_new = cu_seqlens[b + 1] - cu_seqlens[b];
        const int n_keys = context_lens[b] - n_new + (t - cu_seqlens[b]) + 1;
        const int g = h / (H / Hkv);
        const size_t qrow = ((size_t)t * H + h) * D;
        load_row_f32(q_s[warp], q + qrow, D, lane);
        RowState st;
        row_init(st);
        const int* table = block_table + (size_t)b * MB;
        for (int c0 = 0; c0 < n_keys; c0 += KEY_CHUNK) {
            const int j = c0 + lane;
            const T* kp = nullptr;
            const T* vp = nullptr;
            if (j < n_keys) {
                const size_t slot = (size_t)table[j / BS] * BS + (j % BS);
                const size_t row = (slot * Hkv + g) * D;
                kp = k_cache + row;
                vp = v_cache + row;
            }
            chunk_step(st, q_s[warp], kp, vp, D, scale, &scratch[warp], lane);
        }
        row_finish(st, out + qrow, D, lane);
    }
}

}  // namespace sluice_paged

using namespace sluice_paged;

// grid (ceil(T / 4), Hkv), block 128.
extern "C" __global__ void __launch_bounds__(128) paged_attention_kv_append_f32(const float* __restrict__ k_new, const float* __restrict__ v_new, const int* __restrict__ slot_mapping, int T_tokens, int Hkv, int D, long long n_slots, float* __restrict__ k_cache, float* __restrict__ v_cache) {
    kv_append_impl<float>(k_new, v_new, slot_mapping, T_tokens, Hkv, D, n_slots, k_cache, v_cache);
}

extern "C" __global__ void __launch_bounds__(128) paged_attention_kv_append_bf16(const __nv_bfloat16* __restrict__ k_new, const __nv_bfloat16* __restrict__ v_new, const int* __restrict__ slot_mapping, int T_tokens, int Hkv, int D, long long n_slots, __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache) {
    kv_append_impl<__nv_bfloat16>(k_new, v_new, slot_mapping, T_tokens, Hkv, D, n_slots, k_cache, v_cache);
}

// grid (B, H), block 32.
extern "C" __global__ void __launch_bounds__(32) paged_attention_decode_f32(const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_impl<float>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(32) paged_attention_decode_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_impl<__nv_bfloat16>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

// grid (ceil(T / 4), H), block 128.
extern "C" __global__ void __launch_bounds__(128) paged_attention_prefill_f32(const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int T_tokens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_impl<float>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, T_tokens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(128) paged_attention_prefill_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int T_tokens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_impl<__nv_bfloat16>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, T_tokens, H, Hkv, D, BS, MB, scale, out);
}
