// paged_attention_wgmma.cu — paged decode and chunked prefill v3 on sm_90a (bf16 cache, head
// dim <= 128), on the tile routine of the training forward v3 (common/attention_wgmma.cuh), so
// a query's output equals attention_wgmma_forward's for that token bit for bit on one device.
//
// Cache layout as paged_attention.cu: k_cache, v_cache [NB, BS, Hkv, D]; sequence b's key j lives
// in slot block_table[b, j / BS] * BS + j % BS. The block table stays on the device: the
// producer warp looks each key row of a tile up through it as it gathers the tile (cp.async into
// the swizzled layout), so tiles never depend on block boundaries and any BS works. No split-KV:
// training would have to split the same way.
//
// paged_attention_wgmma_decode_d{64,128}: a block of 256 threads (the producer warpgroup and one
//   consumer warpgroup) per (sequence, kv head, group of 64 query heads): the GQA group's
//   queries are rows of the m64 tile (padding rows are computed and never written), all at
//   position context_lens[b] - 1. At decode's DRAM bound the padding costs nothing.
// paged_attention_wgmma_prefill_d{64,128}: 384 threads per (128-position tile of a sequence,
//   head), as the training forward: the tile's rows are sequence positions 128 i .. 128 i + 127,
//   of which the new tokens are attended (the others are padding).
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_wgmma.cuh"

#if SLUICE_HOPPER_OK
namespace sluice_paged_wgmma {

using namespace sluice_attention_wgmma;

constexpr int PREFILL_ROWS = 2 * WG_ROWS;

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

// Key j's K and V rows (of kv head g) in the caches, through one sequence's block-table row:
// one lookup for both.
struct PagedRows {
    const __nv_bfloat16* k_cache;
    const __nv_bfloat16* v_cache;
    const int* table;
    int BS, Hkv, D, g;
    __device__ __forceinline__ KvRows operator()(int j) const {
        const size_t row = ((size_t)table[j / BS] * BS + (j % BS)) * Hkv + g;
        return KvRows{k_cache + row * D, v_cache + row * D};
    }
};

// The producer of a paged block: tile `tile` of the sequence's n_keys keys, gathered.
template <int DP>
struct PagedProducer {
    PagedRows rows;
    int n_keys, D;
    bool vec_ok;
    __device__ __forceinline__ void operator()(int tile, unsigned char* stage,
                                               const sluice::Ring<STAGES>& ring,
                                               const sluice::RingPosition<STAGES>& pos,
                                               int lane) const {
        const int key0 = tile * KEY_TILE;
        const PagedRows kv = rows;
        gather_stage<DP>(
            stage,
            [=](int r) { return kv(key0 + r); },
            min(KEY_TILE, n_keys - key0), D, vec_ok, lane);
        if (lane == 0) ring.producer_commit(pos);
    }
};

template <int DP>
__device__ __forceinline__ void decode_impl(const __nv_bfloat16* __restrict__ q,
                                            const __nv_bfloat16* __restrict__ k_cache,
                                            const __nv_bfloat16* __restrict__ v_cache,
                                            const int* __restrict__ block_table,
                                            const int* __restrict__ context_lens, int H, int Hkv,
                                            int D, int BS, int MB, float scale,
                                            float* __restrict__ out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int b = blockIdx.x;
    const int g = blockIdx.y;
    const int group = H / Hkv;
    const int h0 = g * group + WG_ROWS * blockIdx.z;  // the head of row 0
    const int rows = min(WG_ROWS, group - WG_ROWS * (int)blockIdx.z);
    const int n = context_lens[b];
    if (n <= 0) {
        // An empty context (a padding entry of the batch) has no keys: its output is zero.
        for (int i = threadIdx.x; i < rows * D; i += blockDim.x)
            out[((size_t)b * H + h0 + i / D) * D + i % D] = 0.0f;
        return;
    }
    const int* table = block_table + (size_t)b * MB;
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k_cache) && aligned16(v_cache);
    attend_block<DP, 1>(
        smem_raw, (n - 1) / KEY_TILE + 1,
        PagedProducer<DP>{PagedRows{k_cache, v_cache, table, BS, Hkv, D, g}, n, D, vec_ok},
        [&](int r) -> const __nv_bfloat16* {
            return r < rows ? q + ((size_t)b * H + h0 + r) * D : nullptr;
        },
        [=](int r) { return r < rows ? n - 1 : -1; },
        [&](int r) -> float* { return r < rows ? out + ((size_t)b * H + h0 + r) * D : nullptr; },
        [](int, float) {}, D, scale, vec_ok);
}

