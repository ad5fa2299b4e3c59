// attention_wgmma_bwd.cuh — v3's training backward on sm_90a: v2's two passes without atomics
// (attention_tc.cu) on wgmma, in the warp-specialised block of attention_wgmma.cuh (a producer
// warp streaming 128-row tiles through the ring, two consumer warpgroups of 64 rows).
//
//   dQ pass:    a block owns 128 queries of one head (64 per warpgroup), Q and dO staged once;
//               the ring streams K and V tiles of 128 keys ascending (the forward's producer).
//               Per 64-key half: S = Q K^T and dP = dO V^T (wgmma, both operands from shared
//               memory), dS = P * (dP - delta) with P recomputed from lse, then dQ += bf16(dS) K
//               (dS from registers, K MN-major). dQ *= scale at the end.
//   dK/dV pass: a block owns 128 keys of one kv head (64 per warpgroup), K and V staged once;
//               the ring streams (head of the GQA group ascending, query tile of 128 ascending)
//               tiles of Q and dO. Per 64-query step: S^T = K Q^T and dP^T = V dO^T (wgmma
//               m64n64k16 from shared memory), P and dS in registers with lse and delta read
//               in fragment order (attention_bwd_stats.cuh), then dV += bf16(P^T) dO and
//               dK += bf16(dS^T) Q (registers x MN-major tiles). dK *= scale at the end.
//
// THE ORDER is v2's, element by element: P = exp(s * scale - lse) (0 where masked), dS =
// P * (dP - delta) (round-to-nearest multiply), P and dS rounded to bf16 as operands; dQ sums
// over keys ascending, dK and dV over the group's heads ascending, then queries ascending, one
// fmaf chain per element (the emulated wgmma adds in ascending k, as the emulated mma.sync
// does). So under the emulator v3's gradients equal v2's bit for bit, and the CPU twin is v2's
// (kernels/src/ops/attention/reference.rs). The only freedom is where a step ends: a 64-row step
// may cover masked rows v2's 16- or 32-row steps skip; they add P = +0 or dS = +0 times a
// finite bf16, a +-0 product, which changes no nonzero sum and can change only the sign of a
// sum that is exactly zero (and a chain from +0 reaches -0 only through products that
// underflow).
#pragma once

#include "attention_bwd_stats.cuh"
#include "attention_wgmma.cuh"

