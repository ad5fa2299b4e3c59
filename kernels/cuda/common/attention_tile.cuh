// attention_tile.cuh — the tensor-core tile step shared by the bf16 training attention
// (attention_tc.cu) and the paged decode and prefill kernels (paged_attention_tc.cu): v2 of
// attention, FlashAttention-2 style on mma.sync m16n8k16.
//
// THE TILE ORDER (docs/perf/attention.md, "The tile order"). A query row visits its keys in key
// tiles of KEY_TILE = 32 consecutive keys counted from the first key of its sequence, ascending.
// A warp advances MT x 16 rows (m16 tiles) together; the training kernels give a warp 32 rows
// aligned to multiples of 32 from the sequence start, the decode kernel one m16 tile holding the
// GQA group's queries. Per key tile, for every row of the warp:
//   1. S = Q K^T on mma.sync, k = head dim ascending in steps of 16 (Q zero-padded to DP, a
//      multiple of 16); s = S * scale (a round-to-nearest multiply); keys past the row's last
//      visible key are -inf.
//   2. tile max (exact in any order); m' = max(m, tile max); alpha = exp(m - m') (0 while
//      m = -inf); p = exp(s - m') (0 for masked keys).
//   3. the row sum: lane t of the row's quad adds its 8 values in the order (key 8n + 2t, then
//      8n + 2t + 1) for n ascending, from 0; then the quad's four partial sums as
//      (l0 + l1) + (l2 + l3) (two xor shuffles); l' = fmaf(l, alpha, sum).
//   4. O = O * alpha (round-to-nearest), then O += bf16(P) V on mma.sync, k = key ascending in
//      steps of 16 (P rounded to bf16 at nearest, as the A operand).
// Finally out = O / l and lse = m + log(l).
//
// Why decode equals training bit for bit on one device: a tensor-core instruction's result for
// a row is a fixed function of that row's A operand, the B operand and the accumulator, so the
// row's bits do not depend on the other rows of its m16 tile, nor on MT. A warp's 32 rows are
// aligned to 32 within their sequence and KEY_TILE is a multiple of 32, so the warp visits key
// tiles 0 ..= p / KEY_TILE for every row p it holds, the same tiles decode visits for a query at
// position p: no key tile is fully masked for any row, and no row needs a masked tile to be a
// no-op. Masked keys inside a visited tile have p = +0 and add +-0 to O: the result differs
// from skipping them only in the sign of an O element that is exactly zero.
//
// Under the emulator mma.sync is a chain of fmaf in ascending k (common/mma.cuh), so the Rust
// twin (`TileRowState` in kernels/src/ops/attention_tile.rs) performs the same operations in the
// same order and cpu and emu agree bit for bit; on a GPU the tensor cores sum each 16-term step
// in their own order and the cuda bits agree with cpu to bf16 tolerance.
#pragma once

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "attention_chunk.cuh"
#include "cp_async.cuh"
#include "mma.cuh"

namespace sluice_attention_tile {

using sluice_attention::mul_rn;

// Keys per online-softmax step, for training and decode alike (part of the bits contract: it
// must not depend on D or on the device). A multiple of 32 (see the header). 64 would halve the
// shared-memory reads of Q per FLOP, but at DP = 128 ptxas then spills (255 registers: 128 for O,
// 64 for S); docs/perf/attention.md has the figures.
constexpr int KEY_TILE = 32;
// Query rows per warp in the training kernels (two m16 tiles).
constexpr int WARP_ROWS = 32;
// bf16 elements of padding per shared-memory row: a row stride of DP + 8 elements puts the 8 rows
// of one ldmatrix phase in 8 distinct 16-byte bank groups for every DP in {16, 32, 64, 128}.
constexpr int ROW_PAD = 8;

template <int DP>
struct TileShape {
    static_assert(DP % 16 == 0 && DP >= 16 && DP <= 128, "padded head dim is 16, 32, 64 or 128");
    static constexpr int ROW = DP + ROW_PAD;        // elements per shared row
    static constexpr int CHUNKS = DP / 8;           // 16-byte chunks per row
    static constexpr int KV_TILE_ELEMS = KEY_TILE * ROW;
};

// Two floats as a bf16 pair (round to nearest), the lower column in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    const uint32_t l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
    const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
    return l | (h << 16);
}

