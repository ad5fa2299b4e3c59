// moe: the MoE layer's own kernels (DESIGN.md section 3.4). kernels/src/ops/moe/ composes
// them with the gemm (router GEMM, grouped expert GEMMs), topk, softmax and swiglu families.
//
// Forward:   moe_sigmoid (score_fn=sigmoid; softmax is the elementwise family's), moe_gates,
//            moe_sort_count -> moe_sort_scan -> moe_sort_scatter (stable counting sort of the
//            T*k token-slots by expert), moe_gather_rows, moe_combine.
// Backward:  moe_combine_backward, moe_transpose (weights for the transposed-operand grouped
//            GEMMs), moe_segment_wgrad (per-expert weight gradients), moe_router_backward,
//            moe_unpermute_dx. moe_widen_bf16 / moe_narrow_bf16 convert between f32 and the
//            BF16 operands of the tensor-core expert GEMMs (BF16 inputs).
//
// Determinism: no atomics anywhere. Every output element is written by one thread that sums
// its terms in a fixed order:
//  - the sort: thread c owns row c of counts/bases [chunks,E] and walks its chunk's slots in
//    ascending order, so the sort is stable and needs no atomic counters (the usual GPU
//    histogram + atomic scatter would give an order that changes run to run);
//  - combine and unpermute: k ascending;
//  - weight gradients: one thread per output element walks its expert's contiguous segment of
//    rows in ascending order (no split over rows, so the order depends on the segment alone).
// Batch invariance: every per-token kernel reads and writes its own token's rows only.

#include <stdint.h>
#include <cuda_bf16.h>

namespace moe {

constexpr int kMaxK = 16;    // the top-k family's limit on k
constexpr int kMaxE = 512;   // the top-k family's limit on E

__device__ __forceinline__ long long grid_stride_start() {
    return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_stride_step() {
    return static_cast<long long>(gridDim.x) * blockDim.x;
}

}  // namespace moe

// ---------------------------------------------------------------------------------------------
// Inputs and router
// ---------------------------------------------------------------------------------------------

// dst[i] = float(src[i]) (exact).
extern "C" __global__ void __launch_bounds__(256) moe_widen_bf16(const __nv_bfloat16* __restrict__ src, float* __restrict__ dst, long long n) {
    for (long long i = moe::grid_stride_start(); i < n; i += moe::grid_stride_step())
        dst[i] = __bfloat162float(src[i]);
}

// dst[i] = bf16(src[i]), round to nearest even: the BF16 operand of a tensor-core GEMM.
extern "C" __global__ void __launch_bounds__(256) moe_narrow_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, long long n) {
    for (long long i = moe::grid_stride_start(); i < n; i += moe::grid_stride_step())
        dst[i] = __float2bfloat16_rn(src[i]);
}

// p[i] = 1 / (1 + exp(-z[i])): the sigmoid score of each router logit on its own.
extern "C" __global__ void __launch_bounds__(256) moe_sigmoid(const float* __restrict__ logits, float* __restrict__ p, long long n) {
    for (long long i = moe::grid_stride_start(); i < n; i += moe::grid_stride_step())
        p[i] = 1.0f / (1.0f + expf(-logits[i]));
}

// One thread per token: gate[t,j] = kept[t,j] / sum_j kept[t,j] (sum j ascending) when renorm,
// else kept[t,j].
extern "C" __global__ void __launch_bounds__(256) moe_gates(const float* __restrict__ kept, float* __restrict__ gate, int T, int k, int renorm) {
    const long long t = moe::grid_stride_start();
    if (t >= T) return;
    const float* v = kept + t * k;
    float* g = gate + t * k;
    if (!renorm) {
        for (int j = 0; j < k; ++j) g[j] = v[j];
        return;
    }
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += v[j];
    for (int j = 0; j < k; ++j) g[j] = v[j] / sum;
}

