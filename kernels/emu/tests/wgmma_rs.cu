// Self-test and planted-bug kernels of the register-source wgmma (common/hopper.cuh,
// `wgmma_bf16_rs`). Compiled into the emu kernel table only (kernels/build_emu.rs), never into
// ptx/. Exercised by kernels/tests/emu_wgmma_rs.rs. Every name starts with `emutest_`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/hopper.cuh"

namespace emutest_rs {

// C (64 x N, f32) = A (64 x 16) B (N x 16)^T with A in registers and B in shared memory (no
// swizzle). `frag` holds every thread's four A registers as the host laid them out (frag[4 i +
// r] is register r of warpgroup thread i): the kernel only loads them, so the host's reading of
// the ISA's fragment table meets the emulator's. B [N][16] (row-major, bf16) is stored K-major
// (mn_major == 0: element (n, k) at (n / 8) 128 + (n % 8) 16 + (k / 8) N 16 + (k % 8) 2) or
// MN-major (element (n, k) at (n / 8) 128 + (n % 8) 2 + (k / 8) N 16 + (k % 8) 16), both the
// interleaved layouts of hopper.cuh's header. With `early` != 0 the thread overwrites one of its
// A registers between the wgmma and its wait (PLANTED BUG).
template <int N>
__device__ void wgmma_rs(const uint32_t* __restrict__ frag, const __nv_bfloat16* __restrict__ b,
                         float* __restrict__ out, int mn_major, int early) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  for (int e = tid; e < N * 16; e += 128) {
    const int n = e / 16, k = e % 16;
    const int off = mn_major ? (n / 8) * 128 + (n % 8) * 2 + (k / 8) * N * 16 + (k % 8) * 16
                             : (n / 8) * 128 + (n % 8) * 16 + (k / 8) * N * 16 + (k % 8) * 2;
    *reinterpret_cast<__nv_bfloat16*>(smem + off) = b[e];
  }
  sluice::fence_proxy_async_shared();
  __syncthreads();
  uint32_t a[4];
  for (int r = 0; r < 4; ++r) a[r] = frag[4 * tid + r];
  float acc[N / 2];
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  // K-major: LBO = the distance between the two k halves, SBO = the next 8 rows. MN-major: LBO =
  // the next 8 rows of K, SBO = the next 8 elements of N.
  const uint32_t base = sluice::smem_addr(smem, smem);
  const uint64_t db = mn_major ? sluice::wgmma_desc_mn(base, N * 16, 128, sluice::kWgmmaInterleave)
                               : sluice::wgmma_desc(base, N * 16, 128);
  sluice::wgmma_fence();
  if (mn_major) {
    sluice::wgmma_bf16_rs<N, sluice::kWgmmaMNMajor>(acc, a, db, 1, smem);
  } else {
    sluice::wgmma_bf16_rs<N, sluice::kWgmmaKMajor>(acc, a, db, 1, smem);
  }
  if (early) a[0] = 0u;  // PLANTED BUG: an A register overwritten before wgmma_wait
  sluice::wgmma_commit();
  sluice::wgmma_wait<0>();
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < N / 8; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
      out[row * N + col] = acc[4 * j + e];
    }
  }
  out[64 * N + tid] = static_cast<float>(a[0] & 1u);  // keeps the planted write observable
}

}  // namespace emutest_rs

extern "C" __global__ void __launch_bounds__(128) emutest_wgmma_rs(const uint32_t* __restrict__ frag,
                                                                  const __nv_bfloat16* __restrict__ b,
                                                                  float* __restrict__ out, int n, int mn_major,
                                                                  int early) {
  if (n == 64) emutest_rs::wgmma_rs<64>(frag, b, out, mn_major, early);
  else emutest_rs::wgmma_rs<128>(frag, b, out, mn_major, early);
}
