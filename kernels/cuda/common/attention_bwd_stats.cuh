// attention_bwd_stats.cuh — the per-row statistics of the attention backward (lse and
// delta = rowsum(dO * O)): the row sum both preps compute (v2's attention_tc_bwd_prep and v3's
// attention_wgmma_bwd_prep, one order, one function), and v3's "fragment order" layout of them.
#pragma once

#include <cuda_bf16.h>

namespace sluice_attention_stats {

// delta of one (token, head) row, by one warp: lane l adds d = l, l + 32, ... ascending (fmaf
// from 0), then the 32 partial sums meet in an xor tree (16, 8, 4, 2, 1). Every lane returns the
// sum. The CPU twin is delta_tiles in kernels/src/ops/attention_tile.rs.
__device__ __forceinline__ float row_delta(const __nv_bfloat16* __restrict__ dout_row,
                                           const float* __restrict__ out_row, int D, int lane) {
    float acc = 0.0f;
    for (int d = lane; d < D; d += 32) acc = fmaf(__bfloat162float(dout_row[d]), out_row[d], acc);
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) acc = acc + __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

// v3's layout of lse and delta (attention_wgmma_bwd.cu reads it; the values are v2's, only their
// places differ). Per head a row of stat_stride(T, B) floats. Sequence b (first token s0) starts
// at stat_seq_offset(s0, b), a multiple of STAT_PAD, and owns round_up(L, STAT_PAD) floats (so
// a dK/dV step of STAT_PAD queries never leaves it; the slots past L are never written and never
// used). Its position i sits at stat_slot(i): inside each group of 32 positions, p = 8j + 2t + c
// (the query of accumulator column 8j + 2t + c of an m64nN wgmma tile: j < 4, t = lane % 4,
// c < 2) sits at 16 (j / 2) + 4 t + 2 (j % 2) + c. So a dK/dV thread reads the lse (or delta) of
// its columns 8j + 2t + c and 8(j + 1) + 2t + c (j even) with one 16-byte load, and the four
// lanes of a quad read 64 contiguous bytes: a quarter of the loads of one float per column, at
// the ideal sectors.
constexpr int STAT_PAD = 64;  // = the dK/dV pass's QSTEP (attention_wgmma_bwd.cuh)

__device__ __forceinline__ int stat_seq_offset(int s0, int b) {
    return (s0 + STAT_PAD - 1) / STAT_PAD * STAT_PAD + STAT_PAD * b;
}
// Floats per head: room for every sequence's part whatever the lengths, since
// round_up(s0) + round_up(L) <= round_up(s0 + L) + STAT_PAD.
__device__ __forceinline__ int stat_stride(int T, int B) {
    return (T + STAT_PAD - 1) / STAT_PAD * STAT_PAD + STAT_PAD * B;
}
__device__ __forceinline__ int stat_slot(int i) {
    const int p = i & 31;
    return (i & ~31) | ((p >> 4) << 4) | (((p >> 1) & 3) << 2) | (((p >> 3) & 1) << 1) | (p & 1);
}

}  // namespace sluice_attention_stats
