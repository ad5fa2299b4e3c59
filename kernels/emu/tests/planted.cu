// Planted-bug and self-test kernels of the emulator. Compiled into the emu kernel table only (by
// kernels/build_emu.rs), never into ptx/. Exercised by kernels/tests/emu_planted.rs.
// Every name starts with `emutest_`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/cp_async.cuh"
#include "common/hopper.cuh"
#include "common/named_barrier.cuh"

namespace emutest {

// Block sum of a grid-stride slice; `racy` leaves out the barrier between the tree levels' reads
// and writes (the classic missing __syncthreads), which the emulator exposes as seed dependence.
template <bool racy>
__device__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  __shared__ float partial[256];
  float acc = 0.0f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) acc += x[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    if (!racy) __syncthreads();
  }
  if (racy) __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

}  // namespace emutest

extern "C" __global__ void __launch_bounds__(256) emutest_block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  emutest::block_sum<false>(x, out, n);
}

// PLANTED BUG: missing __syncthreads inside the reduction tree.
extern "C" __global__ void __launch_bounds__(256) emutest_block_sum_racy(const float* __restrict__ x, float* __restrict__ out, int n) {
  emutest::block_sum<true>(x, out, n);
}

// Warp-shuffle sum per warp, then one value per block through dynamic shared memory.
extern "C" __global__ void emutest_warp_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  extern __shared__ float warp_totals[];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.0f;
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) t += warp_totals[w];
    out[blockIdx.x] = t;
  }
}

// Every warp primitive once; out has 16 ints per thread.
extern "C" __global__ void emutest_warp_ops(int* __restrict__ out) {
  int lane = threadIdx.x & 31;
  int* o = out + (blockIdx.x * blockDim.x + threadIdx.x) * 16;
  o[0] = __shfl_sync(0xffffffffu, lane * 10, 3);
  o[1] = __shfl_sync(0xffffffffu, lane * 10, lane + 1, 8);
  o[2] = __shfl_up_sync(0xffffffffu, lane * 10, 2);
  o[3] = __shfl_up_sync(0xffffffffu, lane * 10, 3, 16);
  o[4] = __shfl_down_sync(0xffffffffu, lane * 10, 5);
  o[5] = __shfl_down_sync(0xffffffffu, lane * 10, 1, 4);
  o[6] = __shfl_xor_sync(0xffffffffu, lane * 10, 9);
  o[7] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  o[8] = __any_sync(0xffffffffu, lane == 31);
  o[9] = __all_sync(0xffffffffu, lane < 31);
  unsigned half_mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  o[10] = __shfl_sync(half_mask, lane * 10, 0, 16);  // two independent halves
  __syncwarp();
  int all[32];
  emu_warp_gather(lane * lane, all);
  int s = 0;
  for (int k = 0; k < 32; ++k) s += all[k] * (k + 1);
  o[11] = s;
  o[12] = (int)__activemask();
  o[13] = __popc(0xf0f0u) * 100 + __clz(1) + __ffs(8) * 1000;
  o[14] = __reduce_add_sync(0xffffffffu, lane);
  o[15] = (int)__match_any_sync(0xffffffffu, lane / 4);
}

// bf16 and half conversions: out_bf16[i] = bits of __float2bfloat16(x[i]); out_f[i] = round trip.
extern "C" __global__ void emutest_bf16(const float* __restrict__ x, unsigned short* __restrict__ bits,
                                        float* __restrict__ back, unsigned short* __restrict__ half_bits, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  __nv_bfloat16 b = __float2bfloat16(x[i]);
  bits[i] = __bfloat16_as_ushort(b);
  back[i] = __bfloat162float(b);
  half_bits[i] = __half_as_ushort(__float2half(x[i]));
}

// 128-thread warpgroup gather: out[t] = sum over the warpgroup of (value * index).
extern "C" __global__ void emutest_warpgroup_gather(int* __restrict__ out) {
  int t = threadIdx.x;
  int all[128];
  emu_warpgroup_gather(t * 3 + 1, all);
  long long s = 0;
  for (int k = 0; k < 128; ++k) s += (long long)all[k] * (k % 7);
  out[blockIdx.x * blockDim.x + t] = (int)s;
}

