// attention_wgmma.cuh — v3 of attention on sm_90a, FlashAttention-3 style: the tile routine
// shared by the bf16 training forward (attention_wgmma.cu) and the paged decode and prefill
// (paged_attention_wgmma.cu).
//
// A block is warp-specialised: warpgroup 0 is the producer (one warp works: it fills a ring of
// STAGES stages, each a K tile and a V tile of KEY_TILE keys, by tensor copies where the rows are
// plain strided rows, else by gathering rows with cp.async), and CONSUMERS warpgroups of 64 query
// rows each are the consumers. Per key tile a consumer warpgroup computes
//   S = Q K^T         wgmma m64n128k16 with Q and K from shared memory (128-byte swizzle),
//   softmax           in registers (the order below),
//   O = O * alpha + bf16(P) V   wgmma m64nDPk16 with P from registers (the accumulator layout of
//                     S is the A-register layout, hopper.cuh) and V MN-major from shared memory,
// overlapping the next tile's S = Q K^T with this tile's P V (FlashAttention-3's intra-warpgroup
// pipelining): S_t and P_{t-1} V_{t-1} are issued together, the softmax of S_t runs while P V
// is in flight, and O is rescaled once P V has landed.
//
// THE TILE ORDER of v3 (docs/perf/attention.md, "v3"). A query row visits its keys in tiles of
// KEY_TILE = 128 keys counted from the first key of its sequence, ascending; per tile:
//   1. S = Q K^T, k = head dim ascending (D zero-padded to DP = 64 or 128), from 0;
//      s = S * scale (round-to-nearest); keys past the row's last visible key are -inf.
//   2. m' = max(m, tile max); alpha = exp(m - m') (0 while m = -inf); p = exp(s - m') (0 if
//      masked).
//   3. the row sum: lane t of the row's quad adds its values in the order (key 8n + 2t, then
//      8n + 2t + 1) for n ascending, from 0; then (l0 + l1) + (l2 + l3) across the quad (two xor
//      shuffles); l' = fmaf(l, alpha, sum).
//   4. O = O * alpha (round-to-nearest), then O += bf16(P) V, k = key ascending.
// Finally out = O / l and lse = m + log(l). This is v2's order (attention_tile.cuh) with a
// 128-key tile instead of 32: the CPU twin is v2's, generalised by tile width
// (kernels/src/ops/attention_tile.rs), and under the emulator (wgmma an fmaf chain in ascending
// k, as mma.sync) cpu and emu agree bit for bit.
//
// The bits contract. KEY_TILE is one constant for training, decode and prefill, whatever D and
// the device. Training and prefill give a block 128 sequence positions aligned to 128 from the
// sequence start (64 per consumer warpgroup), so a row at position p visits key tiles
// 0 ..= p / 128, the tiles decode visits for a query at p (its GQA group padded into the m64
// tile: a wgmma's result for a row is a function of that row's operands alone). No real row
// ever meets a fully masked tile. Masked keys inside a visited tile have p = +0 and add +-0 to O
// (training's are real future keys, decode's zero rows): the sign of an exactly-zero O element
// is all they can change, as in v2. Key rows past a sequence's last key are zeros in the stage
// (the gather writes zeros; a tensor copy is used only for tiles wholly inside the sequence),
// so nothing of another sequence can reach a row through 0 * v.
#pragma once

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "attention_chunk.cuh"
#include "attention_tile.cuh"
#include "cp_async.cuh"
#include "hopper.cuh"
#include "named_barrier.cuh"
#include "ring.cuh"

