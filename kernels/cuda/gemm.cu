// gemm: C[M,N] = A[M,K] . B[N,K]^T (row-major; B is the weight in the linear-layer form).
//
// Three kernels, each serving the plain, batched and grouped forms (kernels/src/ops/gemm/ computes
// the grid and picks the kernel; kernels/src/ops/gemm_epilogue.rs launches the
// epilogue kernel, batched):
//   gemm_f32         F32 inputs, true f32 (SIMT FMA; never tf32, never tensor cores).
//   gemm_bf16_mma    BF16 inputs, mma.sync m16n8k16 + ldmatrix, f32 accumulate (compute_80;
//                    the default on every GPU).
//   gemm_bf16_mma_epilogue  the same main loop with an epilogue: v = fmaf(beta, E, alpha acc)
//                    written as f32 and/or bf16, as is and/or transposed (newton_schulz's steps;
//                    gemm::Epilogue below).
//   gemm_bf16_mma_swiglu  the same with the SwiGLU epilogue: bf16(silu(a) * b), bf16(a), bf16(b).
//   gemm_f32_nn, gemm_bf16_mma_nn  the same with B [K,N] row-major, read in place (C = A . B;
//                    the MoE backward's d(ye) . W2_e and da . W1_e: no transposed weight copies).
//   gemm_f32_segment_tn, gemm_bf16_mma_segment_tn  out[g] = P_g^T . Q_g over the row segments
//                    of P and Q (a grouped layer's weight gradient: every group in one launch,
//                    K = the segment's rows, ragged; own signature, see below).
// The output is always F32 (the epilogue kernel: as asked). The Hopper kernel of the same family,
// gemm_bf16_wgmma (tensor-map copies, a producer warp and two consumer warpgroups on wgmma, a
// persistent grid), lives in kernels/cuda/gemm_hopper.cu.
//
// Common signature (only pointers and scalars, per the kernel conventions):
//   (a, b, c, offsets, rows, n, k, groups, stride_a, stride_b, stride_c)
//   batched mode (offsets == nullptr): blockIdx.z is the batch entry; A, B, C advance by
//     stride_a/b/c elements per entry (stride_b = 0 shares one B); blockIdx.x is the row tile.
//   grouped mode (offsets != nullptr): rows offsets[g]..offsets[g+1] of A use B + g*stride_b;
//     blockIdx.x enumerates the row tiles of all segments in order (the host launches
//     ceil(rows/BM) + groups of them, an upper bound; the surplus exits at once).
//   blockIdx.y is the column tile in both modes.
//
// Determinism and batch invariance (DESIGN.md section 2): no split-K, no atomics. Every output
// element is produced by one thread that walks K from 0 upwards in the same steps whatever M is
// and wherever its row sits; rows outside the matrix and k past K are loaded as zeros, and the
// zero padding of K depends on K alone. So row i of C is bit-identical for any M.

#include <math.h>
#include <stdint.h>
#include <cuda_bf16.h>

#include "common/mma.cuh"

