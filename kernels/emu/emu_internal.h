// emu_internal.h — declarations shared by the emulator runtime's source files (runtime.cpp,
// memory.cpp, check.cpp, async.cpp). Not included by kernel code. See docs/emulator.md.
//
// The runtime is compiled WITHOUT instrumentation; kernel translation units are compiled with
// GCC's ThreadSanitizer instrumentation (no sanitizer runtime), which turns every load and store
// of kernel code into a call to __tsan_{read,write}N and friends (check.cpp). Those calls, and explicit
// calls from the runtime for the memory that emulated instructions touch (bulk copies, cp.async,
// mbarriers), are the only way memory accesses reach the checker.
#ifndef SLUICE_EMU_INTERNAL_H
#define SLUICE_EMU_INTERNAL_H

#include "sluice_emu.h"
#include "emu_api.h"

#include <atomic>
#include <condition_variable>
#include <csetjmp>
#include <map>
#include <mutex>
#include <string>
#include <vector>

// The runtime's own thread-locals use the initial-exec model (one instruction per access) in the
// build linked into sluice; a module loaded at run time (`sluice emu check`, built with
// SLUICE_EMU_MODULE) cannot: any initial-exec access puts its whole TLS segment, namespace-scope
// `__shared__` arrays of the user's file included, into the small static TLS block.
#ifdef SLUICE_EMU_MODULE
#define SLUICE_EMU_FAST_TLS
#else
#define SLUICE_EMU_FAST_TLS __attribute__((tls_model("initial-exec")))
#endif