// Dynamic shared memory is poisoned with 0xFF bytes (NaN) at every block start.
extern "C" __global__ void emutest_dyn_shared_poison(float* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char raw[];
  float* f = reinterpret_cast<float*>(raw);
  if (threadIdx.x == 0) f[1] = 2.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    out[blockIdx.x * 2 + 0] = f[0];  // never written: NaN
    out[blockIdx.x * 2 + 1] = f[1];
  }
}

// PLANTED BUG: writes one element past the end of out (n elements).
extern "C" __global__ void emutest_oob_write(float* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = 1.0f;
}

// PLANTED BUG: reads 4096 elements past the end of x (far past: the redzone faults too).
extern "C" __global__ void emutest_oob_read(const float* __restrict__ x, float* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i + 4096];
}

// PLANTED BUG: only half of the block reaches the barrier.
extern "C" __global__ void emutest_divergent_barrier(float* __restrict__ out) {
  if (threadIdx.x < 16) {
    __syncthreads();  // PLANTED BUG: half the block waits here
  }
  out[threadIdx.x] = 1.0f;
}

// PLANTED BUG: one thread returns early while the others wait at a barrier.
extern "C" __global__ void emutest_early_exit_barrier(float* __restrict__ out) {
  if (threadIdx.x == 3) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// PLANTED BUG: full-warp mask but only lanes 0..15 execute the shuffle.
extern "C" __global__ void emutest_bad_shuffle_mask(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x % 32 < 16) v = __shfl_down_sync(0xffffffffu, v, 1);  // PLANTED BUG: full mask, half the lanes
  out[threadIdx.x] = v;
}

// PLANTED BUG: a mask that leaves out the calling lane.
extern "C" __global__ void emutest_mask_without_self(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  v = __shfl_xor_sync(0x0000fffeu, v, 1);
  out[threadIdx.x] = v;
}

// assert() and __trap() are reported as launch errors.
extern "C" __global__ void emutest_assert(const int* __restrict__ x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) assert(x[i] >= 0);
}
extern "C" __global__ void emutest_trap(int flag) {
  if (flag != 0 && threadIdx.x == 5) __trap();
}

// Speed probe: a 1-D block reduction over 1M floats.
extern "C" __global__ void __launch_bounds__(256) emutest_reduce_speed(const float* __restrict__ x, float* __restrict__ out, int n) {
  __shared__ float s[256];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  s[threadIdx.x] = i < n ? x[i] : 0.0f;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

// Static __shared__ memory is poisoned with 0xFF bytes (NaN) when a block first reaches it.
extern "C" __global__ void emutest_static_shared_poison(float* __restrict__ out) {
  __shared__ float s[4];
  if (threadIdx.x == 0) s[1] = 3.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    out[blockIdx.x * 2 + 0] = s[0];  // never written by this block: NaN
    out[blockIdx.x * 2 + 1] = s[1];
    s[0] = 7.0f;  // must not leak into the next block run by this host thread
  }
}

// Spin-wait on a flag in shared memory set by another thread: emu_yield/__nanosleep let it run.
// The flag is accessed with atomics (plain or volatile accesses would be a race).
extern "C" __global__ void emutest_spin_wait(int* __restrict__ out, int never) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 0;
  __syncthreads();
  if (threadIdx.x == 37) {
    atomicExch(&flag, never ? 0 : 42);
  } else {
    while (atomicAdd(&flag, 0) == 0) __nanosleep(100);
  }
  __syncthreads();
  out[threadIdx.x] = flag;
}

// ---------------------------------------------------------------------------------------------
// The sanitizer's planted bugs (kernels/tests/emu_planted.rs and tests/emu_check_cmd.rs, which
// has its own copy in a file outside the project). Each PLANTED BUG line is the one the finding
// must name.
// ---------------------------------------------------------------------------------------------

