// paged_attention_tc.cu — paged decode and chunked prefill v2 (bf16 cache, head dim <= 128), on
// the tensor-core tile step of the training forward (common/attention_tile.cuh), so a query's
// output equals attention_tc_forward's for that token bit for bit on one device.
//
// Cache layout as paged_attention.cu: k_cache, v_cache [NB, BS, Hkv, D]; sequence b's key j lives
// in slot block_table[b, j / BS] * BS + j % BS. The block table stays on the device: each key row
// of a tile is found through it when the tile is staged, so tiles never depend on block
// boundaries and any BS works. No split-KV: training would have to split the same way.
//
// paged_attention_tc_decode_d{16,32,64,128}: one warp per (sequence, kv head, group of 16 query
//   heads): the GQA group's queries are the rows of one m16 tile (padding rows are never
//   written), all at position context_lens[b] - 1.
// paged_attention_tc_prefill_d{16,32,64,128}: 4 warps per (128-position tile of a sequence,
//   head): the tile's rows are sequence positions 128 i .. 128 i + 127, of which the new tokens
//   are attended (the others are padding), so warps hold 32 rows aligned to 32 as in training.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_tile.cuh"

namespace sluice_paged_tc {

using namespace sluice_attention_tile;

constexpr int PREFILL_WARPS = 4;
constexpr int PREFILL_ROWS = PREFILL_WARPS * WARP_ROWS;

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

// Key j's row (of kv head g) in a cache, through one sequence's block-table row.
struct PagedRows {
    const __nv_bfloat16* cache;
    const int* table;
    int BS, Hkv, D, g;
    __device__ __forceinline__ const __nv_bfloat16* operator()(int j) const {
        const size_t slot = (size_t)table[j / BS] * BS + (j % BS);
        return cache + (slot * Hkv + g) * D;
    }
};

template <int DP>
__device__ void decode_impl(const __nv_bfloat16* __restrict__ q,
                            const __nv_bfloat16* __restrict__ k_cache,
                            const __nv_bfloat16* __restrict__ v_cache,
                            const int* __restrict__ block_table,
                            const int* __restrict__ context_lens, int H, int Hkv, int D, int BS,
                            int MB, float scale, float* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int b = blockIdx.x;
    const int g = blockIdx.y;
    const int group = H / Hkv;
    const int h0 = g * group + 16 * blockIdx.z;  // the head of row 0
    const int rows = min(16, group - 16 * (int)blockIdx.z);
    const int n = context_lens[b];
    if (n <= 0) {
        // An empty context (a padding entry of the batch) has no keys: its output is zero.
        for (int i = threadIdx.x; i < rows * D; i += 32)
            out[((size_t)b * H + h0 + i / D) * D + i % D] = 0.0f;
        return;
    }
    const int* table = block_table + (size_t)b * MB;
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k_cache) && aligned16(v_cache);
    attend_block<DP, 1, 1>(
        smem,
        [&](int r) -> const __nv_bfloat16* {
            return r < rows ? q + ((size_t)b * H + h0 + r) * D : nullptr;
        },
        [=](int r) { return r < rows ? n - 1 : -1; }, PagedRows{k_cache, table, BS, Hkv, D, g},
        PagedRows{v_cache, table, BS, Hkv, D, g}, n,
        [&](int r) { return out + ((size_t)b * H + h0 + r) * D; }, [](int, float) {}, D, scale,
        vec_ok);
}

template <int DP>
__device__ void prefill_impl(const __nv_bfloat16* __restrict__ q,
                             const __nv_bfloat16* __restrict__ k_cache,
                             const __nv_bfloat16* __restrict__ v_cache,
                             const int* __restrict__ block_table,
                             const int* __restrict__ cu_seqlens,
                             const int* __restrict__ context_lens, int B, int H, int Hkv, int D,
                             int BS, int MB, float scale, float* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem[];
    // Find this block's (sequence, position tile): sequence s's new tokens sit at positions
    // c - n .. c - 1 and cover tiles (c - n) / 128 ..= (c - 1) / 128.
    int tile = blockIdx.x, b = -1, first_new = 0, c = 0;
    for (int s = 0; s < B; ++s) {
        const int n_new = cu_seqlens[s + 1] - cu_seqlens[s];
        const int cs = context_lens[s];
        if (n_new <= 0) continue;
        const int t0 = (cs - n_new) / PREFILL_ROWS, t1 = (cs - 1) / PREFILL_ROWS;
        if (tile <= t1 - t0) {
            b = s;
            first_new = cs - n_new;
            c = cs;
            tile += t0;
            break;
        }
        tile -= t1 - t0 + 1;
    }
    if (b < 0) return;  // uniform: past the last tile
    const int h = blockIdx.y;
    const int g = h / (H / Hkv);
    const int pos0 = tile * PREFILL_ROWS;
    const int t_first = cu_seqlens[b];  // packed index of the first new token
    const int* table = block_table + (size_t)b * MB;
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k_cache) && aligned16(v_cache);
    auto is_new = [=](int r) { return pos0 + r >= first_new && pos0 + r < c; };
    auto token = [=](int r) { return t_first + (pos0 + r - first_new); };
    attend_block<DP, WARP_ROWS / 16, PREFILL_WARPS>(
        smem,
        [&](int r) -> const __nv_bfloat16* {
            return is_new(r) ? q + ((size_t)token(r) * H + h) * D : nullptr;
        },
        [=](int r) { return is_new(r) ? pos0 + r : -1; },
        PagedRows{k_cache, table, BS, Hkv, D, g}, PagedRows{v_cache, table, BS, Hkv, D, g}, c,
        [&](int r) { return out + ((size_t)token(r) * H + h) * D; }, [](int, float) {}, D, scale,
        vec_ok);
}

}  // namespace sluice_paged_tc

using namespace sluice_paged_tc;

// Decode: grid (B, Hkv, ceil((H / Hkv) / 16)), block 32, dynamic shared memory
// block_smem_bytes<DP, 1, 1>(). Prefill: grid (ceil(T / 128) + 2 B, H), block 128, dynamic shared
// memory block_smem_bytes<DP, 2, 4>() (kernels/src/ops/attention_tile.rs). Written out per DP:
// build.rs finds the kernels by their declarations.
extern "C" __global__ void __launch_bounds__(32) paged_attention_tc_decode_d16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_impl<16>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(32) paged_attention_tc_decode_d32(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_impl<32>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(32) paged_attention_tc_decode_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_impl<64>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(32) paged_attention_tc_decode_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_impl<128>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(128) paged_attention_tc_prefill_d16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_impl<16>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(128) paged_attention_tc_prefill_d32(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_impl<32>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(128) paged_attention_tc_prefill_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_impl<64>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(128) paged_attention_tc_prefill_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_impl<128>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, H, Hkv, D, BS, MB, scale, out);
}