// One block: the switch-style load-balancing loss aux = alpha * E * sum_e f_e P_e, f_e =
// (offsets[e+1] - offsets[e]) / (T*k) (a count: no gradient), P_e = mean over t (ascending) of
// probs[t,e]; and its gradient per score coef[e] = alpha * E * f_e / T. alpha = 0 writes zeros.
extern "C" __global__ void __launch_bounds__(256) moe_aux_loss(const float* __restrict__ probs, const int* __restrict__ offsets, float* __restrict__ loss, float* __restrict__ coef, int T, int E, int k, float alpha) {
    __shared__ float term[moe::kMaxE];
    const float scale = alpha * static_cast<float>(E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (alpha == 0.0f) {
            coef[e] = 0.0f;
            term[e] = 0.0f;
            continue;
        }
        const float frac = static_cast<float>(offsets[e + 1] - offsets[e]) /
                           static_cast<float>(static_cast<long long>(T) * k);
        float sum = 0.0f;
        for (int t = 0; t < T; ++t) sum += probs[static_cast<long long>(t) * E + e];
        term[e] = frac * (sum / static_cast<float>(T));
        coef[e] = scale * frac / static_cast<float>(T);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int e = 0; e < E; ++e) acc += term[e];
        loss[0] = alpha == 0.0f ? 0.0f : scale * acc;
    }
}

// ---------------------------------------------------------------------------------------------
// Stable counting sort of the n = T*k slots (slot = t*k + j, expert idx[slot]) into contiguous
// per-expert segments. Chunk c holds slots [c*chunk, min(n, (c+1)*chunk)).
// ---------------------------------------------------------------------------------------------

// Thread c: counts[c, e] = number of slots of chunk c routed to expert e.
extern "C" __global__ void __launch_bounds__(256) moe_sort_count(const int* __restrict__ idx, int* __restrict__ counts, int n, int E, int chunk) {
    const long long c = moe::grid_stride_start();
    const long long chunks = (static_cast<long long>(n) + chunk - 1) / chunk;
    if (c >= chunks) return;
    int* row = counts + c * E;
    for (int e = 0; e < E; ++e) row[e] = 0;
    const long long end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
    for (long long s = c * chunk; s < end; ++s) {
        const int e = idx[s];
        if (e >= 0 && e < E) row[e] += 1;  // topk returns indices in [0, E); guard anyway
    }
}

// One block. totals[e] = sum over chunks (ascending) of counts[c,e]; offsets = exclusive scan of
// totals over e (offsets[E] = n); bases[c,e] = offsets[e] + sum_{c' < c} counts[c',e].
extern "C" __global__ void __launch_bounds__(256) moe_sort_scan(const int* __restrict__ counts, int* __restrict__ bases, int* __restrict__ offsets, int chunks, int E) {
    __shared__ int start[moe::kMaxE + 1];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int total = 0;
        for (int c = 0; c < chunks; ++c) total += counts[static_cast<long long>(c) * E + e];
        start[e + 1] = total;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // E <= 512 additions by one thread: negligible next to the GEMMs, and trivially ordered.
        start[0] = 0;
        for (int e = 0; e < E; ++e) start[e + 1] += start[e];
        for (int e = 0; e <= E; ++e) offsets[e] = start[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = start[e];
        for (int c = 0; c < chunks; ++c) {
            const long long at = static_cast<long long>(c) * E + e;
            bases[at] = run;
            run += counts[at];
        }
    }
}

// Thread c walks chunk c's slots in ascending order and gives each the next position of its
// expert from its own row of bases (consumed as a cursor): perm[p] = slot, pos[slot] = p.
extern "C" __global__ void __launch_bounds__(256) moe_sort_scatter(const int* __restrict__ idx, int* __restrict__ bases, int* __restrict__ perm, int* __restrict__ pos, int n, int E, int chunk) {
    const long long c = moe::grid_stride_start();
    const long long chunks = (static_cast<long long>(n) + chunk - 1) / chunk;
    if (c >= chunks) return;
    int* cursor = bases + c * E;
    const long long end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
    for (long long s = c * chunk; s < end; ++s) {
        const int e = idx[s];
        if (e < 0 || e >= E) continue;
        const int p = cursor[e]++;
        perm[p] = static_cast<int>(s);
        pos[s] = p;
    }
}