namespace gemm {

// The rows [row_begin, row_end) of A and C one block works on, with its A/B/C base pointers.
template <typename T>
struct Tile {
    const T* a;
    const T* b;
    float* c;
    int row_begin;  // first row of this block's tile (absolute row of a/c)
    int row_end;    // one past the last valid row of the tile's matrix or segment
    bool valid;
};

// Maps blockIdx to a tile (see the file comment for the two modes).
template <typename T, bool C_MAY_BE_NULL = false>
__device__ __forceinline__ Tile<T> find_tile(const T* a, const T* b, float* c,
                                             const int* offsets, int rows, int groups,
                                             long long stride_a, long long stride_b,
                                             long long stride_c, int block_m) {
    Tile<T> tile;
    tile.valid = false;
    if (offsets == nullptr) {
        const long long z = blockIdx.z;
        tile.a = a + z * stride_a;
        tile.b = b + z * stride_b;
        // The epilogue kernel may have no f32 output (c null): no arithmetic on a null pointer.
        tile.c = (C_MAY_BE_NULL && c == nullptr) ? nullptr : c + z * stride_c;
        tile.row_begin = static_cast<int>(blockIdx.x) * block_m;
        tile.row_end = rows;
        tile.valid = tile.row_begin < rows;
        return tile;
    }
    // Grouped: walk the segments in order. The host checked the offsets; they are clamped to
    // [0, rows] and made non-decreasing here as well, so no bad value can send a load outside A.
    int t = static_cast<int>(blockIdx.x);
    int lo = 0;
    for (int g = 0; g < groups; ++g) {
        int hi = offsets[g + 1];
        hi = hi < lo ? lo : (hi > rows ? rows : hi);
        const int tiles = (hi - lo + block_m - 1) / block_m;
        if (t < tiles) {
            tile.a = a;
            tile.b = b + static_cast<long long>(g) * stride_b;
            tile.c = c;
            tile.row_begin = lo + t * block_m;
            tile.row_end = hi;
            tile.valid = true;
            return tile;
        }
        t -= tiles;
        lo = hi;
    }
    return tile;
}

// ---------------------------------------------------------------------------------------------
// gemm_f32: 64x64 tile per block, 256 threads, each 4x4 outputs (rows ty + 16i, columns
// tx + 16j so that a warp's shared-memory reads are broadcasts or conflict-free), K in steps of
// 16 through shared memory. Each output is one fmaf chain over k = 0, 1, ..., K-1.
// ---------------------------------------------------------------------------------------------
constexpr int F32_BM = 64, F32_BN = 64, F32_BK = 16, F32_THREADS = 256;
static_assert(F32_BM * F32_BK == 4 * F32_THREADS, "the f32 loader reads 4 values a thread");

// The body of gemm_f32 (B_KN = false: B is [N,K], the linear-layer form) and gemm_f32_nn
// (B_KN = true: B is [K,N] row-major, read in place). Only the B loads differ: the same values
// reach the same fmaf chain, so C has the same bits as gemm_f32 on B transposed.
template <bool B_KN>
__device__ __forceinline__ void f32_gemm(const float* __restrict__ a, const float* __restrict__ b,
                                         float* __restrict__ c, const int* __restrict__ offsets,
                                         int rows, int n, int k, int groups, long long stride_a,
                                         long long stride_b, long long stride_c) {
    const Tile<float> tile =
        find_tile(a, b, c, offsets, rows, groups, stride_a, stride_b, stride_c, F32_BM);
    if (!tile.valid) return;  // uniform across the block, before any barrier
    const int col0 = static_cast<int>(blockIdx.y) * F32_BN;

    // Transposed tiles ([k][row]) so the inner loop reads rows of shared memory; +4 padding
    // keeps the transposing stores from piling onto one bank.
    __shared__ float as[F32_BK][F32_BM + 4];
    __shared__ float bs[F32_BK][F32_BN + 4];

    const int tid = threadIdx.x;
    const int tx = tid % 16, ty = tid / 16;
    float acc[4][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    // Loader: thread tid reads 4 consecutive k of row tid/4 (64 rows x 16 k = 1024 values).
    const int lr = tid / 4, lk = (tid % 4) * 4;
    for (int k0 = 0; k0 < k; k0 += F32_BK) {
        const int ar = tile.row_begin + lr;
        const int bc = col0 + lr;
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int kk = k0 + lk + e;
            as[lk + e][lr] = (ar < tile.row_end && kk < k)
                                 ? tile.a[static_cast<long long>(ar) * k + kk]
                                 : 0.0f;
            const long long b_at = B_KN ? static_cast<long long>(kk) * n + bc
                                        : static_cast<long long>(bc) * k + kk;
            bs[lk + e][lr] = (bc < n && kk < k) ? tile.b[b_at] : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < F32_BK; ++kk) {
            float av[4], bv[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
            #pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = tile.row_begin + ty + 16 * i;
        if (r >= tile.row_end) continue;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = col0 + tx + 16 * j;
            if (col < n) tile.c[static_cast<long long>(r) * n + col] = acc[i][j];
        }
    }
}

}  // namespace gemm

extern "C" __global__ void __launch_bounds__(256) gemm_f32(
    const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
    const int* __restrict__ offsets, int rows, int n, int k, int groups, long long stride_a,
    long long stride_b, long long stride_c) {
    gemm::f32_gemm<false>(a, b, c, offsets, rows, n, k, groups, stride_a, stride_b, stride_c);
}

// gemm_f32 with B [K,N] row-major (per batch entry or group): C = A . B.
extern "C" __global__ void __launch_bounds__(256) gemm_f32_nn(
    const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
    const int* __restrict__ offsets, int rows, int n, int k, int groups, long long stride_a,
    long long stride_b, long long stride_c) {
    gemm::f32_gemm<true>(a, b, c, offsets, rows, n, k, groups, stride_a, stride_b, stride_c);
}

namespace gemm {

// ---------------------------------------------------------------------------------------------
// gemm_bf16_mma: 128x128 tile per block, K in steps of 32, 256 threads = 8 warps as 2 (rows) x
// 4 (columns), each warp 64x32 = 4 x 4 mma.sync m16n8k16 tiles (64 f32 accumulators a thread).
// Shared memory holds two stages of A[128][32] and B[128][32] (rows padded to 40 bf16 = 80
// bytes: 16-byte aligned for ldmatrix, and the 8 row addresses of one 8x8 ldmatrix fall in
// distinct banks). The next K step is loaded into registers while the current one is computed
// (one barrier per K step).
// ---------------------------------------------------------------------------------------------
constexpr int MMA_BM = 128, MMA_BN = 128, MMA_BK = 32, MMA_LD = MMA_BK + 8, MMA_THREADS = 256;
static_assert(MMA_BM * MMA_BK == 2 * 8 * MMA_THREADS, "the mma loader reads 2 x 8 bf16 a thread");

// 16 bytes (8 bf16) of row `r`, columns kk..kk+7, of a row-major [*, k] matrix, zeros outside.
__device__ __forceinline__ uint4 load8(const __nv_bfloat16* base, int r, int r_end, int kk,
                                       int k, bool vec_ok) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r >= r_end) return v;
    const __nv_bfloat16* p = base + static_cast<long long>(r) * k + kk;
    if (vec_ok && kk + 8 <= k) return *reinterpret_cast<const uint4*>(p);
    uint16_t h[8];
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        h[e] = 0;
        if (kk + e < k) {
            const __nv_bfloat16 x = p[e];
            h[e] = *reinterpret_cast<const uint16_t*>(&x);
        }
    }
    v.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
    v.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
    v.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
    v.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
    return v;
}