// PLANTED BUG: thread n-1 reads x[n], one element past the end of x (n floats).
extern "C" __global__ void emutest_tail_read(const float* __restrict__ x, float* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + x[i + 1];  // PLANTED BUG: tail read
}

// PLANTED BUG: thread 0 writes s[32] of a 32-float static shared array.
extern "C" __global__ void emutest_static_shared_overflow(float* __restrict__ out) {
  __shared__ float s[32];
  __shared__ float after[32];
  s[threadIdx.x] = (float)threadIdx.x;
  after[threadIdx.x] = 0.0f;
  if (threadIdx.x == 0) s[32] = -1.0f;  // PLANTED BUG: one past the array
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x] + after[threadIdx.x];
}

// PLANTED BUG (when sync == 0): each thread reads its neighbour's shared slot without the
// __syncthreads between the writes and the reads.
extern "C" __global__ void emutest_missing_barrier(const float* __restrict__ x, float* __restrict__ out, int sync) {
  __shared__ float s[64];
  s[threadIdx.x] = x[threadIdx.x];
  if (sync) __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];  // PLANTED BUG: read of a neighbour's write
}

// PLANTED BUG (when atomic == 0): every block adds its value to total[0] with a plain
// read-modify-write: updates of other blocks are lost.
extern "C" __global__ void emutest_lost_update(const int* __restrict__ x, int* __restrict__ total, int atomic) {
  if (threadIdx.x != 0) return;
  if (atomic) {
    atomicAdd(total, x[blockIdx.x]);
  } else {
    total[0] += x[blockIdx.x];  // PLANTED BUG: non-atomic update shared by all blocks
  }
}

// Lanes exchange values through shared memory: with __syncwarp between the write and the read
// (sync != 0) this is correct; without it, a race inside the warp.
extern "C" __global__ void emutest_warp_exchange(float* __restrict__ out, int sync) {
  __shared__ float s[32];
  const int lane = threadIdx.x;
  s[lane] = (float)(lane * 3);
  if (sync) __syncwarp();
  out[lane] = s[31 - lane];
}

// Dynamic shared memory is bounded by the bytes requested at launch, to the byte: thread 0 reads
// the float just past them.
extern "C" __global__ void emutest_dyn_shared_overflow(float* __restrict__ out, int n) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = dyn[n];  // PLANTED BUG: n floats were requested
}

// Records the order in which blocks run (an atomic ticket): the seed shuffles it.
extern "C" __global__ void emutest_block_order(int* __restrict__ order, int* __restrict__ ticket) {
  if (threadIdx.x == 0) order[atomicAdd(ticket, 1)] = (int)blockIdx.x;
}

// wgmma m64n128k16 on A = 1 (64x16) and B (128x16) with B[n][k] = n: D[m][n] = 16 n. With
// early != 0 the accumulator is read before wgmma_wait (PLANTED BUG). One warpgroup.
extern "C" __global__ void emutest_wgmma(float* __restrict__ out, int early) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  // K-major, no swizzle: element (row, k) at (row/8)*128 + (row%8)*16 + (k/8)*LBO + (k%8)*2,
  // LBO = rows*16 (A: 64 rows, B: 128 rows).
  unsigned char* a = smem;
  unsigned char* b = smem + 64 * 16 * 2;
  for (int e = tid; e < 64 * 16; e += 128) {
    const int row = e / 16, k = e % 16;
    const __nv_bfloat16 v = __float2bfloat16(1.0f);
    *reinterpret_cast<__nv_bfloat16*>(a + (row / 8) * 128 + (row % 8) * 16 + (k / 8) * 1024 + (k % 8) * 2) = v;
  }
  for (int e = tid; e < 128 * 16; e += 128) {
    const int row = e / 16, k = e % 16;
    const __nv_bfloat16 v = __float2bfloat16((float)row);
    *reinterpret_cast<__nv_bfloat16*>(b + (row / 8) * 128 + (row % 8) * 16 + (k / 8) * 2048 + (k % 8) * 2) = v;
  }
  sluice::fence_proxy_async_shared();
  __syncthreads();
  float acc[64];
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  const uint64_t da = sluice::wgmma_desc(sluice::smem_addr(smem, a), 1024, 128);
  const uint64_t db = sluice::wgmma_desc(sluice::smem_addr(smem, b), 2048, 128);
  sluice::wgmma_fence();
  sluice::wgmma_m64n128k16_bf16(acc, da, db, 1, smem);
  float first = 0.0f;
  if (early) first = acc[0];  // PLANTED BUG: accumulator read before wgmma_wait
  sluice::wgmma_commit();
  sluice::wgmma_wait<0>();
  if (!early) first = acc[0];
  out[tid] = first;
}

