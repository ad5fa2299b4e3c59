// Newton-Schulz orthogonalisation (Muon, DESIGN.md section 3.7), batched over n matrices of
// one shape [r,c]. Per matrix: X0 = G / (||G||_F + 1e-7), in the wide orientation (transposed
// when r > c); then `steps` times X <- a X + (b A + c A^2) X with A = X X^T; the result is
// written back in the input's orientation.
//
// Kernels (the Rust side launches them in sequence; every launch covers all n matrices)
//   newton_schulz_normalize_{f32,bf16}  one 256-thread block per matrix: Frobenius norm in a
//                                       fixed order, then X0 = G / (norm + 1e-7), transposed to
//                                       the wide orientation when asked
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
// products in ascending k by one thread; the norm is a fixed-order block reduction.
//
// The bf16 path (`newton_schulz_bf16` on the Rust side) uses the same normalise launch, then
// runs every product on the gemm family's bf16 tensor-core kernel (C = A B^T, bf16 operands,
// f32 accumulation) and this file's one elementwise kernel between them:
//   newton_schulz_combine_bf16          v = alpha * P + beta * E (fmaf(beta, E, alpha * P); E
//                                       optional), written as any of: f32, f32 transposed, bf16
//                                       (round-to-nearest-even), bf16 transposed. 32x32 tiles,
//                                       the transposes staged through shared memory.
// One step: A = gemm(Xb, Xb); Ab = bf16(A); AA = gemm(Ab, Ab) (A symmetric);
// Bb = bf16(c AA + b A); BX = gemm(Bb, XTb); X' = BX + a X in f32 (the master copy) with its
// bf16 rounding Xb' and bf16 transpose XTb' for the next step.

#include <cuda_bf16.h>
#include "common/block_reduce.cuh"
#include <stdint.h>

namespace newton_schulz_impl {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int TILE = 16;

using sluice::load;
using sluice::block_sum;


// g [n, r, c] -> x [n, r, c] (transpose == 0) or [n, c, r] (transpose != 0), scaled by
// 1 / (||g||_F + 1e-7). Each thread sums the squares of elements t, t + 256, ... in ascending
// order, then the block sums the per-thread partials in a fixed order.
template <typename T>
__device__ __forceinline__ void normalize(const T* __restrict__ g, float* __restrict__ x, int r,
                                          int c, int transpose) {
    __shared__ float scratch[WARPS];
    const long long size = (long long)r * c;
    const long long base = (long long)blockIdx.x * size;
    float ss = 0.0f;
    for (long long i = threadIdx.x; i < size; i += THREADS) {
        const float v = load(g, base + i);
        ss = fmaf(v, v, ss);
    }
    const float total = block_sum<WARPS>(ss, scratch);
    const float denom = sqrtf(total) + 1e-7f;
    for (long long i = threadIdx.x; i < size; i += THREADS) {
        const float v = load(g, base + i) / denom;
        if (transpose) {
            const long long row = i / c;
            const long long col = i % c;
            x[base + col * r + row] = v;
        } else {
            x[base + i] = v;
        }
    }
}

}  // namespace newton_schulz_impl

extern "C" __global__ void __launch_bounds__(256) newton_schulz_normalize_f32(
    const float* __restrict__ g, float* __restrict__ x, int r, int c, int transpose) {
    newton_schulz_impl::normalize(g, x, r, c, transpose);
}

extern "C" __global__ void __launch_bounds__(256) newton_schulz_normalize_bf16(
    const __nv_bfloat16* __restrict__ g, float* __restrict__ x, int r, int c, int transpose) {
    newton_schulz_impl::normalize(g, x, r, c, transpose);
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

// v = alpha * p + beta * e (e may be null: v = alpha * p) over n matrices [rows, cols]
// (blockIdx.z), each output optional (null skips it): out [rows, cols] f32, out_t [cols, rows]
// f32, out_b [rows, cols] bf16, out_bt [cols, rows] bf16 (bf16 = round-to-nearest-even of v).
// Block: 256 threads = 32 columns x 8 rows over a 32x32 tile (4 rows a thread); the transposed
// writes read the tile back from shared memory column-wise so both sides stay coalesced.
extern "C" __global__ void __launch_bounds__(256) newton_schulz_combine_bf16(
    const float* __restrict__ p, const float* __restrict__ e, float* __restrict__ out,
    float* __restrict__ out_t, __nv_bfloat16* __restrict__ out_b,
    __nv_bfloat16* __restrict__ out_bt, int rows, int cols, float alpha, float beta) {
    constexpr int T = 32;
    constexpr int R = 8;
    __shared__ float tile[T][T + 1];
    const int tx = threadIdx.x % T;
    const int ty = threadIdx.x / T;
    const int row0 = blockIdx.y * T;
    const int col0 = blockIdx.x * T;
    const long long base = (long long)blockIdx.z * rows * cols;
    const int j = col0 + tx;
    for (int q = 0; q < T / R; ++q) {
        const int ti = ty + q * R;
        const int i = row0 + ti;
        float v = 0.0f;
        if (i < rows && j < cols) {
            const long long idx = base + (long long)i * cols + j;
            v = alpha * p[idx];
            if (e != nullptr) v = fmaf(beta, e[idx], v);
            if (out != nullptr) out[idx] = v;
            if (out_b != nullptr) out_b[idx] = __float2bfloat16_rn(v);
        }
        tile[ti][tx] = v;
    }
    if (out_t == nullptr && out_bt == nullptr) return;
    __syncthreads();
    // Transposed: thread (tx, ty) writes column col0 + ty + 8q, rows row0 + tx.
    const int ii = row0 + tx;
    for (int q = 0; q < T / R; ++q) {
        const int tj = ty + q * R;
        const int jj = col0 + tj;
        if (ii < rows && jj < cols) {
            const float v = tile[tx][tj];
            const long long idx = base + (long long)jj * rows + ii;
            if (out_t != nullptr) out_t[idx] = v;
            if (out_bt != nullptr) out_bt[idx] = __float2bfloat16_rn(v);
        }
    }
}
