// attention_wgmma_bwd.cu — the training backward of attention v3 on sm_90a: the dQ pass and the
// dK/dV pass of common/attention_wgmma_bwd.cuh (v2's two passes without atomics, on wgmma, with
// v2's bits under the emulator). The prep (delta = rowsum(dO * O), lse and delta head-major) is
// v2's kernel, attention_tc_bwd_prep.
//
// Shapes as attention_tc.cu: q[T,H,D], k, v [T,Hkv,D], dout[T,H,D] bf16, cu_seqlens[B+1],
// dq[T,H,D], dk, dv [T,Hkv,D] f32; lse_f, delta_f [H, stat_stride(T, B)] f32 in the fragment
// order of common/attention_bwd_stats.cuh.
//
// attention_wgmma_bwd_prep: delta = rowsum(dO * O) in v2's order (row_delta) and lse, written
//     in fragment order; one warp per (token, head) row, 128 threads a block.
// attention_wgmma_bwd_dq_d{64,128}:   grid (ceil(T / 128) + B, H), 384 threads; the producer
//     streams K and V tiles of 128 keys (tensor copies through map_k, map_v where whole).
// attention_wgmma_bwd_dkdv_d{64,128}: grid (ceil(T / 128) + B, Hkv), 384 threads; the producer
//     streams Q and dO tiles of 128 queries (through map_q, map_do), heads of the group outer.
// The `_gather` kernels gather every tile with cp.async (no tensor maps: any D, any alignment);
// the stage holds the same values either way.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_bwd_stats.cuh"
#include "common/attention_wgmma_bwd.cuh"

// The prep is plain CUDA (no sm_90a instruction): it is built for both PTX targets.
extern "C" __global__ void __launch_bounds__(128) attention_wgmma_bwd_prep(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ out, const float* __restrict__ lse, const int* __restrict__ cu_seqlens, int B, int T, int H, int D, float* __restrict__ delta_f, float* __restrict__ lse_f) {
    using namespace sluice_attention_stats;
    const int lane = threadIdx.x % 32;
    const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= (long long)T * H) return;  // warp-uniform
    const float delta = row_delta(dout + r * D, out + r * D, D, lane);
    if (lane != 0) return;
    const int t = (int)(r / H), h = (int)(r % H);
    // The sequence holding token t: the last b < B with cu_seqlens[b] <= t (empty sequences
    // before it share its start and are skipped by taking the last).
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_seqlens[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int s0 = cu_seqlens[lo];
    const size_t at = (size_t)h * stat_stride(T, B) + stat_seq_offset(s0, lo) + stat_slot(t - s0);
    delta_f[at] = delta;
    lse_f[at] = lse[r];
}

