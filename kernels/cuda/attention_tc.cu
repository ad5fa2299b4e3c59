// attention_tc.cu — training attention v2 on tensor cores (bf16 inputs, head dim <= 128):
// forward and backward, FlashAttention-2 style, over varlen packed batches.
//
// Shapes as attention.cu: q[T,H,D], k[T,Hkv,D], v[T,Hkv,D] bf16, cu_seqlens[B+1], out[T,H,D] f32,
// lse[T,H] f32; GQA head h reads kv head h / (H / Hkv).
//
// attention_tc_forward_d{16,32,64,128}: one block of 4 warps per (query tile, head); a query tile
// is 128 rows of one sequence starting at a multiple of 128 from the sequence start (so a warp's
// 32 rows start at a multiple of 32: the alignment the bits contract of
// common/attention_tile.cuh needs). Block x walks the sequences' tile counts to find its tile;
// blocks past the last tile exit. D is zero-padded to the kernel's DP (16, 32, 64 or 128).
// Shared memory: the Q tile and two stages of (K, V) tiles, rows padded by 16 bytes.
// attention_tc_bwd_dkdv_d{DP}, attention_tc_bwd_dq_d{DP}: the backward's two passes (below).
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/attention_bwd_stats.cuh"
#include "common/attention_tile.cuh"

