// gemm_bf16_wgmma: C = A . B^T (A [M,K], B [N,K], bf16, f32 accumulate) on Hopper (sm_90a), in
// the batched and grouped forms of kernels/cuda/gemm.cu. The Rust side is
// kernels/src/ops/gemm_hopper.rs; the design and its predicted H200 figures are in
// docs/perf/gemm.md ("The Hopper path").
//
// Block: three warpgroups (384 threads), warp-specialised.
//   - producer (warpgroup 0): one elected thread (thread 0) issues, per K step of 64, two tensor
//     copies (TMA, 128-byte swizzle) into a ring stage: the A box (128 rows x 64 k) and the B box
//     (256 rows x 64 k), completing on the stage's `full` mbarrier; before reusing a stage it
//     waits on the stage's `empty` mbarrier. The other 127 threads of the warpgroup exit at once.
//   - consumers (warpgroups 1 and 2): each owns 64 rows of the 128 x 256 output tile; per K step
//     it waits on `full`, issues four wgmma m64n256k16 (k16 steps) reading A and B from the stage
//     through 128B-swizzle descriptors, commits them, waits until only this step's group is in
//     flight (so the previous step's stage has been read) and releases that stage on `empty`
//     (every consumer thread arrives: 256 arrivals complete the phase).
//   - no block-wide barrier after the set-up: the ring of STAGES stages is ordered by its full
//     and empty mbarriers alone (the emulator's race checker follows that order).
//   - persistent grid: block b takes tiles b, b + gridDim.x, ... of a fixed order (batch entry
//     or row-segment tile major, then 256-column tiles); the host launches at most one block per
//     SM. The ring and its phases carry on from one tile to the next.
//   - epilogue: each consumer thread writes its accumulator fragment straight to global memory,
//     f32 or bf16 (round to nearest even) as `out_bf16` says, pairs of columns per store.
//
// Forms (the same tile walk for producer and consumers, so they agree on every skip):
//   batched (offsets == nullptr): tile t -> batch entry z, row tile, column tile. The A map is 3D
//     [batch, M, K]; the B map [batchB, N, K] with batchB = 1 when `b_shared` (one B for all).
//   grouped (offsets != nullptr): rows offsets[g]..offsets[g+1] of A (a [1, T, K] map) use B
//     matrix g (the B map is [G, N, K]); row tiles enumerate the segments in order, ceil(T/BM) + G
//     of them as an upper bound (the surplus is skipped). A tile's box may run into the next
//     segment's rows: those rows are loaded and computed but never written.
//
// Numerics and determinism (DESIGN.md section 2): no split-K, no atomics. Every output element is
// one accumulator chain over K in k16 steps, ascending, in the same instruction shape for every
// M and every position of the row; K past the tensor and rows past M are zero-filled by the
// tensor copies. A row's bits never depend on M, on the grid size or on which block computed it.
// The host uses this kernel whenever the path is chosen and K % 8 == 0 (the tensor map's row
// stride must be a multiple of 16 bytes); other K take gemm_bf16_mma. The choice depends on the
// device and on K, never on M.

#include <stdint.h>
#include <cuda_bf16.h>

#include "common/hopper.cuh"

namespace gemm_hopper {

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
constexpr int CONSUMERS = 2;                          // warpgroups, 64 rows each
constexpr int THREADS = 128 * (1 + CONSUMERS);        // 384
constexpr int A_BYTES = BM * BK * 2;                  // 16 KiB
constexpr int B_BYTES = BN * BK * 2;                  // 32 KiB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;        // 48 KiB, a multiple of 1024
constexpr int BARRIER_OFFSET = STAGES * STAGE_BYTES;  // 192 KiB
// + full and empty mbarriers, + 1024 bytes to align the stages to the 128B swizzle's atom.
constexpr int SHARED_BYTES = BARRIER_OFFSET + 2 * STAGES * 8 + 1024;
constexpr uint32_t ATOM_BYTES = 8 * 128;  // 8 rows of 128 bytes: SBO of both operands

// The tile a block works on; identical for producer and consumers.
struct Tile {
    int z;          // A map's batch coordinate (0 in grouped mode)
    int zb;         // B map's batch/group coordinate
    int row_begin;  // first row (of the batch entry's M, or of A's T in grouped mode)
    int row_end;    // one past the last row this tile may write
    int col0;
    long long c_offset;  // elements from C's start to the batch entry
    bool valid;
};

__device__ __forceinline__ Tile find_tile(int t, const int* offsets, int rows, int n, int groups,
                                          int b_shared, long long stride_c) {
    Tile tile;
    tile.valid = false;
    const int n_tiles = (n + BN - 1) / BN;
    const int rt = t / n_tiles;
    tile.col0 = (t % n_tiles) * BN;
    if (offsets == nullptr) {
        const int m_tiles = (rows + BM - 1) / BM;
        tile.z = rt / m_tiles;
        tile.zb = b_shared ? 0 : tile.z;
        tile.row_begin = (rt % m_tiles) * BM;
        tile.row_end = rows;
        tile.c_offset = static_cast<long long>(tile.z) * stride_c;
        tile.valid = true;
        return tile;
    }
    // Grouped: the host validated the offsets where it built them; clamped here as well, so no
    // value can send a copy or a store outside the tensors.
    int left = rt, lo = 0;
    for (int g = 0; g < groups; ++g) {
        int hi = offsets[g + 1];
        hi = hi < lo ? lo : (hi > rows ? rows : hi);
        const int tiles = (hi - lo + BM - 1) / BM;
        if (left < tiles) {
            tile.z = 0;
            tile.zb = g;
            tile.row_begin = lo + left * BM;
            tile.row_end = hi;
            tile.c_offset = 0;
            tile.valid = true;
            return tile;
        }
        left -= tiles;
        lo = hi;
    }
    return tile;
}

}  // namespace gemm_hopper