// The epilogue of gemm_bf16_mma_epilogue: each output element is
//   v = fmaf(beta, E[r][col], alpha * acc)   (v = alpha * acc when e is null)
// in f32 (newton_schulz's combine formulas: the same ops in the same order, so the fused
// result has the unfused result's bits), written to any of c [M,N] f32, c_t [N,M] f32, c_b
// [M,N] bf16 (round-to-nearest-even) and c_bt [N,M] bf16; null skips one. E, c and c_b advance
// by stride_c per batch entry, c_t and c_bt too (they hold the same M*N elements transposed).
// The default (alpha 1, beta 0, no E, c only) is the plain GEMM's result, but the plain kernel
// keeps its own direct stores: `Epilogue` is only instantiated for the epilogue kernel.
//
// The SwiGLU form (gemm_bf16_mma_swiglu, the MoE forward's second up-projection): with
// swiglu_a set, v is b = the product, and h_b[idx] = bf16(silu(a) * b) with a = swiglu_a[idx]
// (f32, the first up-projection), computed as swiglu.cu computes it (s = 1 / (1 + expf(-a)),
// a * s * b) and rounded as moe_narrow_bf16 rounds: the bits of GEMM, swiglu and narrowing run
// one after the other, without h's f32 round trip through memory. a_b (if set) gets bf16(a),
// and c_b bf16(b): what the backward keeps.
struct Epilogue {
    const float* e;
    float* c_t;
    __nv_bfloat16* c_b;
    __nv_bfloat16* c_bt;
    float alpha;
    float beta;
    const float* swiglu_a;
    __nv_bfloat16* h_b;
    __nv_bfloat16* a_b;
};

// The epilogue's staging slab: 32 rows of the 128x128 tile in f32 (16 KB, reusing the A stages'
// 20 KB), element (row, col) at row * 128 + (col ^ swz(row)). swz permutes the low five bits:
// over a slab's 32 rows it takes every value 0..31 once, so reading a column (lanes along rows)
// hits 32 banks, and reading a row (lanes along 32 aligned columns) too; the fragment stores
// (lanes g = 0..7 on rows, t = 0..3 on column pairs) are 2-way (16 banks). Padding rows to 129
// floats instead made them 4-way (measured: 2048 wavefronts a block against 512 ideal).
constexpr int EPI_ROWS = 32;
static_assert(EPI_ROWS * MMA_BN * 4 <= 2 * MMA_BM * MMA_LD * 2, "the slab fits the A stages");

__device__ __forceinline__ int slab_at(int row, int col) {
    const int swz = ((row & 7) << 2) | ((row >> 3) & 3);
    return row * MMA_BN + (col ^ swz);
}

