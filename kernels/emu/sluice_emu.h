// sluice_emu.h — CUDA built-ins for compiling kernels/cuda/*.cu as host C++ (the `emu` device).
//
// Force-included (`-include sluice_emu.h`) into every translation unit of the emulator build, before
// the .cu file's own includes. <cuda_runtime.h>, <cuda_bf16.h>, <cuda_fp16.h> and friends resolve to
// the stand-ins in kernels/emu/include/, which only include this file.
//
// Execution model (see docs/emulator.md and runtime.cpp):
//   * every CUDA thread of a block is a fiber on one host thread; fibers switch only inside
//     __syncthreads, the warp-synchronous intrinsics (__shfl*_sync, __ballot_sync, __syncwarp, ...) and
//     the collective helpers below; between those points a fiber runs alone, so plain shared-memory
//     code is "atomic" between barriers and the order in which fibers run is drawn from a generator
//     seeded by (seed, kernel name, block index);
//   * blocks run one at a time per host thread, several host threads in parallel.
//
// threadIdx/blockIdx/blockDim/gridDim are thread_local variables that the scheduler updates on every
// switch, so they can be printed in a debugger. Static block-scope `__shared__` variables are
// rewritten by the emulator's build (kernels/src/emu/rewrite.rs) into references to storage in the
// host thread's static shared window (static_shared below), with redzones between them for exact
// bounds checks. `extern __shared__` dynamic shared memory becomes a pointer to the host thread's
// dynamic shared window (NaN-poisoned, 0xFF bytes, at every block start).
//
// Memory checks: kernel code is compiled with GCC's ThreadSanitizer instrumentation (no sanitizer
// runtime), so every load and store of shared-able memory calls the emulator's checker (kernels/emu/check.cpp): bounds to the byte, races,
// reads of asynchronous results before their wait. The helpers below that touch memory on the
// kernel's behalf (atomics, the Hopper/cp.async entry points) report their accesses explicitly.
#ifndef SLUICE_EMU_H
#define SLUICE_EMU_H

#ifndef SLUICE_EMU
#define SLUICE_EMU 1
#endif

// Standard headers first: the macros below (__noinline__ in particular) must not leak into them.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>  // bits/shared_ptr_base.h spells __attribute__((__noinline__)): include before the macro
#include <math.h>
#include <new>
#include <source_location>
#include <stdint.h>
#include <stdio.h>
#include <type_traits>
#include <utility>
#include <assert.h>  // resolves to kernels/emu/include/assert.h (assert reports an emulator error)

// ---------------------------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
// The driver's opaque tensor map (128 bytes, 128-byte aligned as in CUDA 13). Under the emulator the host encodes
// it in sluice's own layout (kernels/src/tensor_map.rs; decoded in kernels/emu/async.cpp).
struct alignas(128) CUtensorMap_st {
  unsigned long long opaque[16];
};
typedef CUtensorMap_st CUtensorMap;
// Block-scope `__shared__ T x[N];` never reaches the compiler: the build rewrites it into a
// reference to the static shared window (see static_shared). What is left (namespace-scope
// `__shared__`) becomes a thread_local: one instance per host thread, not bounds-checked.
// `extern __shared__ T x[];` is rewritten too (a pointer to the dynamic shared window).
#define __shared__ thread_local
#ifndef __restrict__
#define __restrict__ __restrict
#endif
#define __CUDACC_EMU__ 1

// ---------------------------------------------------------------------------------------------
// Vector types (same layout and alignment as CUDA's vector_types.h)
// ---------------------------------------------------------------------------------------------
#define SLUICE_EMU_VEC(T, N, A)                                                                     \
  struct alignas(A) N##1 { T x; };                                                                  \
  struct alignas(A * 2) N##2 { T x, y; };                                                           \
  struct N##3 { T x, y, z; };                                                                       \
  struct alignas(A * 4 > 16 ? 16 : A * 4) N##4 { T x, y, z, w; };                                   \
  static inline N##1 make_##N##1(T x) { return N##1{x}; }                                          \
  static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }                                   \
  static inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }                           \
  static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