#if SLUICE_HOPPER_OK
namespace sluice_attention_wgmma {

using sluice_attention::mul_rn;
using sluice_attention_tile::pack_bf16x2;
using sluice_attention_tile::pairs_aligned;
using sluice_attention_tile::store_pair;

// Keys per online-softmax step, for training, decode and prefill alike (the bits contract: it
// must not depend on D or on the device). 128 = the query rows of a training block, so both
// consumer warpgroups of a causal block visit the same tiles, none of them fully masked; the
// S tile (64 x 128 f32: 64 registers a thread) and O (64 at DP = 128) fit the consumers' 232
// registers beside bf16 P (32).
constexpr int KEY_TILE = 128;
// Query rows per consumer warpgroup (the wgmma M).
constexpr int WG_ROWS = 64;
// Head-dim elements per 128-byte swizzled row: a K, V or Q tile is DP / 64 such boxes.
constexpr int BOX = 64;
constexpr int STAGES = 2;
// 8 rows of 128 bytes, the 128-byte swizzle's atom: SBO of every operand.
constexpr uint32_t ATOM_BYTES = 1024;

template <int DP>
struct Shape {
    static_assert(DP == 64 || DP == 128, "v3 pads the head dim to 64 or 128");
    static constexpr int BOXES = DP / BOX;
    static constexpr int CHUNKS = DP / 8;                   // 16-byte chunks per row
    static constexpr int KV_BOX_BYTES = KEY_TILE * 128;     // 16 KiB: one box of a K or V tile
    static constexpr int KV_BYTES = BOXES * KV_BOX_BYTES;   // a K (or V) tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;        // K, then V
};

// Shared memory of a block with CONSUMERS consumer warpgroups: REGIONS tiles of the block's own
// rows ([box][row][128 B]: Q for the forward; Q and dO, or K and V, for the backward's passes),
// STAGES stages of the streamed pair (K and V, or Q and dO), the ring's barriers; the regions
// and stages start at 1024-byte aligned addresses (the swizzle atom), found from the raw base
// (SHARED_BYTES leaves 1024 of slack).
template <int DP, int CONSUMERS, int REGIONS = 1>
struct Layout {
    static constexpr int ROWS = CONSUMERS * WG_ROWS;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int Q_BOX_BYTES = ROWS * 128;
    static constexpr int Q_BYTES = Shape<DP>::BOXES * Q_BOX_BYTES;  // one region
    static constexpr int STAGE_OFFSET = REGIONS * Q_BYTES;
    static constexpr int BARRIER_OFFSET = STAGE_OFFSET + STAGES * Shape<DP>::STAGE_BYTES;
    static constexpr int SHARED_BYTES = BARRIER_OFFSET + 2 * STAGES * 8 + 1024;
    static_assert(SHARED_BYTES <= 227 * 1024, "over sm_90's shared memory per block");
};

// Byte offset of 16-byte chunk `chunk` (< 8) of row r in a 128-byte-swizzled box at a 1024-byte
// aligned address: the layout a tensor copy with CU_TENSOR_MAP_SWIZZLE_128B writes.
__device__ __forceinline__ int swizzled(int r, int chunk) {
    return r * 128 + ((chunk ^ (r & 7)) << 4);
}

__device__ __forceinline__ unsigned char* align_1024(unsigned char* raw) {
#ifdef SLUICE_EMU
    const uint32_t a = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(raw));
#else
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
#endif
    return raw + ((1024u - (a & 1023u)) & 1023u);
}

