// The Hopper (sm_90a) GEMM pipeline: bf16 operands through tensor copies, f32 accumulate on
// wgmma, in four forms (kernels/src/ops/gemm_hopper.rs launches them; the design and its
// predicted H200 figures are in docs/perf/gemm.md, "The Hopper path"):
//   gemm_bf16_wgmma            C = A . B^T, A [M,K] and B [N,K] (both K-major), batched or
//                              grouped over row segments of A;
//   gemm_bf16_wgmma_nn         C = A . B, B stored [K,N] (MN-major: read in place, no transposed
//                              copy of the weights), batched or grouped;
//   gemm_bf16_wgmma_segment_tn out[g] = P_g^T . Q_g over the row segments g of P [T,M] and Q [T,N]
//                              (both MN-major), K = the segment's rows (ragged);
//   gemm_bf16_wgmma_swiglu     the grouped C = A . B^T with the SwiGLU epilogue of
//                              gemm_bf16_mma_swiglu (kernels/cuda/gemm.cu).
//
// Block: three warpgroups (384 threads), warp-specialised.
//   - producer (warpgroup 0): one elected thread (thread 0) issues, per K step of 64, the tensor
//     copies (TMA, 128-byte swizzle) of a ring stage: A (128 rows x 64 k) and B (256 x 64), as one
//     box per operand when K-major, as boxes of 64 M/N x 64 K rows side by side when MN-major;
//     they complete on the stage's `full` mbarrier. Before reusing a stage it waits on the
//     stage's `empty` mbarrier. The other 127 threads of the warpgroup exit at once.
//   - consumers (warpgroups 1 and 2): each owns 64 rows of the 128 x 256 output tile; per K step
//     it waits on `full`, issues four wgmma m64n256k16 (k16 steps) reading A and B from the stage
//     through 128B-swizzle descriptors (K-major or MN-major, hopper.cuh), commits them, waits
//     until only this step's group is in flight (so the previous step's stage has been read) and
//     releases that stage on `empty` (every consumer thread arrives: 256 arrivals).
//   - segment form, ragged K: a segment's last K step may read rows past its end (the next
//     segment's, or the copy's zero fill past T). Its consumers zero those rows of both operands
//     in the stage (each K row of an MN-major atom is one 128-byte line, whatever the swizzle),
//     fence them to the async proxy and meet at a named barrier before the wgmmas: products past
//     the segment are exact zeros, as in gemm_bf16_mma_segment_tn's zero-filled tails.
//   - no block-wide barrier after the set-up: the ring of STAGES stages is ordered by its full
//     and empty mbarriers alone (the emulator's race checker follows that order).
//   - persistent grid: block b takes tiles b, b + gridDim.x, ... of a fixed order; the host
//     launches at most one block per SM. The ring and its phases carry on from tile to tile.
//   - epilogue: each consumer thread writes its accumulator fragment straight to global memory,
//     f32 or bf16 (round to nearest even) as `out_bf16` says, pairs of columns per store; the
//     SwiGLU form stages each warp's 16 x 64 pieces through a shared slab of its own (after the
//     ring; 231424 bytes of shared memory in all) and computes h = silu(a) * b per element as
//     swiglu.cu does, reading a and writing its three bf16 outputs along rows.
//
// Tile walks (the same for producer and consumers, so they agree on every skip):
//   batched (offsets == nullptr): tile t -> batch entry z, row tile, column tile.
//   grouped (offsets != nullptr): rows offsets[g]..offsets[g+1] of A use B matrix g; row tiles
//     enumerate the segments in order, ceil(T/BM) + G of them as an upper bound (the surplus is
//     skipped). A tile's box may run into the next segment's rows: those rows are loaded and
//     computed but never written.
//   segment: tile t -> group g, row tile of M, column tile of N; K rows offsets[g]..offsets[g+1].
//
// Numerics and determinism (DESIGN.md section 2): no split-K, no atomics. Every output element is
// one accumulator chain over K in k16 steps, ascending, in the same instruction shape for every
// M and every position of the row; K past the tensor and rows past M are zero-filled by the
// tensor copies. A row's bits never depend on M, on the grid size or on which block computed it.
// The host takes these kernels when the Hopper path is chosen and every tensor map's row stride
// is a multiple of 16 bytes (K % 8 for K-major operands, N % 8 or M % 8 for MN-major ones:
// weight dimensions, never the row count); other shapes take the mma.sync kernels.