SLUICE_EMU_VEC(signed char, char, 1)
SLUICE_EMU_VEC(unsigned char, uchar, 1)
SLUICE_EMU_VEC(short, short, 2)
SLUICE_EMU_VEC(unsigned short, ushort, 2)
SLUICE_EMU_VEC(int, int, 4)
SLUICE_EMU_VEC(unsigned int, uint, 4)
SLUICE_EMU_VEC(float, float, 4)
SLUICE_EMU_VEC(long long, longlong, 8)
SLUICE_EMU_VEC(unsigned long long, ulonglong, 8)
SLUICE_EMU_VEC(double, double, 8)
#undef SLUICE_EMU_VEC

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---------------------------------------------------------------------------------------------
// Built-in variables (defined in runtime.cpp; updated by the scheduler)
// ---------------------------------------------------------------------------------------------
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Runtime entry points used by the intrinsics below (runtime.cpp)
// ---------------------------------------------------------------------------------------------
namespace sluice_emu {

enum class WarpOp : unsigned {
  Shfl, ShflUp, ShflDown, ShflXor,  // in: T, out: T, arg: lane/delta/mask, width
  Ballot, Any, All,                 // in: int predicate, out: unsigned / int
  SyncWarp,                         // no data
  Gather,                           // in: T, out: T[32]; full warp only
  ReduceAdd, ReduceMin, ReduceMax,  // in/out: unsigned or int (arg = 1 for signed)
  ReduceAnd, ReduceOr, ReduceXor,   // in/out: unsigned
  MatchAny, MatchAll,               // in: T, out: unsigned mask (MatchAll: arg points at int pred)
};

// One lane's arrival at a warp-synchronous operation. Blocks until every lane named in `mask` has
// arrived at the same operation, then writes this lane's result to `out`. A mask that does not
// include the caller, names a lane that does not exist or has exited, or that the named lanes
// never reach, is reported as an error of the launch (the block is abandoned, never a hang).
void warp_op(WarpOp op, unsigned mask, const void* in, void* out, unsigned size, int arg, int width,
             const std::source_location& loc);
// Every thread of the current 128-thread warpgroup (threads 128*g .. 128*g+127 of the block)
// contributes `size` bytes at `in`; every thread receives all 128 values in thread order at `out`.
void warpgroup_gather(const void* in, void* out, unsigned size, const std::source_location& loc);
// __syncthreads and friends. kind: 0 plain, 1 count, 2 and, 3 or. Returns the reduced predicate.
int barrier(int kind, int pred, const std::source_location& loc);
// Named barrier (bar.sync id, count): waits until `count` threads (a multiple of 32) arrived at
// barrier `id` (0..15). Id 0 with count == blockDim is the same as __syncthreads.
void named_barrier(unsigned id, unsigned count, const std::source_location& loc);
// Lets the other threads of the block run (the caller stays ready). For spin-waits, e.g. an
// emulated mbarrier wait: `while (!done) emu_yield();`. A block whose threads only yield (no
// barrier, warp operation or exit for 4 M yields) is reported as a hung spin-wait.
void yield_now(const std::source_location& loc);
// Reports an error for the running launch and abandons the block. Never returns.
[[noreturn]] void fail(const char* what, const char* file, unsigned line);
// Mask of the lanes of the caller's warp that exist and have not exited.
unsigned live_lanes();
// Base of the dynamic shared memory of the host thread (stable for the host thread's lifetime).
unsigned char* dynamic_shared_base();
// Storage of a block-scope static __shared__ variable (code that the build inserts): `key` is the
// address of a variable unique to the declaration (and template instantiation). Returns the
// variable's address in the host thread's static shared window; the first call of each block fills
// it with 0xFF bytes (NaN).
void* static_shared_slot(const void* key, std::size_t bytes, std::size_t align, const char* name, const char* file,
                         unsigned line);
// Reports an atomic access of `size` bytes at p by the running thread to the checker (bounds;
// atomics never race with atomics). `ra` is the return address of the atomic intrinsic.
void atomic_access(const volatile void* p, unsigned size, const void* ra);

// Asynchronous operations (kernels/emu/async.cpp), used by kernels/cuda/common/hopper.cuh and
// cp_async.cuh. Their destinations become visible only when they complete; see docs/emulator.md.
void mbarrier_init(void* bar, unsigned count, const std::source_location& loc);
void mbarrier_expect_tx(void* bar, unsigned bytes, const std::source_location& loc);
void mbarrier_arrive(void* bar, const std::source_location& loc);
// True once the phase with parity `parity` has completed.
bool mbarrier_test_wait(void* bar, unsigned parity, const std::source_location& loc);
// Global -> shared copy completing (complete_tx) on mbarrier `bar`; visible when its phase completes.
void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, void* bar, const std::source_location& loc);
// cp.async of 4, 8 or 16 bytes; visible to the issuing thread after the cp_async_wait that covers
// its commit group.
void cp_async(void* dst, const void* src, unsigned bytes, const std::source_location& loc);
void cp_async_commit(const std::source_location& loc);
void cp_async_wait(int pending_groups, const std::source_location& loc);
// wgmma: the accumulator value the next wgmma on `d` starts from (the newest pending result for d,
// else d itself); then the issue of a result, which d receives at the wgmma_wait that covers its
// commit group (d holds NaN until then).
void wgmma_accumulator(const float* d, float* out, unsigned bytes);
// `a`, `a_bytes`: the A fragment's registers of the register-source form (nullptr, 0 when A is in
// shared memory); the thread must not read or write them until the same wait
// (`async-operand-before-wait`).
void wgmma_issue(float* d, const float* value, unsigned bytes, const std::source_location& loc,
                 const void* a = nullptr, unsigned a_bytes = 0);
