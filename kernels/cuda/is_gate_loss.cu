// is_gate_loss: the fused importance-sampling-gate policy loss over logits[N,V] (DESIGN.md 3.6).
// The CPU reference and the exact definitions: kernels/src/ops/is_gate_loss.rs.
//
// Three launches, no atomics (a float atomic would make the loss depend on the order blocks
// finish):
//   1. is_gate_loss_denom   (1 block):  D = sum mask * weight in the fixed lane order -> scratch[N]
//   2. is_gate_loss[_entropy|_bonus]_{f32,bf16} (N blocks of 256, one row each): the shared row log-sum-exp (read
//      1), logp, rho, the gate, d term / d logp, then the gradient pass (read 2, write 1);
//      per-row outputs, and the row's loss term -> scratch[row] (the per-block partial).
//   3. is_gate_loss_finish  (1 block):  loss and counters from the per-row values, fixed order.
// The gradient may alias the logits (in place): each thread reads x[j] then writes g[j] for its
// own j only, after the lse tree's barriers; x[token] is read by every thread before them.
//
// Regularizers (issue 28 item 7), per masked token with loss factor k = mask * weight:
//   KL to a reference: + kl_coef * k * kl(logp, ref_logp) (k1 or k3), d / d logp added to the
//     token's d term / d logp (no change to the row passes).
//   Entropy: the _entropy kernels keep one more online sum in read 1 (EntState: sum of
//     e^(z - m) (z - m)), so H = log s - t / s comes out of the same pass (written to
//     entropy[row]); the _bonus kernels also subtract ent_coef * k * H from the term and add
//     its gradient in read 2: d(-c k H) / dz_j = c k p_j (log p_j + H).
// The variant is a compile-time flag (ENT below), one exported kernel per (variant, dtype): the
// plain kernel's code and bits are those of before.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/row_reduce.cuh"

