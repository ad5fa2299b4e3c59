// attention_wgmma.cu — training attention v3 on sm_90a (bf16 inputs, head dim <= 128): the
// forward, FlashAttention-3 style (wgmma, tensor copies, a warp-specialised producer and two
// consumer warpgroups), over varlen packed batches. The tile routine, its order and the bits
// contract are in common/attention_wgmma.cuh; the design and its predicted figures in
// docs/perf/attention.md ("v3").
//
// Shapes as attention_tc.cu: q[T,H,D], k[T,Hkv,D], v[T,Hkv,D] bf16, cu_seqlens[B+1], out[T,H,D]
// f32, lse[T,H] f32; GQA head h reads kv head h / (H / Hkv).
//
// attention_wgmma_forward_d{64,128}: one block of 384 threads per (query tile, head); a query
// tile is 128 positions of one sequence starting at a multiple of 128 from the sequence start
// (64 per consumer warpgroup). D is zero-padded to DP = 64 or 128. The producer warp brings K and
// V tiles of 128 keys by tensor copies (128-byte swizzle, one box of 64 head dims x 128 keys per
// copy) where D == DP; a sequence's last, partial tile (and every tile when D < DP, whose rows
// are not whole boxes) is gathered row by row with cp.async into the same layout, zero rows past
// the sequence's last key. The `_gather` kernels gather every tile (no tensor maps: any D, any
// alignment). Both give the same bits: the stage holds the same values either way.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_wgmma.cuh"

#if SLUICE_HOPPER_OK
namespace sluice_attention_wgmma_fwd {

using namespace sluice_attention_wgmma;

constexpr int CONSUMERS = 2;
constexpr int ROWS = CONSUMERS * WG_ROWS;  // 128 positions a block

// The sequence and first row of query tile `tile` (of ROWS rows); false past the last.
__device__ __forceinline__ bool find_query_tile(const int* cu_seqlens, int B, int tile, int& b,
                                                int& row0) {
    for (int s = 0; s < B; ++s) {
        const int n = (cu_seqlens[s + 1] - cu_seqlens[s] + ROWS - 1) / ROWS;
        if (tile < n) {
            b = s;
            row0 = tile * ROWS;
            return true;
        }
        tile -= n;
    }
    return false;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

template <int DP, bool TMA>
__device__ __forceinline__ void forward_impl(const CUtensorMap* map_k, const CUtensorMap* map_v,
                                             const __nv_bfloat16* __restrict__ q,
                                             const __nv_bfloat16* __restrict__ k,
                                             const __nv_bfloat16* __restrict__ v,
                                             const int* __restrict__ cu_seqlens, int B, int H,
                                             int Hkv, int D, int causal, float scale,
                                             float* __restrict__ out, float* __restrict__ lse) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    int b = 0, row0 = 0;
    if (!find_query_tile(cu_seqlens, B, blockIdx.x, b, row0)) return;  // uniform
    const int s0 = cu_seqlens[b];
    const int L = cu_seqlens[b + 1] - s0;
    const int h = blockIdx.y;
    const int g = h / (H / Hkv);
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
    // The block's last visible key decides its tiles: causal, its last row's position.
    const int last_row = min(row0 + ROWS, L) - 1;
    const int n_tiles = (causal ? last_row : L - 1) / KEY_TILE + 1;
    const size_t kv_stride = (size_t)Hkv * D;
    const __nv_bfloat16* k_base = k + ((size_t)s0 * Hkv + g) * D;
    const __nv_bfloat16* v_base = v + ((size_t)s0 * Hkv + g) * D;
    auto produce = [&](int tile, unsigned char* stage, const sluice::Ring<STAGES>& ring,
                       const sluice::RingPosition<STAGES>& pos, int lane) {
        const int key0 = tile * KEY_TILE;
        produce_rows<DP, TMA>(stage, ring, pos, lane, map_k, map_v, g, s0 + key0,
                              min(KEY_TILE, L - key0), k_base + (size_t)key0 * kv_stride,
                              v_base + (size_t)key0 * kv_stride, kv_stride, D, vec_ok);
    };
    attend_block<DP, CONSUMERS>(
        smem_raw, n_tiles, produce,
        [&](int r) -> const __nv_bfloat16* {
            return row0 + r < L ? q + ((size_t)(s0 + row0 + r) * H + h) * D : nullptr;
        },
        [&](int r) {
            const int p = row0 + r;
            if (p >= L) return -1;
            return causal ? p : L - 1;
        },
        [&](int r) -> float* {
            return row0 + r < L ? out + ((size_t)(s0 + row0 + r) * H + h) * D : nullptr;
        },
        [&](int r, float x) { lse[(size_t)(s0 + row0 + r) * H + h] = x; }, D, scale, vec_ok);
}

}  // namespace sluice_attention_wgmma_fwd

template <int DP, bool TMA>
__device__ __forceinline__ void forward_kernel(const CUtensorMap* map_k, const CUtensorMap* map_v,
                                               const __nv_bfloat16* q, const __nv_bfloat16* k,
                                               const __nv_bfloat16* v, const int* cu_seqlens,
                                               int B, int H, int Hkv, int D, int causal,
                                               float scale, float* out, float* lse) {
    sluice_attention_wgmma_fwd::forward_impl<DP, TMA>(map_k, map_v, q, k, v, cu_seqlens, B, H,
                                                      Hkv, D, causal, scale, out, lse);
}
#else
// compute_80 PTX: wgmma, tensor copies and mbarrier transactions need sm_90a. The host never
// launches these kernels on such a GPU (ops/attention_wgmma.rs refuses first); trap if it does.
template <int DP, bool TMA>
__device__ __forceinline__ void forward_kernel(const void*, const void*, const __nv_bfloat16*,
                                               const __nv_bfloat16*, const __nv_bfloat16*,
                                               const int*, int, int, int, int, int, float, float*,
                                               float*) {
    __trap();
}
#endif

// Grid (ceil(T / 128) + B, H), block 384, dynamic shared memory Layout<DP, 2>::SHARED_BYTES
// (kernels/src/ops/attention_wgmma.rs). The tensor maps are over k and v as [T, Hkv, D] with
// boxes of 64 x 1 x 128 and the 128-byte swizzle. Written out per DP: build.rs finds the
// kernels by their declarations.
extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_forward_d64(const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_kernel<64, true>(&map_k, &map_v, q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_forward_d128(const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_kernel<128, true>(&map_k, &map_v, q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_forward_gather_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_kernel<64, false>(nullptr, nullptr, q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_forward_gather_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_kernel<128, false>(nullptr, nullptr, q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}