// Writes the block's 128x128 accumulator tile through the epilogue, one 32-row slab at a time:
// the warps holding the slab's rows (wm = slab / 2, fragments i = 2 (slab % 2) + 0, 1) store
// them to the slab; then every thread takes elements along rows (lanes on consecutive columns:
// E loads and c / c_b stores coalesced) computing v and keeping it in the slab, and, when a
// transposed output is asked for, elements along columns (lanes on consecutive rows: c_t / c_bt
// stores coalesced). The fragments' own layout would spread one store instruction over 8 rows.
__device__ __forceinline__ void epilogue_store(const float (&acc)[4][4][4], float* slab,
                                               const Epilogue& ep, float* c, long long cz,
                                               int row_begin, int row_end, int col0, int rows,
                                               int n) {
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / 4, wn = warp % 4;
    const int g = lane / 4, t = lane % 4;
    const bool transposed = ep.c_t != nullptr || ep.c_bt != nullptr;
    // Unrolled: the fragment index i below must be a compile-time constant, or acc would be
    // indexed at run time and live in local memory.
    #pragma unroll
    for (int s = 0; s < MMA_BM / EPI_ROWS; ++s) {
        if (wm == s / 2) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 2 * (s % 2) + h;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    #pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const int row = h * 16 + g + 8 * hr;
                        const int col = wn * 32 + j * 8 + 2 * t;
                        slab[slab_at(row, col)] = acc[i][j][2 * hr];
                        slab[slab_at(row, col + 1)] = acc[i][j][2 * hr + 1];
                    }
                }
            }
        }
        __syncthreads();
        const int r0 = row_begin + s * EPI_ROWS;
        for (int q = tid; q < EPI_ROWS * MMA_BN; q += MMA_THREADS) {
            const int lr = q / MMA_BN, lc = q % MMA_BN;
            const int r = r0 + lr, col = col0 + lc;
            if (r >= row_end || col >= n) continue;
            const long long idx = cz + static_cast<long long>(r) * n + col;
            float v = ep.alpha * slab[slab_at(lr, lc)];
            if (ep.e != nullptr) v = fmaf(ep.beta, ep.e[idx], v);
            if (c != nullptr) c[idx] = v;
            if (ep.c_b != nullptr) ep.c_b[idx] = __float2bfloat16_rn(v);
            if (ep.swiglu_a != nullptr) {
                const float av = ep.swiglu_a[idx];
                const float s = 1.0f / (1.0f + expf(-av));
                ep.h_b[idx] = __float2bfloat16_rn(av * s * v);
                if (ep.a_b != nullptr) ep.a_b[idx] = __float2bfloat16_rn(av);
            }
            if (transposed) slab[slab_at(lr, lc)] = v;  // for the transposed pass
        }
        if (transposed) {  // uniform across the block
            __syncthreads();
            for (int q = tid; q < EPI_ROWS * MMA_BN; q += MMA_THREADS) {
                const int lc = q / EPI_ROWS, lr = q % EPI_ROWS;
                const int r = r0 + lr, col = col0 + lc;
                if (r >= row_end || col >= n) continue;
                const float v = slab[slab_at(lr, lc)];
                const long long idx = cz + static_cast<long long>(col) * rows + r;
                if (ep.c_t != nullptr) ep.c_t[idx] = v;
                if (ep.c_bt != nullptr) ep.c_bt[idx] = __float2bfloat16_rn(v);
            }
        }
        __syncthreads();  // the slab is rewritten by the next pass
    }
}

