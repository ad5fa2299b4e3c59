// Newton-Schulz orthogonalisation (Muon, DESIGN.md section 3.7), batched over n matrices of
// one shape [r,c]. Per matrix: X0 = G / (||G||_F + 1e-7), in the wide orientation (transposed
// when r > c); then `steps` times X <- a X + (b A + c A^2) X with A = X X^T; the result is
// written back in the input's orientation.
//
// Kernels (the Rust side launches them in sequence; every launch covers all n matrices)
//   newton_schulz_sq_partials_{f32,bf16}  the sum of squares of each of many fixed chunks of
//                                         each matrix (16-byte loads), one block per chunk
//   newton_schulz_scale_{f32,bf16}      adds a matrix's partials in a fixed order, then
//                                       X0 = G / (norm + 1e-7) by 64x64 tiles, in f32 and/or
//                                       bf16, as is and/or transposed (the section below)
//   newton_schulz_matmul_f32            batched strided C = alpha * op(A) op(B) + beta * E,
//                                       16x16 output tiles, true f32 (FMA, no tensor cores)
//
// One step is three matmul launches:
//   A  = X X^T                  (alpha 1, beta 0)
//   Bm = c * (A A) + b * A      (alpha c, beta b, E = A)
//   X' = 1 * (Bm X) + a * X     (alpha 1, beta a, E = X); the last step writes X' straight into
//                               the output with transposed strides when the matrix was
//                               transposed at the start.
//
// Numerics: BF16 inputs are widened exactly on load; everything after the load is f32 (norm,
// accumulators and X between steps). Determinism: no atomics; every output element sums its K
// products in ascending k by one thread; the norm is a fixed-order two-level reduction whose
// partition depends on the matrix's size alone (batch-invariant).
//
// The bf16 path (`newton_schulz_bf16` on the Rust side) uses the same normalise launches (the
// scale launch also writes Xb = bf16(X0) and XTb = bf16(X0)^T), then runs every product on the
// gemm family's bf16 tensor-core kernel with its epilogue (`gemm_bf16_mma_epilogue` in gemm.cu:
// C = A B^T, bf16 operands, f32 accumulation, then v = fmaf(beta, E, alpha acc) written as f32
// and/or bf16, as is and/or transposed). One step is three launches:
//   A = gemm(Xb, Xb)                  -> A (f32) and Ab = bf16(A)
//   Bb = bf16(fmaf(b, A, c AA)),         AA = gemm(Ab, Ab) (A symmetric)
//   X' = fmaf(a, X, BX),                 BX = gemm(Bb, XTb) -> X' (f32, the master copy), Xb'
//                                     and XTb' for the next step (the last step: the output)
// (Until issue 23 item 4 the elementwise parts were separate `newton_schulz_combine_bf16`
// launches with the same formulas; the fused results have their bits.)

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace newton_schulz_impl {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int TILE = 16;

using sluice::load;
using sluice::block_sum;


// ---------------------------------------------------------------------------------------------
// The normalisation, in two launches over all n matrices (issue 23 item 4: one block per matrix
// left most SMs idle at 64 matrices and read G with scalar loads).
//
// 1. newton_schulz_sq_partials_*: grid [parts, n]. Matrix m's `size` elements are cut into
//    `parts` chunks of `chunk` elements (a function of `size` alone, computed by the host:
//    ns_sq_partition in newton_schulz.rs), one block each. Thread t takes the 8-element groups
//    t, t + 256, ... of its chunk (16-byte loads of bf16, two of f32, where G's matrix starts on
//    16 bytes; scalar loads otherwise, in the same order) and adds their squares to +0 with one
//    fmaf each, in ascending element order; block_sum adds the 256 lanes in its fixed order.
//    Partial p of matrix m goes to partials[m * parts + p]. No atomics.
// 2. newton_schulz_scale_*: grid [ceil(r/64) * ceil(c/64), n], one 64x64 tile of G each (row
//    tile blockIdx.x / ceil(c/64), column tile blockIdx.x % ceil(c/64)). Every
//    block re-adds its matrix's `parts` partials (lane t holds partial t; block_sum's order:
//    parts <= 256 depends on the size alone), so the norm's bits never depend on n or on the
//    tile; then v = G / (sqrt(sum) + 1e-7) is written to any of: x [r,c] f32, x_t [c,r] f32,
//    xb [r,c] bf16, xb_t [c,r] bf16 (null skips one). The transposes go through shared memory
//    so reads and writes stay coalesced.
// ---------------------------------------------------------------------------------------------
constexpr int GROUP = 8;     // elements a thread loads at once: 16 bytes of bf16
constexpr int SCALE_T = 64;  // the scale kernel's tile edge
constexpr int SCALE_R = THREADS / SCALE_T;  // rows of the tile one pass covers (4)

__device__ __forceinline__ bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Elements i..i+7 of p as f32 (the caller checked that all 8 exist).
__device__ __forceinline__ void load_group(const float* p, long long i, bool vec, float (&v)[GROUP]) {
    if (vec) {
        const float4 lo = *reinterpret_cast<const float4*>(p + i);
        const float4 hi = *reinterpret_cast<const float4*>(p + i + 4);
        v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
        v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
        return;
    }
    #pragma unroll
    for (int e = 0; e < GROUP; ++e) v[e] = p[i + e];
}

__device__ __forceinline__ void load_group(const __nv_bfloat16* p, long long i, bool vec,
                                           float (&v)[GROUP]) {
    if (vec) {
        const uint4 q = *reinterpret_cast<const uint4*>(p + i);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            // bf16 -> f32 is the bf16's bits in the high half (exact).
            v[2 * e] = __uint_as_float(w[e] << 16);
            v[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
        }
        return;
    }
    #pragma unroll
    for (int e = 0; e < GROUP; ++e) v[e] = __bfloat162float(p[i + e]);
}

template <typename T>
__device__ __forceinline__ void sq_partials(const T* __restrict__ g, float* __restrict__ partials,
                                            long long size, long long chunk, int parts) {
    __shared__ float scratch[WARPS];
    const long long m = blockIdx.y;
    const T* gm = g + m * size;
    const long long begin = static_cast<long long>(blockIdx.x) * chunk;
    const long long end = begin + chunk < size ? begin + chunk : size;
    // Every group starts a multiple of 8 elements into the matrix (chunk is a multiple of 8), so
    // one check of the matrix's start covers all of its 16-byte loads.
    const bool vec = aligned16(gm);
    float ss = 0.0f;
    for (long long i = begin + static_cast<long long>(threadIdx.x) * GROUP; i < end;
         i += static_cast<long long>(THREADS) * GROUP) {
        float v[GROUP];
        if (i + GROUP <= end) {
            load_group(gm, i, vec, v);
        } else {
            // The matrix's last, partial group: zeros past the end add nothing
            // (fmaf(0, 0, ss) == ss for ss >= +0).
            #pragma unroll
            for (int e = 0; e < GROUP; ++e) v[e] = i + e < end ? load(gm, i + e) : 0.0f;
        }
        #pragma unroll
        for (int e = 0; e < GROUP; ++e) ss = fmaf(v[e], v[e], ss);
    }
    const float total = block_sum<WARPS>(ss, scratch);
    if (threadIdx.x == 0) partials[m * parts + blockIdx.x] = total;
}

template <typename T>
__device__ __forceinline__ void scale(const T* __restrict__ g, const float* __restrict__ partials,
                                      int parts, float* __restrict__ x, float* __restrict__ x_t,
                                      __nv_bfloat16* __restrict__ xb,
                                      __nv_bfloat16* __restrict__ xb_t, int r, int c) {
    __shared__ float scratch[WARPS];
    __shared__ float tile[SCALE_T][SCALE_T + 1];
    const long long m = blockIdx.y;
    const float p = static_cast<int>(threadIdx.x) < parts ? partials[m * parts + threadIdx.x]
                                                           : 0.0f;
    const float denom = sqrtf(block_sum<WARPS>(p, scratch)) + 1e-7f;
    const int tx = threadIdx.x % SCALE_T;
    const int ty = threadIdx.x / SCALE_T;
    const int col_tiles = (c + SCALE_T - 1) / SCALE_T;
    const int row0 = static_cast<int>(blockIdx.x) / col_tiles * SCALE_T;
    const int col0 = static_cast<int>(blockIdx.x) % col_tiles * SCALE_T;
    const long long base = m * r * static_cast<long long>(c);
    const int j = col0 + tx;
    for (int q = 0; q < SCALE_T / SCALE_R; ++q) {
        const int ti = ty + q * SCALE_R;
        const int i = row0 + ti;
        float v = 0.0f;
        if (i < r && j < c) {
            const long long idx = base + static_cast<long long>(i) * c + j;
            v = load(g, idx) / denom;
            if (x != nullptr) x[idx] = v;
            if (xb != nullptr) xb[idx] = __float2bfloat16_rn(v);
        }
        tile[ti][tx] = v;
    }
    if (x_t == nullptr && xb_t == nullptr) return;  // uniform across the block
    __syncthreads();
    // Transposed: thread (tx, ty) writes rows col0 + ty + 4q of [c, r], columns row0 + tx.
    const int ii = row0 + tx;
    for (int q = 0; q < SCALE_T / SCALE_R; ++q) {
        const int tj = ty + q * SCALE_R;
        const int jj = col0 + tj;
        if (ii < r && jj < c) {
            const float v = tile[tx][tj];
            const long long idx = base + static_cast<long long>(jj) * r + ii;
            if (x_t != nullptr) x_t[idx] = v;
            if (xb_t != nullptr) xb_t[idx] = __float2bfloat16_rn(v);
        }
    }
}

}  // namespace newton_schulz_impl