namespace moe {
// Row loops: block b takes rows b, b + gridDim.x, ... and its threads the columns of each row
// (coalesced, one division per row for the token index, none per element: the launch may use any
// grid). `d` is the row length in elements.
__device__ __forceinline__ int row_start() { return static_cast<int>(blockIdx.x); }
__device__ __forceinline__ int row_step() { return static_cast<int>(gridDim.x); }

// xs[p, :] = x[perm[p] / k, :] for the n sorted positions (a copy: exact in any dtype).
template <typename T>
__device__ __forceinline__ void gather_rows(const T* __restrict__ x, const int* __restrict__ perm, T* __restrict__ xs, int n, int d, int k) {
    for (int p = row_start(); p < n; p += row_step()) {
        const T* src = x + static_cast<long long>(perm[p] / k) * d;
        T* dst = xs + static_cast<long long>(p) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
    }
}
}  // namespace moe

extern "C" __global__ void __launch_bounds__(256) moe_gather_rows(const float* __restrict__ x, const int* __restrict__ perm, float* __restrict__ xs, int n, int d, int k) {
    moe::gather_rows(x, perm, xs, n, d, k);
}
// BF16 rows move as 4-byte pairs when d is even (rows then start 4-byte aligned).
extern "C" __global__ void __launch_bounds__(256) moe_gather_rows_bf16(const __nv_bfloat16* __restrict__ x, const int* __restrict__ perm, __nv_bfloat16* __restrict__ xs, int n, int d, int k) {
    if (d % 2 == 0) {
        moe::gather_rows(reinterpret_cast<const uint32_t*>(x), perm, reinterpret_cast<uint32_t*>(xs), n, d / 2, k);
    } else {
        moe::gather_rows(x, perm, xs, n, d, k);
    }
}

// y[t, c] = sum_{j = 0..k-1, ascending} gate[t, j] * ye[pos[t*k + j], c]. Row t's k gates and
// rows are read once per row (the same for every thread of the block).
extern "C" __global__ void __launch_bounds__(256) moe_combine(const float* __restrict__ ye, const float* __restrict__ gate, const int* __restrict__ pos, float* __restrict__ y, int T, int d, int k) {
    for (int t = moe::row_start(); t < T; t += moe::row_step()) {
        const long long slot0 = static_cast<long long>(t) * k;
        // k <= kMaxK (the host's top-k limit); clamped so no value can overrun the arrays.
        const int kk = k < moe::kMaxK ? k : moe::kMaxK;
        float g[moe::kMaxK];
        const float* rows[moe::kMaxK];
        for (int j = 0; j < kk; ++j) {
            g[j] = gate[slot0 + j];
            rows[j] = ye + static_cast<long long>(pos[slot0 + j]) * d;
        }
        float* out = y + static_cast<long long>(t) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < kk; ++j) acc += g[j] * rows[j][c];
            out[c] = acc;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

// dye[pos[s], c] = gate[s] * dy[s / k, c] for every slot s; dgate[s] = sum_{c ascending}
// dy[s / k, c] * ye[pos[s], c] (one thread per slot; d is at most a few thousand).
extern "C" __global__ void __launch_bounds__(256) moe_combine_backward(const float* __restrict__ dy, const float* __restrict__ ye, const float* __restrict__ gate, const int* __restrict__ pos, float* __restrict__ dye, float* __restrict__ dgate, int T, int d, int k) {
    const long long n = static_cast<long long>(T) * k;
    // Row loop over the slots: one division per slot for its token, none per element.
    for (long long s = moe::row_start(); s < n; s += moe::row_step()) {
        const float gs = gate[s];
        const float* dyr = dy + static_cast<long long>(s / k) * d;
        float* out = dye + static_cast<long long>(pos[s]) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) out[c] = gs * dyr[c];
    }
    for (long long s = moe::grid_stride_start(); s < n; s += moe::grid_stride_step()) {
        const float* dyr = dy + (s / k) * d;
        const float* yer = ye + static_cast<long long>(pos[s]) * d;
        float dot = 0.0f;
        for (int c = 0; c < d; ++c) dot += dyr[c] * yer[c];
        dgate[s] = dot;
    }
}