// The body of gemm_bf16_mma (EPI = false: the plain GEMM's direct f32 stores, unchanged) and
// gemm_bf16_mma_epilogue (EPI = true: epilogue_store). A compile-time flag, not a runtime
// branch, so the plain kernel's code is what it was. B_KN (gemm_bf16_mma_nn): B is [K,N]
// row-major, staged as [32 k][128 n] rows (padded to 136 bf16 = 272 bytes, so the 8 row
// addresses of an ldmatrix fall in distinct banks) and read with ldmatrix .trans, which hands
// each lane the same B fragment the [N,K] layout gives: the same mma instructions on the same
// values, so C has the bits of gemm_bf16_mma on B transposed.
template <bool EPI, bool B_KN = false>
__device__ __forceinline__ void mma_gemm(const __nv_bfloat16* __restrict__ a,
                                         const __nv_bfloat16* __restrict__ b,
                                         float* __restrict__ c, const int* __restrict__ offsets,
                                         int rows, int n, int k, int groups, long long stride_a,
                                         long long stride_b, long long stride_c,
                                         const Epilogue& ep) {
    const Tile<__nv_bfloat16> tile = find_tile<__nv_bfloat16, EPI>(
        a, b, c, offsets, rows, groups, stride_a, stride_b, stride_c, MMA_BM);
    if (!tile.valid) return;  // uniform across the block, before any barrier
    const int col0 = static_cast<int>(blockIdx.y) * MMA_BN;

    __align__(16) __shared__ __nv_bfloat16 as[2][MMA_BM][MMA_LD];
    constexpr int B_ROWS = B_KN ? MMA_BK : MMA_BN, B_LD = B_KN ? MMA_BN + 8 : MMA_LD;
    __align__(16) __shared__ __nv_bfloat16 bs[2][B_ROWS][B_LD];

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / 4, wn = warp % 4;  // warp tile: rows 64*wm.., columns 32*wn..
    // 16-byte loads need every row start 16-byte aligned.
    const bool vec_a = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(tile.a) % 16 == 0);
    const bool vec_b = ((B_KN ? n : k) % 8 == 0) && (reinterpret_cast<uintptr_t>(tile.b) % 16 == 0);

    // Loader: 128 rows x 4 chunks of 8 bf16 per matrix = 512 chunks; thread tid takes chunks
    // tid and tid + 256 (row q/4, chunk q%4). B_KN: 32 k rows x 16 chunks of 8 n (row q/16,
    // chunk q%16).
    uint4 ra[2], rb[2];
    auto load_regs = [&](int k0) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int q = tid + 256 * h;
            const int r = q / 4, kk = k0 + (q % 4) * 8;
            ra[h] = load8(tile.a, tile.row_begin + r, tile.row_end, kk, k, vec_a);
            if constexpr (B_KN) {
                rb[h] = load8(tile.b, k0 + q / 16, k, col0 + (q % 16) * 8, n, vec_b);
            } else {
                rb[h] = load8(tile.b, col0 + r, n, kk, k, vec_b);
            }
        }
    };
    auto store_regs = [&](int s) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int q = tid + 256 * h;
            const int r = q / 4, kc = (q % 4) * 8;
            *reinterpret_cast<uint4*>(&as[s][r][kc]) = ra[h];
            if constexpr (B_KN) {
                *reinterpret_cast<uint4*>(&bs[s][q / 16][(q % 16) * 8]) = rb[h];
            } else {
                *reinterpret_cast<uint4*>(&bs[s][r][kc]) = rb[h];
            }
        }
    };

    float acc[4][4][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    const int ktiles = (k + MMA_BK - 1) / MMA_BK;
    if (ktiles > 0) {
        load_regs(0);
        store_regs(0);
    }
    __syncthreads();
    for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt & 1;
        if (kt + 1 < ktiles) load_regs((kt + 1) * MMA_BK);
        #pragma unroll
        #pragma unroll
        for (int ks = 0; ks < MMA_BK; ks += 16) {
            uint32_t af[4][4], bf[4][2];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                // Lanes 0-15 address rows 0-15 at k ks; lanes 16-31 the same rows at ks + 8.
                const int r = wm * 64 + i * 16 + (lane % 16);
                sluice::ldmatrix_x4(af[i], &as[s][r][ks + (lane / 16) * 8]);
            }
            #pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                // One x4 covers two n8 tiles: matrices (n 0-7, k lo), (n 0-7, k hi),
                // (n 8-15, k lo), (n 8-15, k hi).
                uint32_t r4[4];
                if constexpr (B_KN) {
                    // The same four matrices from [k][n] rows: lanes 8i..8i+7 address k rows
                    // ks + 8 (i % 2) + 0..7 at column n0 + 8 (i / 2); .trans transposes each.
                    const int kr = ks + ((lane / 8) % 2) * 8 + (lane % 8);
                    const int nc = wn * 32 + jj * 16 + (lane / 16) * 8;
                    sluice::ldmatrix_x4_trans(r4, &bs[s][kr][nc]);
                } else {
                    const int nr = wn * 32 + jj * 16 + (lane / 16) * 8 + (lane % 8);
                    sluice::ldmatrix_x4(r4, &bs[s][nr][ks + ((lane / 8) % 2) * 8]);
                }
                bf[2 * jj][0] = r4[0];
                bf[2 * jj][1] = r4[1];
                bf[2 * jj + 1][0] = r4[2];
                bf[2 * jj + 1][1] = r4[3];
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) sluice::mma_m16n8k16_bf16(acc[i][j], af[i], bf[j]);
        }
        if (kt + 1 < ktiles) store_regs(s ^ 1);
        __syncthreads();
    }

    if constexpr (EPI) {
        // The main loop ended with a barrier: the A stages are free for the slab.
        const long long cz = offsets == nullptr ? static_cast<long long>(blockIdx.z) * stride_c : 0;
        epilogue_store(acc, reinterpret_cast<float*>(&as[0][0][0]), ep, c, cz, tile.row_begin,
                       tile.row_end, col0, rows, n);
        return;
    }
    const int g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = col0 + wn * 32 + j * 8 + 2 * t;
            #pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = tile.row_begin + wm * 64 + i * 16 + g + 8 * hr;
                if (r >= tile.row_end) continue;
                float* out = tile.c + static_cast<long long>(r) * n;
                if (col < n) out[col] = acc[i][j][2 * hr];
                if (col + 1 < n) out[col + 1] = acc[i][j][2 * hr + 1];
            }
        }
    }
}

}  // namespace gemm