// A bulk copy of n floats (n * 4 a multiple of 16) into shared memory, completing on an
// mbarrier. With early != 0 thread 0 reads the destination before the barrier's phase completes
// (PLANTED BUG).
extern "C" __global__ void emutest_bulk_copy(const float* __restrict__ src, float* __restrict__ out, int n, int early) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  float* dst = reinterpret_cast<float*>(smem + 128);
  if (threadIdx.x == 0) {
    sluice::mbarrier_init(bar, blockDim.x);
    sluice::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sluice::mbarrier_expect_tx(bar, (uint32_t)n * 4);
    sluice::bulk_copy_g2s(dst, src, (uint32_t)n * 4, bar);
    if (early) out[n] = dst[0];  // PLANTED BUG: bulk-copy destination read before its barrier
  }
  sluice::mbarrier_arrive(bar);
  sluice::mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dst[i] * 2.0f;
}

// cp.async of 16 bytes per thread into shared memory; with early != 0 the thread reads its
// destination before cp_async_wait (PLANTED BUG). Then a barrier and a neighbour's read.
extern "C" __global__ void emutest_cp_async(const float4* __restrict__ src, float* __restrict__ out, int early) {
  __shared__ __align__(16) float4 tile[64];
  sluice::cp_async_16(&tile[threadIdx.x], &src[threadIdx.x]);
  sluice::cp_async_commit();
  float first = 0.0f;
  if (early) first = tile[threadIdx.x].x;  // PLANTED BUG: cp.async destination read before its wait
  sluice::cp_async_wait<0>();
  __syncthreads();
  const float4 v = tile[(threadIdx.x + 1) % blockDim.x];
  out[threadIdx.x] = v.x + v.y + v.z + v.w + first;
}

// ---- Hopper pipeline pieces: tensor copies, swizzled wgmma, mbarrier rings, proxy fences ----

// One tensor copy of the box at (c0, c1) into shared memory, then the raw bytes of the landed
// box copied out (`words` 16-bit words): the test reads where each element landed (the swizzle)
// and what the parts outside the tensor read as (zeros). One warp.
extern "C" __global__ void emutest_tma_box(const __grid_constant__ CUtensorMap map, uint16_t* __restrict__ out,
                                           int c0, int c1, int words) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  unsigned char* box = smem + 1024;
  if (threadIdx.x == 0) {
    sluice::mbarrier_init(bar, 1);
    sluice::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sluice::mbarrier_expect_tx(bar, (uint32_t)words * 2);
    sluice::tma_load_2d(box, &map, c0, c1, bar);
    sluice::mbarrier_arrive(bar);
  }
  sluice::mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < words; i += blockDim.x) out[i] = reinterpret_cast<const uint16_t*>(box)[i];
}