// Elements 8c .. 8c + 7 of a bf16 row into 16 bytes of shared memory: zeros past D or for a null
// row. Whole aligned chunks move as one 16-byte copy (cp.async when `async`, else a load and a
// store); the rest element by element.
__device__ __forceinline__ void copy_chunk(unsigned char* dst, const __nv_bfloat16* row, int c,
                                           int D, bool vec_ok, bool async) {
    const int d0 = 8 * c;
    if (row != nullptr && vec_ok && d0 + 8 <= D) {
        if (async) {
            sluice::cp_async_16(dst, row + d0);
        } else {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(row + d0);
        }
        return;
    }
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        uint32_t lo = 0, hi = 0;
        if (row != nullptr && d0 + 2 * e < D) lo = __bfloat16_as_ushort(row[d0 + 2 * e]);
        if (row != nullptr && d0 + 2 * e + 1 < D) hi = __bfloat16_as_ushort(row[d0 + 2 * e + 1]);
        w[e] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// A consumer warpgroup stages its 64 rows (row(r), r < 64, nullptr: a zero row) into its part of
// a region (`region`: the region's first box). The caller then publishes them with
// publish_rows: the wgmmas read them only after every thread of the warpgroup wrote its part.
template <int DP, int CONSUMERS, class RowFn>
__device__ __forceinline__ void stage_region(unsigned char* region, int wg, RowFn row, int D,
                                             bool vec_ok) {
    using S = Shape<DP>;
    const int wt = threadIdx.x & 127;
    for (int idx = wt; idx < WG_ROWS * S::CHUNKS; idx += 128) {
        const int r = idx / S::CHUNKS, c = idx % S::CHUNKS;
        unsigned char* dst = region + (c / 8) * Layout<DP, CONSUMERS>::Q_BOX_BYTES +
                             swizzled(wg * WG_ROWS + r, c % 8);
        copy_chunk(dst, row(r), c, D, vec_ok, false);
    }
}
// Fences the warpgroup's staged rows to the async proxy and meets at its named barrier (1 + wg).
__device__ __forceinline__ void publish_rows(int wg) {
    sluice::fence_proxy_async_shared();
    sluice::named_barrier_sync(1 + wg, 128);
}

// The producer's fill of one stage with rows row0 .. row0 + n_valid - 1 of two [T, Hx, D] bf16
// tensors (K and V, or Q and dO) of head `head`, zero rows after them: by tensor copies (one
// box of 64 head dims x 128 rows per copy, through map_a and map_b) when TMA and the tile is
// whole and D == DP, else gathered with cp.async from a_base + r * stride and b_base + r *
// stride (row 0 of the tile). Ends with the commit on the stage's full barrier.
template <int DP, bool TMA>
__device__ __forceinline__ void produce_rows(unsigned char* stage, const sluice::Ring<STAGES>& ring,
                                             const sluice::RingPosition<STAGES>& pos, int lane,
                                             const CUtensorMap* map_a, const CUtensorMap* map_b,
                                             int head, int row0, int n_valid,
                                             const __nv_bfloat16* a_base,
                                             const __nv_bfloat16* b_base, size_t stride, int D,
                                             bool vec_ok);

// Key r's K and V rows (D bf16 each).
struct KvRows {
    const __nv_bfloat16* k;
    const __nv_bfloat16* v;
};

// The producer warp gathers one stage: rows r < n_valid of the K and V tiles (kv_rows(r) gives
// key r's rows, tile-relative: one block-table lookup serves both), zero rows after them,
// in the swizzled layout; cp.async for whole aligned chunks. On return every lane's copies have
// landed and been fenced to the async proxy, and the warp has met at __syncwarp, so lane 0's
// arrival on `full` publishes all of them.
template <int DP, class RowsOf>
__device__ __forceinline__ void gather_stage(unsigned char* stage, RowsOf kv_rows, int n_valid,
                                             int D, bool vec_ok, int lane) {
    using S = Shape<DP>;
    for (int idx = lane; idx < KEY_TILE * S::CHUNKS; idx += 32) {
        const int r = idx / S::CHUNKS, c = idx % S::CHUNKS;
        const int off = (c / 8) * S::KV_BOX_BYTES + swizzled(r, c % 8);
        const KvRows rows = r < n_valid ? kv_rows(r) : KvRows{nullptr, nullptr};
        copy_chunk(stage + off, rows.k, c, D, vec_ok, true);
        copy_chunk(stage + S::KV_BYTES + off, rows.v, c, D, vec_ok, true);
    }
    sluice::cp_async_commit();
    sluice::cp_async_wait<0>();
    sluice::fence_proxy_async_shared();
    __syncwarp();
}

template <int DP, bool TMA>
__device__ __forceinline__ void produce_rows(unsigned char* stage, const sluice::Ring<STAGES>& ring,
                                             const sluice::RingPosition<STAGES>& pos, int lane,
                                             const CUtensorMap* map_a, const CUtensorMap* map_b,
                                             int head, int row0, int n_valid,
                                             const __nv_bfloat16* a_base,
                                             const __nv_bfloat16* b_base, size_t stride, int D,
                                             bool vec_ok) {
    using S = Shape<DP>;
    if (TMA && n_valid == KEY_TILE && D == DP) {
        if (lane == 0) {
            uint64_t* full = ring.full_barrier(pos);
            sluice::mbarrier_expect_tx(full, S::STAGE_BYTES);
            for (int bx = 0; bx < S::BOXES; ++bx) {
                sluice::tma_load_3d(stage + bx * S::KV_BOX_BYTES, map_a, bx * BOX, head, row0, full);
                sluice::tma_load_3d(stage + S::KV_BYTES + bx * S::KV_BOX_BYTES, map_b, bx * BOX,
                                    head, row0, full);
            }
            ring.producer_commit(pos);
        }
        return;
    }
    gather_stage<DP>(
        stage, [=](int r) { return KvRows{a_base + (size_t)r * stride, b_base + (size_t)r * stride}; },
        n_valid, D, vec_ok, lane);
    if (lane == 0) ring.producer_commit(pos);
}

// A consumer thread's part of its warpgroup's 64 rows: with warp w, g = lane / 4, t = lane % 4,
// rows 16w + g (h = 0) and 16w + g + 8 (h = 1); o[4j + 2h + c] is output column 8j + 2t + c.
template <int DP>
struct WgRows {
    float o[DP / 2];
    float m[2];
    float l[2];
};

// S = Q K^T for one tile: DP / 16 wgmmas, k = head dim ascending, the first from zero.
template <int DP, int Q_BOX_BYTES>
__device__ __forceinline__ void issue_qk(float (&s)[KEY_TILE / 2], uint32_t q_addr,
                                         uint32_t k_addr, const void* smem_raw) {
#pragma unroll
    for (int j = 0; j < DP / 16; ++j) {
        // k16 step j: box j / 4, 32 bytes along its 128-byte rows.
        const uint64_t da = sluice::wgmma_desc_swizzled(q_addr + (j / 4) * Q_BOX_BYTES + 32 * (j % 4),
                                                        ATOM_BYTES, sluice::kWgmmaSwizzle128B);
        const uint64_t db = sluice::wgmma_desc_swizzled(
            k_addr + (j / 4) * Shape<DP>::KV_BOX_BYTES + 32 * (j % 4), ATOM_BYTES,
            sluice::kWgmmaSwizzle128B);
        sluice::wgmma_bf16<KEY_TILE>(s, da, db, j > 0 ? 1 : 0, smem_raw);
    }
}

// O += P V for one tile: KEY_TILE / 16 wgmmas with P's k16 slices from registers and V MN-major
// (16 key rows a step; LBO = one box = the next 64 head dims, SBO = 8 key rows).
template <int DP>
__device__ __forceinline__ void issue_pv(float (&o)[DP / 2],
                                         const uint32_t (&pa)[KEY_TILE / 16][4],
                                         uint32_t v_addr, const void* smem_raw) {
#pragma unroll
    for (int s = 0; s < KEY_TILE / 16; ++s) {
        const uint64_t db = sluice::wgmma_desc_mn(v_addr + 16 * 128 * s, Shape<DP>::KV_BOX_BYTES,
                                                  ATOM_BYTES, sluice::kWgmmaSwizzle128B);
        sluice::wgmma_bf16_rs<DP, sluice::kWgmmaMNMajor>(o, pa[s], db, 1, smem_raw);
    }
}

// Steps 1-3 of the order for the thread's two rows: s becomes p (f32), m and l advance; returns
// alpha per row in `alpha`. `last[h]` is row h's last visible key (-1: a padding row).
__device__ __forceinline__ void softmax_tile(float (&s)[KEY_TILE / 2], float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], int key0,
                                             const int (&last)[2], float scale, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float v = mul_rn(s[4 * j + 2 * h + c], scale);
                if (key0 + 8 * j + 2 * t + c > last[h]) v = -INFINITY;
                s[4 * j + 2 * h + c] = v;
                mx = fmaxf(mx, v);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        alpha[h] = (m[h] == -INFINITY) ? 0.0f : expf(m[h] - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float v = s[4 * j + 2 * h + c];
                const float p = (v == -INFINITY) ? 0.0f : expf(v - m_new);
                s[4 * j + 2 * h + c] = p;
                sum = sum + p;
            }
        sum = sum + __shfl_xor_sync(0xffffffffu, sum, 1);
        sum = sum + __shfl_xor_sync(0xffffffffu, sum, 2);
        l[h] = fmaf(l[h], alpha[h], sum);
        m[h] = m_new;
    }
}