namespace moe {
// dst[b] = src[b]^T for src [B, rows, cols] -> dst [B, cols, rows]; blockIdx.z = b. 32x32 tiles
// through shared memory (+1 column of padding against bank conflicts), block 32x8.
template <typename T>
__device__ __forceinline__ void transpose(const T* __restrict__ src, T* __restrict__ dst, int rows, int cols) {
    __shared__ T tile[32][33];
    const long long plane = static_cast<long long>(rows) * cols;
    const T* s = src + blockIdx.z * plane;
    T* o = dst + blockIdx.z * plane;
    const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = s[static_cast<long long>(r) * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) o[static_cast<long long>(c) * rows + r] = tile[threadIdx.x][i];
    }
}
}  // namespace moe

extern "C" __global__ void __launch_bounds__(256) moe_transpose(const float* __restrict__ src, float* __restrict__ dst, int rows, int cols) {
    moe::transpose(src, dst, rows, cols);
}
extern "C" __global__ void __launch_bounds__(256) moe_transpose_bf16(const __nv_bfloat16* __restrict__ src, __nv_bfloat16* __restrict__ dst, int rows, int cols) {
    moe::transpose(src, dst, rows, cols);
}

namespace moe {
// dst [cols, n] (BF16) = rows r0..r0+n of src [N, cols], transposed and rounded to BF16 (the
// operands of a per-expert tensor-core weight-gradient GEMM). 32x32 tiles, block 32x8.
template <typename T>
__device__ __forceinline__ void transpose_rows(const T* __restrict__ src, __nv_bfloat16* __restrict__ dst, int r0, int n, int cols) {
    __shared__ float tile[32][33];
    const int rb = blockIdx.y * 32, cb = blockIdx.x * 32;
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int r = rb + i, c = cb + threadIdx.x;
        if (r < n && c < cols)
            tile[i][threadIdx.x] = static_cast<float>(src[static_cast<long long>(r0 + r) * cols + c]);
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = cb + i, r = rb + threadIdx.x;
        if (r < n && c < cols)
            dst[static_cast<long long>(c) * n + r] = __float2bfloat16_rn(tile[threadIdx.x][i]);
    }
}
}  // namespace moe

extern "C" __global__ void __launch_bounds__(256) moe_transpose_rows_f32_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int r0, int n, int cols) {
    moe::transpose_rows(src, dst, r0, n, cols);
}
extern "C" __global__ void __launch_bounds__(256) moe_transpose_rows_bf16(const __nv_bfloat16* __restrict__ src, __nv_bfloat16* __restrict__ dst, int r0, int n, int cols) {
    moe::transpose_rows(src, dst, r0, n, cols);
}

// dst[offset + i] = src[i] for i < n.
extern "C" __global__ void __launch_bounds__(256) moe_copy(const float* __restrict__ src, float* __restrict__ dst, long long offset, long long n) {
    for (long long i = moe::grid_stride_start(); i < n; i += moe::grid_stride_step()) dst[offset + i] = src[i];
}

// out[g, i, j] = sum_{r in segment g, ascending} P[r, i] * Q[r, j] for P [N, p], Q [N, q],
// segment g = rows offsets[g]..offsets[g+1]; blockIdx.z = g. This is the weight gradient of a
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
namespace moe {
constexpr int WG_TILE = 64, WG_ROWS = 16, WG_THREADS = 256;
}  // namespace moe