// C (64 x N, f32) = A (64 x K) B (N x K)^T with both operands brought in by tensor copies in the
// map's swizzle and read by wgmma m64nNk16 through descriptors of mode `desc_mode` (1 128B, 2 64B,
// 3 32B). K = span / 2 (one swizzle row). One warpgroup. With a desc_mode that differs from the
// maps' swizzle the product is wrong: PLANTED BUG (the test passes the wrong mode).
template <int N>
__device__ void wgmma_tma(const CUtensorMap& map_a, const CUtensorMap& map_b, float* out, int span, int desc_mode) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  unsigned char* a = smem + 1024;
  unsigned char* b = a + 64 * span;  // 64 rows of span bytes: a multiple of 8 * span, so aligned
  const int k = span / 2;
  if (threadIdx.x == 0) {
    sluice::mbarrier_init(bar, 1);
    sluice::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sluice::mbarrier_expect_tx(bar, (uint32_t)(64 + N) * span);
    sluice::tma_load_2d(a, &map_a, 0, 0, bar);
    sluice::tma_load_2d(b, &map_b, 0, 0, bar);
    sluice::mbarrier_arrive(bar);
  }
  sluice::mbarrier_wait(bar, 0);
  float acc[N / 2];
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  const sluice::WgmmaSwizzle mode = static_cast<sluice::WgmmaSwizzle>(desc_mode);
  sluice::wgmma_fence();
  for (int kk = 0; kk < k; kk += 16) {
    const uint64_t da = sluice::wgmma_desc_swizzled(sluice::smem_addr(smem, a) + 2 * kk, 8 * span, mode);
    const uint64_t db = sluice::wgmma_desc_swizzled(sluice::smem_addr(smem, b) + 2 * kk, 8 * span, mode);
    sluice::wgmma_bf16<N>(acc, da, db, 1, smem);  // PLANTED BUG site when desc_mode mismatches
  }
  sluice::wgmma_commit();
  sluice::wgmma_wait<0>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < N / 8; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
      out[row * N + col] = acc[4 * j + e];
    }
  }
}

extern "C" __global__ void __launch_bounds__(128) emutest_wgmma_tma(const __grid_constant__ CUtensorMap map_a,
                                                                    const __grid_constant__ CUtensorMap map_b,
                                                                    float* __restrict__ out, int n, int span,
                                                                    int desc_mode) {
  if (n == 64) wgmma_tma<64>(map_a, map_b, out, span, desc_mode);
  else if (n == 128) wgmma_tma<128>(map_a, map_b, out, span, desc_mode);
  else wgmma_tma<256>(map_a, map_b, out, span, desc_mode);
}

// C (64 x N, f32) = A (64 x K) B (N x K)^T with both operands MN-major: A stored [K, 64] and B
// [K, N] (M and N contiguous), K = 32 (two k16 steps). Tensor copies bring boxes of K rows x
// `row_bytes` (16 without swizzle, else the swizzle span) side by side along M/N, each K x
// row_bytes bytes; wgmma reads them through MN-major descriptors of mode `desc_mode` (0 none,
// 3 32B, 2 64B, 1 128B): swizzled LBO = one box (the next atom along MN), SBO = 8 rows;
// interleaved LBO = 8 rows (the next core matrix along K), SBO = one box. One warpgroup.
template <int N>
__device__ void wgmma_mn_tma(const CUtensorMap& map_a, const CUtensorMap& map_b, float* out, int row_bytes,
                             int desc_mode) {
  constexpr int K = 32;
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  unsigned char* a = smem + 1024;
  unsigned char* b = a + 64 * K * 2;  // 4 KiB: aligned for every swizzle atom
  const int per_box = row_bytes / 2;  // M/N elements per box row
  const uint32_t box_bytes = static_cast<uint32_t>(K * row_bytes);
  if (threadIdx.x == 0) {
    sluice::mbarrier_init(bar, 1);
    sluice::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sluice::mbarrier_expect_tx(bar, (uint32_t)(64 + N) * K * 2);
    for (int i = 0; i < 64 / per_box; ++i) sluice::tma_load_2d(a + i * box_bytes, &map_a, i * per_box, 0, bar);
    for (int i = 0; i < N / per_box; ++i) sluice::tma_load_2d(b + i * box_bytes, &map_b, i * per_box, 0, bar);
    sluice::mbarrier_arrive(bar);
  }
  sluice::mbarrier_wait(bar, 0);
  float acc[N / 2];
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  const sluice::WgmmaSwizzle mode = static_cast<sluice::WgmmaSwizzle>(desc_mode);
  const uint32_t eight_rows = 8u * static_cast<uint32_t>(row_bytes);
  const uint32_t lbo = mode == sluice::kWgmmaInterleave ? eight_rows : box_bytes;
  const uint32_t sbo = mode == sluice::kWgmmaInterleave ? box_bytes : eight_rows;
  sluice::wgmma_fence();
  for (int j = 0; j < K / 16; ++j) {
    const uint32_t step = static_cast<uint32_t>(16 * row_bytes * j);
    const uint64_t da = sluice::wgmma_desc_mn(sluice::smem_addr(smem, a) + step, lbo, sbo, mode);
    const uint64_t db = sluice::wgmma_desc_mn(sluice::smem_addr(smem, b) + step, lbo, sbo, mode);
    sluice::wgmma_bf16<N, sluice::kWgmmaMNMajor, sluice::kWgmmaMNMajor>(acc, da, db, 1, smem);
  }
  sluice::wgmma_commit();
  sluice::wgmma_wait<0>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < N / 8; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
      out[row * N + col] = acc[4 * j + e];
    }
  }
}