namespace sluice {
namespace gate {

enum Mode { DIS = 0, ICEPOP = 1, PPO = 2, PG = 3 };
enum GateCode { INSIDE = 0, LOW = 1, HIGH = 2, UNDEFINED = 3 };

// The gate of a ratio (ops/is_gate_loss.rs gate_of).
__device__ __forceinline__ int gate_of(int mode, float rho, float el, float eh, float beta) {
    bool inside = true, low = false, high = false;
    if (mode == DIS) {
        const float lo = 1.0f - el, hi = 1.0f + eh;
        inside = rho > lo && rho < hi;  // open interval
        low = rho <= lo;
        high = rho >= hi;
    } else if (mode == ICEPOP) {
        const float lo = 1.0f / beta, hi = beta;
        inside = rho >= lo && rho <= hi;  // closed interval
        low = rho < lo;
        high = rho > hi;
    }
    return inside ? INSIDE : low ? LOW : high ? HIGH : UNDEFINED;
}

struct TokenTerm {
    float rho;
    float term;
    float dterm;
    bool accepted;
};

// The clip bounds of a token with advantage `adv`: (el, eh), or (el_neg, eh_neg) when adv < 0
// (ops/is_gate_loss.rs GateParams::bounds; the host passes the positive pair twice when unset).
struct Bounds {
    float el, eh, el_neg, eh_neg;
    __device__ __forceinline__ float low(float adv) const { return adv < 0.0f ? el_neg : el; }
    __device__ __forceinline__ float high(float adv) const { return adv < 0.0f ? eh_neg : eh; }
};

// One token's ratio, gate, loss term and d term / d logp (ops/is_gate_loss.rs token_term).
__device__ __forceinline__ TokenTerm token_term(int mode, Bounds b, float beta, float logp,
                                                float behavior, float adv, float m, float c) {
    TokenTerm r;
    const float el = b.low(adv), eh = b.high(adv);
    r.rho = expf(logp - behavior);
    const int gate = gate_of(mode, r.rho, el, eh, beta);
    const bool masked = m != 0.0f;
    const float k = rr_mul(m, c);
    r.accepted = masked && gate == INSIDE;
    r.term = 0.0f;
    r.dterm = 0.0f;
    if (r.accepted && k != 0.0f) {
        if (mode == DIS || mode == PG) {
            // dis: rho is a stop-gradient weight; pg: weight 1.
            const float g = mode == DIS ? rr_mul(rr_mul(k, r.rho), adv) : rr_mul(k, adv);
            if (g != 0.0f) {  // no 0 * -inf
                // A zero-probability token: term 0 (not +-inf), gradient kept (ops/is_gate_loss.rs).
                if (logp != SLUICE_NEG_INF) r.term = -rr_mul(g, logp);
                r.dterm = -g;
            }
        } else {
            // PPO clipped surrogate; the gradient flows through rho = exp(logp - b) on the
            // unclipped branch (d rho / d logp = rho).
            const float s1 = rr_mul(r.rho, adv);
            const float clipped = fminf(fmaxf(r.rho, 1.0f - el), 1.0f + eh);
            const float s2 = rr_mul(clipped, adv);
            r.term = -rr_mul(k, fminf(s1, s2));
            if (s1 <= s2) r.dterm = -rr_mul(rr_mul(k, adv), r.rho);
        }
    }
    return r;
}

enum KlMode { KL_OFF = 0, KL_K1 = 1, KL_K3 = 2 };

struct KlTerm {
    float term;
    float dterm;
};

// kl_coef * k * the estimator of KL(pi || ref) at one sampled token, and its d / d logp
// (ops/is_gate_loss.rs kl_term): k1 = logp - ref (d: 1); k3 = e^(ref - logp) - 1 - (ref - logp)
// (d: 1 - e^(ref - logp)). A token with logp or ref -inf adds nothing (an infinite estimate).
__device__ __forceinline__ KlTerm kl_term(int kl_mode, float kl_coef, float logp, float ref, float k) {
    KlTerm r{0.0f, 0.0f};
    if (kl_mode == KL_OFF || k == 0.0f || logp == SLUICE_NEG_INF || ref == SLUICE_NEG_INF) return r;
    const float w = rr_mul(kl_coef, k);
    if (kl_mode == KL_K1) {
        r.term = rr_mul(w, logp - ref);
        r.dterm = w;
    } else {
        const float u = ref - logp;
        const float q = expf(u);
        r.term = rr_mul(w, rr_add(q - 1.0f, -u));
        r.dterm = rr_mul(w, 1.0f - q);
    }
    return r;
}

// The entropy variants of the row kernel.
enum Ent { ENT_OFF = 0, ENT_MEASURE = 1, ENT_BONUS = 2 };

template <int ENT>
struct RowState {
    typedef EntState type;
    typedef EntCombine combine;
};
template <>
struct RowState<ENT_OFF> {
    typedef LseState type;
    typedef LseCombine combine;
};

__device__ __forceinline__ float row_entropy(LseState) { return 0.0f; }
__device__ __forceinline__ float row_entropy(EntState st) { return ent_value(st); }

// One gradient entry: coef * (onehot - p), plus with the bonus ecoef * p * (log p + H).
template <int ENT>
__device__ __forceinline__ float grad_entry(float z, float lse, bool live, float onehot, float coef,
                                            float ecoef, float h) {
    const float lz = z - lse;
    const float p = live ? expf(lz) : 0.0f;
    const float g = rr_mul(coef, onehot - p);
    if (ENT != ENT_BONUS || !live) return g;
    return rr_add(g, rr_mul(rr_mul(ecoef, p), rr_add(lz, h)));
}

template <typename T, int ENT>
__device__ __forceinline__ void loss_row(const T* logits, T* dlogits, const int* __restrict__ tokens,
                                         const float* __restrict__ behavior, const float* __restrict__ adv,
                                         const float* __restrict__ mask, const float* __restrict__ weight,
                                         int has_weight, float* __restrict__ logp_out,
                                         float* __restrict__ ratio_out, unsigned char* __restrict__ accepted_out,
                                         float* __restrict__ scratch, int n, int V, int mode, Bounds bounds,
                                         float beta, float scale, const float* __restrict__ ref_logp,
                                         int kl_mode, float kl_coef, float ent_coef,
                                         float* __restrict__ entropy_out) {
    typedef typename RowState<ENT>::type State;
    __shared__ State sh_lse[ROW_THREADS];
    const int row = blockIdx.x;
    const T* x = logits + (long long)row * V;
    T* g = dlogits + (long long)row * V;
    const int tok = tokens[row];
    // z = logits * scale (scale = 1 / the sampling temperature, the sampler's exact multiply;
    // scale 1 leaves the bits alone). Read before any barrier: see the in-place note.
    const float z_tok = rr_mul(load_logit(x, tok), scale);

    // Read 1: THE shared row log-sum-exp of z.
    // (With ENT, the entropy's sum rides along: same m and s, so the same lse bits.)
    const State st = block_tree(row_state_pass<State>(x, V, scale, [](int, float) {}), sh_lse,
                                typename RowState<ENT>::combine{});
    const float lse = lse_value(lse_of(st));
    const float h = row_entropy(st);
    const float logp = row_logprob(z_tok, lse);
    const float c = has_weight ? weight[row] : 1.0f;
    TokenTerm tt = token_term(mode, bounds, beta, logp, behavior[row], adv[row], mask[row], c);
    const float k = rr_mul(mask[row], c);
    if (kl_mode != KL_OFF) {
        // The regularizers act on every masked token, whatever the gate decided.
        const KlTerm kl = kl_term(kl_mode, kl_coef, logp, ref_logp[row], k);
        tt.term = rr_add(tt.term, kl.term);
        tt.dterm = rr_add(tt.dterm, kl.dterm);
    }
    if (ENT == ENT_BONUS && k != 0.0f) tt.term = rr_add(tt.term, -rr_mul(rr_mul(ent_coef, k), h));
    const float d = scratch[n];
    const bool live = lse != SLUICE_NEG_INF;
    // A row with no mass (all -inf) has no softmax to move: zero gradient in every mode.
    // d z / d logits = scale, folded into the coefficient (exact at scale 1).
    const float coef = (d > 0.0f && live) ? rr_mul(tt.dterm / d, scale) : 0.0f;
    const float ecoef = (ENT == ENT_BONUS && d > 0.0f && live) ? rr_mul(rr_mul(ent_coef, k) / d, scale) : 0.0f;

    // Read 2 + write: dlogits = coef * (onehot - softmax). Elementwise, so any assignment of
    // entries to threads gives the same bits: 8 consecutive entries per thread (16-byte loads
    // and stores) where both rows are aligned, then scalar for the rest.
    int done = 0;
    if (aligned16(x) && aligned16(g)) {
        done = (V / ROW_TILE) * ROW_TILE;
        for (int base = threadIdx.x * ROW_VEC; base < done; base += ROW_TILE) {
            float v[ROW_VEC];
            load_vec8(x + base, v);
#pragma unroll
            for (int e = 0; e < ROW_VEC; ++e) {
                const float onehot = base + e == tok ? 1.0f : 0.0f;
                v[e] = grad_entry<ENT>(rr_mul(v[e], scale), lse, live, onehot, coef, ecoef, h);
            }
            store_vec8(g + base, v);
        }
    }
#pragma unroll 4
    for (int j = done + threadIdx.x; j < V; j += ROW_THREADS) {
        const float onehot = j == tok ? 1.0f : 0.0f;
        store_logit(g, j, grad_entry<ENT>(rr_mul(load_logit(x, j), scale), lse, live, onehot, coef, ecoef, h));
    }
    if (threadIdx.x == 0) {
        if (ENT != ENT_OFF) entropy_out[row] = h;
        logp_out[row] = logp;
        ratio_out[row] = tt.rho;
        accepted_out[row] = tt.accepted ? 1 : 0;
        scratch[row] = tt.term;
    }
}

struct Partial {
    float term, masked, accepted, ratio_sum, ratio_min, ratio_max, low, high, diff;
};

struct PartialCombine {
    __device__ __forceinline__ Partial operator()(Partial a, Partial b) const {
        Partial r;
        r.term = rr_add(a.term, b.term);
        r.masked = rr_add(a.masked, b.masked);
        r.accepted = rr_add(a.accepted, b.accepted);
        r.ratio_sum = rr_add(a.ratio_sum, b.ratio_sum);
        r.ratio_min = fminf(a.ratio_min, b.ratio_min);
        r.ratio_max = fmaxf(a.ratio_max, b.ratio_max);
        r.low = rr_add(a.low, b.low);
        r.high = rr_add(a.high, b.high);
        r.diff = rr_add(a.diff, b.diff);
        return r;
    }
};

}  // namespace gate
}  // namespace sluice