extern "C" __global__ void __launch_bounds__(256) moe_segment_wgrad(const float* __restrict__ P, const float* __restrict__ Q, const int* __restrict__ offsets, float* __restrict__ out, int p, int q) {
    using namespace moe;
    __shared__ float ps[WG_ROWS][WG_TILE];
    __shared__ float qs[WG_ROWS][WG_TILE];
    const int g = blockIdx.z;
    const int r0 = offsets[g];
    int r1 = offsets[g + 1];
    if (r1 < r0) r1 = r0;
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

// One thread per token: dlogits[t, :] from dgate[t, :] through the gates and the score function.
//   dv_j = (dg_j - sum_i dg_i g_i) / S when renorm (g_j = v_j / S, S = sum_j v_j), else dg_j;
//   dprobs = dv at the kept experts, 0 elsewhere;
//   softmax: dlogits[e] = p_e * (dprobs[e] - sum_j dv_j p_{idx_j});  sigmoid: dprobs * p (1 - p).
//   With use_aux, dprobs[e] also gets the load-balancing loss's aux_coef[e] (every e).
extern "C" __global__ void __launch_bounds__(256) moe_router_backward(const float* __restrict__ probs, const float* __restrict__ kept, const int* __restrict__ idx, const float* __restrict__ dgate, const float* __restrict__ aux_coef, float* __restrict__ dlogits, int T, int E, int k, int renorm, int sigmoid, int use_aux) {
    const long long t = moe::grid_stride_start();
    if (t >= T) return;
    const float* v = kept + t * k;
    const float* dg = dgate + t * k;
    const int* ix = idx + t * k;
    const float* p = probs + t * E;
    float* out = dlogits + t * E;
    float dv[moe::kMaxK];
    const int kk = k < moe::kMaxK ? k : moe::kMaxK;
    if (renorm) {
        float sum = 0.0f;
        for (int j = 0; j < kk; ++j) sum += v[j];
        float dot = 0.0f;
        for (int j = 0; j < kk; ++j) dot += dg[j] * (v[j] / sum);
        for (int j = 0; j < kk; ++j) dv[j] = (dg[j] - dot) / sum;
    } else {
        for (int j = 0; j < kk; ++j) dv[j] = dg[j];
    }
    if (use_aux) {
        // The auxiliary loss's gradient reaches every score: dprobs[e] = coef[e] (+ dv_j when e
        // is the j-th kept expert), then the score function's backward over all E.
        float s = 0.0f;
        for (int pass = 0; pass < 2; ++pass) {
            for (int e = 0; e < E; ++e) {
                float dp = aux_coef[e];
                for (int j = 0; j < kk; ++j)
                    if (ix[j] == e) dp += dv[j];
                if (sigmoid) {
                    if (pass == 1) out[e] = dp * (p[e] * (1.0f - p[e]));
                } else if (pass == 0) {
                    s += dp * p[e];
                } else {
                    out[e] = p[e] * (dp - s);
                }
            }
        }
        return;
    }
    if (sigmoid) {
        for (int e = 0; e < E; ++e) out[e] = 0.0f;
        for (int j = 0; j < kk; ++j) {
            const int e = ix[j];
            if (e >= 0 && e < E) out[e] = dv[j] * (p[e] * (1.0f - p[e]));
        }
        return;
    }
    float s = 0.0f;
    for (int j = 0; j < kk; ++j) {
        const int e = ix[j];
        if (e >= 0 && e < E) s += dv[j] * p[e];
    }
    for (int e = 0; e < E; ++e) out[e] = p[e] * (0.0f - s);
    for (int j = 0; j < kk; ++j) {
        const int e = ix[j];
        if (e >= 0 && e < E) out[e] = p[e] * (dv[j] - s);
    }
}

// dx[t, c] = dx_router[t, c] + sum_{j ascending} (dxa + dxb)[pos[t*k + j], c].
extern "C" __global__ void __launch_bounds__(256) moe_unpermute_dx(const float* __restrict__ dx_router, const float* __restrict__ dxa, const float* __restrict__ dxb, const int* __restrict__ pos, float* __restrict__ dx, int T, int d, int k) {
    for (int t = moe::row_start(); t < T; t += moe::row_step()) {
        const int kk = k < moe::kMaxK ? k : moe::kMaxK;  // the host's top-k limit; see moe_combine
        long long rows[moe::kMaxK];
        for (int j = 0; j < kk; ++j) rows[j] = static_cast<long long>(pos[static_cast<long long>(t) * k + j]) * d;
        const long long row = static_cast<long long>(t) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float acc = dx_router[row + c];
            for (int j = 0; j < kk; ++j) acc += dxa[rows[j] + c] + dxb[rows[j] + c];
            dx[row + c] = acc;
        }
    }
}
