// topk.cu — router top-k over scores[T,E] (DESIGN.md section 3.2).
//
// values[T,k] (f32) and indices[T,k] (i32), sorted by value descending, ties to the LOWER index,
// NaN below every number (including -inf), -0.0 equal to +0.0. E <= 512, k <= 16, k <= E.
//
// Determinism by construction: every element of a row gets a distinct place in one total order
// (its order key below, then its index), so "the k largest" is a unique set in a unique order;
// the kernel finds it with k rounds of an exact warp max and a lowest-lane ballot. No atomics,
// no shared memory, nothing depends on which thread finishes first. Rows are independent, so
// the result is batch-invariant.
//
// Layout: one warp per row, 8 rows per 256-thread block. Lane l holds the C = E/32 (rounded up
// to a power of two) CONTIGUOUS elements [l*C, l*C + C) of its row as 32-bit order keys in
// registers. Contiguous (not strided) so that lane order is index order: among lanes whose best
// key ties, the lowest lane holds the lowest index, and a ballot + find-first-set breaks the tie
// with no second reduction over indices.
//
// Everything here is integer arithmetic on the raw bits (scores are read as u32 / u16 words and
// values written as u32 words), so values are the input scores bit for bit (NaN payloads too;
// bf16 widened exactly) and no float comparison semantics can creep in.

#include <cuda_bf16.h>
#include <stdint.h>

namespace topk {

constexpr int kWarpsPerBlock = 8;  // rows per block; 256 threads
constexpr unsigned kFullMask = 0xffffffffu;

// Order key of an f32 bit pattern: unsigned comparison of keys is the op's order on values.
//   finite and infinite numbers: the usual "flip" (negative: all bits inverted; non-negative:
//   sign bit set), which maps -inf to 0x007fffff and +inf to 0xff800000;
//   -0.0 is mapped as +0.0 (the two compare equal; the tie goes to the lower index);
//   NaN (any payload, either sign) -> 1, below -inf; 0 is reserved for "no element" (padding
//   lanes and elements already taken), below NaN.
// Written as selects, not early returns: the branchy form compiled to one branch per element.
__device__ __forceinline__ unsigned order_key(unsigned bits) {
    const unsigned flip = (unsigned)((int)bits >> 31) | 0x80000000u;  // all ones if negative
    unsigned key = bits ^ flip;
    key = bits == 0x80000000u ? 0x80000000u : key;             // -0.0 -> key of +0.0
    key = (bits & 0x7fffffffu) > 0x7f800000u ? 1u : key;       // NaN -> 1
    return key;
}

// Exact max of a u32 over the warp, every lane gets it: redux.sync (sm_80+, so both PTX
// targets), one instruction instead of five shuffle rounds; the emulator implements it too.
// Integer max is exact and order-free.
__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
    return __reduce_max_sync(kFullMask, v);
}

// Raw element words: f32 scores are read as u32, bf16 scores as u16.
template <typename Word>
__device__ __forceinline__ unsigned widen_bits(Word w);
template <>
__device__ __forceinline__ unsigned widen_bits<uint32_t>(uint32_t w) { return w; }
template <>
__device__ __forceinline__ unsigned widen_bits<uint16_t>(uint16_t w) {
    return (unsigned)w << 16;  // bf16 -> f32 is exact: the bf16 bits are the f32's top half
}

// Four consecutive elements starting at a 4-element-aligned position, in one vector load
// (16 B for f32, 8 B for bf16). The caller guarantees the alignment (vec_ok).
__device__ __forceinline__ void load4(const uint32_t* p, unsigned out[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, unsigned out[4]) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    // Little-endian: the lower half of each word is the element at the lower address.
    out[0] = v.x << 16;
    out[1] = v.x & 0xffff0000u;
    out[2] = v.y << 16;
    out[3] = v.y & 0xffff0000u;
}

// Lane-local best: the largest key, ties to the lowest slot (strict >, ascending scan).
template <int C>
__device__ __forceinline__ void local_best(const unsigned (&key)[C], unsigned& best, int& slot) {
    best = key[0];
    slot = 0;
#pragma unroll
    for (int j = 1; j < C; ++j) {
        if (key[j] > best) {
            best = key[j];
            slot = j;
        }
    }
}

// Lane-local top two: head (largest, lowest slot on ties) and next (the one ranked right
// below the head); key 0 means "none".
template <int C>
__device__ __forceinline__ void local_top2(const unsigned (&key)[C], unsigned& head, int& hslot,
                                           unsigned& next, int& nslot) {
    head = key[0];
    hslot = 0;
    next = 0u;
    nslot = 0;
#pragma unroll
    for (int j = 1; j < C; ++j) {
        if (key[j] > head) {
            next = head;
            nslot = hslot;
            head = key[j];
            hslot = j;
        } else if (key[j] > next) {
            next = key[j];
            nslot = j;
        }
    }
}

