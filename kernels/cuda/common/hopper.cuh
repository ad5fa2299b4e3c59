// Hopper (sm_90a) helpers: mbarrier, bulk asynchronous copy (the TMA engine's non-tensor form),
// async-proxy fences and wgmma m64n128k16 (bf16 x bf16 -> f32) reading both operands from shared
// memory through matrix descriptors. Each has a portable version for the emulator.
//
// Guard: these compile when SLUICE_EMU is defined or for __CUDA_ARCH__ >= 900 (compute_90a).
// In the compute_80 build they are absent; kernels that use them must put their body behind the
// same test (SLUICE_HOPPER_OK below) with __trap() in the #else.
//
// Shared-memory operand layout (the only one these helpers implement): K-major, NO swizzle
// ("interleave" mode 0). A core matrix is 8 rows x 16 bytes (8 bf16), stored as 128 contiguous
// bytes (row r of the core matrix at +16r). In a matrix descriptor:
//   start address  = shared address of element (0, 0), >> 4, bits 0-13
//   LBO (bits 16-29, >> 4) = bytes between core matrices adjacent in K
//   SBO (bits 32-45, >> 4) = bytes between core matrices adjacent in M (or N)
//   base offset (bits 49-51) = 0, swizzle (bits 62-63) = 0.
// So element (row, k) lives at start + (row/8)*SBO + (row%8)*16 + (k/8)*LBO + (k%8)*2.
//
// Emulation notes:
// - Shared addresses: a descriptor or mbarrier address holds a 32-bit shared-window address on
//   the GPU. Under the emulator shared memory is ordinary host memory, so these helpers take the
//   block's dynamic shared-memory base (`smem_base`) and store offsets from it instead; on the
//   GPU the argument is ignored.
// - Every one of them is asynchronous under the emulator as on the GPU (kernels/emu/async.cpp):
//   a bulk copy's destination is written when the mbarrier phase it signals completes, and a
//   wgmma's accumulator receives its result at the wgmma_wait covering its commit group (it holds
//   NaN in between). Reading either earlier is an `async-read-before-wait` finding. The mbarrier
//   state lives in the emulator (keyed by the barrier's address); a wait spins with emu_yield()
//   until the other threads' arrivals complete the phase.
// - wgmma is computed when issued (each thread its own accumulator fragment, reading the operands
//   from shared memory through the checker). Products are exact; the 16 products of one k16 step
//   are added one at a time in ascending k, which may differ from the tensor cores' internal
//   order in the last bits (as for mma.sync, see mma.cuh).
#pragma once

#include <stdint.h>
#ifdef SLUICE_EMU
#include <string.h>
#include <source_location>
#define SLUICE_HOPPER_LOC std::source_location loc = std::source_location::current()
#endif

#if defined(SLUICE_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define SLUICE_HOPPER_OK 1
#else
#define SLUICE_HOPPER_OK 0
#endif

#if SLUICE_HOPPER_OK
namespace sluice {

// The address of `p` in the shared window (GPU) or its offset from `smem_base` (emulator).
__device__ __forceinline__ uint32_t smem_addr(const void* smem_base, const void* p) {
#ifdef SLUICE_EMU
    return static_cast<uint32_t>(reinterpret_cast<const char*>(p) -
                                 reinterpret_cast<const char*>(smem_base));
#else
    (void)smem_base;
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}

// ---- mbarrier -------------------------------------------------------------------------------

// One thread initialises; every thread then needs a __syncthreads (after fence_mbarrier_init).
#ifdef SLUICE_EMU
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals, SLUICE_HOPPER_LOC) {
    ::sluice_emu::mbarrier_init(bar, arrivals, loc);
#else
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(arrivals));
#endif
}

// Makes initialised mbarriers visible to the async proxy (bulk copies) before first use.
__device__ __forceinline__ void fence_mbarrier_init() {
#ifndef SLUICE_EMU
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Raises the transaction bytes the current phase waits for (before this thread's copies).
#ifdef SLUICE_EMU
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes, SLUICE_HOPPER_LOC) {
    ::sluice_emu::mbarrier_expect_tx(bar, bytes, loc);
#else
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(bytes)
                 : "memory");
#endif
}

// This thread's arrival (release semantics: its earlier shared-memory writes are visible to a
// thread whose wait observes the phase complete).
#ifdef SLUICE_EMU
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar, SLUICE_HOPPER_LOC) {
    ::sluice_emu::mbarrier_arrive(bar, loc);
#else
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
#endif
}

