// Kernels with known memory-pipeline counts, for the tests of the emulator's profiler
// (kernels/tests/emu_profile.rs). Compiled into the emu kernel table only (kernels/build_emu.rs),
// never into ptx/. Each comment says what Nsight Compute would count per warp-level request.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/mma.cuh"

// y[i] = x[i * stride + offset]: stride 1 is coalesced (4 sectors, 1 line per full warp), stride 2
// touches 8 sectors in 2 lines, stride 32 touches 32 sectors in 32 lines; offset 1 is misaligned
// (5 sectors, 2 lines). The store is always coalesced.
extern "C" __global__ void emutest_prof_strided(const float* __restrict__ x, float* __restrict__ y, int stride,
                                                 int offset) {
  const int i = threadIdx.x;
  y[i] = x[i * stride + offset];
}

// Every lane reads x[0]: one sector, one line (a broadcast).
extern "C" __global__ void emutest_prof_broadcast(const float* __restrict__ x, float* __restrict__ y) {
  y[threadIdx.x] = x[0];
}

// One 16-byte load per lane: 512 bytes, 16 sectors, 4 lines per full warp.
extern "C" __global__ void emutest_prof_float4(const float4* __restrict__ x, float4* __restrict__ y) {
  y[threadIdx.x] = x[threadIdx.x];
}

// A 32x32 shared tile written by rows and read by columns. Without padding a column read puts
// all 32 lanes in one bank (32 wavefronts); with a row pitch of 33 words, 1 wavefront.
template <int pitch>
__device__ void transpose_tile(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float tile[32 * pitch];
  const int lane = threadIdx.x & 31, row = threadIdx.x >> 5;  // 32 x 32 threads
  tile[row * pitch + lane] = x[row * 32 + lane];                 // row write: 1 wavefront
  __syncthreads();
  y[row * 32 + lane] = tile[lane * pitch + row];                 // column read
}
extern "C" __global__ void __launch_bounds__(1024) emutest_prof_transpose(const float* __restrict__ x,
                                                                          float* __restrict__ y) {
  transpose_tile<32>(x, y);
}
extern "C" __global__ void __launch_bounds__(1024) emutest_prof_transpose_padded(const float* __restrict__ x,
                                                                                 float* __restrict__ y) {
  transpose_tile<33>(x, y);
}

// 8- and 16-byte shared accesses by 32 lanes: 256 bytes in two half-warp phases (2 wavefronts),
// 512 bytes in four quarter-warp phases (4 wavefronts), for the stores and the loads alike.
extern "C" __global__ void emutest_prof_wide_shared(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float2 s2[32];
  __shared__ float4 s4[32];
  const int i = threadIdx.x;
  s2[i] = make_float2(x[i], x[i] + 1.0f);
  s4[i] = make_float4(x[i], x[i] + 1.0f, x[i] + 2.0f, x[i] + 3.0f);
  __syncwarp();
  const float2 a = s2[31 - i];
  const float4 b = s4[31 - i];
  y[i] = a.x + a.y + b.x + b.y + b.z + b.w;
}

// ldmatrix.x4 from a 32-row tile of 64 bf16 (128-byte rows). Plain: the 8 rows of each matrix
// start 128 bytes apart, all in banks 0-3 (8 wavefronts per matrix, 32 per instruction).
// Swizzled (16-byte chunk c of row r stored at chunk c ^ (r % 8)): the 8 rows fall in 8 distinct
// bank groups (1 wavefront per matrix, 4 per instruction).
template <bool swizzle>
__device__ void ldmatrix_tile(const __nv_bfloat16* __restrict__ x, uint32_t* __restrict__ y) {
  __shared__ __align__(16) __nv_bfloat16 tile[32 * 64];
  for (int i = threadIdx.x; i < 32 * 64; i += 32) tile[i] = x[i];  // plain copy; layout only below
  __syncwarp();
  const int lane = threadIdx.x;
  const int row = lane;  // lanes 8m..8m+7 give the rows of matrix m: rows 0..31, column chunk 0
  const int chunk = swizzle ? (0 ^ (row % 8)) : 0;
  uint32_t r[4];
  sluice::ldmatrix_x4(r, &tile[row * 64 + chunk * 8]);
  for (int m = 0; m < 4; ++m) y[m * 32 + lane] = r[m];
}
extern "C" __global__ void emutest_prof_ldmatrix(const __nv_bfloat16* __restrict__ x, uint32_t* __restrict__ y) {
  ldmatrix_tile<false>(x, y);
}
extern "C" __global__ void emutest_prof_ldmatrix_swizzled(const __nv_bfloat16* __restrict__ x,
                                                           uint32_t* __restrict__ y) {
  ldmatrix_tile<true>(x, y);
}

// One warp multiplies n x n bf16 tiles (n a multiple of 16) by mma.sync m16n8k16 from registers
// only: (n/16) * (n/8) * (n/16) = n^3 / 2048 instructions. The fragments are read from global
// memory directly (the values do not matter to the counts).
extern "C" __global__ void emutest_prof_mma(const uint32_t* __restrict__ frag, float* __restrict__ out, int n) {
  const int lane = threadIdx.x;
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = frag[lane * 4 + i];
  for (int i = 0; i < 2; ++i) b[i] = frag[128 + lane * 2 + i];
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int mi = 0; mi < n / 16; ++mi) {
    for (int ni = 0; ni < n / 8; ++ni) {
      for (int ki = 0; ki < n / 16; ++ki) sluice::mma_m16n8k16_bf16(acc, a, b);
    }
  }
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = acc[i];
}

// A divergent branch and a divergent loop. Lanes 0-15 load x[lane], lanes 16-31 load
// x[64 + lane] at another line of code: two requests of 16 lanes (2 sectors each). Then lane L
// runs L % 4 + 1 iterations of a load: the k-th iterations of the lanes form one request each,
// of 32, 24, 16 and 8 lanes.
extern "C" __global__ void emutest_prof_divergent(const float* __restrict__ x, float* __restrict__ y) {
  const int lane = threadIdx.x;
  float v;
  if (lane < 16) {
    v = x[lane];
  } else {
    v = x[64 + lane];
  }
  for (int k = 0; k <= lane % 4; ++k) v += x[128 + k * 32 + lane];
  y[lane] = v;
}

// Special functions, barriers, shuffles and atomics: each lane calls expf and sqrtf once; one
// __syncthreads; a 5-step xor butterfly; one integer atomicAdd per lane.
extern "C" __global__ void emutest_prof_misc(const float* __restrict__ x, float* __restrict__ y, int* __restrict__ count) {
  const int i = threadIdx.x;
  const float xi = x[i];
  float v = expf(xi) + sqrtf(fabsf(xi));
  __syncthreads();
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  atomicAdd(count, 1);
  y[i] = v;
}

// A winner per round: in round r of a loop with a warp vote in it, only lane 8r loads and
// stores. The GPU issues one request per round (4 of 1 lane each), not one of 4 lanes: the
// lanes reach the site in different rounds, between different convergence points.
extern "C" __global__ void emutest_prof_round_winners(const float* __restrict__ x, float* __restrict__ y) {
  const int lane = threadIdx.x;
  for (int r = 0; r < 4; ++r) {
    const unsigned winners = __ballot_sync(0xffffffffu, lane == r * 8);
    if (lane == r * 8) y[r] = x[lane] + static_cast<float>(__popc(winners));
  }
}
