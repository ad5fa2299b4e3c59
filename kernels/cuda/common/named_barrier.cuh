// Named barriers (`bar.sync id, count`): `count` threads (a multiple of 32, whole warps) of the
// block meet at barrier `id` (1..15; 0 is __syncthreads). Warp-specialised kernels use them to
// sync a subset of warps (the consumer warpgroups of a pipeline) without stopping the others.
// Under the emulator they order the participants' memory accesses for the race checker
// (docs/emulator.md, "Race detection").
#pragma once

namespace sluice {

__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned count) {
#ifdef SLUICE_EMU
    emu_named_barrier(id, count);
#else
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}

}  // namespace sluice
