// Planted-bug and self-test kernels of the emulator. Compiled into the emu kernel table only (by
// kernels/build_emu.rs), never into ptx/. Exercised by kernels/tests/emu_planted.rs.
// Every name starts with `emutest_`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

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
  out[blockIdx.x * 2 + 0] = f[0];  // never written: NaN
  out[blockIdx.x * 2 + 1] = f[1];
}

// PLANTED BUG: writes one element past the end of out (n elements).
extern "C" __global__ void emutest_oob_write(float* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = 1.0f;
}

// PLANTED BUG: reads 4096 elements past the end of x.
extern "C" __global__ void emutest_oob_read(const float* __restrict__ x, float* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i + 4096];
}

// PLANTED BUG: only half of the block reaches the barrier.
extern "C" __global__ void emutest_divergent_barrier(float* __restrict__ out) {
  if (threadIdx.x < 16) {
    __syncthreads();
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
  if (threadIdx.x % 32 < 16) v = __shfl_down_sync(0xffffffffu, v, 1);
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
extern "C" __global__ void emutest_spin_wait(int* __restrict__ out, int never) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 0;
  __syncthreads();
  if (threadIdx.x == 37) {
    volatile int* f = &flag;
    *f = never ? 0 : 42;
  } else {
    volatile int* f = &flag;
    while (*f == 0) __nanosleep(100);
  }
  out[threadIdx.x] = flag;
}
