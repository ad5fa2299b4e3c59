// ring.cuh — the producer/consumer ring of a warp-specialised kernel: STAGES stage buffers, each
// with a `full` mbarrier (the producer filled it) and an `empty` mbarrier (the consumers released
// it). The CUTLASS habit: the ring is an object, so no kernel writes its phase bits by hand, and
// the emulator's ordering checks and the reader meet the same five calls.
//
//   Ring<STAGES> ring{full, empty};            barriers in shared memory (2 x STAGES x 8 bytes)
//   ring.init(producer_arrivals, consumer_arrivals)   one thread, then __syncthreads
//   RingPosition<STAGES> p;                    stage 0, phase 0; p.advance() after each use
//   producer:  ring.producer_acquire(p)        waits until the stage's previous use is released
//              ... copies completing on ring.full_barrier(p) (expect_tx first) ...
//              ring.producer_commit(p)         the producer's arrival on `full`
//   consumers: ring.consumer_wait(p)           waits until the stage is full
//              ... reads (wgmma operands) ...
//              ring.consumer_release(p)        each consumer thread's arrival on `empty`
//
// Phases: the k-th use of a stage (k = 0, 1, ...) is phase k of its `full` barrier, and is
// released by phase k of its `empty` barrier. The producer's k-th acquire waits for phase k - 1
// of `empty` to complete, i.e. for the parity (k & 1) ^ 1; for k = 0 the barrier is still in
// phase 0, whose parity-1 predecessor counts as complete, so the first use of each stage passes
// at once (the PTX ISA's mbarrier.try_wait.parity semantics).
#pragma once

#include <stdint.h>

#include "hopper.cuh"

#if SLUICE_HOPPER_OK
namespace sluice {

template <int STAGES>
struct RingPosition {
    int stage = 0;
    uint32_t phase = 0;  // parity of the current use of `stage`
    __device__ __forceinline__ void advance() {
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
        }
    }
};

#ifdef SLUICE_EMU
#define SLUICE_RING_LOC , SLUICE_HOPPER_LOC
#define SLUICE_RING_PASS , loc
#else
#define SLUICE_RING_LOC
#define SLUICE_RING_PASS
#endif

template <int STAGES>
struct Ring {
    uint64_t* full;   // [STAGES]
    uint64_t* empty;  // [STAGES]

    // One thread; every thread of the block then meets at a __syncthreads.
    __device__ __forceinline__ void init(uint32_t producer_arrivals, uint32_t consumer_arrivals) const {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], producer_arrivals);
            mbarrier_init(&empty[s], consumer_arrivals);
        }
        fence_mbarrier_init();
    }
    __device__ __forceinline__ uint64_t* full_barrier(const RingPosition<STAGES>& p) const {
        return &full[p.stage];
    }
    __device__ __forceinline__ void producer_acquire(const RingPosition<STAGES>& p SLUICE_RING_LOC) const {
        mbarrier_wait(&empty[p.stage], p.phase ^ 1u SLUICE_RING_PASS);
    }
    __device__ __forceinline__ void producer_commit(const RingPosition<STAGES>& p SLUICE_RING_LOC) const {
        mbarrier_arrive(&full[p.stage] SLUICE_RING_PASS);
    }
    __device__ __forceinline__ void consumer_wait(const RingPosition<STAGES>& p SLUICE_RING_LOC) const {
        mbarrier_wait(&full[p.stage], p.phase SLUICE_RING_PASS);
    }
    __device__ __forceinline__ void consumer_release(const RingPosition<STAGES>& p SLUICE_RING_LOC) const {
        mbarrier_arrive(&empty[p.stage] SLUICE_RING_PASS);
    }
};

#undef SLUICE_RING_LOC
#undef SLUICE_RING_PASS

}  // namespace sluice
#endif  // SLUICE_HOPPER_OK