namespace sluice_attention_tc {

using namespace sluice_attention_tile;

constexpr int FWD_WARPS = 4;
constexpr int FWD_MT = WARP_ROWS / 16;
constexpr int FWD_ROWS = FWD_WARPS * WARP_ROWS;

// The sequence and first row of query tile `tile` of `rows` rows per tile; false past the last.
__device__ __forceinline__ bool find_query_tile(const int* cu_seqlens, int B, int rows, int tile,
                                                int& b, int& row0) {
    for (int s = 0; s < B; ++s) {
        const int n = (cu_seqlens[s + 1] - cu_seqlens[s] + rows - 1) / rows;
        if (tile < n) {
            b = s;
            row0 = tile * rows;
            return true;
        }
        tile -= n;
    }
    return false;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

template <int DP>
__device__ void forward_impl(const __nv_bfloat16* __restrict__ q,
                             const __nv_bfloat16* __restrict__ k,
                             const __nv_bfloat16* __restrict__ v,
                             const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D,
                             int causal, float scale, float* __restrict__ out,
                             float* __restrict__ lse) {
    extern __shared__ __align__(16) unsigned char smem[];
    int b = 0, row0 = 0;
    if (!find_query_tile(cu_seqlens, B, FWD_ROWS, blockIdx.x, b, row0)) return;  // uniform
    const int s0 = cu_seqlens[b];
    const int L = cu_seqlens[b + 1] - s0;
    const int h = blockIdx.y;
    const int g = h / (H / Hkv);
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
    auto pos_of = [&](int r) { return row0 + r; };
    // Hoisted so the loader keeps few registers live across the tile loop.
    const int kv_stride = Hkv * D;
    const __nv_bfloat16* k_base = k + ((size_t)s0 * Hkv + g) * D;
    const __nv_bfloat16* v_base = v + ((size_t)s0 * Hkv + g) * D;
    attend_block<DP, FWD_MT, FWD_WARPS>(
        smem,
        [&](int r) -> const __nv_bfloat16* {
            const int p = pos_of(r);
            return p < L ? q + ((size_t)(s0 + p) * H + h) * D : nullptr;
        },
        [&](int r) {
            const int p = pos_of(r);
            if (p >= L) return -1;
            return causal ? p : L - 1;
        },
        [=](int j) { return k_base + (size_t)j * kv_stride; },
        [=](int j) { return v_base + (size_t)j * kv_stride; }, L,
        [&](int r) { return out + ((size_t)(s0 + pos_of(r)) * H + h) * D; },
        [&](int r, float x) { lse[(size_t)(s0 + pos_of(r)) * H + h] = x; }, D, scale, vec_ok);
}

// ---------------------------------------------------------------------------------------------
// Backward (FlashAttention-2 style, two passes, no atomics). P is recomputed from lse; the
// products with P and dS run on mma.sync with P and dS rounded to bf16 (the CPU twin rounds them
// the same way); every sum has one owner and a fixed order:
//   dK, dV: a block owns 64 keys of one kv head (4 warps x 16 keys) and visits the GQA group's
//           heads ascending, and for each the query tiles of 32 that see its keys ascending;
//           dV += bf16(P)^T dO, dK += bf16(dS)^T Q, then dK *= scale.
//   dQ:     a block owns 64 queries of one head (4 warps x 16 rows) and visits the key tiles of
//           32 ascending; dQ += bf16(dS) K, then dQ *= scale.
// with dS = P * (dP - delta), dP = dO V^T, delta = rowsum(dO * O) (attention_tc_bwd_prep, which
// also lays delta and lse out head-major, so both passes read them in whole sectors).
// 16 rows a warp (not 32 as the forward): each warp holds two accumulators (dK and dV) or its
// S, dP and dQ at once, and at DP = 128 32 rows would not fit in registers.
// ---------------------------------------------------------------------------------------------
constexpr int BWD_WARPS = 4;
constexpr int BWD_ROWS = BWD_WARPS * 16;  // keys (dK/dV pass) or queries (dQ pass) per block
constexpr int BWD_QT = 32;                // queries per step of the dK/dV pass

template <int DP>
constexpr int dkdv_smem_bytes() {
    return 2 * BWD_ROWS * TileShape<DP>::ROW * 2 + 2 * (2 * BWD_QT * TileShape<DP>::ROW * 2 + 2 * BWD_QT * 4);
}
template <int DP>
constexpr int dq_smem_bytes() {
    return 2 * BWD_ROWS * TileShape<DP>::ROW * 2 + 2 * (2 * KEY_TILE * TileShape<DP>::ROW * 2);
}

// acc[n2 pairs] += A (16 x 16, from registers) * B (16 x DP, a row-major [k][DP] shared tile at
// b_s, k rows ascending): the B fragments through ldmatrix.trans.
template <int DP>
__device__ __forceinline__ void mma_rows_by_tile(float (&acc)[DP / 8][4], const uint32_t (&a)[4],
                                                 const __nv_bfloat16* b_s, int lane) {
    using S = TileShape<DP>;
#pragma unroll
    for (int n2 = 0; n2 < DP / 16; ++n2) {
        uint32_t b[4];
        sluice::ldmatrix_x4_trans(b, b_s + (((lane / 8) % 2) * 8 + lane % 8) * S::ROW + n2 * 16 + (lane / 16) * 8);
        const uint32_t b0[2] = {b[0], b[1]};
        const uint32_t b1[2] = {b[2], b[3]};
        sluice::mma_m16n8k16_bf16(acc[2 * n2], a, b0);
        sluice::mma_m16n8k16_bf16(acc[2 * n2 + 1], a, b1);
    }
}

// c[NT][4] = A (16 rows at a_s) * B^T (NT * 8 rows at b_s), both row-major [*][DP] shared tiles:
// the dot over the head dim, ascending in steps of 16, from 0.
template <int DP, int NT>
__device__ __forceinline__ void mma_rows_dot_rows(float (&c)[NT][4], const __nv_bfloat16* a_s,
                                                  const __nv_bfloat16* b_s, int lane) {
    using S = TileShape<DP>;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP; kk += 16) {
        uint32_t a[4];
        sluice::ldmatrix_x4(a, a_s + (lane % 16) * S::ROW + kk + (lane / 16) * 8);
#pragma unroll
        for (int n2 = 0; n2 < NT / 2; ++n2) {
            uint32_t b[4];
            sluice::ldmatrix_x4(b, b_s + (n2 * 16 + (lane / 16) * 8 + lane % 8) * S::ROW + kk + ((lane / 8) % 2) * 8);
            const uint32_t b0[2] = {b[0], b[1]};
            const uint32_t b1[2] = {b[2], b[3]};
            sluice::mma_m16n8k16_bf16(c[2 * n2], a, b0);
            sluice::mma_m16n8k16_bf16(c[2 * n2 + 1], a, b1);
        }
    }
}

// The A fragment of k-step j (columns 16 j .. 16 j + 15) from an accumulator tile, in bf16.
template <int NT>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[NT][4], int j) {
    a[0] = pack_bf16x2(c[2 * j][0], c[2 * j][1]);
    a[1] = pack_bf16x2(c[2 * j][2], c[2 * j][3]);
    a[2] = pack_bf16x2(c[2 * j + 1][0], c[2 * j + 1][1]);
    a[3] = pack_bf16x2(c[2 * j + 1][2], c[2 * j + 1][3]);
}