#include <stdint.h>
#include <cuda_bf16.h>

#include "common/hopper.cuh"
#include "common/named_barrier.cuh"

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
// The SwiGLU form's epilogue slabs, after the barriers: per consumer warp 16 rows x 64 columns
// of f32 (4 KiB), 8 warps; 231424 bytes in all, under sm_90's 227 KiB.
constexpr int SLAB_OFFSET = BARRIER_OFFSET + 1024;
constexpr int SLAB_FLOATS = 16 * 64;
constexpr int SWIGLU_SHARED_BYTES = SLAB_OFFSET + 4 * CONSUMERS * SLAB_FLOATS * 4 + 1024;
constexpr uint32_t ATOM_BYTES = 8 * 128;  // 8 rows of 128 bytes: SBO of every operand
// An MN-major box: 64 M/N elements (one 128-byte swizzled row) x BK rows of K; boxes side by
// side along M/N are this far apart (the MN-major descriptors' LBO).
constexpr uint32_t MN_BOX_BYTES = BK * 128;  // 8 KiB
constexpr int MN_BOX = 64;                   // M/N elements per MN-major box

enum Form : int { kNT = 0, kNN = 1, kSegmentTN = 2 };

// The tile a block works on; identical for producer and consumers.
struct Tile {
    int z;          // A map's batch coordinate (0 in grouped mode)
    int zb;         // B map's batch/group coordinate
    int row_begin;  // first row (of the batch entry's M, or of A's T in grouped mode)
    int row_end;    // one past the last row this tile may write
    int col0;
    long long c_offset;  // elements from C's start to the batch entry
    int k_begin;         // K rows of this tile: [k_begin, k_end) (segment form), else [0, K)
    int k_end;
    bool valid;
};

// The segment form's tile t: group g, row tile of M (`rows` = M), column tile; K = the group's
// rows of P and Q (offsets clamped into [0, T] as the other forms clamp them).
__device__ __forceinline__ Tile find_segment_tile(int t, const int* offsets, int m, int n,
                                                  int t_rows) {
    Tile tile;
    const int n_tiles = (n + BN - 1) / BN, m_tiles = (m + BM - 1) / BM;
    const int g = t / (m_tiles * n_tiles), rem = t % (m_tiles * n_tiles);
    tile.z = 0;
    tile.zb = 0;
    tile.row_begin = (rem / n_tiles) * BM;
    tile.row_end = m;
    tile.col0 = (rem % n_tiles) * BN;
    tile.c_offset = static_cast<long long>(g) * m * n;
    int lo = offsets[g], hi = offsets[g + 1];
    lo = lo < 0 ? 0 : (lo > t_rows ? t_rows : lo);
    hi = hi < lo ? lo : (hi > t_rows ? t_rows : hi);
    tile.k_begin = lo;
    tile.k_end = hi;
    tile.valid = true;
    return tile;
}

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
        tile.k_begin = 0;
        tile.k_end = -1;  // the whole K (the caller's k)
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
            tile.k_begin = 0;
            tile.k_end = -1;
            tile.valid = true;
            return tile;
        }
        left -= tiles;
        lo = hi;
    }
    return tile;
}