// Step 4's rescale and the bf16 P fragments: k16 slice s of P is accumulator registers
// 8s .. 8s + 7, packed in pairs (hopper.cuh, wgmma_bf16_rs).
template <int DP>
__device__ __forceinline__ void rescale_and_pack(WgRows<DP>& st, uint32_t (&pa)[KEY_TILE / 16][4],
                                                 const float (&s)[KEY_TILE / 2],
                                                 const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < DP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st.o[4 * j + e] = mul_rn(st.o[4 * j + e], alpha[e / 2]);
#pragma unroll
    for (int k = 0; k < KEY_TILE / 16; ++k)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[k][r] = pack_bf16x2(s[8 * k + 2 * r], s[8 * k + 2 * r + 1]);
}

// A consumer warpgroup's whole key loop: tiles 0 .. n_tiles - 1 of the ring, Q of its rows at
// shared address q_addr (box 0, its first row), stage s's K at stage_addr + s * STAGE_BYTES and
// V KV_BYTES after it. last_key(r), r < 64: the last key row r sees (-1: padding).
template <int DP, int Q_BOX_BYTES, class LastKey>
__device__ __forceinline__ void consume_tiles(WgRows<DP>& st, const sluice::Ring<STAGES>& ring,
                                              const void* smem_raw, uint32_t q_addr,
                                              uint32_t stage_addr, int n_tiles, LastKey last_key,
                                              float scale) {
    using S = Shape<DP>;
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, t = lane % 4;
    const int last[2] = {last_key(16 * warp + g), last_key(16 * warp + g + 8)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        st.m[h] = -INFINITY;
        st.l[h] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) st.o[i] = 0.0f;
    float s[KEY_TILE / 2];
    uint32_t pa[KEY_TILE / 16][4];
    float alpha[2];
    auto k_addr = [&](int stage) { return stage_addr + stage * S::STAGE_BYTES; };

    sluice::RingPosition<STAGES> pos;
    ring.consumer_wait(pos);
    sluice::wgmma_fence();
    issue_qk<DP, Q_BOX_BYTES>(s, q_addr, k_addr(pos.stage), smem_raw);
    sluice::wgmma_commit();
    sluice::wgmma_wait<0>();
    sluice::wgmma_fence_operand(s);
    softmax_tile(s, st.m, st.l, alpha, 0, last, scale, t);
    rescale_and_pack(st, pa, s, alpha);
    for (int it = 1; it < n_tiles; ++it) {
        const sluice::RingPosition<STAGES> prev = pos;
        pos.advance();
        ring.consumer_wait(pos);
        // S_it and P_{it-1} V_{it-1} in flight together; the softmax of S_it overlaps P V.
        sluice::wgmma_fence();
        issue_qk<DP, Q_BOX_BYTES>(s, q_addr, k_addr(pos.stage), smem_raw);
        sluice::wgmma_commit();
        issue_pv<DP>(st.o, pa, k_addr(prev.stage) + S::KV_BYTES, smem_raw);
        sluice::wgmma_commit();
        sluice::wgmma_wait<1>();  // S_it has landed; P V may still run (P and O untouched)
        sluice::wgmma_fence_operand(s);
        softmax_tile(s, st.m, st.l, alpha, it * KEY_TILE, last, scale, t);
        sluice::wgmma_wait<0>();  // P V has landed: O and P's registers are free
        sluice::wgmma_fence_operand(st.o);
        sluice::wgmma_fence_operand(pa);
        ring.consumer_release(prev);  // this thread's reads of stage prev (K and V) are done
        rescale_and_pack(st, pa, s, alpha);
    }
    sluice::wgmma_fence();
    issue_pv<DP>(st.o, pa, k_addr(pos.stage) + S::KV_BYTES, smem_raw);
    sluice::wgmma_commit();
    sluice::wgmma_wait<0>();
    sluice::wgmma_fence_operand(st.o);
    ring.consumer_release(pos);
}