using namespace sluice;
using namespace sluice::gate;

// D = sum mask[t] * weight[t] (weight 1 when has_weight = 0) -> scratch[n]. One block.
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_denom(const float* __restrict__ mask,
                                                                     const float* __restrict__ weight,
                                                                     int has_weight, float* __restrict__ scratch,
                                                                     int n) {
    __shared__ float sh[ROW_THREADS];
    float acc = 0.0f;
    for (int t = threadIdx.x; t < n; t += ROW_THREADS) {
        acc = rr_add(acc, rr_mul(mask[t], has_weight ? weight[t] : 1.0f));
    }
    const float d = block_tree(acc, sh, AddF32{});
    if (threadIdx.x == 0) scratch[n] = d;
}

// The row kernels: one per (entropy variant, dtype). Their shared parameter list:
#define GATE_ROW_PARAMS(T)                                                                               \
    const T *logits, T *dlogits, const int *__restrict__ tokens, const float *__restrict__ behavior,     \
        const float *__restrict__ adv, const float *__restrict__ mask, const float *__restrict__ weight, \
        int has_weight, float *__restrict__ logp, float *__restrict__ ratio,                             \
        unsigned char *__restrict__ accepted, float *__restrict__ scratch, int n, int V, int mode,      \
        float eps_low, float eps_high, float eps_low_neg, float eps_high_neg, float beta, float scale,  \
        const float *__restrict__ ref_logp, int kl_mode, float kl_coef, float ent_coef,                  \
        float *__restrict__ entropy