// Copies `rows` rows of a row source into a shared tile [rows][ROW]: element d < D of row r is
// src(r)[d] (src(r) == nullptr: a zero row); elements D..DP-1 are zeros. Rows whose start is
// 16-byte aligned and D % 8 == 0 go through cp.async (16 bytes a thread); the rest through
// ordinary loads and stores. Every thread of the block calls it; the caller commits the group and
// waits, then a barrier makes the tile visible.
template <int DP, class RowFn>
__device__ __forceinline__ void stage_rows(__nv_bfloat16* dst, int rows, RowFn src, int D,
                                           bool vec_ok, int tid, int nthreads) {
    using S = TileShape<DP>;
    for (int idx = tid; idx < rows * S::CHUNKS; idx += nthreads) {
        const int r = idx / S::CHUNKS;
        const int d0 = (idx % S::CHUNKS) * 8;
        __nv_bfloat16* out = dst + r * S::ROW + d0;
        const __nv_bfloat16* row = src(r);
        if (row != nullptr && vec_ok && d0 + 8 <= D) {
            sluice::cp_async_16(out, row + d0);
        } else {
            uint32_t w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                uint32_t lo = 0, hi = 0;
                if (row != nullptr && d0 + 2 * e < D) lo = __bfloat16_as_ushort(row[d0 + 2 * e]);
                if (row != nullptr && d0 + 2 * e + 1 < D) hi = __bfloat16_as_ushort(row[d0 + 2 * e + 1]);
                w[e] = lo | (hi << 16);
            }
            *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// The online-softmax state of one warp's MT x 16 rows. Lane (g = lane / 4, t = lane % 4) holds,
// for m16 tile mt, rows g (half 0) and g + 8 (half 1): the output columns 8n + 2t, 8n + 2t + 1.
template <int MT, int DP>
struct WarpRows {
    float o[MT][DP / 8][4];
    float m[MT][2];
    float l[MT][2];
};

template <int MT, int DP>
__device__ __forceinline__ void rows_init(WarpRows<MT, DP>& st) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            st.m[mt][h] = -INFINITY;
            st.l[mt][h] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st.o[mt][n][e] = 0.0f;
    }
}

// One key tile for the warp's rows. q_s: the warp's first query row in shared memory (MT x 16
// rows, stride ROW); k_s, v_s: the key tile [KEY_TILE][ROW] (rows past the keys that exist are
// zeros); key0: the sequence position of the tile's first key; last_key(row_base + i): the last
// key position the warp's row i may see (a function, not an array: four fewer live registers).
// Every lane of the warp calls it.
// Q's A fragments stay in registers for the whole key loop where they fit: DP <= 64 costs
// 4 x MT x DP / 16 registers (32 at DP = 64). At DP = 128 they would take 64 beside O's 128, so
// there each key tile re-reads them from shared memory (a third of the forward's ldmatrix
// wavefronts: docs/perf/attention.md). Either way the same values enter the same mma: no bits
// change.
template <int DP>
struct QInRegisters {
    static constexpr bool value = DP <= 64;
};

// The warp's Q fragments for columns kk .. kk + 15 of its MT m16 tiles.
template <int MT, int DP>
__device__ __forceinline__ void load_q_frags(uint32_t (&qa)[MT][DP / 16][4],
                                             const __nv_bfloat16* q_s, int lane) {
    using S = TileShape<DP>;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < DP; kk += 16)
            sluice::ldmatrix_x4(qa[mt][kk / 16],
                                q_s + (mt * 16 + lane % 16) * S::ROW + kk + (lane / 16) * 8);
}

template <int MT, int DP, class LastKey>
__device__ __forceinline__ void tile_step(WarpRows<MT, DP>& st, const __nv_bfloat16* q_s,
                                          const uint32_t (&qa)[MT][DP / 16][4],
                                          const __nv_bfloat16* k_s, const __nv_bfloat16* v_s,
                                          int key0, LastKey last_key, int row_base, float scale,
                                          int lane) {
    using S = TileShape<DP>;
    constexpr int NT = KEY_TILE / 8;  // n8 tiles of keys
    const int t = lane % 4;

    // 1. S = Q K^T.
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP; kk += 16) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (QInRegisters<DP>::value) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[mt][e] = qa[mt][kk / 16][e];
            } else {
                sluice::ldmatrix_x4(a[mt],
                                    q_s + (mt * 16 + lane % 16) * S::ROW + kk + (lane / 16) * 8);
            }
        }