extern "C" __global__ void __launch_bounds__(256) newton_schulz_sq_partials_f32(
    const float* __restrict__ g, float* __restrict__ partials, long long size, long long chunk,
    int parts) {
    newton_schulz_impl::sq_partials(g, partials, size, chunk, parts);
}

extern "C" __global__ void __launch_bounds__(256) newton_schulz_sq_partials_bf16(
    const __nv_bfloat16* __restrict__ g, float* __restrict__ partials, long long size,
    long long chunk, int parts) {
    newton_schulz_impl::sq_partials(g, partials, size, chunk, parts);
}

extern "C" __global__ void __launch_bounds__(256) newton_schulz_scale_f32(
    const float* __restrict__ g, const float* __restrict__ partials, int parts,
    float* __restrict__ x, float* __restrict__ x_t, __nv_bfloat16* __restrict__ xb,
    __nv_bfloat16* __restrict__ xb_t, int r, int c) {
    newton_schulz_impl::scale(g, partials, parts, x, x_t, xb, xb_t, r, c);
}

extern "C" __global__ void __launch_bounds__(256) newton_schulz_scale_bf16(
    const __nv_bfloat16* __restrict__ g, const float* __restrict__ partials, int parts,
    float* __restrict__ x, float* __restrict__ x_t, __nv_bfloat16* __restrict__ xb,
    __nv_bfloat16* __restrict__ xb_t, int r, int c) {
    newton_schulz_impl::scale(g, partials, parts, x, x_t, xb, xb_t, r, c);
}