#if SLUICE_HOPPER_OK
namespace sluice_attention_wgmma_bwd_k {

using namespace sluice_attention_wgmma_bwd;

constexpr int ROWS = CONSUMERS * WG_ROWS;  // 128 queries (dQ) or keys (dK/dV) a block

// The sequence and first row of row tile `tile` (of ROWS rows); false past the last.
__device__ __forceinline__ bool find_tile(const int* cu_seqlens, int B, int tile, int& b,
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

struct BwdArgs {
    const __nv_bfloat16* q;
    const __nv_bfloat16* k;
    const __nv_bfloat16* v;
    const int* cu_seqlens;
    const __nv_bfloat16* dout;
    const float* lse_f;
    const float* delta_f;
    int B, T, H, Hkv, D, causal;
    float scale;
};

template <int DP, bool TMA>
__device__ __forceinline__ void dq_impl(const CUtensorMap* map_k, const CUtensorMap* map_v,
                                        const BwdArgs& a, float* dq) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    int b = 0, row0 = 0;
    if (!find_tile(a.cu_seqlens, a.B, blockIdx.x, b, row0)) return;  // uniform
    const int s0 = a.cu_seqlens[b];
    const BwdSeq sq{s0, a.cu_seqlens[b + 1] - s0, a.causal, a.scale, a.T, a.D};
    const int h = blockIdx.y;
    const int g = h / (a.H / a.Hkv);
    const size_t stats = (size_t)h * stat_stride(a.T, a.B) + stat_seq_offset(s0, b);
    const bool vec_ok = a.D % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
                        aligned16(a.dout);
    const int last = sq.causal ? min(row0 + ROWS, sq.L) - 1 : sq.L - 1;
    const size_t kv_stride = (size_t)a.Hkv * a.D;
    const __nv_bfloat16* k_base = a.k + ((size_t)s0 * a.Hkv + g) * a.D;
    const __nv_bfloat16* v_base = a.v + ((size_t)s0 * a.Hkv + g) * a.D;
    auto row = [&](const __nv_bfloat16* base, int c) {
        return [=](int r) -> const __nv_bfloat16* {
            const int p = row0 + c * WG_ROWS + r;
            return p < sq.L ? base + ((size_t)(s0 + p) * a.H + h) * a.D : nullptr;
        };
    };
    run_pipeline<DP, CONSUMERS, 2>(
        smem_raw, last / KEY_TILE + 1,
        [&](int tile, unsigned char* stage, const sluice::Ring<STAGES>& ring,
            const sluice::RingPosition<STAGES>& pos, int lane) {
            const int key0 = tile * KEY_TILE;
            produce_rows<DP, TMA>(stage, ring, pos, lane, map_k, map_v, g, s0 + key0,
                                  min(KEY_TILE, sq.L - key0), k_base + (size_t)key0 * kv_stride,
                                  v_base + (size_t)key0 * kv_stride, kv_stride, a.D, vec_ok);
        },
        [&](int c, const sluice::Ring<STAGES>& ring, unsigned char* smem, unsigned char* stages) {
            dq_consume<DP>(c, ring, smem_raw, smem, stages, last / KEY_TILE + 1, row0, sq,
                           row(a.q, c), row(a.dout, c), a.lse_f + stats,
                           a.delta_f + stats,
                           [&](int p) { return dq + ((size_t)(s0 + p) * a.H + h) * a.D; },
                           vec_ok);
        });
}

template <int DP, bool TMA>
__device__ __forceinline__ void dkdv_impl(const CUtensorMap* map_q, const CUtensorMap* map_do,
                                          const BwdArgs& a, float* dk, float* dv) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    int b = 0, key0 = 0;
    if (!find_tile(a.cu_seqlens, a.B, blockIdx.x, b, key0)) return;  // uniform
    const int s0 = a.cu_seqlens[b];
    const BwdSeq sq{s0, a.cu_seqlens[b + 1] - s0, a.causal, a.scale, a.T, a.D};
    const int g = blockIdx.y;
    const int group = a.H / a.Hkv;
    const bool vec_ok = a.D % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
                        aligned16(a.dout);
    // Stream tiles: (head of the group, query tile of 128) with heads outer, both ascending;
    // causal: from the query tile holding the block's first key.
    const int qt_first = sq.causal ? key0 / KEY_TILE : 0;
    const int qt_count = (sq.L - 1) / KEY_TILE - qt_first + 1;
    const int n_items = group * qt_count;
    auto item = [=](int i, int& h, int& q0) {
        h = g * group + i / qt_count;
        q0 = (qt_first + i % qt_count) * KEY_TILE;
    };
    const size_t q_stride = (size_t)a.H * a.D;
    auto stats = [&](int h) {
        return (size_t)h * stat_stride(a.T, a.B) + stat_seq_offset(s0, b);
    };
    auto kv_row = [&](const __nv_bfloat16* base, int c) {
        return [=](int r) -> const __nv_bfloat16* {
            const int j = key0 + c * WG_ROWS + r;
            return j < sq.L ? base + ((size_t)(s0 + j) * a.Hkv + g) * a.D : nullptr;
        };
    };
    run_pipeline<DP, CONSUMERS, 2>(
        smem_raw, n_items,
        [&](int i, unsigned char* stage, const sluice::Ring<STAGES>& ring,
            const sluice::RingPosition<STAGES>& pos, int lane) {
            int h = 0, q0 = 0;
            item(i, h, q0);
            const size_t first = ((size_t)(s0 + q0) * a.H + h) * a.D;
            produce_rows<DP, TMA>(stage, ring, pos, lane, map_q, map_do, h, s0 + q0,
                                  min(KEY_TILE, sq.L - q0), a.q + first, a.dout + first, q_stride,
                                  a.D, vec_ok);
        },
        [&](int c, const sluice::Ring<STAGES>& ring, unsigned char* smem, unsigned char* stages) {
            dkdv_consume<DP>(
                c, ring, smem_raw, smem, stages, n_items, key0, sq, kv_row(a.k, c),
                kv_row(a.v, c), item, [&](int h) { return a.lse_f + stats(h); },
                [&](int h) { return a.delta_f + stats(h); },
                [&](int j) { return dk + ((size_t)(s0 + j) * a.Hkv + g) * a.D; },
                [&](int j) { return dv + ((size_t)(s0 + j) * a.Hkv + g) * a.D; }, vec_ok);
        });
}

}  // namespace sluice_attention_wgmma_bwd_k