#pragma unroll
        for (int n2 = 0; n2 < NT / 2; ++n2) {
            uint32_t b[4];
            sluice::ldmatrix_x4(
                b, k_s + (n2 * 16 + (lane / 16) * 8 + lane % 8) * S::ROW + kk + ((lane / 8) % 2) * 8);
            const uint32_t b0[2] = {b[0], b[1]};
            const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                sluice::mma_m16n8k16_bf16(s[mt][2 * n2], a[mt], b0);
                sluice::mma_m16n8k16_bf16(s[mt][2 * n2 + 1], a[mt], b1);
            }
        }
    }

    // 2-3. Scale, mask, max, exp, row sums; rescale O.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int last = last_key(row_base + mt * 16 + lane / 4 + 8 * h);
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = key0 + 8 * n + 2 * t + c;
                    float v = mul_rn(s[mt][n][2 * h + c], scale);
                    if (key > last) v = -INFINITY;
                    s[mt][n][2 * h + c] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(st.m[mt][h], mx);
            const float alpha = (st.m[mt][h] == -INFINITY) ? 0.0f : expf(st.m[mt][h] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float v = s[mt][n][2 * h + c];
                    const float p = (v == -INFINITY) ? 0.0f : expf(v - m_new);
                    s[mt][n][2 * h + c] = p;
                    sum = sum + p;
                }
            sum = sum + __shfl_xor_sync(0xffffffffu, sum, 1);
            sum = sum + __shfl_xor_sync(0xffffffffu, sum, 2);
            st.l[mt][h] = fmaf(st.l[mt][h], alpha, sum);
            st.m[mt][h] = m_new;
#pragma unroll
            for (int n = 0; n < DP / 8; ++n) {
                st.o[mt][n][2 * h] = mul_rn(st.o[mt][n][2 * h], alpha);
                st.o[mt][n][2 * h + 1] = mul_rn(st.o[mt][n][2 * h + 1], alpha);
            }
        }
    }

    // 4. O += bf16(P) V: the accumulator layout of two n8 key tiles is the A layout of one k16.
#pragma unroll
    for (int j = 0; j < KEY_TILE / 16; ++j) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack_bf16x2(s[mt][2 * j][0], s[mt][2 * j][1]);
            a[mt][1] = pack_bf16x2(s[mt][2 * j][2], s[mt][2 * j][3]);
            a[mt][2] = pack_bf16x2(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
            a[mt][3] = pack_bf16x2(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
        }
#pragma unroll
        for (int n2 = 0; n2 < DP / 16; ++n2) {
            uint32_t b[4];
            sluice::ldmatrix_x4_trans(
                b, v_s + (j * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S::ROW + n2 * 16 + (lane / 16) * 8);
            const uint32_t b0[2] = {b[0], b[1]};
            const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                sluice::mma_m16n8k16_bf16(st.o[mt][2 * n2], a[mt], b0);
                sluice::mma_m16n8k16_bf16(st.o[mt][2 * n2 + 1], a[mt], b1);
            }
        }
    }
}

// A lane of an mma accumulator holds two adjacent columns (2t, 2t + 1) of a row: one 8-byte
// store where D is even and the row 8-byte aligned (a quad then fills a 32-byte sector), else
// two 4-byte stores; columns >= D are not written.
__device__ __forceinline__ bool pairs_aligned(const float* row, int D) {
    return D % 2 == 0 && (reinterpret_cast<uintptr_t>(row) & 7) == 0;
}

__device__ __forceinline__ void store_pair(float* row, int d, int D, float x0, float x1,
                                           bool pair) {
    if (pair) {
        if (d < D) *reinterpret_cast<float2*>(row + d) = make_float2(x0, x1);
    } else {
        if (d < D) row[d] = x0;
        if (d + 1 < D) row[d + 1] = x1;
    }
}

// Writes the lane's part of row (mt, h): out[8n + 2t + c] = O / l for columns < D (out_row may
// be nullptr: a padding row), and returns lse = m + log(l).
template <int MT, int DP>
__device__ __forceinline__ float row_finish(const WarpRows<MT, DP>& st, int mt, int h,
                                            float* out_row, int D, int lane) {
    if (out_row != nullptr) {
        const bool pair = pairs_aligned(out_row, D);
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
            store_pair(out_row, 8 * n + 2 * (lane % 4), D, st.o[mt][n][2 * h] / st.l[mt][h],
                       st.o[mt][n][2 * h + 1] / st.l[mt][h], pair);
    }
    return st.m[mt][h] + logf(st.l[mt][h]);
}

// Shared memory of attend_block, in bytes: the query tile and two stages of (K, V) tiles.
template <int DP, int MT, int WARPS>
constexpr int block_smem_bytes() {
    return (WARPS * MT * 16 + 4 * KEY_TILE) * TileShape<DP>::ROW * 2;
}