// C[b,i,j] = alpha * sum_k A[b,i,k] B[b,k,j] + beta * E[b,i,j] for i < m, j < nn, b = blockIdx.z.
// Every operand is addressed by (batch stride, row stride, column stride), so transposes are
// free. beta == 0 skips E (which may then be any valid pointer). Block: 256 threads, one 16x16
// output tile; the K loop stages 16x16 tiles of A and B in shared memory and each thread adds
// its products in ascending k with one FMA each.
extern "C" __global__ void __launch_bounds__(256) newton_schulz_matmul_f32(
    const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ e,
    float* __restrict__ c, int m, int nn, int k, long long a_bs, long long a_rs, long long a_cs,
    long long b_bs, long long b_rs, long long b_cs, long long e_bs, long long e_rs,
    long long e_cs, long long c_bs, long long c_rs, long long c_cs, float alpha, float beta) {
    using namespace newton_schulz_impl;
    __shared__ float ta[TILE][TILE + 1];
    __shared__ float tb[TILE][TILE + 1];
    const int tx = threadIdx.x % TILE;  // column within the tile
    const int ty = threadIdx.x / TILE;  // row within the tile
    const int i = blockIdx.y * TILE + ty;
    const int j = blockIdx.x * TILE + tx;
    const long long bz = blockIdx.z;
    const float* ab = a + bz * a_bs;
    const float* bb = b + bz * b_bs;
    float acc = 0.0f;
    for (int k0 = 0; k0 < k; k0 += TILE) {
        // ta[ty][tx] = A[i, k0 + tx]; tb[ty][tx] = B[k0 + ty, j]
        const int ka = k0 + tx;
        const int kb = k0 + ty;
        ta[ty][tx] = (i < m && ka < k) ? ab[(long long)i * a_rs + (long long)ka * a_cs] : 0.0f;
        tb[ty][tx] = (kb < k && j < nn) ? bb[(long long)kb * b_rs + (long long)j * b_cs] : 0.0f;
        __syncthreads();
        const int kend = (k - k0) < TILE ? (k - k0) : TILE;
        for (int kk = 0; kk < kend; ++kk) acc = fmaf(ta[ty][kk], tb[kk][tx], acc);
        __syncthreads();
    }
    if (i < m && j < nn) {
        float out = alpha * acc;
        if (beta != 0.0f) {
            out = fmaf(beta, e[bz * e_bs + (long long)i * e_rs + (long long)j * e_cs], out);
        }
        c[bz * c_bs + (long long)i * c_rs + (long long)j * c_cs] = out;
    }
}
