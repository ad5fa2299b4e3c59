// Hopper (sm_90a) helpers: mbarrier, bulk asynchronous copies (plain and through a tensor map,
// the TMA engine), async-proxy fences and wgmma m64nNk16 (bf16 x bf16 -> f32, N = 32/64/128/256)
// reading both operands from shared memory through matrix descriptors. Each has a portable
// version for the emulator.
//
// Guard: these compile when SLUICE_EMU is defined or for __CUDA_ARCH__ >= 900 (compute_90a).
// In the compute_80 build they are absent; kernels that use them must put their body behind the
// same test (SLUICE_HOPPER_OK below) with __trap() in the #else.
//
// Shared-memory operand layouts: K-major or MN-major, either interleaved (no swizzle, below) or
// swizzled by 32/64/128 bytes (see "wgmma operand layouts" further down). K-major interleaved:
// a core matrix is
// 8 rows x 16 bytes (8 bf16), stored as 128 contiguous bytes (row r of the core matrix at +16r).
// In a matrix descriptor:
//   start address  = shared address of element (0, 0), >> 4, bits 0-13
//   LBO (bits 16-29, >> 4) = bytes between core matrices adjacent in K
//   SBO (bits 32-45, >> 4) = bytes between core matrices adjacent in M (or N)
//   base offset (bits 49-51) = 0, swizzle (bits 62-63) = 0 (1: 128B, 2: 64B, 3: 32B).
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
// - Proxies: a thread's ordinary stores to shared memory reach wgmma (the async proxy) only
//   after its fence.proxy.async; the emulator reports a wgmma operand byte written without one
//   (`missing-proxy-fence`), and one a tensor copy landed with another swizzle than the wgmma's
//   descriptor says (`swizzle-mismatch`). The emulator and these helpers encode the same reading
//   of the PTX ISA: a misreading shared by both passes here, and only a GPU run settles it.
// - wgmma is computed when issued (each thread its own accumulator fragment, reading the operands
//   from shared memory through the checker). Products are exact; the 16 products of one k16 step
//   are added one at a time in ascending k, which may differ from the tensor cores' internal
//   order in the last bits (as for mma.sync, see mma.cuh).
#pragma once

#include <stdint.h>
#ifndef SLUICE_EMU
#include <cuda.h>  // CUtensorMap
#endif
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
#ifdef SLUICE_EMU
__device__ __forceinline__ void fence_proxy_async_shared(SLUICE_HOPPER_LOC) {
    ::sluice_emu::fence_proxy_async(loc);
}
#else
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif

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