extern "C" __global__ void __launch_bounds__(256) gemm_bf16_mma(
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
    float* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    long long stride_a, long long stride_b, long long stride_c) {
    gemm::mma_gemm<false>(a, b, c, offsets, rows, n, k, groups, stride_a, stride_b, stride_c,
                          gemm::Epilogue{nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f, nullptr, nullptr, nullptr});
}

// gemm_bf16_mma with B [K,N] row-major (per batch entry or group): C = A . B.
extern "C" __global__ void __launch_bounds__(256) gemm_bf16_mma_nn(
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
    float* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    long long stride_a, long long stride_b, long long stride_c) {
    gemm::mma_gemm<false, true>(a, b, c, offsets, rows, n, k, groups, stride_a, stride_b,
                                stride_c,
                                gemm::Epilogue{nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f, nullptr, nullptr, nullptr});
}

// gemm_f32_segment_tn: out[g, i, j] = sum_{r in segment g, ascending} P[r, i] * Q[r, j] for
// P [rows, p], Q [rows, q] f32, segment g = rows offsets[g]..offsets[g+1] (clamped to
// [0, rows], non-decreasing); blockIdx.z = g. The f32 form of gemm_bf16_mma_segment_tn (until
// 2026-12-02 the moe family's moe_segment_wgrad). This is the weight gradient of a
// grouped linear layer (dW_e = dOut_e^T · In_e) without atomics and without a split over rows:
// each element is one chain over its segment's rows in ascending order, so its bits depend on
// the segment alone. An empty segment gives zeros. The chain is written as explicit fmaf (what
// nvcc makes of `acc += a * b` anyway), so the emulator, whose host compiler does not contract,
// sums it the same way and the CPU reference (an FMA chain, gemm_chain) gives the same bits.
//
// Version 2 (version 1, commit 0ddafc8: a 16x16 tile, one output per thread): a 64x64 tile of
// out per 256-thread block, 4x4 outputs per thread (rows ty + 16a, columns tx + 16b, so a warp's
// shared-memory reads are broadcasts or conflict-free), 16 rows of P and Q at a time through
// shared memory with coalesced loads along the columns. 16 FMAs per 8 shared loads instead of
// 1 per 2: predicted ~4x on the GPU. Same summation order as version 1, so the same bits.
namespace gemm {
constexpr int WG_TILE = 64, WG_ROWS = 16, WG_THREADS = 256;
}  // namespace gemm