// What one launch multiplies: the maps, the output and the shape of its form.
struct Args {
    void* c;              // C (f32 or bf16); out [G, M, N] f32 in the segment form
    const int* offsets;   // row segments (grouped, segment) or null (batched)
    int rows;             // M (batched), T (grouped); M in the segment form
    int n;
    int k;                // K (batched, grouped); T in the segment form (P's and Q's rows)
    int groups;
    int tiles;
    int b_shared;
    int out_bf16;
    long long stride_c;
    // The SwiGLU epilogue (gemm_bf16_wgmma_swiglu): null elsewhere.
    const float* swiglu_a;
    __nv_bfloat16* b_b;
    __nv_bfloat16* h_b;
    __nv_bfloat16* a_b;
};

template <int F>
__device__ __forceinline__ Tile tile_of(int t, const Args& p) {
    if (F == kSegmentTN) return find_segment_tile(t, p.offsets, p.rows, p.n, p.k);
    Tile tile = find_tile(t, p.offsets, p.rows, p.n, p.groups, p.b_shared, p.stride_c);
    tile.k_end = p.k;
    return tile;
}

// Writes one pair of adjacent columns (col, col + 1) of row `at`'s element: f32 or bf16, as a
// pair when both are inside and aligned.
__device__ __forceinline__ void store_pair(void* c, bool bf16_out, long long at, int col, int n,
                                           float v0, float v1) {
    if (bf16_out) {
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

// The SwiGLU epilogue of one element (gemm.cu's Epilogue with swiglu_a: b = the product),
// h = a * s * b with s = 1 / (1 + e^-a) as swiglu.cu computes it.
__device__ __forceinline__ float swiglu_h(float av, float b) {
    const float s = 1.0f / (1.0f + expf(-av));
    return av * s * b;
}
__device__ __forceinline__ void swiglu_store(const Args& p, long long idx, float b) {
    if (p.c != nullptr) static_cast<float*>(p.c)[idx] = b;
    if (p.b_b != nullptr) p.b_b[idx] = __float2bfloat16_rn(b);
    const float av = p.swiglu_a[idx];
    p.h_b[idx] = __float2bfloat16_rn(swiglu_h(av, b));
    if (p.a_b != nullptr) p.a_b[idx] = __float2bfloat16_rn(av);
}
// Columns col and col + 1 of one row (idx = col's element): one 8-byte load of a and 4-byte
// stores of the bf16 pairs where both are inside and aligned, else element by element.
__device__ __forceinline__ void swiglu_pair(const Args& p, long long idx, int col, float b0,
                                            float b1) {
    if (col + 1 < p.n && (idx & 1) == 0) {
        const float2 av = *reinterpret_cast<const float2*>(p.swiglu_a + idx);
        if (p.c != nullptr) *reinterpret_cast<float2*>(static_cast<float*>(p.c) + idx) = make_float2(b0, b1);
        if (p.b_b != nullptr) {
            *reinterpret_cast<__nv_bfloat162*>(p.b_b + idx) = __floats2bfloat162_rn(b0, b1);
        }
        *reinterpret_cast<__nv_bfloat162*>(p.h_b + idx) =
            __floats2bfloat162_rn(swiglu_h(av.x, b0), swiglu_h(av.y, b1));
        if (p.a_b != nullptr) {
            *reinterpret_cast<__nv_bfloat162*>(p.a_b + idx) = __floats2bfloat162_rn(av.x, av.y);
        }
    } else {
        if (col < p.n) swiglu_store(p, idx, b0);
        if (col + 1 < p.n) swiglu_store(p, idx + 1, b1);
    }
}

// The slab position of (row, col) of a warp's 16 x 64 slab: the column's 8-float group XOR the
// row mod 8, so the fragment's 8-byte stores (lanes g on rows, q on column pairs) and the row
// reads (lanes on 32 consecutive pairs) both hit 32 distinct banks per half-warp phase.
__device__ __forceinline__ int slab_at(int row, int col) { return row * 64 + (col ^ (8 * (row & 7))); }

template <int F, bool SWIGLU>
__device__ __forceinline__ void wgmma_gemm(const CUtensorMap& map_a, const CUtensorMap& map_b,
                                           const Args& p) {
    constexpr int MAJOR_A = F == kSegmentTN ? sluice::kWgmmaMNMajor : sluice::kWgmmaKMajor;
    constexpr int MAJOR_B = F == kNT ? sluice::kWgmmaKMajor : sluice::kWgmmaMNMajor;
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

    if (warpgroup == 0) {
        // Producer: one thread issues every copy.
        if (threadIdx.x != 0) return;
        int it = 0;  // K steps issued by this block, over all its tiles
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
            const Tile tile = tile_of<F>(t, p);
            if (!tile.valid) continue;
            const int ktiles = (tile.k_end - tile.k_begin + BK - 1) / BK;
            for (int kt = 0; kt < ktiles; ++kt, ++it) {
                const int s = it % STAGES, use = it / STAGES;
                // Stage s is free once the consumers released its previous use.
                if (use > 0) sluice::mbarrier_wait(&empty[s], static_cast<uint32_t>((use - 1) & 1));
                unsigned char* stage = smem + s * STAGE_BYTES;
                const int k0 = tile.k_begin + kt * BK;
                sluice::mbarrier_expect_tx(&full[s], STAGE_BYTES);
                if (MAJOR_A == sluice::kWgmmaKMajor) {
                    sluice::tma_load_3d(stage, &map_a, k0, tile.row_begin, tile.z, &full[s]);
                } else {
                    for (int i = 0; i < BM / MN_BOX; ++i) {
                        sluice::tma_load_2d(stage + i * MN_BOX_BYTES, &map_a,
                                            tile.row_begin + i * MN_BOX, k0, &full[s]);
                    }
                }
                unsigned char* b_stage = stage + A_BYTES;
                if (MAJOR_B == sluice::kWgmmaKMajor) {
                    sluice::tma_load_3d(b_stage, &map_b, k0, tile.col0, tile.zb, &full[s]);
                } else {
                    for (int i = 0; i < BN / MN_BOX; ++i) {
                        sluice::tma_load_3d(b_stage + i * MN_BOX_BYTES, &map_b,
                                            tile.col0 + i * MN_BOX, k0, tile.zb, &full[s]);
                    }
                }
                sluice::mbarrier_arrive(&full[s]);
            }
        }
        return;
    }

    // Consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127.
    const int cw = warpgroup - 1;
    const int ct = threadIdx.x - 128;  // 0..255 over both consumer warpgroups
    const int wt = threadIdx.x & 127;
    const int warp = wt / 32, lane = wt % 32, g = lane / 4, q = lane % 4;
    int it = 0;
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        const Tile tile = tile_of<F>(t, p);
        if (!tile.valid) continue;
        const int ktiles = (tile.k_end - tile.k_begin + BK - 1) / BK;
        float acc[BN / 2];
        #pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[e] = 0.0f;
        int held = -1;  // the stage whose wgmmas may still be reading it
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int s = it % STAGES;
            sluice::mbarrier_wait(&full[s], static_cast<uint32_t>((it / STAGES) & 1));
            unsigned char* stage = smem + s * STAGE_BYTES;
            if (F == kSegmentTN) {
                // A ragged tail: K rows past the segment's end read as zero in both operands.
                const int valid = tile.k_end - (tile.k_begin + kt * BK);
                if (valid < BK) {
                    constexpr int BOXES = BM / MN_BOX + BN / MN_BOX;  // 6 boxes of BK rows
                    const int chunks = BOXES * (BK - valid) * 8;      // 16-byte chunks
                    for (int c = ct; c < chunks; c += 128 * CONSUMERS) {
                        const int box = c / ((BK - valid) * 8), rem = c % ((BK - valid) * 8);
                        const int row = valid + rem / 8;
                        *reinterpret_cast<uint4*>(stage + box * MN_BOX_BYTES + row * 128 +
                                                  (rem % 8) * 16) = make_uint4(0, 0, 0, 0);
                    }
                    sluice::fence_proxy_async_shared();
                    sluice::named_barrier_sync(1, 128 * CONSUMERS);
                }
            }
            const uint32_t a_base = sluice::smem_addr(smem_raw, stage);
            const uint32_t b_base = sluice::smem_addr(smem_raw, stage + A_BYTES);
            sluice::wgmma_fence();
            #pragma unroll
            for (int j = 0; j < BK / 16; ++j) {
                // k16 step j: 32 bytes along a K-major 128-byte row, or 16 rows of an MN-major box.
                const uint64_t da =
                    MAJOR_A == sluice::kWgmmaKMajor
                        ? sluice::wgmma_desc_swizzled(a_base + cw * 64 * 128 + 32 * j, ATOM_BYTES,
                                                      sluice::kWgmmaSwizzle128B)
                        : sluice::wgmma_desc_mn(a_base + cw * MN_BOX_BYTES + 16 * 128 * j,
                                                MN_BOX_BYTES, ATOM_BYTES,
                                                sluice::kWgmmaSwizzle128B);
                const uint64_t db =
                    MAJOR_B == sluice::kWgmmaKMajor
                        ? sluice::wgmma_desc_swizzled(b_base + 32 * j, ATOM_BYTES,
                                                      sluice::kWgmmaSwizzle128B)
                        : sluice::wgmma_desc_mn(b_base + 16 * 128 * j, MN_BOX_BYTES, ATOM_BYTES,
                                                sluice::kWgmmaSwizzle128B);
                sluice::wgmma_bf16<BN, MAJOR_A, MAJOR_B>(acc, da, db, 1, smem_raw);
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
        if (SWIGLU) {
            // Through the warp's slab, 64 columns at a time: the fragment's 8-byte stores, then
            // each row read back with lanes on consecutive column pairs, so the loads of a and
            // the three bf16 stores cover whole lines (the fragment layout puts one warp
            // instruction on 8 rows of 32 bytes).
            float* slab = reinterpret_cast<float*>(smem + SLAB_OFFSET) + (4 * cw + warp) * SLAB_FLOATS;
            #pragma unroll
            for (int c = 0; c < BN / 64; ++c) {
                #pragma unroll  // fully: acc must stay in registers (constant indices)
                for (int jj = 0; jj < 8; ++jj) {
                    const int j = 8 * c + jj;
                    #pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        *reinterpret_cast<float2*>(slab + slab_at(g + 8 * hr, 8 * jj + 2 * q)) =
                            make_float2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
                    }
                }
                __syncwarp();
                const int col = tile.col0 + 64 * c + 2 * lane;
                for (int row = 0; row < 16; ++row) {
                    const int r = tile.row_begin + 64 * cw + 16 * warp + row;
                    if (r >= tile.row_end || col >= p.n) continue;
                    const float2 b = *reinterpret_cast<const float2*>(slab + slab_at(row, 2 * lane));
                    swiglu_pair(p, tile.c_offset + static_cast<long long>(r) * p.n + col, col, b.x, b.y);
                }
                __syncwarp();  // the slab is rewritten by the next 64 columns
            }
        } else {
            #pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = tile.row_begin + 64 * cw + 16 * warp + g + 8 * hr;
                if (r >= tile.row_end) continue;
                const long long row_off = tile.c_offset + static_cast<long long>(r) * p.n;
                #pragma unroll  // fully: acc must stay in registers (constant indices)
                for (int j = 0; j < BN / 8; ++j) {
                    const int col = tile.col0 + 8 * j + 2 * q;
                    store_pair(p.c, p.out_bf16 != 0, row_off + col, col, p.n,
                               acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
                }
            }
        }
    }
}

}  // namespace gemm_hopper

