// moe: the MoE layer's own kernels (DESIGN.md section 3.4). kernels/src/ops/moe/ composes
// them with the gemm (router GEMM, grouped expert GEMMs), topk, softmax and swiglu families.
//
// Forward:   moe_sigmoid (score_fn=sigmoid; softmax is the elementwise family's), moe_gates,
//            moe_sort_count -> moe_sort_scan -> moe_sort_scatter (stable counting sort of the
//            T*k token-slots by expert), moe_gather_rows, moe_combine.
// Backward:  moe_combine_backward, moe_router_backward, moe_unpermute_dx (the expert GEMMs,
//            activation and weight gradients, are the gemm family's grouped forms, reading
//            the segments and the weights in place). moe_widen_bf16 / moe_narrow_bf16 convert between f32 and the
//            BF16 operands of the tensor-core expert GEMMs (BF16 inputs).
//
// Determinism: no atomics anywhere. Every output element is written by one thread that sums
// its terms in a fixed order:
//  - the sort: thread c owns row c of counts/bases [chunks,E] and walks its chunk's slots in
//    ascending order, so the sort is stable and needs no atomic counters (the usual GPU
//    histogram + atomic scatter would give an order that changes run to run);
//  - combine and unpermute: k ascending; dgate: a warp's 32 lane-strided fmaf chains, then its
//    xor butterfly;
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

// dye[pos[s], c] = gate[s] * dy[s / k, c] for every slot s (a block per slot row, threads over
// c); dgate[s] = dy[s / k] . ye[pos[s]] by one warp per slot: lane l sums c = l, l + 32, ... as
// one fmaf chain (written out, so nvcc, the emulator and the CPU reference all fuse), then the
// warp's xor butterfly (masks 16, 8, 4, 2, 1). Each warp-wide load reads 128 consecutive bytes
// of both rows; before (2026-12-02), one thread per slot walked its two 2048-long rows, 4.35x
// the ideal sectors at the doc shape. The order changed, so dgate's bits did.
extern "C" __global__ void __launch_bounds__(256) moe_combine_backward(const float* __restrict__ dy, const float* __restrict__ ye, const float* __restrict__ gate, const int* __restrict__ pos, float* __restrict__ dye, float* __restrict__ dgate, int T, int d, int k) {
    const long long n = static_cast<long long>(T) * k;
    // Row loop over the slots: one division per slot for its token, none per element.
    for (long long s = moe::row_start(); s < n; s += moe::row_step()) {
        const float gs = gate[s];
        const float* dyr = dy + static_cast<long long>(s / k) * d;
        float* out = dye + static_cast<long long>(pos[s]) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) out[c] = gs * dyr[c];
    }
    // Warp loop over the slots (the bound is uniform across a warp, as the shuffles need).
    const int lane = threadIdx.x % 32;
    const long long warps_per_block = blockDim.x / 32;
    const long long first = static_cast<long long>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
    for (long long s = first; s < n; s += static_cast<long long>(gridDim.x) * warps_per_block) {
        const float* dyr = dy + (s / k) * d;
        const float* yer = ye + static_cast<long long>(pos[s]) * d;
        float part = 0.0f;
        for (int c = lane; c < d; c += 32) part = fmaf(dyr[c], yer[c], part);
        for (int mask = 16; mask > 0; mask /= 2) part += __shfl_xor_sync(0xffffffffu, part, mask);
        if (lane == 0) dgate[s] = part;
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