// Waits until the phase with parity `parity` has completed.
#ifdef SLUICE_EMU
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity, SLUICE_HOPPER_LOC) {
    // Spin with a yield so the other emulated threads of the block can arrive (the emulator
    // reports a wait that no thread will ever end as a hung spin-wait).
    while (!::sluice_emu::mbarrier_test_wait(bar, parity, loc)) emu_yield(loc);
#else
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(a),
        "r"(parity)
        : "memory");
#endif
}

// ---- bulk async copy (global -> shared), completing on an mbarrier ---------------------------

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) and signals `bar` with
// complete_tx(bytes). The issuing thread must have added `bytes` with mbarrier_expect_tx first.
#ifdef SLUICE_EMU
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar, SLUICE_HOPPER_LOC) {
    ::sluice_emu::bulk_copy_g2s(dst, src, bytes, bar, loc);
#else
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(d), "l"(src), "r"(bytes), "r"(b)
        : "memory");
#endif
}

// Orders this thread's ordinary shared-memory writes before later async-proxy reads (wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifndef SLUICE_EMU
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---- wgmma ----------------------------------------------------------------------------------

// A K-major, no-swizzle matrix descriptor (see the layout at the top of this file).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t start, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((start >> 4) & 0x3fffu) |
           (static_cast<uint64_t>((lbo >> 4) & 0x3fffu) << 16) |
           (static_cast<uint64_t>((sbo >> 4) & 0x3fffu) << 32);
}

__device__ __forceinline__ void wgmma_fence() {
#ifndef SLUICE_EMU
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
#ifdef SLUICE_EMU
__device__ __forceinline__ void wgmma_commit(SLUICE_HOPPER_LOC) { ::sluice_emu::wgmma_commit(loc); }
// Waits until at most N committed wgmma groups of this thread are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait(SLUICE_HOPPER_LOC) {
    ::sluice_emu::wgmma_wait(N, loc);
}
#else
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warp are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
#endif

#ifdef SLUICE_EMU
namespace emu_hopper {
inline float smem_bf16(const void* smem_base, uint64_t desc, int row, int k) {
    const uint32_t start = static_cast<uint32_t>(desc & 0x3fffu) << 4;
    const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3fffu) << 4;
    const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3fffu) << 4;
    const uint32_t off = start + (row / 8) * sbo + (row % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    uint16_t h;
    memcpy(&h, reinterpret_cast<const char*>(smem_base) + off, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
}  // namespace emu_hopper
#endif

// D(64x128) = A(64x16) * B(128x16)^T + (scale_d ? D : 0), bf16 from shared memory (K-major, no
// swizzle), f32 accumulators in registers. All 128 threads of the warpgroup must call it.
// Fragment of D: warp w = (threadIdx.x % 128) / 32 holds rows 16w..16w+15; with g = lane/4,
// t = lane%4, d[4j + 0, 1] = D[16w + g][8j + 2t, +1], d[4j + 2, 3] = D[16w + g + 8][8j + 2t, +1].
#ifdef SLUICE_EMU
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d,
                                                      const void* smem_base, SLUICE_HOPPER_LOC) {
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, t = lane % 4;
    // The accumulator this wgmma starts from: the newest pending result on d, else d (read by
    // the emulator, so that chaining wgmmas before their wait is not a premature read).
    float in[64], out[64];
    ::sluice_emu::wgmma_accumulator(d, in, sizeof in);
    // Profile: one instruction per warpgroup; its operands, A (64x16) and B (128x16) bf16, read
    // from shared memory once (a model); the emulation's own reads are not counted.
    if (wt == 0) {
        ::sluice_emu::prof_tensor_op("wgmma.m64n128k16.bf16", 2.0 * 64 * 128 * 16, loc);
        ::sluice_emu::prof_wgmma_operands((64 + 128) * 16 * 2, loc);
    }
    ::sluice_emu::prof_quiet(1);
    for (int j = 0; j < 16; ++j) {
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * warp + g + (e >= 2 ? 8 : 0);
            const int col = 8 * j + 2 * t + (e & 1);
            float acc = scale_d ? in[4 * j + e] : 0.0f;
            for (int k = 0; k < 16; ++k) {
                acc = fmaf(emu_hopper::smem_bf16(smem_base, desc_a, row, k),
                           emu_hopper::smem_bf16(smem_base, desc_b, col, k), acc);
            }
            out[4 * j + e] = acc;
        }
    }
    ::sluice_emu::prof_quiet(-1);
    ::sluice_emu::wgmma_issue(d, out, sizeof out, loc);
#else
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d,
                                                      const void* smem_base) {
    (void)smem_base;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
          "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),
          "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),
          "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

}  // namespace sluice
#endif  // SLUICE_HOPPER_OK