void wgmma_commit(const std::source_location& loc);
void wgmma_wait(int pending_groups, const std::source_location& loc);
// Tensor-map copy (cp.async.bulk.tensor, tile mode) of the box at `coords` (rank entries, in
// elements, may lie partly outside the tensor: those elements read as zero) into `dst` in the
// map's shared-memory layout (swizzled as the map says); completes (complete_tx of the whole
// box's bytes) on mbarrier `bar`. `map` is the 128-byte CUtensorMap the host encoded.
void tensor_copy_g2s(void* dst, const void* map, const int* coords, unsigned rank, void* bar,
                     const std::source_location& loc);
// fence.proxy.async.shared::cta by the running thread: its earlier generic-proxy writes to shared
// memory become visible to later async-proxy reads (wgmma operands, tensor stores).
void fence_proxy_async(const std::source_location& loc);
// An async-proxy read (a wgmma operand) of [p, p + bytes) of shared memory that the instruction
// reads with swizzle mode `swizzle` (0 none, 1 32B, 2 64B, 3 128B): checked as a read by the
// calling thread (bounds, copies in flight, races), and reported if a thread wrote the bytes
// without a fence.proxy.async after it, or a tensor copy landed them with another swizzle.
// Called by one thread per warpgroup.
void async_proxy_read(const void* p, unsigned bytes, unsigned swizzle, const std::source_location& loc);

// Profiler (kernels/emu/profile.cpp; docs/emulator.md, "Profiling"). Each is a no-op unless the
// running launch is profiled. The emulated instructions of kernels/cuda/common report their own
// footprint with these and hide their emulation's internal accesses inside prof_quiet(+1/-1).
void prof_quiet(int delta);
// A tensor-core instruction (`shape` a string literal), called by one thread per warp (mma.sync)
// or warpgroup (wgmma).
void prof_tensor_op(const char* shape, double flops, const std::source_location& loc);
// ldmatrix: `rows` holds the 32 lanes' row addresses; matrix i is rows[8i .. 8i+7], 16 bytes each.
// Called by one lane per warp.
void prof_ldmatrix(const void* const* rows, unsigned matrices, const std::source_location& loc);
// wgmma's shared-memory operands, `bytes` read per instruction (a model: the hardware's rule for
// wgmma operand reads is not documented); called by one thread per warpgroup.
void prof_wgmma_operands(unsigned bytes, const std::source_location& loc);
// A special-function call (exp, log, sqrt, rsqrt, rcp, fast sin/cos) by the running thread.
void prof_sfu(const std::source_location& loc);

template <class T, std::size_t Align>
inline T& static_shared(const void* key, const char* name, const char* file, unsigned line) {
  constexpr std::size_t a = Align > alignof(T) ? Align : alignof(T);
  return *static_cast<T*>(static_shared_slot(key, sizeof(T), a, name, file, line));
}

}  // namespace sluice_emu