template <int DP, bool TMA>
__device__ __forceinline__ void dq_kernel(const CUtensorMap* mk, const CUtensorMap* mv,
                                          const __nv_bfloat16* q, const __nv_bfloat16* k,
                                          const __nv_bfloat16* v, const int* cu_seqlens,
                                          const __nv_bfloat16* dout, const float* lse_f,
                                          const float* delta_f, int B, int T, int H, int Hkv,
                                          int D, int causal, float scale, float* dq) {
    using namespace sluice_attention_wgmma_bwd_k;
    dq_impl<DP, TMA>(mk, mv, BwdArgs{q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale}, dq);
}
template <int DP, bool TMA>
__device__ __forceinline__ void dkdv_kernel(const CUtensorMap* mq, const CUtensorMap* mdo,
                                            const __nv_bfloat16* q, const __nv_bfloat16* k,
                                            const __nv_bfloat16* v, const int* cu_seqlens,
                                            const __nv_bfloat16* dout, const float* lse_f,
                                            const float* delta_f, int B, int T, int H, int Hkv,
                                            int D, int causal, float scale, float* dk, float* dv) {
    using namespace sluice_attention_wgmma_bwd_k;
    dkdv_impl<DP, TMA>(mq, mdo, BwdArgs{q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale}, dk, dv);
}
#else
// compute_80 PTX: these kernels need sm_90a; the host never launches them on such a GPU.
template <int DP, bool TMA>
__device__ __forceinline__ void dq_kernel(const void*, const void*, const __nv_bfloat16*,
                                          const __nv_bfloat16*, const __nv_bfloat16*, const int*,
                                          const __nv_bfloat16*, const float*, const float*, int,
                                          int, int, int, int, int, float, float*) {
    __trap();
}
template <int DP, bool TMA>
__device__ __forceinline__ void dkdv_kernel(const void*, const void*, const __nv_bfloat16*,
                                            const __nv_bfloat16*, const __nv_bfloat16*, const int*,
                                            const __nv_bfloat16*, const float*, const float*, int,
                                            int, int, int, int, int, float, float*, float*) {
    __trap();
}
#endif

// Dynamic shared memory: Layout<DP, 2, 2>::SHARED_BYTES (kernels/src/ops/attention_wgmma.rs).
// The maps: dq over k and v, dkdv over q and dout, as [T, Hx, D] with boxes of 64 x 1 x 128 and
// the 128-byte swizzle. Written out per DP: build.rs finds the kernels by their declarations.
extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dq_d64(const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_kernel<64, true>(&map_k, &map_v, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dq);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dq_d128(const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_kernel<128, true>(&map_k, &map_v, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dq);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dq_gather_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_kernel<64, false>(nullptr, nullptr, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dq);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dq_gather_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_kernel<128, false>(nullptr, nullptr, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dq);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dkdv_d64(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_do, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_kernel<64, true>(&map_q, &map_do, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dk, dv);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dkdv_d128(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_do, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_kernel<128, true>(&map_q, &map_do, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dk, dv);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dkdv_gather_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_kernel<64, false>(nullptr, nullptr, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dk, dv);
}

extern "C" __global__ void __launch_bounds__(384, 1) attention_wgmma_bwd_dkdv_gather_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_f, const float* __restrict__ delta_f, int B, int T, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_kernel<128, false>(nullptr, nullptr, q, k, v, cu_seqlens, dout, lse_f, delta_f, B, T, H, Hkv, D, causal, scale, dk, dv);
}