// One block attends its WARPS x MT x 16 query rows over their keys: the whole of a kernel after
// it has found its rows. Row r (0 ..) of the block is warp r / (MT * 16)'s row r % (MT * 16).
//   q_row(r)     the query row r (D bf16), or nullptr for a padding row;
//   last_key(r)  the last key position row r sees (causal: its own position), -1 for padding;
//   k_row(j), v_row(j)  key j's rows (D bf16 each), for 0 <= j < n_keys;
//   out_row(r)   where row r's output goes (D f32), or nullptr;
//   lse_out(r, x)  called once per row with its logsumexp (the lane holding column 0..1).
// Key tiles 0, 1, ... are staged through shared memory with cp.async, two stages deep; a warp
// computes a tile only when one of its rows sees a key in it (warp-uniform), so the diagonal
// skips whole tiles. Every thread of the block calls it; smem is block_smem_bytes() long and
// 16-byte aligned.
template <int DP, int MT, int WARPS, class QRow, class LastKey, class KRow, class VRow, class OutRow,
          class LseOut>
__device__ __forceinline__ void attend_block(unsigned char* smem, QRow q_row, LastKey last_key,
                                             KRow k_row, VRow v_row, int n_keys, OutRow out_row,
                                             LseOut lse_out, int D, float scale, bool vec_ok) {
    using S = TileShape<DP>;
    constexpr int ROWS = WARPS * MT * 16;
    constexpr int NTHREADS = WARPS * 32;
    __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* kv_s = q_s + ROWS * S::ROW;  // stage s: K at 2s, V at 2s + 1
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;

    // The last key any row of a warp sees (-1: the warp has no rows), and of the block.
    auto warp_last_of = [&](int w) {
        int last = -1;
        for (int r = w * MT * 16; r < (w + 1) * MT * 16; ++r) last = max(last, last_key(r));
        return last;
    };
    int block_last = -1;
    for (int w = 0; w < WARPS; ++w) block_last = max(block_last, warp_last_of(w));
    const int warp_last = warp_last_of(warp);
    if (block_last < 0) return;  // uniform: no row to attend
    const int n_tiles = block_last / KEY_TILE + 1;

    auto stage_kv = [&](int stage, int tile) {
        const int j0 = tile * KEY_TILE;
        stage_rows<DP>(kv_s + (2 * stage) * S::KV_TILE_ELEMS, KEY_TILE,
                       [&](int r) { return j0 + r < n_keys ? k_row(j0 + r) : nullptr; }, D,
                       vec_ok, tid, NTHREADS);
        stage_rows<DP>(kv_s + (2 * stage + 1) * S::KV_TILE_ELEMS, KEY_TILE,
                       [&](int r) { return j0 + r < n_keys ? v_row(j0 + r) : nullptr; }, D,
                       vec_ok, tid, NTHREADS);
    };
    stage_rows<DP>(q_s, ROWS, q_row, D, vec_ok, tid, NTHREADS);
    stage_kv(0, 0);
    sluice::cp_async_commit();

    WarpRows<MT, DP> st;
    rows_init(st);
    const __nv_bfloat16* q_warp = q_s + warp * MT * 16 * S::ROW;
    uint32_t qa[MT][DP / 16][4];  // filled at the first tile where QInRegisters, else unused

    for (int it = 0; it < n_tiles; ++it) {
        if (it + 1 < n_tiles) {
            stage_kv((it + 1) % 2, it + 1);  // the stage the previous iteration finished with
            sluice::cp_async_commit();
            sluice::cp_async_wait<1>();
        } else {
            sluice::cp_async_wait<0>();
        }
        __syncthreads();
        if (it * KEY_TILE <= warp_last) {  // warp-uniform
            const __nv_bfloat16* k_s = kv_s + (2 * (it % 2)) * S::KV_TILE_ELEMS;
            if constexpr (QInRegisters<DP>::value) {
                if (it == 0) load_q_frags<MT, DP>(qa, q_warp, lane);  // Q landed with tile 0
            }
            tile_step<MT, DP>(st, q_warp, qa, k_s, k_s + S::KV_TILE_ELEMS, it * KEY_TILE,
                              last_key, warp * MT * 16, scale, lane);
        }
        __syncthreads();  // the next iteration's copies overwrite this stage
    }

    if (warp_last < 0) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * MT * 16 + mt * 16 + lane / 4 + 8 * h;
            if (last_key(r) < 0) continue;
            const float x = row_finish<MT, DP>(st, mt, h, out_row(r), D, lane);
            if (lane % 4 == 0) lse_out(r, x);
        }
}

}  // namespace sluice_attention_tile