#define GATE_ROW_ARGS                                                                                    \
    logits, dlogits, tokens, behavior, adv, mask, weight, has_weight, logp, ratio, accepted, scratch, n, \
        V, mode, Bounds{eps_low, eps_high, eps_low_neg, eps_high_neg}, beta, scale, ref_logp, kl_mode,  \
        kl_coef, ent_coef, entropy

// No entropy (entropy may be null).
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_f32(GATE_ROW_PARAMS(float)) {
    loss_row<float, ENT_OFF>(GATE_ROW_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_bf16(GATE_ROW_PARAMS(__nv_bfloat16)) {
    loss_row<__nv_bfloat16, ENT_OFF>(GATE_ROW_ARGS);
}
// The entropy measured (entropy[row]), loss and gradient unchanged.
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_entropy_f32(GATE_ROW_PARAMS(float)) {
    loss_row<float, ENT_MEASURE>(GATE_ROW_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_entropy_bf16(GATE_ROW_PARAMS(__nv_bfloat16)) {
    loss_row<__nv_bfloat16, ENT_MEASURE>(GATE_ROW_ARGS);
}
// The entropy measured and its bonus in the loss and the gradient.
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_bonus_f32(GATE_ROW_PARAMS(float)) {
    loss_row<float, ENT_BONUS>(GATE_ROW_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_bonus_bf16(GATE_ROW_PARAMS(__nv_bfloat16)) {
    loss_row<__nv_bfloat16, ENT_BONUS>(GATE_ROW_ARGS);
}

// Loss and counters from the per-row values, in the fixed lane order. One block.
extern "C" __global__ void __launch_bounds__(256) is_gate_loss_finish(
    const float* __restrict__ mask, const float* __restrict__ behavior, const float* __restrict__ adv,
    const float* __restrict__ logp, const float* __restrict__ ratio, const unsigned char* __restrict__ accepted,
    const float* __restrict__ scratch, int n, int mode, float eps_low, float eps_high, float eps_low_neg,
    float eps_high_neg, float beta, float* __restrict__ loss, float* __restrict__ counters) {
    const Bounds bounds{eps_low, eps_high, eps_low_neg, eps_high_neg};
    __shared__ Partial sh[ROW_THREADS];
    Partial p = {0.0f, 0.0f, 0.0f, 0.0f, INFINITY, SLUICE_NEG_INF, 0.0f, 0.0f, 0.0f};
    for (int t = threadIdx.x; t < n; t += ROW_THREADS) {
        p.term = rr_add(p.term, scratch[t]);
        if (mask[t] != 0.0f) {
            const float rho = ratio[t];
            const int gate = gate_of(mode, rho, bounds.low(adv[t]), bounds.high(adv[t]), beta);
            p.masked = rr_add(p.masked, 1.0f);
            p.accepted = rr_add(p.accepted, accepted[t] ? 1.0f : 0.0f);
            p.ratio_sum = rr_add(p.ratio_sum, rho);
            p.ratio_min = fminf(p.ratio_min, rho);
            p.ratio_max = fmaxf(p.ratio_max, rho);
            p.low = rr_add(p.low, gate == LOW ? 1.0f : 0.0f);
            p.high = rr_add(p.high, gate == HIGH ? 1.0f : 0.0f);
            p.diff = rr_add(p.diff, behavior[t] - logp[t]);
        }
    }
    const Partial total = block_tree(p, sh, PartialCombine{});
    if (threadIdx.x == 0) {
        const float d = scratch[n];
        const bool any = total.masked > 0.0f;
        loss[0] = d > 0.0f ? total.term / d : 0.0f;
        counters[0] = total.masked;
        counters[1] = total.accepted;
        counters[2] = any ? total.ratio_sum / total.masked : 0.0f;
        counters[3] = any ? total.ratio_min : 0.0f;
        counters[4] = any ? total.ratio_max : 0.0f;
        counters[5] = total.low;
        counters[6] = total.high;
        counters[7] = any ? total.diff / total.masked : 0.0f;
    }
}