extern "C" __global__ void __launch_bounds__(256) gemm_f32_segment_tn(
    const float* __restrict__ P, const float* __restrict__ Q, const int* __restrict__ offsets,
    float* __restrict__ out, int rows, int p, int q) {
    using namespace gemm;
    __shared__ float ps[WG_ROWS][WG_TILE];
    __shared__ float qs[WG_ROWS][WG_TILE];
    const int g = blockIdx.z;
    int r0 = offsets[g];
    r0 = r0 < 0 ? 0 : (r0 > rows ? rows : r0);
    int r1 = offsets[g + 1];
    r1 = r1 < r0 ? r0 : (r1 > rows ? rows : r1);
    const int i0 = blockIdx.y * WG_TILE, j0 = blockIdx.x * WG_TILE;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[4][4];
    #pragma unroll
    for (int a = 0; a < 4; ++a)
        #pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;
    for (int base = r0; base < r1; base += WG_ROWS) {
        // 16 rows x 64 columns of P and of Q: 4 values of each per thread, consecutive threads
        // on consecutive columns.
        #pragma unroll
        for (int m = 0; m < (WG_ROWS * WG_TILE) / WG_THREADS; ++m) {
            const int at = tid + m * WG_THREADS;
            const int rr = at / WG_TILE, cc = at % WG_TILE;
            const int r = base + rr;
            const bool row_ok = r < r1;
            ps[rr][cc] = (row_ok && i0 + cc < p) ? P[static_cast<long long>(r) * p + i0 + cc] : 0.0f;
            qs[rr][cc] = (row_ok && j0 + cc < q) ? Q[static_cast<long long>(r) * q + j0 + cc] : 0.0f;
        }
        __syncthreads();
        const int rows = r1 - base < WG_ROWS ? r1 - base : WG_ROWS;
        for (int rr = 0; rr < rows; ++rr) {
            float av[4], bv[4];
            #pragma unroll
            for (int a = 0; a < 4; ++a) av[a] = ps[rr][ty + 16 * a];
            #pragma unroll
            for (int b = 0; b < 4; ++b) bv[b] = qs[rr][tx + 16 * b];
            #pragma unroll
            for (int a = 0; a < 4; ++a)
                #pragma unroll
                for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(av[a], bv[b], acc[a][b]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty + 16 * a;
        if (i >= p) continue;
        #pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int j = j0 + tx + 16 * b;
            if (j < q) out[(static_cast<long long>(g) * p + i) * q + j] = acc[a][b];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// gemm_bf16_mma_segment_tn: out[g] = P_g^T . Q_g for the row segments g of P [rows, p] and
// Q [rows, q] (segment g = rows offsets[g]..offsets[g+1]), out [groups, p, q] f32: the weight
// gradient of a grouped linear layer, all groups in one launch, reading the segments in place.
// Grid (ceil(q/128), ceil(p/128), groups): a 128x128 tile of out[g] per block, the mma_gemm
// warp layout; K is the segment's rows, 32 at a time from its first row, rows past its end
// loaded as zeros (a ragged K needs no scalar path: rows are whole 16-byte chunks when p and q
// are multiples of 8). Both operands are staged as they lie, [32 rows][128 columns] (padded to
// 136 bf16), and read with ldmatrix .trans: P's as the A fragment (m = P's column), Q's as the
// B fragment. No split over rows and no atomics: element (i, j) is one chain of mma steps over
// the segment's rows in ascending order, k16 by k16, so its bits depend on the segment alone,
// and equal those of gemm_bf16_mma on the segment's transposed rows (P_g^T [p, n_g] times
// (Q_g^T)^T), which the per-expert path ran before. An empty segment writes zeros.
// ---------------------------------------------------------------------------------------------
namespace gemm {

constexpr int SEG_LD = MMA_BN + 8;

__device__ __forceinline__ void mma_segment_tn(const __nv_bfloat16* __restrict__ pm,
                                               const __nv_bfloat16* __restrict__ qm,
                                               const int* __restrict__ offsets,
                                               float* __restrict__ out, int rows, int p, int q) {
    const int g = static_cast<int>(blockIdx.z);
    // Clamped to [0, rows] and non-decreasing from this segment's start, so no bad offset can
    // send a load outside P or Q.
    int r_begin = offsets[g];
    r_begin = r_begin < 0 ? 0 : (r_begin > rows ? rows : r_begin);
    int r_end = offsets[g + 1];
    r_end = r_end < r_begin ? r_begin : (r_end > rows ? rows : r_end);
    const int m0 = static_cast<int>(blockIdx.y) * MMA_BM;  // columns of P: rows of out[g]
    const int n0 = static_cast<int>(blockIdx.x) * MMA_BN;  // columns of Q: columns of out[g]

    __align__(16) __shared__ __nv_bfloat16 ps[2][MMA_BK][SEG_LD];
    __align__(16) __shared__ __nv_bfloat16 qs[2][MMA_BK][SEG_LD];

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / 4, wn = warp % 4;  // warp tile: rows 64*wm.., columns 32*wn..
    const bool vec_p = (p % 8 == 0) && (reinterpret_cast<uintptr_t>(pm) % 16 == 0);
    const bool vec_q = (q % 8 == 0) && (reinterpret_cast<uintptr_t>(qm) % 16 == 0);

    // Loader: 32 rows x 16 chunks of 8 bf16 per operand = 512 chunks; thread tid takes chunks
    // tid and tid + 256 (row c/16, chunk c%16): a warp reads two whole 256-byte row pieces.
    uint4 rp[2], rq[2];
    auto load_regs = [&](int r0) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = tid + 256 * h;
            const int r = r0 + c / 16, col = (c % 16) * 8;
            rp[h] = load8(pm, r, r_end, m0 + col, p, vec_p);
            rq[h] = load8(qm, r, r_end, n0 + col, q, vec_q);
        }
    };
    auto store_regs = [&](int s) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = tid + 256 * h;
            *reinterpret_cast<uint4*>(&ps[s][c / 16][(c % 16) * 8]) = rp[h];
            *reinterpret_cast<uint4*>(&qs[s][c / 16][(c % 16) * 8]) = rq[h];
        }
    };

    float acc[4][4][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    const int ktiles = (r_end - r_begin + MMA_BK - 1) / MMA_BK;
    if (ktiles > 0) {
        load_regs(r_begin);
        store_regs(0);
    }
    __syncthreads();
    for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt & 1;
        if (kt + 1 < ktiles) load_regs(r_begin + (kt + 1) * MMA_BK);
        #pragma unroll
        for (int ks = 0; ks < MMA_BK; ks += 16) {
            uint32_t af[4][4], bf[4][2];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                // A (16 m x 16 k) from [k][m] rows: matrices (k lo, m lo), (k lo, m hi),
                // (k hi, m lo), (k hi, m hi) are a0..a3; lanes 8i..8i+7 address matrix i's rows.
                const int kr = ks + (lane / 16) * 8 + (lane % 8);
                const int mc = wm * 64 + i * 16 + ((lane / 8) % 2) * 8;
                sluice::ldmatrix_x4_trans(af[i], &ps[s][kr][mc]);
            }
            #pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                // Two n8 tiles of B from [k][n] rows, as gemm_bf16_mma_nn reads them.
                const int kr = ks + ((lane / 8) % 2) * 8 + (lane % 8);
                const int nc = wn * 32 + jj * 16 + (lane / 16) * 8;
                uint32_t r4[4];
                sluice::ldmatrix_x4_trans(r4, &qs[s][kr][nc]);
                bf[2 * jj][0] = r4[0];
                bf[2 * jj][1] = r4[1];
                bf[2 * jj + 1][0] = r4[2];
                bf[2 * jj + 1][1] = r4[3];
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) sluice::mma_m16n8k16_bf16(acc[i][j], af[i], bf[j]);
        }
        if (kt + 1 < ktiles) store_regs(s ^ 1);
        __syncthreads();
    }

    float* o = out + static_cast<long long>(g) * p * q;
    const int gr = lane / 4, t = lane % 4;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + wn * 32 + j * 8 + 2 * t;
            #pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = m0 + wm * 64 + i * 16 + gr + 8 * hr;
                if (r >= p) continue;
                float* row = o + static_cast<long long>(r) * q;
                if (col < q) row[col] = acc[i][j][2 * hr];
                if (col + 1 < q) row[col + 1] = acc[i][j][2 * hr + 1];
            }
        }
    }
}

}  // namespace gemm