// Writes a warp's 16 x DP accumulator rows (times `scale` unless scale == 1) to rows r of
// dst + row_off(r) (row_off(r) < 0: not written), columns < D.
template <int DP, class RowOff>
__device__ __forceinline__ void store_rows(const float (&acc)[DP / 8][4], float* dst, RowOff row_off,
                                           int D, float scale, bool scaled, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long off = row_off(g + 8 * h);
        if (off < 0) continue;
        float* row = dst + off;
        const bool pair = pairs_aligned(row, D);
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
            const float x0 = acc[n][2 * h], x1 = acc[n][2 * h + 1];
            store_pair(row, 8 * n + 2 * t, D, scaled ? mul_rn(x0, scale) : x0,
                       scaled ? mul_rn(x1, scale) : x1, pair);
        }
    }
}

// delta[h][t] = rowsum(dO * O) (common/attention_bwd_stats.cuh's order) and lse[h][t],
// head-major for the two passes' coalesced reads. One warp per (token, head) row.
__device__ void prep_impl(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ out,
                          const float* __restrict__ lse, int T_tokens, int H, int D,
                          float* __restrict__ delta_t, float* __restrict__ lse_t) {
    const int lane = threadIdx.x % 32;
    const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= (long long)T_tokens * H) return;  // warp-uniform
    const float acc = sluice_attention_stats::row_delta(dout + r * D, out + r * D, D, lane);
    if (lane == 0) {
        const long long t = r / H, h = r % H;
        delta_t[h * T_tokens + t] = acc;
        lse_t[h * T_tokens + t] = lse[r];
    }
}