// ---------------------------------------------------------------------------------------------
// Barriers and warp-synchronous intrinsics
// ---------------------------------------------------------------------------------------------
inline void __syncthreads(std::source_location loc = std::source_location::current()) {
  sluice_emu::barrier(0, 1, loc);
}
inline int __syncthreads_count(int pred, std::source_location loc = std::source_location::current()) {
  return sluice_emu::barrier(1, pred, loc);
}
inline int __syncthreads_and(int pred, std::source_location loc = std::source_location::current()) {
  return sluice_emu::barrier(2, pred, loc);
}
inline int __syncthreads_or(int pred, std::source_location loc = std::source_location::current()) {
  return sluice_emu::barrier(3, pred, loc);
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location loc = std::source_location::current()) {
  sluice_emu::warp_op(sluice_emu::WarpOp::SyncWarp, mask, nullptr, nullptr, 0, 0, 32, loc);
}
inline unsigned __activemask() { return sluice_emu::live_lanes(); }

#define SLUICE_EMU_SHFL(NAME, OP)                                                                \
  template <class T>                                                                             \
  inline T NAME(unsigned mask, T var, int arg, int width = 32,                                   \
                std::source_location loc = std::source_location::current()) {                   \
    static_assert(std::is_trivially_copyable_v<T>, #NAME " needs a trivially copyable type");    \
    T out = var;                                                                                 \
    sluice_emu::warp_op(sluice_emu::WarpOp::OP, mask, &var, &out, sizeof(T), arg, width, loc);   \
    return out;                                                                                  \
  }
SLUICE_EMU_SHFL(__shfl_sync, Shfl)
SLUICE_EMU_SHFL(__shfl_up_sync, ShflUp)
SLUICE_EMU_SHFL(__shfl_down_sync, ShflDown)
SLUICE_EMU_SHFL(__shfl_xor_sync, ShflXor)
#undef SLUICE_EMU_SHFL

inline unsigned __ballot_sync(unsigned mask, int pred,
                              std::source_location loc = std::source_location::current()) {
  unsigned out = 0;
  sluice_emu::warp_op(sluice_emu::WarpOp::Ballot, mask, &pred, &out, sizeof(int), 0, 32, loc);
  return out;
}
inline int __any_sync(unsigned mask, int pred, std::source_location loc = std::source_location::current()) {
  int out = 0;
  sluice_emu::warp_op(sluice_emu::WarpOp::Any, mask, &pred, &out, sizeof(int), 0, 32, loc);
  return out;
}
inline int __all_sync(unsigned mask, int pred, std::source_location loc = std::source_location::current()) {
  int out = 0;
  sluice_emu::warp_op(sluice_emu::WarpOp::All, mask, &pred, &out, sizeof(int), 0, 32, loc);
  return out;
}
#define SLUICE_EMU_REDUCE(NAME, OP, T, SIGNED)                                                   \
  inline T NAME(unsigned mask, T value, std::source_location loc = std::source_location::current()) { \
    T out = value;                                                                               \
    sluice_emu::warp_op(sluice_emu::WarpOp::OP, mask, &value, &out, sizeof(T), SIGNED, 32, loc); \
    return out;                                                                                  \
  }
SLUICE_EMU_REDUCE(__reduce_add_sync, ReduceAdd, unsigned, 0)
SLUICE_EMU_REDUCE(__reduce_add_sync, ReduceAdd, int, 1)
SLUICE_EMU_REDUCE(__reduce_min_sync, ReduceMin, unsigned, 0)
SLUICE_EMU_REDUCE(__reduce_min_sync, ReduceMin, int, 1)
SLUICE_EMU_REDUCE(__reduce_max_sync, ReduceMax, unsigned, 0)
SLUICE_EMU_REDUCE(__reduce_max_sync, ReduceMax, int, 1)
SLUICE_EMU_REDUCE(__reduce_and_sync, ReduceAnd, unsigned, 0)
SLUICE_EMU_REDUCE(__reduce_or_sync, ReduceOr, unsigned, 0)
SLUICE_EMU_REDUCE(__reduce_xor_sync, ReduceXor, unsigned, 0)
#undef SLUICE_EMU_REDUCE

template <class T>
inline unsigned __match_any_sync(unsigned mask, T value,
                                 std::source_location loc = std::source_location::current()) {
  unsigned out = 0;
  sluice_emu::warp_op(sluice_emu::WarpOp::MatchAny, mask, &value, &out, sizeof(T), 0, 32, loc);
  return out;
}
template <class T>
inline unsigned __match_all_sync(unsigned mask, T value, int* pred,
                                 std::source_location loc = std::source_location::current()) {
  unsigned out = 0;
  sluice_emu::warp_op(sluice_emu::WarpOp::MatchAll, mask, &value, &out, sizeof(T), 0, 32, loc);
  *pred = out != 0;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Collective exchange primitives for emulating tensor-core instructions (mma.sync, ldmatrix,
// wgmma) from their documented fragment layouts in kernels/cuda/common. Only under SLUICE_EMU.
//
//   emu_warp_gather(mine, all32): every lane of the caller's warp (all 32 must be alive and call
//     it; it is a full-warp rendezvous like __shfl_sync(0xffffffff, ...)) contributes `mine`;
//     afterwards all32[i] holds lane i's value, in every lane.
//   emu_warpgroup_gather(mine, all128): the same over the 128 threads of the caller's warpgroup
//     (threads 128*g .. 128*g+127 of the block, g = linear thread index / 128); the block must
//     have a multiple of 128 threads. all128[i] holds the value of thread 128*g + i.
//   emu_lane_id(), emu_warp_id(): lane within the warp and warp index within the block (from the
//     linear thread index x + y*Dx + z*Dx*Dy, as on the GPU).
// T must be trivially copyable; any size (a whole fragment struct is fine).
// ---------------------------------------------------------------------------------------------
template <class T>
inline void emu_warp_gather(const T& mine, T* all32,
                            std::source_location loc = std::source_location::current()) {
  static_assert(std::is_trivially_copyable_v<T>, "emu_warp_gather needs a trivially copyable type");
  sluice_emu::warp_op(sluice_emu::WarpOp::Gather, 0xffffffffu, &mine, all32, sizeof(T), 0, 32, loc);
}
template <class T>
inline void emu_warpgroup_gather(const T& mine, T* all128,
                                 std::source_location loc = std::source_location::current()) {
  static_assert(std::is_trivially_copyable_v<T>, "emu_warpgroup_gather needs a trivially copyable type");
  sluice_emu::warpgroup_gather(&mine, all128, sizeof(T), loc);
}
inline unsigned emu_linear_tid() {
  return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
}
inline unsigned emu_lane_id() { return emu_linear_tid() & 31u; }
inline unsigned emu_warp_id() { return emu_linear_tid() >> 5; }
// bar.sync id, count (named barriers, e.g. for warp-specialised kernels).
inline void emu_named_barrier(unsigned id, unsigned count,
                              std::source_location loc = std::source_location::current()) {
  sluice_emu::named_barrier(id, count, loc);
}

// ---------------------------------------------------------------------------------------------
// Errors, fences, timers
// ---------------------------------------------------------------------------------------------
[[noreturn]] inline void __trap(std::source_location loc = std::source_location::current()) {
  sluice_emu::fail("__trap() called", loc.file_name(), loc.line());
}
[[noreturn]] inline void __brkpt(std::source_location loc = std::source_location::current()) {
  sluice_emu::fail("__brkpt() called", loc.file_name(), loc.line());
}
// Fences are real fences (blocks run on parallel host threads); not instrumented.
__attribute__((no_sanitize_thread)) inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__attribute__((no_sanitize_thread)) inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__attribute__((no_sanitize_thread)) inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// __nanosleep yields to the other threads of the block, so spin-wait loops make progress.
inline void __nanosleep(unsigned, std::source_location loc = std::source_location::current()) {
  sluice_emu::yield_now(loc);
}
inline void emu_yield(std::source_location loc = std::source_location::current()) { sluice_emu::yield_now(loc); }
// clock64(): a monotonic nanosecond counter. clock() is the C library's (process CPU time).
long long clock64();

// ---------------------------------------------------------------------------------------------
// Memory access hints: plain loads and stores on the host
// ---------------------------------------------------------------------------------------------
template <class T> __forceinline__ T __ldg(const T* p) { return *p; }
template <class T> __forceinline__ T __ldca(const T* p) { return *p; }
template <class T> __forceinline__ T __ldcg(const T* p) { return *p; }
template <class T> __forceinline__ T __ldcs(const T* p) { return *p; }
template <class T> __forceinline__ T __ldlu(const T* p) { return *p; }
template <class T> __forceinline__ T __ldcv(const T* p) { return *p; }
template <class T> __forceinline__ void __stwb(T* p, T v) { *p = v; }
template <class T> __forceinline__ void __stcg(T* p, T v) { *p = v; }
template <class T> __forceinline__ void __stcs(T* p, T v) { *p = v; }
template <class T> __forceinline__ void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------------------------
// Atomics. Fibers of one block never interleave inside an operation, but blocks run on parallel
// host threads, so every atomic is a real std::atomic_ref operation.
// ---------------------------------------------------------------------------------------------
// The atomic intrinsics are out of line and not instrumented (no_sanitize_thread; they use the
// compiler's __atomic builtins directly, since a call to std::atomic_ref would be instrumented):
// each reports one atomic access to the checker with its caller's address, then does the
// operation. Blocks run on parallel host threads, so every atomic is a real atomic operation.
#define SLUICE_EMU_ATOMIC_FN __attribute__((noinline, no_sanitize_thread)) inline
#define SLUICE_EMU_NOTE(p) sluice_emu::atomic_access(p, sizeof(*(p)), __builtin_return_address(0))
// Compare-and-swap loop applying NEW (an expression of the old value `o`) to *p; returns the old value.
#define SLUICE_EMU_CAS_LOOP(T, NEW)                                                               \
  T o = __atomic_load_n(p, __ATOMIC_RELAXED);                                                     \
  while (!__atomic_compare_exchange_n(p, &o, (NEW), true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {   \
  }                                                                                               \
  return o;
#define SLUICE_EMU_ATOMIC_INT(T)                                                                  \
  SLUICE_EMU_ATOMIC_FN T atomicAdd(T* p, T v) { SLUICE_EMU_NOTE(p); return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); } \
  SLUICE_EMU_ATOMIC_FN T atomicSub(T* p, T v) { SLUICE_EMU_NOTE(p); return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); } \
  SLUICE_EMU_ATOMIC_FN T atomicExch(T* p, T v) { SLUICE_EMU_NOTE(p); return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); } \
  SLUICE_EMU_ATOMIC_FN T atomicAnd(T* p, T v) { SLUICE_EMU_NOTE(p); return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); } \
  SLUICE_EMU_ATOMIC_FN T atomicOr(T* p, T v) { SLUICE_EMU_NOTE(p); return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }  \
  SLUICE_EMU_ATOMIC_FN T atomicXor(T* p, T v) { SLUICE_EMU_NOTE(p); return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); } \
  SLUICE_EMU_ATOMIC_FN T atomicMax(T* p, T v) { SLUICE_EMU_NOTE(p); SLUICE_EMU_CAS_LOOP(T, o > v ? o : v) }          \
  SLUICE_EMU_ATOMIC_FN T atomicMin(T* p, T v) { SLUICE_EMU_NOTE(p); SLUICE_EMU_CAS_LOOP(T, o < v ? o : v) }          \
  SLUICE_EMU_ATOMIC_FN T atomicCAS(T* p, T cmp, T v) {                                            \
    SLUICE_EMU_NOTE(p);                                                                           \
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);           \
    return cmp;                                                                                   \
  }                                                                                               \
  inline T atomicAdd_block(T* p, T v) { return atomicAdd(p, v); }                                 \
  inline T atomicMax_block(T* p, T v) { return atomicMax(p, v); }                                 \
  inline T atomicMin_block(T* p, T v) { return atomicMin(p, v); }                                 \
  inline T atomicCAS_block(T* p, T c, T v) { return atomicCAS(p, c, v); }                         \
  inline T atomicExch_block(T* p, T v) { return atomicExch(p, v); }
