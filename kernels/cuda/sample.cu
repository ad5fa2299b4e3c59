// sample: batch-invariant next-token sampling over logits[B,V] (DESIGN.md 3.3). One block of
// 256 threads per row; a row's result depends only on its logits, seed, request id and position.
// The CPU reference and the exact definitions: kernels/src/ops/sample.rs.
//
// Default path (top_k off, top_p = 1, or greedy): ONE pass over the row, fused with THE shared
// row log-sum-exp (common/row_reduce.cuh): each thread keeps its Gumbel-max (or argmax)
// candidate while it pushes the row into its lse state; the candidates meet in the fixed tree.
// Filtered path: the lse pass, then a bitwise binary search over the 50-bit ranking key for the
// top-k threshold (integer counts) and the top-p threshold (masses summed in the shared lane
// order), then a Gumbel-max pass over the kept entries. No sorting, no atomics.
#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>

#include "common/philox.cuh"
#include "common/row_reduce.cuh"

namespace sluice {
namespace sampler {

constexpr int KEY_BITS = 50;
constexpr uint32_t MAX_VOCAB = 1u << 18;
// Bound on the Gumbel noise (max 16.64) plus margin for the rounding of z + bound (|z| < 2^27).
constexpr float GUMBEL_BOUND = 32.0f;

// words[k & 3] without dynamic indexing (which would put the array in local memory: a stack).
__device__ __forceinline__ uint32_t pick_word(const uint32_t w[4], int k) {
    k &= 3;
    return k == 0 ? w[0] : k == 1 ? w[1] : k == 2 ? w[2] : w[3];
}

struct Best {
    float score;
    int index;
};

// Larger score wins; ties go to the lower index (a total order, so the tree's shape cannot
// change the winner).
struct BetterOf {
    __device__ __forceinline__ Best operator()(Best a, Best b) const {
        return (b.score > a.score || (b.score == a.score && b.index < a.index)) ? b : a;
    }
};

// f32 order as u32 order, and the ranking key ord(z) << 18 | (2^18 - 1 - j).
__device__ __forceinline__ unsigned long long rank_key(float z, int j) {
    const uint32_t b = float_bits(z);
    const uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)ord << 18) | (unsigned long long)(MAX_VOCAB - 1u - (uint32_t)j);
}

// Gumbel-max candidates of this thread over the entries with rank_key >= lo (lo = 0: all).
// Noise layout: step i = j / 256 of thread l = j % 256 uses word i % 4 of the Philox block with
// group (i / 4) * 256 + l, so each thread draws one Philox block per four of its entries.
template <typename T>
__device__ __forceinline__ Best gumbel_candidates(const T* x, int V, float scale, unsigned long long seed,
                                                  unsigned long long rid, int pos, unsigned long long lo) {
    Best best = {SLUICE_NEG_INF, INT_MAX};
    uint32_t words[4];
    int loaded = -1;
    int i = 0;
    for (int j = threadIdx.x; j < V; j += ROW_THREADS, ++i) {
        const float z = rr_mul(load_logit(x, j), scale);
        if (rank_key(z, j) < lo || z + GUMBEL_BOUND < best.score) continue;  // pruned: cannot win
        if ((i >> 2) != loaded) {
            sampler_words(seed, rid, pos, (uint32_t)(((i >> 2) << 8) | threadIdx.x), words);
            loaded = i >> 2;
        }
        best = BetterOf{}(best, Best{rr_add(z, gumbel_noise(pick_word(words, i))), j});
    }
    return best;
}