template <int DP>
__device__ void dkdv_impl(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                          const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens,
                          const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t,
                          const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv,
                          int D, int causal, float scale, float* __restrict__ dk,
                          float* __restrict__ dv) {
    using S = TileShape<DP>;
    constexpr int NT = BWD_QT / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    int b = 0, key0 = 0;
    if (!find_query_tile(cu_seqlens, B, BWD_ROWS, blockIdx.x, b, key0)) return;  // uniform
    const int s0 = cu_seqlens[b];
    const int L = cu_seqlens[b + 1] - s0;
    const int g = blockIdx.y;
    const int group = H / Hkv;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
    __nv_bfloat16* k_s = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* v_s = k_s + BWD_ROWS * S::ROW;
    unsigned char* stages = smem + 2 * BWD_ROWS * S::ROW * 2;
    constexpr int STAGE_BYTES = 2 * BWD_QT * S::ROW * 2 + 2 * BWD_QT * 4;
    auto q_stage = [&](int st) { return reinterpret_cast<__nv_bfloat16*>(stages + st * STAGE_BYTES); };
    auto do_stage = [&](int st) { return q_stage(st) + BWD_QT * S::ROW; };
    auto stat_stage = [&](int st) {  // lse[BWD_QT] then delta[BWD_QT]
        return reinterpret_cast<float*>(stages + st * STAGE_BYTES + 2 * BWD_QT * S::ROW * 2);
    };

    const size_t kv_stride = (size_t)Hkv * D;
    stage_rows<DP>(k_s, BWD_ROWS, [&](int r) -> const __nv_bfloat16* {
        return key0 + r < L ? k + (size_t)(s0 + key0 + r) * kv_stride + (size_t)g * D : nullptr;
    }, D, vec_ok, tid, BWD_WARPS * 32);
    stage_rows<DP>(v_s, BWD_ROWS, [&](int r) -> const __nv_bfloat16* {
        return key0 + r < L ? v + (size_t)(s0 + key0 + r) * kv_stride + (size_t)g * D : nullptr;
    }, D, vec_ok, tid, BWD_WARPS * 32);

    // Work items: (head of the group, query tile) with heads outer, both ascending.
    const int qt_first = causal ? key0 / BWD_QT : 0;
    const int qt_count = (L - 1) / BWD_QT - qt_first + 1;
    const int n_items = group * qt_count;
    auto stage_item = [&](int st, int item) {
        const int h = g * group + item / qt_count;
        const int i0 = (qt_first + item % qt_count) * BWD_QT;
        auto row = [&](const __nv_bfloat16* base) {
            return [=](int r) -> const __nv_bfloat16* {
                return i0 + r < L ? base + ((size_t)(s0 + i0 + r) * H + h) * D : nullptr;
            };
        };
        stage_rows<DP>(q_stage(st), BWD_QT, row(q), D, vec_ok, tid, BWD_WARPS * 32);
        stage_rows<DP>(do_stage(st), BWD_QT, row(dout), D, vec_ok, tid, BWD_WARPS * 32);
        float* stats = stat_stage(st);
        for (int r = tid; r < BWD_QT; r += BWD_WARPS * 32) {
            const bool in = i0 + r < L;
            stats[r] = in ? lse_t[(size_t)h * T_tokens + s0 + i0 + r] : 0.0f;
            stats[BWD_QT + r] = in ? delta_t[(size_t)h * T_tokens + s0 + i0 + r] : 0.0f;
        }
    };

    float acc_k[DP / 8][4], acc_v[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc_k[n][e] = 0.0f;
            acc_v[n][e] = 0.0f;
        }
    const int wkey0 = key0 + warp * 16;  // the warp's first key
    const bool warp_has_keys = wkey0 < L;

    stage_item(0, 0);
    sluice::cp_async_commit();
    for (int it = 0; it < n_items; ++it) {
        if (it + 1 < n_items) {
            stage_item((it + 1) % 2, it + 1);
            sluice::cp_async_commit();
            sluice::cp_async_wait<1>();
        } else {
            sluice::cp_async_wait<0>();
        }
        __syncthreads();
        const int i0 = (qt_first + it % qt_count) * BWD_QT;
        // Some query of the tile sees some key of the warp (warp-uniform).
        if (warp_has_keys && (!causal || i0 + BWD_QT - 1 >= wkey0)) {
            const int st = it % 2;
            const __nv_bfloat16* qs = q_stage(st);
            const __nv_bfloat16* dos = do_stage(st);
            const float* stats = stat_stage(st);
            float s[NT][4], dp[NT][4];
            mma_rows_dot_rows<DP, NT>(s, k_s + warp * 16 * S::ROW, qs, lane);   // S^T = K Q^T
            mma_rows_dot_rows<DP, NT>(dp, v_s + warp * 16 * S::ROW, dos, lane); // dP^T = V dO^T
            const int t = lane % 4;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = wkey0 + lane / 4 + 8 * (e / 2);  // key (row)
                    const int c = 8 * n + 2 * t + (e % 2);          // query column in the tile
                    const int i = i0 + c;
                    const bool seen = i < L && j < L && (!causal || i >= j);
                    const float p = seen ? expf(mul_rn(s[n][e], scale) - stats[c]) : 0.0f;
                    s[n][e] = p;
                    dp[n][e] = seen ? mul_rn(p, dp[n][e] - stats[BWD_QT + c]) : 0.0f;
                }
#pragma unroll
            for (int jj = 0; jj < BWD_QT / 16; ++jj) {
                uint32_t a[4];
                acc_to_a<NT>(a, s, jj);
                mma_rows_by_tile<DP>(acc_v, a, dos + jj * 16 * S::ROW, lane);  // dV += P^T dO
                acc_to_a<NT>(a, dp, jj);
                mma_rows_by_tile<DP>(acc_k, a, qs + jj * 16 * S::ROW, lane);   // dK += dS^T Q
            }
        }
        __syncthreads();
    }
    if (!warp_has_keys) return;
    auto row_off = [&](int r) -> long long {
        const int j = wkey0 + r;
        return j < L ? ((long long)(s0 + j) * Hkv + g) * D : -1;
    };
    store_rows<DP>(acc_k, dk, row_off, D, scale, true, lane);
    store_rows<DP>(acc_v, dv, row_off, D, scale, false, lane);
}

