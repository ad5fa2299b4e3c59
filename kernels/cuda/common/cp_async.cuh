// cp.async (sm_80+): asynchronous global -> shared copies of 16 bytes, grouped per thread.
//
//   cp_async_16(dst, src)   issue (dst in shared memory, src in global memory, both 16-byte aligned)
//   cp_async_commit()       close this thread's current group of copies
//   cp_async_wait<N>()      wait until at most N of this thread's committed groups are pending
//
// The copies are visible to the issuing thread after the wait; other threads need a barrier
// after it (the usual `cp_async_wait<0>(); __syncthreads();`).
//
// Under the emulator (SLUICE_EMU) each copy is asynchronous as on the GPU (kernels/emu/async.cpp):
// its destination is written at the wait that covers its group. Reading it earlier is an
// `async-read-before-wait` finding; another thread reading it after the wait without a barrier is
// a `race`.
//
// No sluice kernel uses these yet; they exist so a kernel can, and the emulator's tests plant the
// bug they are easy to make (kernels/emu/tests/planted.cu).
#pragma once

#include <stdint.h>
#ifdef SLUICE_EMU
#include <source_location>
#endif

namespace sluice {

#ifdef SLUICE_EMU
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src,
                                            std::source_location loc = std::source_location::current()) {
    ::sluice_emu::cp_async(smem_dst, gmem_src, 16, loc);
}
__device__ __forceinline__ void cp_async_commit(
    std::source_location loc = std::source_location::current()) {
    ::sluice_emu::cp_async_commit(loc);
}
template <int N>
__device__ __forceinline__ void cp_async_wait(
    std::source_location loc = std::source_location::current()) {
    ::sluice_emu::cp_async_wait(N, loc);
}
#else
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

}  // namespace sluice