extern "C" __global__ void __launch_bounds__(256) gemm_bf16_mma_segment_tn(
    const __nv_bfloat16* __restrict__ pm, const __nv_bfloat16* __restrict__ qm,
    const int* __restrict__ offsets, float* __restrict__ out, int rows, int p, int q) {
    gemm::mma_segment_tn(pm, qm, offsets, out, rows, p, q);
}

// gemm_bf16_mma with the epilogue (gemm::Epilogue above): the common signature, then E, c_t,
// c_b, c_bt, alpha, beta. `c` may be null. Outputs must not overlap the inputs (a, b, e).
extern "C" __global__ void __launch_bounds__(256) gemm_bf16_mma_epilogue(
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
    float* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    long long stride_a, long long stride_b, long long stride_c, const float* __restrict__ e,
    float* __restrict__ c_t, __nv_bfloat16* __restrict__ c_b, __nv_bfloat16* __restrict__ c_bt,
    float alpha, float beta) {
    gemm::mma_gemm<true>(a, b, c, offsets, rows, n, k, groups, stride_a, stride_b, stride_c,
                         gemm::Epilogue{e, c_t, c_b, c_bt, alpha, beta, nullptr, nullptr, nullptr});
}

// gemm_bf16_mma with the SwiGLU epilogue (gemm::Epilogue above): the common signature, then
// swiglu_a (f32), b_b, h_b and a_b (bf16), all shaped as c. `c` (b in f32), b_b and a_b may be
// null. Outputs must not overlap the inputs.
extern "C" __global__ void __launch_bounds__(256) gemm_bf16_mma_swiglu(
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
    float* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    long long stride_a, long long stride_b, long long stride_c,
    const float* __restrict__ swiglu_a, __nv_bfloat16* __restrict__ b_b,
    __nv_bfloat16* __restrict__ h_b, __nv_bfloat16* __restrict__ a_b) {
    gemm::mma_gemm<true>(a, b, c, offsets, rows, n, k, groups, stride_a, stride_b, stride_c,
                         gemm::Epilogue{nullptr, nullptr, b_b, nullptr, 1.0f, 0.0f, swiglu_a,
                                        h_b, a_b});
}