template <int DP>
__device__ void dq_impl(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                        const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens,
                        const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t,
                        const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv,
                        int D, int causal, float scale, float* __restrict__ dq) {
    using S = TileShape<DP>;
    constexpr int NT = KEY_TILE / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    int b = 0, row0 = 0;
    if (!find_query_tile(cu_seqlens, B, BWD_ROWS, blockIdx.x, b, row0)) return;  // uniform
    const int s0 = cu_seqlens[b];
    const int L = cu_seqlens[b + 1] - s0;
    const int h = blockIdx.y;
    const int g = h / (H / Hkv);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const bool vec_ok = D % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
    __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* do_s = q_s + BWD_ROWS * S::ROW;
    __nv_bfloat16* kv_s = do_s + BWD_ROWS * S::ROW;  // stage st: K at 2 st, V at 2 st + 1

    auto qrow = [&](const __nv_bfloat16* base) {
        return [=](int r) -> const __nv_bfloat16* {
            return row0 + r < L ? base + ((size_t)(s0 + row0 + r) * H + h) * D : nullptr;
        };
    };
    stage_rows<DP>(q_s, BWD_ROWS, qrow(q), D, vec_ok, tid, BWD_WARPS * 32);
    stage_rows<DP>(do_s, BWD_ROWS, qrow(dout), D, vec_ok, tid, BWD_WARPS * 32);
    const size_t kv_stride = (size_t)Hkv * D;
    auto stage_kv = [&](int st, int tile) {
        const int j0 = tile * KEY_TILE;
        auto row = [&](const __nv_bfloat16* base) {
            return [=](int r) -> const __nv_bfloat16* {
                return j0 + r < L ? base + (size_t)(s0 + j0 + r) * kv_stride + (size_t)g * D : nullptr;
            };
        };
        stage_rows<DP>(kv_s + 2 * st * S::KV_TILE_ELEMS, KEY_TILE, row(k), D, vec_ok, tid, BWD_WARPS * 32);
        stage_rows<DP>(kv_s + (2 * st + 1) * S::KV_TILE_ELEMS, KEY_TILE, row(v), D, vec_ok, tid, BWD_WARPS * 32);
    };

    // The rows of this lane (g and g + 8 of the warp's 16) and their statistics.
    const int wrow0 = row0 + warp * 16;
    int pos[2];
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        pos[hh] = wrow0 + lane / 4 + 8 * hh;
        const bool in = pos[hh] < L;
        row_lse[hh] = in ? lse_t[(size_t)h * T_tokens + s0 + pos[hh]] : 0.0f;
        row_delta[hh] = in ? delta_t[(size_t)h * T_tokens + s0 + pos[hh]] : 0.0f;
    }
    const int block_last = causal ? min(row0 + BWD_ROWS - 1, L - 1) : L - 1;
    const int warp_last = wrow0 < L ? (causal ? min(wrow0 + 15, L - 1) : L - 1) : -1;
    const int n_tiles = block_last / KEY_TILE + 1;

    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;

    stage_kv(0, 0);
    sluice::cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
        if (it + 1 < n_tiles) {
            stage_kv((it + 1) % 2, it + 1);
            sluice::cp_async_commit();
            sluice::cp_async_wait<1>();
        } else {
            sluice::cp_async_wait<0>();
        }
        __syncthreads();
        const int j0 = it * KEY_TILE;
        if (j0 <= warp_last) {  // warp-uniform
            const __nv_bfloat16* ks = kv_s + 2 * (it % 2) * S::KV_TILE_ELEMS;
            const __nv_bfloat16* vs = ks + S::KV_TILE_ELEMS;
            float s[NT][4], dp[NT][4];
            mma_rows_dot_rows<DP, NT>(s, q_s + warp * 16 * S::ROW, ks, lane);    // S = Q K^T
            mma_rows_dot_rows<DP, NT>(dp, do_s + warp * 16 * S::ROW, vs, lane);  // dP = dO V^T
            const int t = lane % 4;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int hh = e / 2;
                    const int j = j0 + 8 * n + 2 * t + (e % 2);
                    const bool seen = pos[hh] < L && j < L && (!causal || j <= pos[hh]);
                    const float p = seen ? expf(mul_rn(s[n][e], scale) - row_lse[hh]) : 0.0f;
                    dp[n][e] = seen ? mul_rn(p, dp[n][e] - row_delta[hh]) : 0.0f;
                }