template <int DP>
__device__ __forceinline__ void prefill_impl(const __nv_bfloat16* __restrict__ q,
                                             const __nv_bfloat16* __restrict__ k_cache,
                                             const __nv_bfloat16* __restrict__ v_cache,
                                             const int* __restrict__ block_table,
                                             const int* __restrict__ cu_seqlens,
                                             const int* __restrict__ context_lens, int B, int H,
                                             int Hkv, int D, int BS, int MB, float scale,
                                             float* __restrict__ out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
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
    // The block's last new position decides its tiles.
    const int last = min(pos0 + PREFILL_ROWS, c) - 1;
    attend_block<DP, 2>(
        smem_raw, last / KEY_TILE + 1,
        PagedProducer<DP>{PagedRows{k_cache, v_cache, table, BS, Hkv, D, g}, c, D, vec_ok},
        [&](int r) -> const __nv_bfloat16* {
            return is_new(r) ? q + ((size_t)token(r) * H + h) * D : nullptr;
        },
        [=](int r) { return is_new(r) ? pos0 + r : -1; },
        [&](int r) -> float* { return is_new(r) ? out + ((size_t)token(r) * H + h) * D : nullptr; },
        [](int, float) {}, D, scale, vec_ok);
}

}  // namespace sluice_paged_wgmma

template <int DP>
__device__ __forceinline__ void decode_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k_cache,
                                              const __nv_bfloat16* v_cache, const int* block_table,
                                              const int* context_lens, int H, int Hkv, int D,
                                              int BS, int MB, float scale, float* out) {
    sluice_paged_wgmma::decode_impl<DP>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D,
                                        BS, MB, scale, out);
}
template <int DP>
__device__ __forceinline__ void prefill_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k_cache,
                                               const __nv_bfloat16* v_cache, const int* block_table,
                                               const int* cu_seqlens, const int* context_lens,
                                               int B, int H, int Hkv, int D, int BS, int MB,
                                               float scale, float* out) {
    sluice_paged_wgmma::prefill_impl<DP>(q, k_cache, v_cache, block_table, cu_seqlens,
                                         context_lens, B, H, Hkv, D, BS, MB, scale, out);
}
#else
// compute_80 PTX: these kernels need sm_90a; the host never launches them on such a GPU.
template <int DP>
__device__ __forceinline__ void decode_kernel(const __nv_bfloat16*, const __nv_bfloat16*,
                                              const __nv_bfloat16*, const int*, const int*, int,
                                              int, int, int, int, float, float*) {
    __trap();
}
template <int DP>
__device__ __forceinline__ void prefill_kernel(const __nv_bfloat16*, const __nv_bfloat16*,
                                               const __nv_bfloat16*, const int*, const int*,
                                               const int*, int, int, int, int, int, int, float,
                                               float*) {
    __trap();
}
#endif

// Decode: grid (B, Hkv, ceil((H / Hkv) / 64)), block 256, dynamic shared memory
// Layout<DP, 1>::SHARED_BYTES. Prefill: grid (ceil(T / 128) + 2 B, H), block 384, dynamic shared
// memory Layout<DP, 2>::SHARED_BYTES (kernels/src/ops/attention_wgmma.rs). Written out per DP:
// build.rs finds the kernels by their declarations.
extern "C" __global__ void __launch_bounds__(256, 1) paged_attention_wgmma_decode_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_kernel<64>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(256, 1) paged_attention_wgmma_decode_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ context_lens, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    decode_kernel<128>(q, k_cache, v_cache, block_table, context_lens, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(384, 1) paged_attention_wgmma_prefill_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_kernel<64>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, H, Hkv, D, BS, MB, scale, out);
}

extern "C" __global__ void __launch_bounds__(384, 1) paged_attention_wgmma_prefill_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, int B, int H, int Hkv, int D, int BS, int MB, float scale, float* __restrict__ out) {
    prefill_kernel<128>(q, k_cache, v_cache, block_table, cu_seqlens, context_lens, B, H, Hkv, D, BS, MB, scale, out);
}