#if SLUICE_HOPPER_OK
namespace sluice_attention_wgmma_bwd {

using namespace sluice_attention_wgmma;
using namespace sluice_attention_stats;

constexpr int CONSUMERS = 2;
constexpr int HALF = 64;   // keys of a stage tile per step of the dQ pass
// Queries of a stage tile per step of the dK/dV pass. 64, not 32: an m64n32 step re-reads its A
// operand (K for S^T, V for dP^T: 64 x 16 per k16) once per 32 queries, as many shared-memory
// wavefronts as its tensor time; at 64 the A reads are halved (docs/perf/attention.md, "v3's
// dK/dV pass at 64 queries a step"). Registers: dK and dV 128 a thread, S^T and dP^T 64, under
// the consumers' 232 only with the masking branch-free (p = seen ? exp(..) : 0 as a select: a
// branch around each exp held about 30 more registers and spilled).
constexpr int QSTEP = 64;
static_assert(QSTEP == STAT_PAD, "a dK/dV step reads one STAT_PAD-aligned part of the stats");
template <int DP>
using BwdLayout = Layout<DP, CONSUMERS, 2>;

// c (64 x N f32) = A B^T over the head dim ascending, from 0: A the warpgroup's 64 rows of a
// region (a_addr: box 0 of its first row; boxes A_BOX_BYTES apart), B N rows of a stage tile
// (b_addr: box 0 of its first row). Both K-major in the 128-byte swizzle.
template <int DP, int A_BOX_BYTES, int N>
__device__ __forceinline__ void issue_dot(float (&c)[N / 2], uint32_t a_addr, uint32_t b_addr,
                                          const void* smem_raw) {
#pragma unroll
    for (int j = 0; j < DP / 16; ++j) {
        const uint64_t da = sluice::wgmma_desc_swizzled(a_addr + (j / 4) * A_BOX_BYTES + 32 * (j % 4),
                                                        ATOM_BYTES, sluice::kWgmmaSwizzle128B);
        const uint64_t db = sluice::wgmma_desc_swizzled(
            b_addr + (j / 4) * Shape<DP>::KV_BOX_BYTES + 32 * (j % 4), ATOM_BYTES,
            sluice::kWgmmaSwizzle128B);
        sluice::wgmma_bf16<N>(c, da, db, j > 0 ? 1 : 0, smem_raw);
    }
}

// acc (64 x DP) += A B: A the bf16 fragments of a 64 x N tile (a[s]: columns 16s .. 16s + 15),
// B N rows of a stage tile (b_addr: its first row), MN-major: k = the tile's rows ascending.
template <int DP, int N>
__device__ __forceinline__ void issue_by_rows(float (&acc)[DP / 2], const uint32_t (&a)[N / 16][4],
                                              uint32_t b_addr, const void* smem_raw) {
#pragma unroll
    for (int s = 0; s < N / 16; ++s) {
        const uint64_t db = sluice::wgmma_desc_mn(b_addr + 16 * 128 * s, Shape<DP>::KV_BOX_BYTES,
                                                  ATOM_BYTES, sluice::kWgmmaSwizzle128B);
        sluice::wgmma_bf16_rs<DP, sluice::kWgmmaMNMajor>(acc, a[s], db, 1, smem_raw);
    }
}

// The bf16 A fragments of a 64 x N accumulator (registers 8s .. 8s + 7 are columns 16s ..).
template <int N>
__device__ __forceinline__ void pack_frags(uint32_t (&a)[N / 16][4], const float (&c)[N / 2]) {
#pragma unroll
    for (int s = 0; s < N / 16; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[s][r] = pack_bf16x2(c[8 * s + 2 * r], c[8 * s + 2 * r + 1]);
}

// Writes the thread's two rows of a 64 x DP accumulator (times scale when `scaled`): row h goes
// to row_ptr(h) (nullptr: not written), columns < D.
template <int DP, class RowPtr>
__device__ __forceinline__ void store_acc(const float (&acc)[DP / 2], RowPtr row_ptr, int D,
                                          float scale, bool scaled, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float* row = row_ptr(h);
        if (row == nullptr) continue;
        const bool pair = pairs_aligned(row, D);
#pragma unroll
        for (int j = 0; j < DP / 8; ++j) {
            const float x0 = acc[4 * j + 2 * h], x1 = acc[4 * j + 2 * h + 1];
            store_pair(row, 8 * j + 2 * t, D, scaled ? mul_rn(x0, scale) : x0,
                       scaled ? mul_rn(x1, scale) : x1, pair);
        }
    }
}

// What a pass knows of its sequence and head.
struct BwdSeq {
    int s0, L, causal;
    float scale;
    int T, D;
};

// The dQ pass's consumer warpgroup c: rows (queries) at sequence positions row0 + 64 c + r.
// q_row(r), do_row(r): the rows (nullptr past the sequence); lse_h, delta_h: head h's statistics
// (its sequence's part, fragment order); dq_row(p): the output row of position p. n_tiles tiles.
template <int DP, class QRow, class DoRow, class DqRow>
__device__ __forceinline__ void dq_consume(int c, const sluice::Ring<STAGES>& ring,
                                           const void* smem_raw, unsigned char* smem,
                                           unsigned char* stages, int n_tiles, int row0,
                                           const BwdSeq& sq, QRow q_row, DoRow do_row,
                                           const float* lse_h, const float* delta_h,
                                           DqRow dq_row, bool vec_ok) {
    using L = BwdLayout<DP>;
    using S = Shape<DP>;
    const int first = row0 + c * WG_ROWS;
    if (first >= sq.L) {
        drain(ring, n_tiles);
        return;
    }
    stage_region<DP, CONSUMERS>(smem, c, q_row, sq.D, vec_ok);
    stage_region<DP, CONSUMERS>(smem + L::Q_BYTES, c, do_row, sq.D, vec_ok);
    publish_rows(c);
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, t = lane % 4;
    int pos[2];
    float lse[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        pos[h] = first + 16 * warp + g + 8 * h;
        const bool in = pos[h] < sq.L;
        lse[h] = in ? lse_h[stat_slot(pos[h])] : 0.0f;
        delta[h] = in ? delta_h[stat_slot(pos[h])] : 0.0f;
    }
    // The last key any row of the warpgroup sees (uniform over the warpgroup).
    const int wg_last = sq.causal ? min(first + WG_ROWS - 1, sq.L - 1) : sq.L - 1;
    const uint32_t q_addr = sluice::smem_addr(smem_raw, smem + c * WG_ROWS * 128);
    const uint32_t do_addr = q_addr + L::Q_BYTES;
    const uint32_t stage0 = sluice::smem_addr(smem_raw, stages);
    float dq[DP / 2];
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) dq[i] = 0.0f;
    sluice::RingPosition<STAGES> rp;
    for (int it = 0; it < n_tiles; ++it, rp.advance()) {
        ring.consumer_wait(rp);
        const uint32_t k_addr = stage0 + rp.stage * S::STAGE_BYTES;
        for (int hf = 0; hf < 2; ++hf) {
            const int key0 = it * KEY_TILE + HALF * hf;
            if (key0 > wg_last) continue;  // uniform: every key of the half is masked
            float s[32], dp[32];
            sluice::wgmma_fence();
            issue_dot<DP, L::Q_BOX_BYTES, HALF>(s, q_addr, k_addr + HALF * hf * 128, smem_raw);
            issue_dot<DP, L::Q_BOX_BYTES, HALF>(dp, do_addr, k_addr + S::KV_BYTES + HALF * hf * 128,
                                                smem_raw);
            sluice::wgmma_commit();
            sluice::wgmma_wait<0>();
            sluice::wgmma_fence_operand(s);
            sluice::wgmma_fence_operand(dp);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e / 2;
                    const int key = key0 + 8 * j + 2 * t + (e & 1);
                    const bool seen = pos[h] < sq.L && key < sq.L && (!sq.causal || key <= pos[h]);
                    const float p = seen ? expf(mul_rn(s[4 * j + e], sq.scale) - lse[h]) : 0.0f;
                    dp[4 * j + e] = seen ? mul_rn(p, dp[4 * j + e] - delta[h]) : 0.0f;
                }
            uint32_t a[HALF / 16][4];
            pack_frags<HALF>(a, dp);
            sluice::wgmma_fence();
            issue_by_rows<DP, HALF>(dq, a, k_addr + HALF * hf * 128, smem_raw);  // dQ += dS K
            sluice::wgmma_commit();
            sluice::wgmma_wait<0>();
            sluice::wgmma_fence_operand(dq);
        }
        ring.consumer_release(rp);
    }
    store_acc<DP>(dq, [&](int h) { return pos[h] < sq.L ? dq_row(pos[h]) : nullptr; }, sq.D,
                  sq.scale, true, t);
}