#pragma unroll
            for (int jj = 0; jj < KEY_TILE / 16; ++jj) {
                uint32_t a[4];
                acc_to_a<NT>(a, dp, jj);
                mma_rows_by_tile<DP>(acc, a, ks + jj * 16 * S::ROW, lane);  // dQ += dS K
            }
        }
        __syncthreads();
    }
    if (warp_last < 0) return;
    store_rows<DP>(acc, dq, [&](int r) -> long long {
        const int p = wrow0 + r;
        return p < L ? ((long long)(s0 + p) * H + h) * D : -1;
    }, D, scale, true, lane);
}

}  // namespace sluice_attention_tc

using namespace sluice_attention_tc;

// grid (ceil(T / 128) + B, H), block 128, dynamic shared memory block_smem_bytes<DP, 2, 4>()
// (kernels/src/ops/attention_tile.rs computes the same). Written out per DP (not by a macro):
// build.rs finds the kernels by their declarations.
extern "C" __global__ void __launch_bounds__(128) attention_tc_forward_d16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_impl<16>(q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(128) attention_tc_forward_d32(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_impl<32>(q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(128) attention_tc_forward_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_impl<64>(q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(128) attention_tc_forward_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, int B, int H, int Hkv, int D, int causal, float scale, float* __restrict__ out, float* __restrict__ lse) {
    forward_impl<128>(q, k, v, cu_seqlens, B, H, Hkv, D, causal, scale, out, lse);
}

// grid (ceil(T / 64) + B, Hkv), block 128, dynamic shared memory dkdv_smem_bytes<16>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dkdv_d16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_impl<16>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dk, dv);
}

// grid (ceil(T / 64) + B, H), block 128, dynamic shared memory dq_smem_bytes<16>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dq_d16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_impl<16>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dq);
}

// grid (ceil(T / 64) + B, Hkv), block 128, dynamic shared memory dkdv_smem_bytes<32>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dkdv_d32(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_impl<32>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dk, dv);
}

// grid (ceil(T / 64) + B, H), block 128, dynamic shared memory dq_smem_bytes<32>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dq_d32(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_impl<32>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dq);
}

// grid (ceil(T / 64) + B, Hkv), block 128, dynamic shared memory dkdv_smem_bytes<64>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dkdv_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_impl<64>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dk, dv);
}

// grid (ceil(T / 64) + B, H), block 128, dynamic shared memory dq_smem_bytes<64>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dq_d64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_impl<64>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dq);
}

// grid (ceil(T / 64) + B, Hkv), block 128, dynamic shared memory dkdv_smem_bytes<128>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dkdv_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dk, float* __restrict__ dv) {
    dkdv_impl<128>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dk, dv);
}

// grid (ceil(T / 64) + B, H), block 128, dynamic shared memory dq_smem_bytes<128>().
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_dq_d128(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, const int* __restrict__ cu_seqlens, const __nv_bfloat16* __restrict__ dout, const float* __restrict__ lse_t, const float* __restrict__ delta_t, int B, int T_tokens, int H, int Hkv, int D, int causal, float scale, float* __restrict__ dq) {
    dq_impl<128>(q, k, v, cu_seqlens, dout, lse_t, delta_t, B, T_tokens, H, Hkv, D, causal, scale, dq);
}

// grid (ceil(T * H / 4)), block 128.
extern "C" __global__ void __launch_bounds__(128) attention_tc_bwd_prep(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ out, const float* __restrict__ lse, int T_tokens, int H, int D, float* __restrict__ delta_t, float* __restrict__ lse_t) {
    prep_impl(dout, out, lse, T_tokens, H, D, delta_t, lse_t);
}