extern "C" __global__ void __launch_bounds__(384, 1) gemm_bf16_wgmma(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    void* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    int tiles, int b_shared, int out_bf16, long long stride_c) {
#if SLUICE_HOPPER_OK
    using namespace gemm_hopper;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The stages start at a 1024-byte aligned shared address (the 128B swizzle's atom).
#ifdef SLUICE_EMU
    const uint32_t raw_addr = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(smem_raw));
#else
    const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
#endif
    unsigned char* smem = smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + BARRIER_OFFSET);
    uint64_t* empty = full + STAGES;
    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            sluice::mbarrier_init(&full[s], 1);
            sluice::mbarrier_init(&empty[s], 128 * CONSUMERS);
        }
        sluice::fence_mbarrier_init();
    }
    __syncthreads();
    const int ktiles = (k + BK - 1) / BK;

    if (warpgroup == 0) {
        // Producer: one thread issues every copy.
        if (threadIdx.x != 0) return;
        int it = 0;  // K steps issued by this block, over all its tiles
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            const Tile tile = find_tile(t, offsets, rows, n, groups, b_shared, stride_c);
            if (!tile.valid) continue;
            for (int kt = 0; kt < ktiles; ++kt, ++it) {
                const int s = it % STAGES, use = it / STAGES;
                // Stage s is free once the consumers released its previous use.
                if (use > 0) sluice::mbarrier_wait(&empty[s], static_cast<uint32_t>((use - 1) & 1));
                unsigned char* stage = smem + s * STAGE_BYTES;
                sluice::mbarrier_expect_tx(&full[s], STAGE_BYTES);
                sluice::tma_load_3d(stage, &map_a, kt * BK, tile.row_begin, tile.z, &full[s]);
                sluice::tma_load_3d(stage + A_BYTES, &map_b, kt * BK, tile.col0, tile.zb, &full[s]);
                sluice::mbarrier_arrive(&full[s]);
            }
        }
        return;
    }

    // Consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127.
    const int cw = warpgroup - 1;
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, q = lane % 4;
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const Tile tile = find_tile(t, offsets, rows, n, groups, b_shared, stride_c);
        if (!tile.valid) continue;
        float acc[BN / 2];
        #pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[e] = 0.0f;
        int held = -1;  // the stage whose wgmmas may still be reading it
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int s = it % STAGES;
            sluice::mbarrier_wait(&full[s], static_cast<uint32_t>((it / STAGES) & 1));
            const unsigned char* stage = smem + s * STAGE_BYTES;
            const uint32_t a_addr = sluice::smem_addr(smem_raw, stage) + cw * 64 * 128;
            const uint32_t b_addr = sluice::smem_addr(smem_raw, stage + A_BYTES);
            sluice::wgmma_fence();
            #pragma unroll
            for (int j = 0; j < BK / 16; ++j) {
                // k16 step j: 32 bytes further along the 128-byte swizzled rows.
                const uint64_t da = sluice::wgmma_desc_swizzled(a_addr + 32 * j, ATOM_BYTES,
                                                                sluice::kWgmmaSwizzle128B);
                const uint64_t db = sluice::wgmma_desc_swizzled(b_addr + 32 * j, ATOM_BYTES,
                                                                sluice::kWgmmaSwizzle128B);
                sluice::wgmma_bf16<BN>(acc, da, db, 1, smem_raw);
            }
            sluice::wgmma_commit();
            // At most this step's group in flight: the previous step's stage has been read.
            sluice::wgmma_wait<1>();
            if (held >= 0) sluice::mbarrier_arrive(&empty[held]);
            held = s;
        }
        sluice::wgmma_wait<0>();
        if (held >= 0) sluice::mbarrier_arrive(&empty[held]);

        // Epilogue: d[4j + e] is row 16 warp + g (+8 for e >= 2), column 8j + 2q (+1 for odd e).
        #pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = tile.row_begin + 64 * cw + 16 * warp + g + 8 * hr;
            if (r >= tile.row_end) continue;
            const long long row_off = tile.c_offset + static_cast<long long>(r) * n;
            #pragma unroll  // fully: acc must stay in registers (constant indices)
            for (int j = 0; j < BN / 8; ++j) {
                const int col = tile.col0 + 8 * j + 2 * q;
                const float v0 = acc[4 * j + 2 * hr], v1 = acc[4 * j + 2 * hr + 1];
                const long long at = row_off + col;
                if (out_bf16) {
                    __nv_bfloat16* o = static_cast<__nv_bfloat16*>(c);
                    if (col + 1 < n && (at & 1) == 0) {
                        *reinterpret_cast<__nv_bfloat162*>(o + at) = __floats2bfloat162_rn(v0, v1);
                    } else {
                        if (col < n) o[at] = __float2bfloat16_rn(v0);
                        if (col + 1 < n) o[at + 1] = __float2bfloat16_rn(v1);
                    }
                } else {
                    float* o = static_cast<float*>(c);
                    if (col + 1 < n && (at & 1) == 0) {
                        *reinterpret_cast<float2*>(o + at) = make_float2(v0, v1);
                    } else {
                        if (col < n) o[at] = v0;
                        if (col + 1 < n) o[at + 1] = v1;
                    }
                }
            }
        }
    }
#else
    // compute_80 PTX: tensor copies, wgmma and mbarrier transactions need sm_90a. The host never
    // launches this kernel on such a GPU (ops/gemm/ refuses first); trap if it ever happens.
    (void)map_a; (void)map_b; (void)c; (void)offsets; (void)rows; (void)n; (void)k; (void)groups;
    (void)tiles; (void)b_shared; (void)out_bf16; (void)stride_c;
    __trap();
#endif
}