SLUICE_EMU_ATOMIC_INT(int)
SLUICE_EMU_ATOMIC_INT(unsigned int)
SLUICE_EMU_ATOMIC_INT(long long)
SLUICE_EMU_ATOMIC_INT(unsigned long long)
#undef SLUICE_EMU_ATOMIC_INT
SLUICE_EMU_ATOMIC_FN unsigned short atomicCAS(unsigned short* p, unsigned short cmp, unsigned short v) {
  SLUICE_EMU_NOTE(p);
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
SLUICE_EMU_ATOMIC_FN unsigned atomicInc(unsigned* p, unsigned lim) {
  SLUICE_EMU_NOTE(p);
  SLUICE_EMU_CAS_LOOP(unsigned, o >= lim ? 0u : o + 1u)
}
SLUICE_EMU_ATOMIC_FN unsigned atomicDec(unsigned* p, unsigned lim) {
  SLUICE_EMU_NOTE(p);
  SLUICE_EMU_CAS_LOOP(unsigned, (o == 0u || o > lim) ? lim : o - 1u)
}
// Float atomics exist for completeness; sluice's determinism rule forbids them in reductions.
// They operate on the bits (the builtins take integers).
#define SLUICE_EMU_FLOAT_RMW(F, U, NEW)                                                          \
  SLUICE_EMU_NOTE(p);                                                                             \
  U* q = reinterpret_cast<U*>(p);                                                                 \
  U o = __atomic_load_n(q, __ATOMIC_RELAXED);                                                     \
  for (;;) {                                                                                      \
    F old = __builtin_bit_cast(F, o);                                                             \
    U want = __builtin_bit_cast(U, static_cast<F>(NEW));                                          \
    if (__atomic_compare_exchange_n(q, &o, want, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return old; \
  }
SLUICE_EMU_ATOMIC_FN float atomicAdd(float* p, float v) { SLUICE_EMU_FLOAT_RMW(float, unsigned, old + v) }
SLUICE_EMU_ATOMIC_FN double atomicAdd(double* p, double v) { SLUICE_EMU_FLOAT_RMW(double, unsigned long long, old + v) }
SLUICE_EMU_ATOMIC_FN float atomicExch(float* p, float v) { SLUICE_EMU_FLOAT_RMW(float, unsigned, v) }
inline float atomicAdd_block(float* p, float v) { return atomicAdd(p, v); }
#undef SLUICE_EMU_FLOAT_RMW
#undef SLUICE_EMU_CAS_LOOP
#undef SLUICE_EMU_NOTE

// ---------------------------------------------------------------------------------------------
// Integer and bit intrinsics
// ---------------------------------------------------------------------------------------------
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
inline int __ffsll(long long x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned long long>(x)) + 1;
}
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(static_cast<unsigned>(x))) << 32) |
         __brev(static_cast<unsigned>(x >> 32));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (((s >> (4 * i)) & 7u) * 8)) & 0xffu) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned sh) {
  unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>((v << (sh & 31u)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (sh & 31u));
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline long long __mul64hi(long long a, long long b) {
  return static_cast<long long>((static_cast<__int128>(a) * b) >> 64);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline int __mul24(int a, int b) { return ((a << 8) >> 8) * ((b << 8) >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline int __sad(int a, int b, unsigned c) { return (a > b ? a - b : b - a) + static_cast<int>(c); }
inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return (a > b ? a - b : b - a) + c; }

// CUDA's global min/max overloads (math_functions.hpp)
#define SLUICE_EMU_MINMAX(R, A, B)                                  \
  inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
  inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
SLUICE_EMU_MINMAX(int, int, int)
SLUICE_EMU_MINMAX(unsigned, unsigned, unsigned)
SLUICE_EMU_MINMAX(unsigned, int, unsigned)
SLUICE_EMU_MINMAX(unsigned, unsigned, int)
SLUICE_EMU_MINMAX(long, long, long)
SLUICE_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
SLUICE_EMU_MINMAX(unsigned long, long, unsigned long)
SLUICE_EMU_MINMAX(unsigned long, unsigned long, long)
SLUICE_EMU_MINMAX(long long, long long, long long)
SLUICE_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
SLUICE_EMU_MINMAX(unsigned long long, long long, unsigned long long)
SLUICE_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef SLUICE_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Special-function calls are counted for the profiler at the caller's line (the default
// argument is evaluated where the intrinsic is called).
#define SLUICE_EMU_SFU_LOC std::source_location sluice_emu_sfu_loc = std::source_location::current()
#define SLUICE_EMU_SFU_COUNT ::sluice_emu::prof_sfu(sluice_emu_sfu_loc)
// Float intrinsics. Functions of the C library (expf, logf, sqrtf, tanhf, ...) come from <math.h>
// and are correctly rounded or within 1 ulp on glibc; the GPU's versions are within 1-2 ulp, so
// results can differ in the last bits. The __fast intrinsics below imitate the GPU's formulation
// (exp via exp2, log via log2) but not its exact approximation error. See docs/emulator.md.
// ---------------------------------------------------------------------------------------------
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __hiloint2double(int hi, int lo) {
  return std::bit_cast<double>((static_cast<unsigned long long>(static_cast<unsigned>(hi)) << 32) |
                               static_cast<unsigned>(lo));
}

inline float rsqrtf(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return 1.0f / ::sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __expf(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::exp2f(x * 1.4426950408889634f); }
inline float __exp10f(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::exp2f(x * 3.3219280948873623f); }
inline float __logf(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::log2f(x) * 0.6931471805599453f; }
inline float __log2f(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::log2f(x); }
inline float __log10f(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::log2f(x) * 0.3010299956639812f; }
inline float __powf(float a, float b, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; SLUICE_EMU_SFU_COUNT; return ::exp2f(b * ::log2f(a)); }
inline float __sinf(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::sinf(x); }
inline float __cosf(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float a, float b, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return 1.0f / x; }
inline float __frsqrt_rn(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return 1.0f / ::sqrtf(x); }
inline float __fsqrt_rn(float x, SLUICE_EMU_SFU_LOC) { SLUICE_EMU_SFU_COUNT; return ::sqrtf(x); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fmaf_rz(float a, float b, float c) { return fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float saturatef(float x) { return __saturatef(x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(nearbyintf(x)); }
inline unsigned __float2uint_rz(float x) { return static_cast<unsigned>(x); }
inline long long __float2ll_rn(float x) { return static_cast<long long>(nearbyintf(x)); }
inline long long __float2ll_rz(float x) { return static_cast<long long>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }
inline int __double2int_rn(double x) { return static_cast<int>(nearbyint(x)); }
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// ---------------------------------------------------------------------------------------------
// printf / assert
// ---------------------------------------------------------------------------------------------
// printf is the host's printf (stdout is shared by the host threads; lines of different blocks
// may interleave, as on the GPU).
// assert() is redefined by kernels/emu/include/assert.h to call sluice_emu_assert_fail.

#include "sluice_emu_half.h"

// The C library's special functions, counted in kernel translation units (the build defines
// SLUICE_EMU_KERNEL_TU for them, never for the runtime): a call `expf(x)` in kernel code becomes a
// counted call at the caller's line. Accurate sinf/cosf/tanhf are not counted: on the GPU they are
// polynomials on the FMA pipe, not special-function instructions.
#ifdef SLUICE_EMU_KERNEL_TU
namespace sluice_emu::sfu {
#define SLUICE_EMU_SFU_FN(NAME)                                                        \
  inline float NAME##_counted(float x, SLUICE_EMU_SFU_LOC) {                           \
    SLUICE_EMU_SFU_COUNT;                                                              \
    return ::NAME(x);                                                                  \
  }
SLUICE_EMU_SFU_FN(expf)
SLUICE_EMU_SFU_FN(exp2f)
SLUICE_EMU_SFU_FN(logf)
SLUICE_EMU_SFU_FN(log2f)
SLUICE_EMU_SFU_FN(sqrtf)
#undef SLUICE_EMU_SFU_FN
}  // namespace sluice_emu::sfu
#define expf(x) ::sluice_emu::sfu::expf_counted(x)
#define exp2f(x) ::sluice_emu::sfu::exp2f_counted(x)
#define logf(x) ::sluice_emu::sfu::logf_counted(x)
#define log2f(x) ::sluice_emu::sfu::log2f_counted(x)
#define sqrtf(x) ::sluice_emu::sfu::sqrtf_counted(x)
#endif

#endif  // SLUICE_EMU_H