extern "C" __global__ void __launch_bounds__(128) emutest_wgmma_mn_tma(const __grid_constant__ CUtensorMap map_a,
                                                                       const __grid_constant__ CUtensorMap map_b,
                                                                       float* __restrict__ out, int n, int row_bytes,
                                                                       int desc_mode) {
  if (n == 64) wgmma_mn_tma<64>(map_a, map_b, out, row_bytes, desc_mode);
  else if (n == 128) wgmma_mn_tma<128>(map_a, map_b, out, row_bytes, desc_mode);
  else wgmma_mn_tma<256>(map_a, map_b, out, row_bytes, desc_mode);
}

// The byte offset the emulated wgmma reads element (row, k) of an operand from, for descriptor
// `desc`: out[row * 16 + k], rows x 16 (the test checks it against the PTX ISA's layouts).
extern "C" __global__ void emutest_wgmma_offsets(unsigned long long desc, int mn_major, int rows,
                                                 unsigned* __restrict__ out) {
  if (threadIdx.x != 0) return;
  for (int r = 0; r < rows; ++r) {
    for (int k = 0; k < 16; ++k) out[r * 16 + k] = sluice::emu_hopper::operand_offset(desc, r, k, mn_major != 0);
  }
}

// A ring of STAGES stage buffers between one producer thread (warp 4, lane 0) and a consumer
// warpgroup (warps 0-3), ordered by mbarriers alone (no block-wide barrier after the set-up): per
// step i a `full[i]` barrier, per stage an `empty[s]` barrier reused with its phase parity. The
// producer waits until stage s is empty, writes the step number with a plain store, issues a bulk
// copy of the step's 128 floats into the stage and arrives on full[i]; the consumers wait on
// full[i], read the stage (plain loads) and arrive on empty[s]. out[i * 128 + t] = 2 x[i][t] + i.
// With skip_empty != 0 the producer never waits on `empty` (PLANTED BUG): it overwrites stages
// the consumers may not have read yet. steps <= 8.
extern "C" __global__ void __launch_bounds__(160) emutest_mbarrier_ring(const float* __restrict__ x,
                                                                        float* __restrict__ out, int steps,
                                                                        int skip_empty) {
  constexpr int STAGES = 2, W = 128;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // 8
  uint64_t* empty = full + 8;                          // STAGES
  int* step_of = reinterpret_cast<int*>(smem + 96);
  float* stage = reinterpret_cast<float*>(smem + 128);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < steps; ++i) sluice::mbarrier_init(&full[i], 1);
    for (int s = 0; s < STAGES; ++s) sluice::mbarrier_init(&empty[s], 128);
    sluice::fence_mbarrier_init();
  }
  __syncthreads();
  if (warp == 4) {
    if (threadIdx.x % 32 == 0) {
      for (int i = 0; i < steps; ++i) {
        const int s = i % STAGES;
        if (i >= STAGES && !skip_empty) sluice::mbarrier_wait(&empty[s], ((i / STAGES) - 1) & 1);
        step_of[s] = i;  // PLANTED BUG site: without the empty wait, this write races the consumers' reads
        sluice::mbarrier_expect_tx(&full[i], W * 4);
        sluice::bulk_copy_g2s(stage + s * W, x + (size_t)i * W, W * 4, &full[i]);
        sluice::mbarrier_arrive(&full[i]);
      }
    }
    return;
  }
  for (int i = 0; i < steps; ++i) {
    const int s = i % STAGES;
    sluice::mbarrier_wait(&full[i], 0);
    out[(size_t)i * W + threadIdx.x] = 2.0f * stage[s * W + threadIdx.x] + (float)step_of[s];
    sluice::mbarrier_arrive(&empty[s]);
  }
}