namespace sluice_emu::rt {

constexpr size_t kPage = 4096;
constexpr size_t kMaxDynamicShared = 232448;   // 227 KiB, the sm_90 opt-in maximum
constexpr size_t kMaxStaticShared = 48 * 1024;  // CUDA's limit for static __shared__ per block
constexpr unsigned kMaxFindings = 50;           // distinct findings kept per launch

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// ---------------------------------------------------------------------------------------------
// Race shadow (check.cpp): four access records per 8-byte granule of tracked memory. A record is
// one earlier access in the current launch (global memory) or block (shared memory); an empty
// record has block == 0. See docs/emulator.md, "Race detection".
// ---------------------------------------------------------------------------------------------
struct Slot {
  uint32_t block;   // linear block index + 1 (0 = empty)
  int32_t pc;       // code address of the access, relative to code_base() (0 = unknown)
  uint16_t bar;     // block barrier interval of the access
  uint16_t clk;     // the accessing thread's clock within that interval (check.cpp, "Races")
  uint16_t thread;  // linear thread index, or kAgentBase + i for the async agent of mbarrier i
  uint8_t mask;     // bytes of the granule accessed
  uint8_t flags;    // kSlotWrite | kSlotAtomic
};
static_assert(sizeof(Slot) == 16, "race records are 16 bytes");
constexpr uint8_t kSlotWrite = 1, kSlotAtomic = 2;
constexpr size_t kSlotsPerGranule = 4;
constexpr size_t kGranule = 8;

// ---------------------------------------------------------------------------------------------
// Memory regions (memory.cpp). All emu memory (global allocations and every worker's shared
// windows) lives in one reserved arena; a map from 64 KiB chunks to Region finds the region of an
// address in one load.
// ---------------------------------------------------------------------------------------------
enum class RegionKind : uint8_t { Global, DynShared, StaticShared };

struct Worker;

struct Region {
  RegionKind kind = RegionKind::Global;
  uintptr_t lo = 0, hi = 0;  // the span registered in the region map (data, slack and redzones)
  uintptr_t start = 0;       // first data byte
  size_t bytes = 0;          // data bytes (DynShared: set per launch to the requested size)
  unsigned long long id = 0; // allocation number (Global)
  // Race shadow: kSlotsPerGranule records per granule of the data, mapped on first use.
  std::atomic<Slot*> race{nullptr};
  size_t race_granules = 0;
  // Granules touched since the shadow was last cleared (cleared per launch for global memory,
  // per block for shared memory).
  size_t touched_lo = SIZE_MAX, touched_hi = 0;
  std::atomic<unsigned long long> race_launch{0};  // launch that last wrote records (Global)
  // Async-copy tags (shared windows only): per granule, index + 1 of the pending copy writing it.
  uint16_t* async_tag = nullptr;
  size_t tagged_lo = SIZE_MAX, tagged_hi = 0;
  // Proxy tags (shared windows only), per granule: who last wrote it through the generic proxy
  // and whether that write is fenced for the async proxy, or the swizzle of the tensor copy that
  // landed it (async.cpp, kProxy*). Cleared per block over [proxy_lo, proxy_hi).
  uint32_t* proxy_tag = nullptr;
  size_t proxy_lo = SIZE_MAX, proxy_hi = 0;
  Worker* owner = nullptr;  // shared windows: the worker whose blocks use it
};

// Reserves the arena and the region map (once per process). Returns false if the address space
// cannot be reserved.
bool arena_init();
extern uintptr_t g_arena_lo;
extern size_t g_arena_size;
extern std::atomic<Region*>* g_region_map;
constexpr unsigned kChunkShift = 16;  // 64 KiB

inline Region* region_of(uintptr_t a) {
  uintptr_t off = a - g_arena_lo;
  if (off >= g_arena_size) return nullptr;
  return g_region_map[off >> kChunkShift].load(std::memory_order_acquire);
}

// The race shadow of r, mapped on first use; nullptr if it cannot be mapped.
Slot* race_shadow(Region& r);
// Clears the records of the granules touched since the last clear.
void clear_race_shadow(Region& r);

// Per-host-thread shared memory: the dynamic window and the static window, each its own region.
struct StaticArray {
  const void* key;           // address of the declaration's key variable (per instantiation)
  const char* name;
  const char* file;
  unsigned line;
  size_t off, bytes;         // in the static window
  unsigned long long block;  // block serial of the last 0xFF fill
};
struct SharedWindows {
  Region dyn;
  Region stat;
  uint16_t* stat_owner = nullptr;  // per byte of the static window: array index + 1, 0 = redzone
  std::vector<StaticArray> arrays;
  size_t stat_used = 0;            // bytes of the static window laid out (redzones included)
  size_t stat_data = 0;            // data bytes of the arrays (CUDA's 48 KiB limit)
};
constexpr size_t kDynSpan = 256 * 1024;
constexpr size_t kStatSpan = 128 * 1024;
constexpr size_t kStaticRedzone = 64;
bool shared_windows_init(SharedWindows& s, Worker* owner);
// Limits the accessible part of the dynamic window to `bytes` (rounded up to a page for
// accesses that bypass the checks; exact for checked ones).
void shared_windows_set_dynamic(SharedWindows& s, size_t bytes);
void shared_windows_restore(SharedWindows& s);
// Forgets the static layout (a new launch on this host thread).
void shared_windows_reset_static(SharedWindows& s);

// Global allocations.
void* global_alloc(size_t bytes);
void global_free(void* p);

// ---------------------------------------------------------------------------------------------
// Scheduler state (runtime.cpp)
// ---------------------------------------------------------------------------------------------
using sluice_emu::WarpOp;
enum FiberState : unsigned char { kReady, kRunning, kBarrier, kWarp, kWarpGroup, kNamed, kDone };

// A wgmma whose result is not visible yet (until the matching wgmma_wait).
struct PendingWgmma {
  float* d;
  unsigned bytes;
  // The A fragment's registers of the register-source form (null for shared-memory A): the
  // thread's own registers, which it must not touch until the wait (PTX ISA, wgmma.mma_async).
  const void* a;
  unsigned a_bytes;
  int group;  // -1 while not committed
  const char* file;
  unsigned line;
  float value[128];
};

struct Fiber {
  void* sp;
  char* stack;  // mapping: guard page + stack
  uint3 tid;
  unsigned linear;
  FiberState state;
  // The operation the fiber waits at.
  WarpOp op;
  unsigned mask;
  unsigned size;
  int arg;
  int width;
  const void* in;
  void* out;
  const char* file;
  unsigned line;
  int pred;
  // Asynchronous operations issued by this thread.
  std::vector<PendingWgmma> wgmma;
  int wgmma_groups = 0;     // commit groups issued
  int cp_groups = 0;        // cp.async commit groups issued
  // Inside an emulated instruction (ldmatrix, wgmma): its internal accesses are not profiled.
  int prof_quiet = 0;
  // fence.proxy.async executed by this thread in the block (async.cpp, proxy tags).
  uint16_t proxy_fences = 0;
  // Convergence points this thread has passed in the block (warp operations of every live lane
  // of its warp, barriers): the lanes of a warp with equal epochs are between the same two, so
  // the profiler groups their accesses into requests within an epoch (profile.cpp).
  uint32_t sync_epoch = 0;
};

struct PendingWarpOp {
  unsigned mask;
  unsigned arrived;
};
struct Warp {
  unsigned exists;
  unsigned live;
  unsigned npend;
  PendingWarpOp pend[32];
};
struct NamedBarrier {
  unsigned expected;
  unsigned arrived;
};

// One finding of a launch (deduplicated by kind, code addresses and source line).
struct Finding {
  std::string kind;
  std::string message;
  const char* file = nullptr;  // known source line (barriers, warp ops, emulated instructions)
  unsigned line = 0;
  uintptr_t pc = 0;   // code address of the access (symbolized by the caller), 0 if none
  uintptr_t pc2 = 0;  // the earlier conflicting access of a race
  unsigned long long count = 1;
};

enum CheckLevel : int { kChecksOff = 0, kChecksBounds = 1, kChecksFull = 2 };

struct ProfileWorker;   // profile.cpp: one host thread's counts for the running launch
struct ProfileLaunch;   // profile.cpp: the merged counts of a launch

struct Launch {
  const sluice_emu_kernel* kernel;
  unsigned grid[3];
  unsigned block[3];
  size_t dyn_bytes;
  void** params;
  const char* const* param_names = nullptr;
  unsigned long long seed;
  unsigned long long name_hash;
  unsigned long long nblocks;
  unsigned long long serial = 0;
  unsigned nthreads;
  int checks = kChecksFull;
  bool race = false;
  // Block order: block i of the launch order is (i * order_mul + order_add) mod nblocks.
  unsigned long long order_mul = 1, order_add = 0;
  // Pointer arguments: the allocation start and parameter index, to name buffers in findings.
  std::vector<std::pair<uintptr_t, unsigned>> pointer_args;
  std::mutex mu;
  std::condition_variable done;
  unsigned pending = 0;
  // Findings, shared by the workers.
  std::mutex fmu;
  std::vector<Finding> findings;
  unsigned long long dropped = 0;  // findings beyond kMaxFindings
  std::vector<Region*> race_regions;  // global regions whose race shadow this launch wrote
  // Profiling (profile.cpp): null unless the launch is profiled. With a sample, only the listed
  // blocks run, each weighted.
  ProfileLaunch* profile = nullptr;
  std::vector<unsigned long long> sample_blocks;
  std::vector<double> sample_weights;
  void finish_one() {
    std::lock_guard<std::mutex> g(mu);
    if (--pending == 0) done.notify_all();
  }
  void add(Finding f);
};

// Pending asynchronous copy (bulk copy or cp.async) into shared memory.
enum class AsyncKind : uint8_t { Bulk, CpAsync, Tensor };
struct AsyncOp {
  AsyncKind kind;
  bool live;
  char* dst;
  const char* src;
  unsigned bytes;
  uintptr_t bar;       // Bulk: the mbarrier it completes on
  unsigned fiber;      // issuing thread (linear index)
  int group;           // CpAsync: commit group, -1 while open
  const char* file;
  unsigned line;
  // Tensor copies: the box as it lands (gathered, zero-filled and swizzled at issue; src points
  // into it) and the map's swizzle mode + 1 (0 for other copies).
  std::vector<char> staged;
  uint8_t swizzle_tag = 0;
};
// A vector clock of the current barrier interval (check.cpp, "Races"): entry t is the clock of
// thread (or agent) t that it covers; a clock stamped with another interval reads as all zeros.
struct VectorClock {
  std::vector<uint16_t> c;
  uint16_t stamp = UINT16_MAX;
};
struct MBarrier {
  uintptr_t addr;
  unsigned expected;
  unsigned pending;
  long long tx;
  unsigned long long completed;  // phases completed
  std::vector<unsigned> ops;     // bulk copies completing on the current phase
  VectorClock arrivals;          // the releases of the current phase's arrivals
  VectorClock done;              // what a wait that sees the last completed phase acquires
};

struct Worker {
  Launch* L = nullptr;
  std::vector<Fiber> fibers;
  std::vector<unsigned> ready;
  std::vector<Warp> warps;
  std::vector<unsigned> wg_arrived;
  NamedBarrier named[16] = {};
  std::vector<char*> stacks;
  bool alt_ok = false;
  bool shared_ok = false;
  SharedWindows shared;
  unsigned char* dyn_base = nullptr;
  size_t dyn_poison = 0;
  unsigned ndone = 0;
  unsigned long long rng = 0;
  void* sched_sp = nullptr;
  void* dead_sp = nullptr;
  bool failed = false;
  unsigned long long block_linear = 0;
  uint3 bidx{};
  int bar_result = 0;
  unsigned long long block_serial = 0;
  unsigned long long spins = 0;  // emu_yield calls since the last barrier/warp op/exit
  std::vector<char> scratch;     // gather assembly buffer
  // Race detection state of the running block.
  bool race = false;             // race detection on for this block
  uint16_t bar = 0;              // barrier intervals completed
  // Vector clocks of the current interval (check.cpp, "Races"): per thread, then per async
  // agent (the bulk copies completing on one mbarrier), its own clock and what it acquired.
  unsigned vc_cols = 0;          // nthreads + kMaxAgents
  std::vector<uint16_t> clk;
  std::vector<uint16_t> clk_stamp;
  std::vector<VectorClock> acquired;
  VectorClock sync_join;         // scratch of race_sync_group (kept: no allocation per __syncwarp)
  // Asynchronous copies and mbarriers of the running block.
  std::vector<AsyncOp> async_ops;
  std::vector<unsigned> async_free;
  unsigned async_live = 0;
  std::vector<MBarrier> mbarriers;
  // fault handling
  sigjmp_buf jb;
  volatile bool catching = false;
  volatile int fault_sig = 0;
  volatile uintptr_t fault_addr = 0;
  volatile int fault_write = -1;
  Fiber* volatile fault_fiber = nullptr;
  uintptr_t last_oob_addr = 0;  // the last out-of-bounds access reported by the checker
  // Profiling of the running launch (null when it is not profiled) and the weight of the block.
  ProfileWorker* prof = nullptr;
  double block_weight = 1.0;
};

extern thread_local Worker* t_worker SLUICE_EMU_FAST_TLS;
extern thread_local Fiber* t_cur SLUICE_EMU_FAST_TLS;
// Non-null while the running fiber has wgmma results pending (its accumulators are watched).
extern thread_local Fiber* t_watch SLUICE_EMU_FAST_TLS;

std::string where(const Worker& w);
std::string thread_str(const Fiber& f);
std::string block_str(const Launch& L, unsigned long long linear);
std::string thread_str_linear(const Launch& L, unsigned linear);
// Records a finding of kind `kind` for the running launch; the block goes on.
void report(Worker& w, const char* kind, std::string msg, uintptr_t pc = 0, uintptr_t pc2 = 0,
            const char* file = nullptr, unsigned line = 0);
// Records a finding and abandons the block (never returns when called from a fiber).
[[noreturn]] void fiber_fail(Worker& w, const char* kind, std::string msg, const char* file = nullptr,
                             unsigned line = 0);

// ---------------------------------------------------------------------------------------------
// Checker (check.cpp)
// ---------------------------------------------------------------------------------------------
// kAccRmw: an atomic read-modify-write instruction (atomicAdd, ...), as opposed to a volatile
// load or store (kAccAtomic alone).
// kAccRange: an aggregate copy the compiler instrumented as one range (__tsan_*_range): a
// struct whose alignment is below its size, which nvcc copies field by field.
constexpr unsigned kAccWrite = 1, kAccAtomic = 2, kAccRmw = 4, kAccRange = 8;
// Checks one access of kernel code (or of an emulated instruction on its behalf) by the running
// fiber: bounds of tracked memory, pending asynchronous writes, races. `pc` is the code address
// reported for it (0 when `file`/`line` name the source instead).
void check_access(uintptr_t a, size_t n, unsigned flags, uintptr_t pc, const char* file = nullptr,
                  unsigned line = 0);
// The object file holding code address pc and the address to give addr2line for it.
struct CodeLocation {
  const char* object = nullptr;
  unsigned long long vaddr = 0;
};
CodeLocation locate_code(uintptr_t pc);
// The base for the 32-bit code addresses in race records.
uintptr_t code_base();
// Names the buffer at address a (allocation and argument, shared array, ...) for findings.
std::string describe_address(const Worker& w, uintptr_t a, size_t n);
// Race state of the block (called by the scheduler).
void race_block_start(Worker& w);
void race_barrier(Worker& w);
// A synchronisation of `n` threads (a __syncwarp's lanes, a named barrier of part of the block):
// each one's accesses before it are ordered before every other one's accesses after it.
void race_sync_group(Worker& w, const unsigned* threads, unsigned n);
// mbarrier ordering: thread t's arrival releases into `into`; a thread whose wait observes the
// phase complete acquires `from`. Agent a (kAgentBase + mbarrier index) is the async proxy's
// writer of the bulk copies completing on that mbarrier.
constexpr unsigned kAgentBase = 1024, kMaxAgents = 64;
void race_release(Worker& w, unsigned t, VectorClock& into);
void race_acquire(Worker& w, unsigned t, const VectorClock& from);
// Records a write of [a, a + n) by thread or agent t (a copy landing).
void race_record_write_by(Worker& w, unsigned t, uintptr_t a, size_t n, const char* file, unsigned line);
// Forgets race records of [a, a + n) (an asynchronous write superseded them).
void race_forget(uintptr_t a, size_t n);
// Records a write of [a, a + n) by fiber f (a cp.async landing at its wait).
void race_record_write(Worker& w, const Fiber& f, uintptr_t a, size_t n, const char* file, unsigned line);

// ---------------------------------------------------------------------------------------------
// Profiler (profile.cpp). Counts what the GPU's memory pipeline would see; see docs/emulator.md,
// "Profiling". Every entry point is a no-op unless the running launch is profiled (w.prof).
// ---------------------------------------------------------------------------------------------
enum ProfCounter : unsigned {
  kGldReq, kGldBytes, kGldSectors, kGldLines, kGldIdeal,
  kGstReq, kGstBytes, kGstSectors, kGstLines, kGstIdeal,
  kSldReq, kSldWaves, kSldIdeal,
  kSstReq, kSstWaves, kSstIdeal,
  kTensorFlops, kSfu, kAsyncBytes, kBarriers, kShuffles, kAtomics, kVotes,
  kLdmatrix, kWgmmaOperandWaves, kAsyncInstr,
  kProfCounters
};
static_assert(kProfCounters == SLUICE_EMU_PROFILE_COUNTERS, "emu_api.h names every counter");
// A memory access of kernel code by the running fiber (pc: its code address). Atomics count as
// atomics (per warp-level request), not as loads or stores.
void prof_access(Worker& w, uintptr_t a, size_t n, unsigned flags, uintptr_t pc);
// An event of the running fiber counted once per warp-level instruction (or per thread, as the
// counter says) at a known source line.
void prof_add(Worker& w, ProfCounter c, double v, const char* file, unsigned line);
// A global load request made by an emulated instruction (cp.async) at a source line, grouped by
// warp like kernel accesses.
void prof_global_read(Worker& w, uintptr_t a, size_t n, const char* file, unsigned line);
// A tensor-core instruction of shape `shape` (a string literal) doing `flops` FLOPs, counted once
// per warp (mma.sync) or warpgroup (wgmma).
void prof_tensor(Worker& w, const char* shape, double flops, const char* file, unsigned line);
// Bytes of global memory read by an asynchronous copy (unique-byte accounting only).
void prof_mark_read(Worker& w, uintptr_t a, size_t n);
// Launch and block life cycle (runtime.cpp).
ProfileLaunch* prof_launch_begin(Launch& L);
void prof_job_begin(Worker& w);
void prof_block_begin(Worker& w);
void prof_block_end(Worker& w);
void prof_job_end(Worker& w);
// Builds the C view of the launch's profile, calls fn, and frees the launch's profile.
void prof_launch_end(Launch& L, void (*fn)(void*, const sluice_emu_profile*), void* ctx);

// ---------------------------------------------------------------------------------------------
// Asynchronous operations (async.cpp)
// ---------------------------------------------------------------------------------------------
void async_block_start(Worker& w);
// The pending asynchronous copy writing granule `g` of shared region r, or nullptr.
const AsyncOp* async_pending_at(const Worker& w, const Region& r, uintptr_t a, size_t n);
// A generic-proxy write of [a, a + n) of shared region r by the running thread (proxy tags).
void proxy_note_write(Worker& w, Region& r, uintptr_t a, size_t n);

}  // namespace sluice_emu::rt

#endif  // SLUICE_EMU_INTERNAL_H
