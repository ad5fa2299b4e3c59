// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC 2011): the counter-based generator of the
// sampler. Mirrors kernels/src/ops/philox.rs operation for operation (integer arithmetic only,
// so the same bits on cuda, emu and cpu). Portable C++: the 32x32->64 products compile to
// mul.lo/mul.hi on the GPU, so no inline PTX is needed.
#pragma once
#include <math.h>
#include <stdint.h>

namespace sluice {

constexpr uint32_t PHILOX_M0 = 0xD2511F53u;  // S-box multipliers (Salmon et al., table 2)
constexpr uint32_t PHILOX_M1 = 0xCD9E8D57u;
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u;  // key schedule: golden ratio, sqrt(3) - 1
constexpr uint32_t PHILOX_W1 = 0xBB67AE85u;

// Four 32-bit words from the 128-bit counter c (overwritten with the result) and key (k0, k1).
__device__ __forceinline__ void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
        const uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
        const uint32_t n1 = (uint32_t)p1;
        const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        const uint32_t n3 = (uint32_t)p0;
        c[0] = n0;
        c[1] = n1;
        c[2] = n2;
        c[3] = n3;
    }
}

// The sampler's stream: key = seed, counter = (group, position, request id lo, request id hi).
__device__ __forceinline__ void sampler_words(unsigned long long seed, unsigned long long request_id,
                                              int position, uint32_t group, uint32_t out[4]) {
    out[0] = group;
    out[1] = (uint32_t)position;
    out[2] = (uint32_t)request_id;
    out[3] = (uint32_t)(request_id >> 32);
    philox4x32_10(out, (uint32_t)seed, (uint32_t)(seed >> 32));
}

// Open uniform (0, 1) from the word's top 23 bits (exact in f32), and Gumbel noise
// -log(-log u), always finite. expf/logf, not the fast intrinsics (same as row_reduce.cuh).
__device__ __forceinline__ float gumbel_noise(uint32_t word) {
    const float u = ((float)(word >> 9) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

}  // namespace sluice