// The batched and grouped C = A . B^T (A [M,K] or [T,K], B [N,K] or [G,N,K]; see the header).
extern "C" __global__ void __launch_bounds__(384, 1) gemm_bf16_wgmma(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    void* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    int tiles, int b_shared, int out_bf16, long long stride_c) {
#if SLUICE_HOPPER_OK
    using namespace gemm_hopper;
    wgmma_gemm<kNT, false>(map_a, map_b,
                    Args{c, offsets, rows, n, k, groups, tiles, b_shared, out_bf16, stride_c,
                         nullptr, nullptr, nullptr, nullptr});
#else
    // compute_80 PTX: tensor copies, wgmma and mbarrier transactions need sm_90a. The host never
    // launches these kernels on such a GPU (ops/gemm/ refuses first); trap if it ever happens.
    (void)map_a; (void)map_b; (void)c; (void)offsets; (void)rows; (void)n; (void)k; (void)groups;
    (void)tiles; (void)b_shared; (void)out_bf16; (void)stride_c;
    __trap();
#endif
}

// C = A . B with B stored [K,N] ([G,K,N] grouped, [batchB,K,N] batched): the signature of
// gemm_bf16_wgmma; the B map is over [batchB or G, K, N] with N innermost.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_bf16_wgmma_nn(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    void* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    int tiles, int b_shared, int out_bf16, long long stride_c) {
#if SLUICE_HOPPER_OK
    using namespace gemm_hopper;
    wgmma_gemm<kNN, false>(map_a, map_b,
                    Args{c, offsets, rows, n, k, groups, tiles, b_shared, out_bf16, stride_c,
                         nullptr, nullptr, nullptr, nullptr});
