// mma.sync m16n8k16 (bf16 x bf16 -> f32) and ldmatrix, with portable versions for the emulator.
//
// On a GPU (compute_80 and compute_90a) these are single PTX instructions. Under the emulator
// (SLUICE_EMU defined, __CUDA_ARCH__ not) they are rebuilt from the fragment layouts the PTX ISA
// documents ("Matrix Fragments for mma.m16n8k16 with floating point type", "Warp-level matrix
// load instruction: ldmatrix"), so a kernel that
// gets a layout wrong fails under the emulator exactly as it would on the GPU. The lanes exchange
// their operands with the emulator's emu_warp_gather (one full-warp rendezvous per instruction).
//
// Layouts (lane = threadIdx.x % 32, g = lane / 4 "groupID", t = lane % 4 "threadID_in_group"):
//   A (16x16, row-major): 4 x .b32, each two bf16 (lower column in the low half):
//     a0 = A[g][2t..2t+1]   a1 = A[g+8][2t..2t+1]   a2 = A[g][2t+8..2t+9]   a3 = A[g+8][2t+8..2t+9]
//   B (16x8, "col": stored as B^T rows, n-major): 2 x .b32:
//     b0 = B[2t..2t+1][g]   b1 = B[2t+8..2t+9][g]
//   C/D (16x8, f32): d0 = D[g][2t]  d1 = D[g][2t+1]  d2 = D[g+8][2t]  d3 = D[g+8][2t+1]
//   ldmatrix .x4 (no .trans): lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16
//     bytes each); lane L receives r[i] = matrix i, row L/4, columns 2(L%4)..2(L%4)+1.
//
// Numerics of the emulation: bf16 x bf16 products are exact in f32, so the only freedom is the
// order of the 16 additions inside one mma. The emulation adds the products to the accumulator
// one at a time in ascending k (fmaf chain from c). Tensor cores add them in an internal order
// and alignment the ISA does not specify, so emulated and hardware results may differ in the
// last bits of each 16-term step; both are compared with the CPU reference by relative norm, and
// each is bit-deterministic on its own device.
//
// Both wrappers assume a 1-D block (the lane is threadIdx.x % 32), as every sluice GEMM uses.
#pragma once

#include <stdint.h>
#include <cuda_bf16.h>
#ifdef SLUICE_EMU
#include <string.h>
#include <source_location>
#endif

namespace sluice {

#ifdef SLUICE_EMU
namespace emu_mma {
// The low (i = 0) or high (i = 1) bf16 of a packed pair, widened to f32 exactly.
inline float bf16_half(uint32_t pair, int i) {
    uint32_t bits = (i == 0 ? (pair & 0xffffu) : (pair >> 16)) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
// One lane's mma operands, gathered across the warp in one rendezvous.
struct Fragments {
    uint32_t a[4];
    uint32_t b[2];
};
}  // namespace emu_mma
#endif

// r[0..3] = four 8x8 b16 matrices from shared memory; `row` is this lane's row address (see the
// layout above). Every lane of the warp must call it (.sync.aligned).
#ifdef SLUICE_EMU
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row,
                                            std::source_location loc = std::source_location::current()) {
    const int lane = static_cast<int>(emu_lane_id());
    const void* rows[32];
    emu_warp_gather(row, rows);  // every lane's row address
    // The profiler counts the instruction once per warp by its 8-row phases; the emulation's
    // own reads below are not the kernel's accesses.
    if (lane == 0) ::sluice_emu::prof_ldmatrix(rows, 4, loc);
    ::sluice_emu::prof_quiet(1);
    for (int i = 0; i < 4; ++i) {
        // Lane L reads row L/4 of matrix i, whose address lane 8i + L/4 gave.
        const unsigned char* p = static_cast<const unsigned char*>(rows[8 * i + lane / 4]);
        memcpy(&r[i], p + 4 * (lane % 4), 4);
    }
    ::sluice_emu::prof_quiet(-1);
#else
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// ldmatrix .x4 .trans: the same row addresses as ldmatrix_x4, but lane L receives, of matrix i,
// the two b16 at (row 2(L%4), column L/4) and (row 2(L%4)+1, column L/4), lower row in the low
// half: the B fragment of mma.m16n8k16 from a row-major [k][n] tile (e.g. V stored key-major).
#ifdef SLUICE_EMU
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row,
                                                  std::source_location loc = std::source_location::current()) {
    const int lane = static_cast<int>(emu_lane_id());
    const void* rows[32];
    emu_warp_gather(row, rows);
    // The transpose happens in the datapath: the shared-memory footprint is that of ldmatrix.
    if (lane == 0) ::sluice_emu::prof_ldmatrix(rows, 4, loc);
    ::sluice_emu::prof_quiet(1);
    for (int i = 0; i < 4; ++i) {
        const unsigned char* lo = static_cast<const unsigned char*>(rows[8 * i + 2 * (lane % 4)]);
        const unsigned char* hi = static_cast<const unsigned char*>(rows[8 * i + 2 * (lane % 4) + 1]);
        uint16_t a, b;
        memcpy(&a, lo + 2 * (lane / 4), 2);
        memcpy(&b, hi + 2 * (lane / 4), 2);
        r[i] = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
    }
    ::sluice_emu::prof_quiet(-1);
#else
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// d += A(16x16) * B(16x8), bf16 inputs, f32 accumulate. Fragments as in the layout above.
// Every lane of the warp must call it (.sync.aligned).
#ifdef SLUICE_EMU
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2],
                                                  std::source_location loc = std::source_location::current()) {
    const int lane = static_cast<int>(emu_lane_id());
    const int g = lane / 4, t = lane % 4;
    if (lane == 0) ::sluice_emu::prof_tensor_op("mma.m16n8k16.bf16", 2.0 * 16 * 8 * 16, loc);
    emu_mma::Fragments mine, all[32];
    for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
    mine.b[0] = b[0];
    mine.b[1] = b[1];
    emu_warp_gather(mine, all);
    // Rows g and g+8 of A: lane 4g + j holds columns 2j, 2j+1 (a0/a1) and 2j+8, 2j+9 (a2/a3).
    // Columns 2t and 2t+1 of B: lane 4n + j holds rows 2j, 2j+1 (b0) and 2j+8, 2j+9 (b1) of
    // column n.
    float arow[2][16], bcol[2][16];
    for (int j = 0; j < 4; ++j) {
        const emu_mma::Fragments& fa = all[4 * g + j];
        for (int h = 0; h < 2; ++h) {
            arow[0][2 * j + h] = emu_mma::bf16_half(fa.a[0], h);
            arow[1][2 * j + h] = emu_mma::bf16_half(fa.a[1], h);
            arow[0][2 * j + 8 + h] = emu_mma::bf16_half(fa.a[2], h);
            arow[1][2 * j + 8 + h] = emu_mma::bf16_half(fa.a[3], h);
        }
        for (int c = 0; c < 2; ++c) {
            const emu_mma::Fragments& fb = all[4 * (2 * t + c) + j];
            for (int h = 0; h < 2; ++h) {
                bcol[c][2 * j + h] = emu_mma::bf16_half(fb.b[0], h);
                bcol[c][2 * j + 8 + h] = emu_mma::bf16_half(fb.b[1], h);
            }
        }
    }
    for (int r = 0; r < 2; ++r) {
        for (int c = 0; c < 2; ++c) {
            float acc = d[2 * r + c];
            for (int k = 0; k < 16; ++k) acc = fmaf(arow[r][k], bcol[c][k], acc);
            d[2 * r + c] = acc;
        }
    }
#else
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

}  // namespace sluice