// Pins registers an asynchronous wgmma reads or writes (its accumulator, or A in registers) in
// place: an empty asm that "reads and writes" each, so the compiler cannot move other accesses
// to them across a wgmma's issue, commit or wait. Nothing to do under the emulator.
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&r)[N]) {
#ifndef SLUICE_EMU
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
#else
    (void)r;
#endif
}
template <int N, int M>
__device__ __forceinline__ void wgmma_fence_operand(uint32_t (&r)[N][M]) {
#ifndef SLUICE_EMU
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < M; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
#else
    (void)r;
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


// ---- wgmma operand layouts -------------------------------------------------------------------
//
// Both operands K-major in shared memory, read through a matrix descriptor. Two layouts:
// - interleave (no swizzle; descriptor mode 0): the core-matrix layout at the top of this file.
// - swizzled, 32/64/128 bytes (descriptor modes 3/2/1): rows of W = 32/64/128 bytes (16/32/64 bf16
//   of K), 8 rows an atom of 8W bytes, atoms SBO apart along M (or N); element (row, k) at the
//   canonical address start + (row/8)*SBO + (row%8)*W + 2k, then swizzled on the address: its
//   16-byte chunk index (bits 4..) XOR the 128-byte line index (bits 7..), 1/2/3 bits for
//   32/64/128 bytes. The K step of an instruction (16 bf16, 32 bytes) advances the start address
//   by 32 bytes inside the row, so a tile's K extent is one row (W bytes), and atoms must sit at
//   addresses aligned to 8W (the descriptor's base offset is 0). This is the layout a tensor copy
//   with the same swizzle writes (tma_load_2d below), which is what makes the pair work.
enum WgmmaSwizzle : uint32_t {
    kWgmmaInterleave = 0,
    kWgmmaSwizzle128B = 1,
    kWgmmaSwizzle64B = 2,
    kWgmmaSwizzle32B = 3
};

// A swizzled K-major descriptor (LBO is unused by these layouts and set to 1, as CUTLASS does).
__device__ __forceinline__ uint64_t wgmma_desc_swizzled(uint32_t start, uint32_t sbo,
                                                        WgmmaSwizzle mode) {
    return static_cast<uint64_t>((start >> 4) & 0x3fffu) | (static_cast<uint64_t>(1) << 16) |
           (static_cast<uint64_t>((sbo >> 4) & 0x3fffu) << 32) |
           (static_cast<uint64_t>(mode) << 62);
}

// Which dimension of an operand is contiguous in shared memory: K (the layouts above; the
// instruction's transpose bit 0) or M/N (transpose bit 1, bf16 and f16 only). The PTX ISA's
// canonical MN-major layouts ("Canonical Layouts", in elements, T = 8 bf16 = 16 bytes):
//   interleave: ((T,1,m),(8,k)):((1,T,SBO),(T,LBO))   core matrix: 8 MN-contiguous elements
//               x 8 K rows of 16 bytes (128 contiguous bytes); SBO steps 8 MN, LBO steps 8 K;
//   swizzled W: ((T,W/16,m),(8,k)):((1,T,LBO),(W/2,SBO))   an atom is W/2 MN-contiguous
//               elements (one W-byte row) x 8 K rows; LBO steps one atom along MN, SBO 8 rows
//               along K; the address then swizzled as for K-major (Swizzle<log2(W/16),4,3>).
// So LBO and SBO trade places with the swizzle: what a demanding reader should check against
// the ISA's Figures 168-170 (kernels/tests/emu_hopper.rs evaluates their exact layouts). A tensor
// copy of a [K rows, MN] box whose row is the swizzle span (W/2 elements of MN) lands exactly
// the swizzled atom: row k at +W k, 8 rows SBO = 8W apart; boxes side by side along MN are LBO
// apart. The k16 step of an instruction advances the start by 16 rows (2 SBO).
enum WgmmaMajor : int { kWgmmaKMajor = 0, kWgmmaMNMajor = 1 };

// A descriptor with every field given (MN-major operands use both offsets).
__device__ __forceinline__ uint64_t wgmma_desc_mn(uint32_t start, uint32_t lbo, uint32_t sbo,
                                                  WgmmaSwizzle mode) {
    return static_cast<uint64_t>((start >> 4) & 0x3fffu) |
           (static_cast<uint64_t>((lbo >> 4) & 0x3fffu) << 16) |
           (static_cast<uint64_t>((sbo >> 4) & 0x3fffu) << 32) |
           (static_cast<uint64_t>(mode) << 62);
}

#ifdef SLUICE_EMU
// The emulation's own element reads and scratch arrays are not the kernel's accesses: they are
// not instrumented (the checker would otherwise check every operand element of every thread, and
// watch every scratch access while a wgmma is pending). The operands' bytes are checked once per
// instruction instead (bounds, races, proxies), by operand_reads below.
#define SLUICE_EMU_UNCHECKED __attribute__((no_sanitize("thread")))
namespace emu_hopper {
// Byte offset (from smem_base) of element (row, k), k < 16, of the operand `desc` describes;
// `row` is the M (or N) index. `mn_major` selects the MN-major layouts.
inline uint32_t operand_offset(uint64_t desc, int row, int k, bool mn_major = false) {
    const uint32_t start = static_cast<uint32_t>(desc & 0x3fffu) << 4;
    const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3fffu) << 4;
    const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3fffu) << 4;
    const uint32_t mode = static_cast<uint32_t>(desc >> 62);
    if (mode == kWgmmaInterleave) {
        if (mn_major) {
            return start + (row / 8) * sbo + (row % 8) * 2 + (k / 8) * lbo + (k % 8) * 16;
        }
        return start + (row / 8) * sbo + (row % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    }
    const uint32_t width = mode == kWgmmaSwizzle128B ? 128 : mode == kWgmmaSwizzle64B ? 64 : 32;
    const uint32_t canon =
        mn_major ? start + (row / (width / 2)) * lbo + (row % (width / 2)) * 2 + (k / 8) * sbo +
                       (k % 8) * width
                 : start + (row / 8) * sbo + (row % 8) * width + k * 2;
    return canon ^ (((canon >> 7) & (width / 16 - 1)) << 4);
}
// The descriptor's swizzle in the emulator's numbering (0 none, 1 32B, 2 64B, 3 128B).
inline unsigned swizzle_of(uint64_t desc) {
    const unsigned mode = static_cast<unsigned>(desc >> 62);
    return mode == 0 ? 0 : 4 - mode;
}
SLUICE_EMU_UNCHECKED inline float smem_bf16(const void* smem_base, uint64_t desc, int row, int k,
                                            bool mn_major) {
    uint16_t h;
    memcpy(&h, reinterpret_cast<const char*>(smem_base) + operand_offset(desc, row, k, mn_major),
           2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
// The async proxy's reads of one operand (rows x 16 of K) in 16-byte chunks: each row's two
// (K-major), or each K row's rows/8 (MN-major). The runtime checks each chunk's bounds and
// races as a read by the calling thread (one per warpgroup) and its proxy and swizzle tags.
inline void operand_reads(const void* smem_base, uint64_t desc, int rows, bool mn_major,
                          const std::source_location& loc) {
    const char* base = reinterpret_cast<const char*>(smem_base);
    if (mn_major) {
        for (int k = 0; k < 16; ++k) {
            for (int row = 0; row < rows; row += 8) {
                ::sluice_emu::async_proxy_read(base + operand_offset(desc, row, k, true), 16,
                                               swizzle_of(desc), loc);
            }
        }
        return;
    }
    for (int row = 0; row < rows; ++row) {
        for (int k = 0; k < 16; k += 8) {
            ::sluice_emu::async_proxy_read(base + operand_offset(desc, row, k), 16,
                                           swizzle_of(desc), loc);
        }
    }
}
// out[4j + 2r + c] = (scale_d ? in[..] : 0) + sum over k ascending of arow[r][k] * B[col][k]
// (one fmaf at a time), col = 8j + 2t + c: a thread's part of a wgmma m64nNk16 given its two
// rows of A (rows 16 warp + g and + 8) and B through `desc_b`.
// The bf16 at byte offset `off` from smem_base, widened exactly.
SLUICE_EMU_UNCHECKED inline float bf16_at(const void* smem_base, uint32_t off) {
    uint16_t h;
    memcpy(&h, reinterpret_cast<const char*>(smem_base) + off, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
// Columns col0 and col0 + 1 (col0 even) of B, k = 0..15: K-major, a row's 16 k are two
// contiguous 16-byte chunks; MN-major, the two columns are adjacent in one chunk per k. Element
// offsets come from operand_offset, so every layout and swizzle is read as the header says.
SLUICE_EMU_UNCHECKED inline void column_pair(float (&bcol)[2][16], const void* smem_base,
                                             uint64_t desc_b, int col0, bool mn_major) {
    if (mn_major) {
        for (int k = 0; k < 16; ++k) {
            const uint32_t off = operand_offset(desc_b, col0, k, true);
            bcol[0][k] = bf16_at(smem_base, off);
            bcol[1][k] = bf16_at(smem_base, off + 2);
        }
        return;
    }
    for (int c = 0; c < 2; ++c)
        for (int k0 = 0; k0 < 16; k0 += 8) {
            const uint32_t off = operand_offset(desc_b, col0 + c, k0, false);
            for (int k = 0; k < 8; ++k) bcol[c][k0 + k] = bf16_at(smem_base, off + 2 * k);
        }
}
// out[4j + 2r + c] = (scale_d ? in[..] : 0) + sum over k ascending of arow[r][k] * B[col][k]
// (one fused multiply-add at a time), col = 8j + 2t + c: a thread's part of a wgmma m64nNk16
// given its two rows of A (rows 16 warp + g and + 8) and B through `desc_b`.
template <int N, int MajorB>
__attribute__((always_inline)) inline void multiply_body(float (&out)[N / 2], const float (&in)[N / 2],
                                                         const float (&arow)[2][16], uint64_t desc_b,
                                                         int scale_d, const void* smem_base, int t) {
    for (int j = 0; j < N / 8; ++j) {
        float bcol[2][16];
        column_pair(bcol, smem_base, desc_b, 8 * j + 2 * t, MajorB == kWgmmaMNMajor);
        for (int c = 0; c < 2; ++c)
            for (int r = 0; r < 2; ++r) {
                float acc = scale_d ? in[4 * j + 2 * r + c] : 0.0f;
                for (int k = 0; k < 16; ++k) acc = __builtin_fmaf(arow[r][k], bcol[c][k], acc);
                out[4 * j + 2 * r + c] = acc;
            }
    }
}
// The same compiled for the host's FMA unit where it has one (a fused multiply-add rounds once
// either way: the same bits, without a library call per product).
template <int N, int MajorB>
SLUICE_EMU_UNCHECKED __attribute__((target("fma"))) void multiply_fma(
    float (&out)[N / 2], const float (&in)[N / 2], const float (&arow)[2][16], uint64_t desc_b,
    int scale_d, const void* smem_base, int t) {
    multiply_body<N, MajorB>(out, in, arow, desc_b, scale_d, smem_base, t);
}
template <int N, int MajorB>
SLUICE_EMU_UNCHECKED void multiply_portable(float (&out)[N / 2], const float (&in)[N / 2],
                                            const float (&arow)[2][16], uint64_t desc_b,
                                            int scale_d, const void* smem_base, int t) {
    multiply_body<N, MajorB>(out, in, arow, desc_b, scale_d, smem_base, t);
}
template <int N, int MajorB>
SLUICE_EMU_UNCHECKED inline void multiply(float (&out)[N / 2], const float (&in)[N / 2],
                                          const float (&arow)[2][16], uint64_t desc_b,
                                          int scale_d, const void* smem_base, int t) {
    // (No function-local static: its guard would be an atomic the emulator does not link.)
    if (__builtin_cpu_supports("fma")) {
        multiply_fma<N, MajorB>(out, in, arow, desc_b, scale_d, smem_base, t);
    } else {
        multiply_portable<N, MajorB>(out, in, arow, desc_b, scale_d, smem_base, t);
    }
}
// The low (h = 0) or high (h = 1) bf16 of a register pair, widened exactly.
SLUICE_EMU_UNCHECKED inline float bf16_of_pair(uint32_t pair, int h) {
    const uint32_t bits = (h == 0 ? (pair & 0xffffu) : (pair >> 16)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
// The thread's two rows of A (rows 16 warp + g and + 8) from shared memory through `desc_a`.
SLUICE_EMU_UNCHECKED inline void rows_from_smem(float (&arow)[2][16], const void* smem_base,
                                                uint64_t desc_a, bool mn_major, int warp, int g) {
    for (int r = 0; r < 2; ++r)
        for (int k = 0; k < 16; ++k)
            arow[r][k] = smem_bf16(smem_base, desc_a, 16 * warp + g + 8 * r, k, mn_major);
}
// The same rows from the registers of the quad 4g .. 4g + 3 of the warp (A's register fragment).
SLUICE_EMU_UNCHECKED inline void rows_from_quad(float (&arow)[2][16], const uint32_t (&quad)[32][4],
                                                int g) {
    for (int j = 0; j < 4; ++j) {
        const uint32_t* f = quad[4 * g + j];
        for (int h = 0; h < 2; ++h) {
            arow[0][2 * j + h] = bf16_of_pair(f[0], h);
            arow[1][2 * j + h] = bf16_of_pair(f[1], h);
            arow[0][2 * j + 8 + h] = bf16_of_pair(f[2], h);
            arow[1][2 * j + 8 + h] = bf16_of_pair(f[3], h);
        }
    }
}
}  // namespace emu_hopper
#endif

// D(64xN) = A(64x16) * B(Nx16)^T + (scale_d ? D : 0), bf16 from shared memory (any of the
// layouts above; MajorA / MajorB say which major-ness each descriptor describes, the
// instruction's transpose bits), f32 accumulators in registers; N = 64, 128 or 256. All 128
// threads of the warpgroup must call it. Fragment of D: warp w = (threadIdx.x % 128) / 32 holds rows
// 16w..16w+15; with g = lane/4, t = lane%4, d[4j + 0, 1] = D[16w + g][8j + 2t, +1],
// d[4j + 2, 3] = D[16w + g + 8][8j + 2t, +1], j < N/8.
#ifdef SLUICE_EMU
template <int N, int MajorA = kWgmmaKMajor, int MajorB = kWgmmaKMajor>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d, const void* smem_base, SLUICE_HOPPER_LOC) {
    static_assert(N == 32 || N == 64 || N == 128 || N == 256, "wgmma_bf16: N is 32, 64, 128 or 256");
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, t = lane % 4;
    // The accumulator this wgmma starts from: the newest pending result on d, else d (read by
    // the emulator, so that chaining wgmmas before their wait is not a premature read).
    float in[N / 2], out[N / 2];
    ::sluice_emu::wgmma_accumulator(d, in, sizeof in);
    // Profile: one instruction per warpgroup; its operands, A (64x16) and B (Nx16) bf16, read
    // from shared memory once (a model); the emulation's own reads are not counted. The same
    // thread reports the operands' async-proxy reads (a missing proxy fence, a layout mismatch).
    if (wt == 0) {
        ::sluice_emu::prof_tensor_op(N == 32    ? "wgmma.m64n32k16.bf16"
                                     : N == 64  ? "wgmma.m64n64k16.bf16"
                                     : N == 128 ? "wgmma.m64n128k16.bf16"
                                                : "wgmma.m64n256k16.bf16",
                                     2.0 * 64 * N * 16, loc);
        ::sluice_emu::prof_wgmma_operands((64 + N) * 16 * 2, loc);
        emu_hopper::operand_reads(smem_base, desc_a, 64, MajorA == kWgmmaMNMajor, loc);
        emu_hopper::operand_reads(smem_base, desc_b, N, MajorB == kWgmmaMNMajor, loc);
    }
    ::sluice_emu::prof_quiet(1);
    // The thread's two rows of A and, per column it owns, the column of B, read once each.
    float arow[2][16];
    emu_hopper::rows_from_smem(arow, smem_base, desc_a, MajorA == kWgmmaMNMajor, warp, g);
    emu_hopper::multiply<N, MajorB>(out, in, arow, desc_b, scale_d, smem_base, t);
    ::sluice_emu::prof_quiet(-1);
    ::sluice_emu::wgmma_issue(d, out, sizeof out, loc);
}
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d,
                                                      const void* smem_base, SLUICE_HOPPER_LOC) {
    wgmma_bf16<128>(d, desc_a, desc_b, scale_d, smem_base, loc);
}

// The register-source form: D(64xN) = A(64x16) * B(Nx16)^T + (scale_d ? D : 0) with A in the
// warpgroup's registers and B from shared memory (`MajorB` as above; A has no transpose in this
// form). The fragment of A (the PTX ISA, "Register Fragments", wgmma .m64nNk16 matrix A; the
// same map as a 64 x 16 slice of the f32 accumulator's): warp w holds rows 16w..16w+15, and with
// g = lane/4, t = lane%4 each register holds two bf16, the lower column in the low half:
//   a[0] = A[16w + g][2t, 2t+1]       a[1] = A[16w + g + 8][2t, 2t+1]
//   a[2] = A[16w + g][2t+8, 2t+9]     a[3] = A[16w + g + 8][2t+8, 2t+9]
// So accumulator registers d[8s .. 8s+7] of an m64nN result, packed in pairs, are the A fragment
// of its columns 16s .. 16s+15: what FlashAttention-style P V needs. The instruction reads the A
// registers asynchronously: the thread must not touch them until the wgmma_wait that covers it
// (the emulator reports an access as `async-operand-before-wait`).
template <int N, int MajorB = kWgmmaKMajor>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b, int scale_d,
                                              const void* smem_base, SLUICE_HOPPER_LOC) {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma_bf16_rs: N is 64, 128 or 256");
    const int wt = threadIdx.x & 127;
    const int lane = wt % 32, g = lane / 4, t = lane % 4;
    float in[N / 2], out[N / 2];
    ::sluice_emu::wgmma_accumulator(d, in, sizeof in);
    // Rows g and g + 8 of the warp's 16 come from the quad 4g .. 4g + 3 (one warp rendezvous;
    // the registers are read by the runtime, not as the kernel's own accesses).
    uint32_t quad[32][4];
    emu_warp_gather(a, quad);
    if (wt == 0) {
        ::sluice_emu::prof_tensor_op(N == 64    ? "wgmma.m64n64k16.bf16"
                                     : N == 128 ? "wgmma.m64n128k16.bf16"
                                                : "wgmma.m64n256k16.bf16",
                                     2.0 * 64 * N * 16, loc);
        // Only B comes from shared memory.
        ::sluice_emu::prof_wgmma_operands(N * 16 * 2, loc);
        emu_hopper::operand_reads(smem_base, desc_b, N, MajorB == kWgmmaMNMajor, loc);
    }
    ::sluice_emu::prof_quiet(1);
    float arow[2][16];
    emu_hopper::rows_from_quad(arow, quad, g);
    emu_hopper::multiply<N, MajorB>(out, in, arow, desc_b, scale_d, smem_base, t);
    ::sluice_emu::prof_quiet(-1);
    ::sluice_emu::wgmma_issue(d, out, sizeof out, loc, a, sizeof a);
}

// setmaxnreg: the register budget of a warpgroup (every warp of it must call it). Nothing to do
// under the emulator.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {}
#else
template <int N, int TA, int TB>
struct WgmmaBf16;
template <int TA, int TB>
struct WgmmaBf16<32, TA, TB> {
    static __device__ __forceinline__ void run(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                               int scale_d) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "%16, %17, p, 1, 1, %19, %20;\n"
            "}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));
    }
};
template <int TA, int TB>
struct WgmmaBf16<64, TA, TB> {
    static __device__ __forceinline__ void run(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                               int scale_d) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, %35, %36;\n"
            "}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));
    }
};
template <int TA, int TB>
struct WgmmaBf16<128, TA, TB> {
    static __device__ __forceinline__ void run(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                               int scale_d) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, %67, %68;\n"
            "}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));
    }
};
template <int TA, int TB>
struct WgmmaBf16<256, TA, TB> {
    static __device__ __forceinline__ void run(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                               int scale_d) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
            "%128, %129, p, 1, 1, %131, %132;\n"
            "}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));
    }
};