// The lane's best among the elements ranked below (head, hslot): a lane gives up its elements
// in its own rank order, so these are exactly the ones not yet taken; nothing is cleared.
template <int C>
__device__ __forceinline__ void best_below(const unsigned (&key)[C], unsigned& head, int& hslot) {
    unsigned best = 0u;
    int slot = 0;
#pragma unroll
    for (int j = 0; j < C; ++j) {
        const bool below = key[j] < head || (key[j] == head && j > hslot);
        if (below && key[j] > best) {
            best = key[j];
            slot = j;
        }
    }
    head = best;
    hslot = slot;
}

// One warp computes the top-k of one row. Word: uint32_t (f32 scores) or uint16_t (bf16).
// C: slots per lane, a power of two with 32*C >= E (templated so the key array stays in
// registers: every index into it is a compile-time constant after unrolling).
// V: the lane bookkeeping after a win (see docs/perf/topk.md). Both give the same bits.
//   1: clear the taken slot and rescan all C slots (every win costs ~4C instructions);
//   2: keep the lane's next-best too; a win promotes it in two moves, and only a lane's second
//      win in a row pays a rescan (best_below). Fewer instructions on typical rows, more when
//      one lane holds most of the top k (e.g. all-equal rows).
template <typename Word, int C, int V>
__device__ __forceinline__ void topk_row(const Word* __restrict__ scores, int T, int E, int k,
                                         int vec_ok, uint32_t* __restrict__ values,
                                         int* __restrict__ indices) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    // The row is uniform across the warp, so a whole warp leaves together and every shuffle
    // below has all 32 lanes. There is no block barrier.
    if (row >= T) return;
    const Word* src = scores + row * (long long)E;
    const int base = lane * C;

    unsigned key[C];
    if constexpr (C >= 4) {
#pragma unroll
        for (int g = 0; g < C / 4; ++g) {
            const int e0 = base + 4 * g;
            if (vec_ok && e0 + 4 <= E) {
                unsigned bits[4];
                load4(src + e0, bits);
#pragma unroll
                for (int j = 0; j < 4; ++j) key[4 * g + j] = order_key(bits[j]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int e = e0 + j;
                    key[4 * g + j] = e < E ? order_key(widen_bits<Word>(src[e])) : 0u;
                }
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < C; ++j) {
            const int e = base + j;
            key[j] = e < E ? order_key(widen_bits<Word>(src[e])) : 0u;
        }
    }

    unsigned best;  // the lane's candidate this round (V=2: its head)
    int slot;
    unsigned next = 0u;  // V=2 only: the lane's second, valid while has_next
    int nslot = 0;
    bool has_next = false;
    if constexpr (V == 1) {
        local_best<C>(key, best, slot);
    } else {
        local_top2<C>(key, best, slot, next, nslot);
        has_next = true;
    }

    uint32_t* vout = values + row * (long long)k;
    int* iout = indices + row * (long long)k;
    for (int r = 0; r < k; ++r) {
        // Several lanes may hold the max key; the lowest such lane holds the lowest index
        // (contiguous layout), and inside a lane the candidate is already the lowest slot of
        // its key. Since k <= E, at least k - r real elements (key >= 1) remain, so the key-0
        // padding is never taken.
        const unsigned m = warp_max_u32(best);
        const unsigned holders = __ballot_sync(kFullMask, best == m);
        const int winner = __ffs(holders) - 1;
        if (lane == winner) {
            const int e = base + slot;
            vout[r] = widen_bits<Word>(src[e]);  // the score's bits, re-read (an L1 hit)
            iout[r] = e;
            if constexpr (V == 1) {
#pragma unroll
                for (int j = 0; j < C; ++j) {
                    if (j == slot) key[j] = 0u;  // taken
                }
                local_best<C>(key, best, slot);
            } else {
                if (has_next) {
                    best = next;
                    slot = nslot;
                    has_next = false;
                } else {
                    best_below<C>(key, best, slot);
                }
            }
        }
    }
}

}  // namespace topk

// Exported kernels: one per (input dtype, slots per lane C, version: no suffix = 1, _v2 = 2).
// Grid: ceil(T/8) blocks of 256 threads. vec_ok = 1 when E % 4 == 0 and the scores pointer is aligned for 4-element vector
// loads (the launcher checks both).
extern "C" __global__ void __launch_bounds__(256) topk_f32_c1(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 1, 1>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c2(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 2, 1>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c4(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 4, 1>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c8(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 8, 1>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c16(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 16, 1>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c1(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 1, 1>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c2(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 2, 1>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c4(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 4, 1>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c8(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 8, 1>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c16(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 16, 1>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c1_v2(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 1, 2>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c2_v2(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 2, 2>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c4_v2(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 4, 2>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c8_v2(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 8, 2>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_f32_c16_v2(const float* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint32_t, 16, 2>(reinterpret_cast<const uint32_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c1_v2(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 1, 2>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c2_v2(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 2, 2>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c4_v2(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 4, 2>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c8_v2(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 8, 2>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
extern "C" __global__ void __launch_bounds__(256) topk_bf16_c16_v2(const __nv_bfloat16* __restrict__ scores, int T, int E, int k, int vec_ok, float* __restrict__ values, int* __restrict__ indices) {
    topk::topk_row<uint16_t, 16, 2>(reinterpret_cast<const uint16_t*>(scores), T, E, k, vec_ok, reinterpret_cast<uint32_t*>(values), indices);
}