// The dK/dV pass's consumer warpgroup c: rows (keys) at sequence positions key0 + 64 c + r.
// k_row(r), v_row(r): the rows; item(i, h, q0): the head and first query position of stream
// tile i; lse_of(h), delta_of(h): head h's statistics (its sequence's part, fragment order);
// dk_row(j), dv_row(j): the output rows of key position j.
template <int DP, class KRow, class VRow, class Item, class LseOf, class DeltaOf, class DkRow,
          class DvRow>
__device__ __forceinline__ void dkdv_consume(int c, const sluice::Ring<STAGES>& ring,
                                             const void* smem_raw, unsigned char* smem,
                                             unsigned char* stages, int n_items, int key0,
                                             const BwdSeq& sq, KRow k_row, VRow v_row, Item item,
                                             LseOf lse_of, DeltaOf delta_of, DkRow dk_row,
                                             DvRow dv_row, bool vec_ok) {
    using L = BwdLayout<DP>;
    using S = Shape<DP>;
    const int first = key0 + c * WG_ROWS;
    if (first >= sq.L) {
        drain(ring, n_items);
        return;
    }
    stage_region<DP, CONSUMERS>(smem, c, k_row, sq.D, vec_ok);
    stage_region<DP, CONSUMERS>(smem + L::Q_BYTES, c, v_row, sq.D, vec_ok);
    publish_rows(c);
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, t = lane % 4;
    const int kpos[2] = {first + 16 * warp + g, first + 16 * warp + g + 8};
    const uint32_t k_addr = sluice::smem_addr(smem_raw, smem + c * WG_ROWS * 128);
    const uint32_t v_addr = k_addr + L::Q_BYTES;
    const uint32_t stage0 = sluice::smem_addr(smem_raw, stages);
    float acc_k[DP / 2], acc_v[DP / 2];
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) {
        acc_k[i] = 0.0f;
        acc_v[i] = 0.0f;
    }
    sluice::RingPosition<STAGES> rp;
    for (int it = 0; it < n_items; ++it, rp.advance()) {
        ring.consumer_wait(rp);
        int h = 0, q0 = 0;
        item(it, h, q0);
        const float* lse_h = lse_of(h);
        const float* delta_h = delta_of(h);
        const uint32_t q_addr = stage0 + rp.stage * S::STAGE_BYTES;
        const uint32_t do_addr = q_addr + S::KV_BYTES;
        for (int qs = 0; qs < KEY_TILE / QSTEP; ++qs) {
            const int i0 = q0 + QSTEP * qs;
            // Uniform: no query of the step exists, or (causal) every one precedes the keys.
            if (i0 >= sq.L || (sq.causal && i0 + QSTEP - 1 < first)) continue;
            const uint32_t off = QSTEP * qs * 128;  // the step's first row in the stage tiles
            float s[QSTEP / 2], dp[QSTEP / 2];
            sluice::wgmma_fence();
            issue_dot<DP, L::Q_BOX_BYTES, QSTEP>(s, k_addr, q_addr + off, smem_raw);
            issue_dot<DP, L::Q_BOX_BYTES, QSTEP>(dp, v_addr, do_addr + off, smem_raw);
            sluice::wgmma_commit();
            sluice::wgmma_wait<0>();
            sluice::wgmma_fence_operand(s);
            sluice::wgmma_fence_operand(dp);
#pragma unroll
            for (int jp = 0; jp < QSTEP / 16; ++jp) {
                // Columns j = 2jp, 2jp + 1: one 16-byte load of lse and of delta (stat_slot).
                const int slot = i0 + 32 * (jp / 2) + 16 * (jp % 2) + 4 * t;
                const float4 l4 = *reinterpret_cast<const float4*>(lse_h + slot);
                const float4 d4 = *reinterpret_cast<const float4*>(delta_h + slot);
                const float lse_c[4] = {l4.x, l4.y, l4.z, l4.w};
                const float delta_c[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                    for (int cc = 0; cc < 2; ++cc) {
                        const int j = 2 * jp + jj;
                        const int i = i0 + 8 * j + 2 * t + cc;  // the query of this column
                        const bool in = i < sq.L;
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const int e = 4 * j + 2 * hh + cc;
                            const bool seen =
                                in && kpos[hh] < sq.L && (!sq.causal || i >= kpos[hh]);
                            const float ex = expf(mul_rn(s[e], sq.scale) - lse_c[2 * jj + cc]);
                            const float p = seen ? ex : 0.0f;
                            s[e] = p;
                            dp[e] = seen ? mul_rn(p, dp[e] - delta_c[2 * jj + cc]) : 0.0f;
                        }
                    }
            }
            uint32_t pp[QSTEP / 16][4], pd[QSTEP / 16][4];
            pack_frags<QSTEP>(pp, s);
            pack_frags<QSTEP>(pd, dp);
            sluice::wgmma_fence();
            issue_by_rows<DP, QSTEP>(acc_v, pp, do_addr + off, smem_raw);  // dV += P^T dO
            issue_by_rows<DP, QSTEP>(acc_k, pd, q_addr + off, smem_raw);   // dK += dS^T Q
            sluice::wgmma_commit();
            sluice::wgmma_wait<0>();
            sluice::wgmma_fence_operand(acc_v);
            sluice::wgmma_fence_operand(acc_k);
        }
        ring.consumer_release(rp);
    }
    store_acc<DP>(acc_k, [&](int hh) { return kpos[hh] < sq.L ? dk_row(kpos[hh]) : nullptr; },
                  sq.D, sq.scale, true, t);
    store_acc<DP>(acc_v, [&](int hh) { return kpos[hh] < sq.L ? dv_row(kpos[hh]) : nullptr; },
                  sq.D, sq.scale, false, t);
}

}  // namespace sluice_attention_wgmma_bwd
#endif  // SLUICE_HOPPER_OK