template <int N, int MajorA = kWgmmaKMajor, int MajorB = kWgmmaKMajor>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d, const void* smem_base) {
    (void)smem_base;
    WgmmaBf16<N, MajorA, MajorB>::run(d, desc_a, desc_b, scale_d);
}
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d,
                                                      const void* smem_base) {
    wgmma_bf16<128>(d, desc_a, desc_b, scale_d, smem_base);
}

// The register-source form (see the emulator's version above for the fragment of A).
template <int N, int TB>
struct WgmmaBf16Rs;
template <int TB>
struct WgmmaBf16Rs<64, TB> {
    static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4],
                                               uint64_t desc_b, int scale_d) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
            "}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TB));
    }
};
template <int TB>
struct WgmmaBf16Rs<128, TB> {
    static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4],
                                               uint64_t desc_b, int scale_d) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
            "}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TB));
    }
};

template <int N, int MajorB = kWgmmaKMajor>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b, int scale_d,
                                              const void* smem_base) {
    (void)smem_base;
    WgmmaBf16Rs<N, MajorB>::run(d, a, desc_b, scale_d);
}

// setmaxnreg: the register budget of the calling warpgroup (every warp of it must call it; the
// kernel's launch bounds fix the entry count: __launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif

// ---- tensor-map copies (TMA) -------------------------------------------------------------------
//
// `map` is a `const __grid_constant__ CUtensorMap` kernel parameter the host encoded
// (kernels/src/tensor_map.rs: cuTensorMapEncodeTiled on cuda, sluice's own layout on emu). One
// thread issues the copy of the box at (c0, c1[, c2]) (elements; parts outside the tensor read as
// zero) into `dst` (128-byte aligned; 8W-aligned for a swizzle of W bytes, so the wgmma layout
// above matches), completing complete_tx(box bytes) on `bar`: that thread must have raised the
// phase's transaction count by the box's bytes (mbarrier_expect_tx) first.
#ifdef SLUICE_EMU
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar, SLUICE_HOPPER_LOC) {
    const int coords[2] = {c0, c1};
    ::sluice_emu::tensor_copy_g2s(dst, map, coords, 2, bar, loc);
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint64_t* bar, SLUICE_HOPPER_LOC) {
    const int coords[3] = {c0, c1, c2};
    ::sluice_emu::tensor_copy_g2s(dst, map, coords, 3, bar, loc);
}
#else
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(d),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(b)
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint64_t* bar) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(d),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(b)
        : "memory");
}
#endif

}  // namespace sluice
#endif  // SLUICE_HOPPER_OK