#else
    (void)map_a; (void)map_b; (void)c; (void)offsets; (void)rows; (void)n; (void)k; (void)groups;
    (void)tiles; (void)b_shared; (void)out_bf16; (void)stride_c;
    __trap();
#endif
}

// out[g] (f32 [G, M, N]) = P_g^T . Q_g over rows offsets[g]..offsets[g+1] of P [T,M] and Q [T,N]
// (maps over [T, M] and [T, N], M and N innermost); an empty segment gives zeros.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_bf16_wgmma_segment_tn(
    const __grid_constant__ CUtensorMap map_p, const __grid_constant__ CUtensorMap map_q,
    float* __restrict__ out, const int* __restrict__ offsets, int m, int n, int t_rows,
    int groups, int tiles) {
#if SLUICE_HOPPER_OK
    using namespace gemm_hopper;
    wgmma_gemm<kSegmentTN, false>(map_p, map_q,
                           Args{out, offsets, m, n, t_rows, groups, tiles, 0, 0, 0, nullptr,
                                nullptr, nullptr, nullptr});
#else
    (void)map_p; (void)map_q; (void)out; (void)offsets; (void)m; (void)n; (void)t_rows;
    (void)groups; (void)tiles;
    __trap();
#endif
}

// The grouped C = A . B^T with gemm_bf16_mma_swiglu's epilogue: b = the product (f32 into `c`
// when not null, bf16 into b_b when not null), h_b = bf16(silu(a) * b) and a_b = bf16(a) (when
// not null) for a = swiglu_a, every array [T, N]. Outputs must not overlap the inputs.
extern "C" __global__ void __launch_bounds__(384, 1) gemm_bf16_wgmma_swiglu(
    const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
    float* __restrict__ c, const int* __restrict__ offsets, int rows, int n, int k, int groups,
    int tiles, const float* __restrict__ swiglu_a, __nv_bfloat16* __restrict__ b_b,
    __nv_bfloat16* __restrict__ h_b, __nv_bfloat16* __restrict__ a_b) {
#if SLUICE_HOPPER_OK
    using namespace gemm_hopper;
    wgmma_gemm<kNT, true>(map_a, map_b,
                    Args{c, offsets, rows, n, k, groups, tiles, 0, 0, 0, swiglu_a, b_b, h_b,
                         a_b});
#else
    (void)map_a; (void)map_b; (void)c; (void)offsets; (void)rows; (void)n; (void)k; (void)groups;
    (void)tiles; (void)swiglu_a; (void)b_b; (void)h_b; (void)a_b;
    __trap();
#endif
}