template <typename T>
__device__ __forceinline__ void sample_row(const T* __restrict__ logits,
                                           const unsigned long long* __restrict__ request_ids,
                                           const int* __restrict__ positions, int* __restrict__ tokens,
                                           float* __restrict__ logprobs, int V, unsigned long long seed, int greedy,
                                           float scale, int top_k, float top_p) {
    __shared__ LseState sh_lse[ROW_THREADS];
    __shared__ Best sh_best[ROW_THREADS];
    __shared__ float sh_f[ROW_THREADS];
    __shared__ int sh_i[ROW_THREADS];
    const int row = blockIdx.x;
    const T* x = logits + (long long)row * V;
    const unsigned long long rid = request_ids[row];
    const int pos = positions[row];
    const bool filtered = !greedy && (top_k > 0 || top_p < 1.0f);

    // Pass 1: THE shared row log-sum-exp, with the unfiltered candidate fused in.
    Best best = {SLUICE_NEG_INF, INT_MAX};
    uint32_t words[4];
    int loaded = -1;
    int step = 0;
    const LseState part = row_lse_pass(x, V, scale, [&](int j, float z) {
        if (!filtered) {
            float score = z;
            if (!greedy) {
                // Pruning: the noise is below GUMBEL_BOUND, so an entry this far under the best
                // score so far cannot win; skipping its Philox and logf changes no result.
                if (z + GUMBEL_BOUND < best.score) {
                    ++step;
                    return;
                }
                if ((step >> 2) != loaded) {
                    sampler_words(seed, rid, pos, (uint32_t)(((step >> 2) << 8) | threadIdx.x), words);
                    loaded = step >> 2;
                }
                score = rr_add(z, gumbel_noise(pick_word(words, step)));
            }
            best = BetterOf{}(best, Best{score, j});
        }
        ++step;
    });
    const LseState st = block_tree(part, sh_lse, LseCombine{});
    const float lse = lse_value(st);

    int tok = 0;
    if (st.m != SLUICE_NEG_INF) {  // a row of all -inf samples token 0 with log-prob -inf
        if (filtered) {
            unsigned long long lo = 0;
            if (top_k > 0) {
                // The k-th largest key: the largest threshold keeping at least k entries.
                unsigned long long t = 0;
                for (int bit = KEY_BITS - 1; bit >= 0; --bit) {
                    const unsigned long long c = t | (1ull << bit);
                    int count = 0;
                    for (int j = threadIdx.x; j < V; j += ROW_THREADS)
                        count += rank_key(rr_mul(load_logit(x, j), scale), j) >= c ? 1 : 0;
                    if (block_tree(count, sh_i, AddI32{}) >= top_k) t = c;
                }
                lo = t;
            }
            if (top_p < 1.0f) {
                // Kept mass sum exp(z - max) over keys >= c, in the shared lane order and tree.
                auto mass = [&](unsigned long long c) {
                    float acc = 0.0f;
                    for (int j = threadIdx.x; j < V; j += ROW_THREADS) {
                        const float z = rr_mul(load_logit(x, j), scale);
                        if (rank_key(z, j) >= c) acc = rr_add(acc, expf(z - st.m));
                    }
                    return block_tree(acc, sh_f, AddF32{});
                };
                const float target = rr_mul(top_p, mass(lo));
                unsigned long long t = 0;
                for (int bit = KEY_BITS - 1; bit >= 0; --bit) {
                    const unsigned long long c = t | (1ull << bit);
                    const float m = mass(c > lo ? c : lo);
                    if (m > 0.0f && m >= target) t = c;
                }
                lo = t > lo ? t : lo;
            }
            best = gumbel_candidates(x, V, scale, seed, rid, pos, lo);
        }
        tok = block_tree(best, sh_best, BetterOf{}).index;
    }
    if (threadIdx.x == 0) {
        tokens[row] = tok;
        logprobs[row] = row_logprob(rr_mul(load_logit(x, tok), scale), lse);
    }
}

}  // namespace sampler
}  // namespace sluice

using namespace sluice;
using namespace sluice::sampler;

extern "C" __global__ void __launch_bounds__(256, 1) sample_f32(const float* __restrict__ logits,
                                                             const unsigned long long* __restrict__ request_ids,
                                                             const int* __restrict__ positions,
                                                             int* __restrict__ tokens, float* __restrict__ logprobs,
                                                             int V, unsigned long long seed, int greedy, float scale,
                                                             int top_k, float top_p) {
    sample_row<float>(logits, request_ids, positions, tokens, logprobs, V, seed, greedy, scale, top_k, top_p);
}

extern "C" __global__ void __launch_bounds__(256, 1) sample_bf16(const __nv_bfloat16* __restrict__ logits,
                                                              const unsigned long long* __restrict__ request_ids,
                                                              const int* __restrict__ positions,
                                                              int* __restrict__ tokens, float* __restrict__ logprobs,
                                                              int V, unsigned long long seed, int greedy, float scale,
                                                              int top_k, float top_p) {
    sample_row<__nv_bfloat16>(logits, request_ids, positions, tokens, logprobs, V, seed, greedy, scale, top_k,
                              top_p);
}