// Writes the thread's part of rows r (out_row(r): D floats, or nullptr for a row not written):
// out = O / l, and lse_out(r, m + log(l)) from the quad's lane 0.
template <int DP, class OutRow, class LseOut>
__device__ __forceinline__ void finish_rows(const WgRows<DP>& st, OutRow out_row, LseOut lse_out,
                                            int D) {
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * warp + g + 8 * h;
        float* row = out_row(r);
        if (row == nullptr) continue;
        const bool pair = pairs_aligned(row, D);
#pragma unroll
        for (int j = 0; j < DP / 8; ++j)
            store_pair(row, 8 * j + 2 * t, D, st.o[4 * j + 2 * h] / st.l[h],
                       st.o[4 * j + 2 * h + 1] / st.l[h], pair);
        if (t == 0) lse_out(r, st.m[h] + logf(st.l[h]));
    }
}

// The warp-specialised block: the producer warp fills stages 0 .. n_tiles - 1 of the ring with
// produce(tile, stage, ring, position, lane) (which ends with the commit on `full`), and each
// consumer warpgroup c runs consume(c, ring, smem, stages) (smem: the aligned base, where the
// regions start). Every thread of the block calls it with Layout::THREADS threads.
template <int DP, int CONSUMERS, int REGIONS, class Produce, class Consume>
__device__ __forceinline__ void run_pipeline(unsigned char* smem_raw, int n_tiles, Produce produce,
                                             Consume consume) {
    using L = Layout<DP, CONSUMERS, REGIONS>;
    unsigned char* smem = align_1024(smem_raw);
    unsigned char* stages = smem + L::STAGE_OFFSET;
    const sluice::Ring<STAGES> ring{reinterpret_cast<uint64_t*>(smem + L::BARRIER_OFFSET),
                                    reinterpret_cast<uint64_t*>(smem + L::BARRIER_OFFSET) + STAGES};
    if (threadIdx.x == 0) ring.init(1, 128 * CONSUMERS);
    __syncthreads();
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        // The producer: warpgroup 0 gives registers to the consumers (40 left, not 24: the
        // cp.async gather spilled at 24; 40 + 2 x 232 = 3 x 168); one warp works.
        if constexpr (CONSUMERS == 2) sluice::setmaxnreg_dec<40>();
        if (threadIdx.x >= 32) return;
        const int lane = threadIdx.x;
        sluice::RingPosition<STAGES> pos;
        for (int tile = 0; tile < n_tiles; ++tile, pos.advance()) {
            ring.producer_acquire(pos);
            produce(tile, stages + pos.stage * Shape<DP>::STAGE_BYTES, ring, pos, lane);
        }
        return;
    }
    if constexpr (CONSUMERS == 2) sluice::setmaxnreg_inc<232>();
    consume(wg - 1, ring, smem, stages);
}