// Threads write wgmma operands with ordinary stores, then a block barrier, then wgmma (the async
// proxy reads them). With fence != 0 each thread runs fence.proxy.async after its stores;
// without (PLANTED BUG) the emulator reports the missing fence. A = 1, B[n][k] = n: D = 16 n.
extern "C" __global__ void __launch_bounds__(128) emutest_proxy_fence(float* __restrict__ out, int fence) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  unsigned char* a = smem;
  unsigned char* b = smem + 64 * 16 * 2;
  for (int e = tid; e < 64 * 16; e += 128) {
    const int row = e / 16, k = e % 16;
    *reinterpret_cast<__nv_bfloat16*>(a + (row / 8) * 128 + (row % 8) * 16 + (k / 8) * 1024 + (k % 8) * 2) =
        __float2bfloat16(1.0f);
  }
  for (int e = tid; e < 64 * 16; e += 128) {
    const int row = e / 16, k = e % 16;
    *reinterpret_cast<__nv_bfloat16*>(b + (row / 8) * 128 + (row % 8) * 16 + (k / 8) * 1024 + (k % 8) * 2) =
        __float2bfloat16((float)row);
  }
  if (fence) sluice::fence_proxy_async_shared();
  __syncthreads();  // PLANTED BUG site: without the fence, the wgmma below reads unfenced bytes
  float acc[32];
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
  const uint64_t da = sluice::wgmma_desc(sluice::smem_addr(smem, a), 1024, 128);
  const uint64_t db = sluice::wgmma_desc(sluice::smem_addr(smem, b), 1024, 128);
  sluice::wgmma_fence();
  sluice::wgmma_bf16<64>(acc, da, db, 1, smem);
  sluice::wgmma_commit();
  sluice::wgmma_wait<0>();
  out[tid] = acc[0];
}

// Two pairs of warps exchange through shared memory, each pair meeting at its own named barrier
// (ids 1 and 2, 64 threads each): warp 2p writes, the pair syncs, warp 2p + 1 reads. With
// sync == 0 the pair does not meet (PLANTED BUG).
extern "C" __global__ void __launch_bounds__(128) emutest_named_barrier(float* __restrict__ out, int sync) {
  __shared__ float s[64];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, pair = warp / 2;
  if (warp % 2 == 0) s[pair * 32 + lane] = (float)(threadIdx.x + 1);
  if (sync) sluice::named_barrier_sync(1 + pair, 64);
  if (warp % 2 == 1) out[pair * 32 + lane] = s[pair * 32 + (lane + 1) % 32];  // PLANTED BUG site: read without the pair's barrier
}

// Order through a chain of __syncwarp with different masks: lane 0 writes, syncs with lane 1,
// lane 1 syncs with lane 2, lane 2 reads (ordered transitively: clean).
extern "C" __global__ void emutest_syncwarp_chain(float* __restrict__ out) {
  __shared__ float s[1];
  const int lane = threadIdx.x % 32;
  if (lane == 0) s[0] = 7.0f;
  if (lane < 2) __syncwarp(0x3u);
  if (lane == 1 || lane == 2) __syncwarp(0x6u);
  if (lane == 2) out[0] = s[0];
}