// A consumer warpgroup with nothing to compute releases the stages only.
__device__ __forceinline__ void drain(const sluice::Ring<STAGES>& ring, int n_tiles) {
    sluice::RingPosition<STAGES> pos;
    for (int tile = 0; tile < n_tiles; ++tile, pos.advance()) {
        ring.consumer_wait(pos);
        ring.consumer_release(pos);
    }
}

// One block of the forward, decode or prefill: the producer fills key tiles 0 .. n_tiles - 1
// with produce(...), the consumer warpgroups attend their rows over them. Block row r (0 ..
// ROWS - 1) belongs to consumer r / 64:
//   q_row(r)     the query row (D bf16), nullptr for padding;
//   last_key(r)  the last key row r sees, -1 for padding;
//   out_row(r)   its output (D f32), nullptr: not written;   lse_out(r, x)  its logsumexp.
template <int DP, int CONSUMERS, class Produce, class QRow, class LastKey, class OutRow,
          class LseOut>
__device__ __forceinline__ void attend_block(unsigned char* smem_raw, int n_tiles, Produce produce,
                                             QRow q_row, LastKey last_key, OutRow out_row,
                                             LseOut lse_out, int D, float scale, bool vec_ok) {
    using L = Layout<DP, CONSUMERS>;
    run_pipeline<DP, CONSUMERS, 1>(
        smem_raw, n_tiles, produce,
        [&](int c, const sluice::Ring<STAGES>& ring, unsigned char* smem, unsigned char* stages) {
            auto row_of = [&](int r) { return c * WG_ROWS + r; };
            bool any = false;
            for (int r = 0; r < WG_ROWS; ++r) any = any || last_key(row_of(r)) >= 0;
            if (!any) {
                // No row of this warpgroup attends (the tail of a sequence).
                drain(ring, n_tiles);
                return;
            }
            stage_region<DP, CONSUMERS>(smem, c, [&](int r) { return q_row(row_of(r)); }, D, vec_ok);
            publish_rows(c);
            WgRows<DP> st;
            consume_tiles<DP, L::Q_BOX_BYTES>(
                st, ring, smem_raw, sluice::smem_addr(smem_raw, smem + c * WG_ROWS * 128),
                sluice::smem_addr(smem_raw, stages), n_tiles,
                [&](int r) { return last_key(row_of(r)); }, scale);
            finish_rows<DP>(st, [&](int r) { return out_row(row_of(r)); },
                            [&](int r, float x) { lse_out(row_of(r), x); }, D);
        });
}

}  // namespace sluice_attention_wgmma
#endif  // SLUICE_HOPPER_OK
