// runtime.cpp — the emulator's scheduler, allocator and C ABI (emu_api.h). See docs/emulator.md.
//
// Structure:
//   * context switch: ~20 lines of x86-64 assembly (callee-saved registers + MXCSR/x87 control
//     word); swapcontext would make a system call per switch.
//   * Worker: one host thread of a launch. It runs whole blocks, one at a time, blocks w, w+W,
//     w+2W, ... (fixed round-robin, so results never depend on timing). Each CUDA thread of the
//     block is a Fiber on a pooled 64 KiB stack with a guard page below it.
//   * Fibers run until they block (barrier, warp op, exit); then a ready fiber is drawn from the
//     block's generator (seeded by seed, kernel name and block index) and switched to directly.
//     When none is ready the worker's scheduler context decides: block done, barrier released,
//     or an error (deadlock: divergent barrier, early exit, unmatched warp op).
//   * Faults (SIGSEGV/SIGBUS/SIGFPE/SIGILL) inside a worker are caught on an alternate signal
//     stack and siglongjmp'd back to the worker, which names the allocation and offset.
#include "sluice_emu.h"
#include "emu_api.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------------------
// Built-in variables
// ---------------------------------------------------------------------------------------------
thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

long long clock64() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------------------------
// Context switch
// ---------------------------------------------------------------------------------------------
// void sluice_emu_switch(void** save_sp, void* load_sp): saves the callee-saved state on the
// current stack, stores the stack pointer in *save_sp, loads load_sp and restores from there.
// sluice_emu_fiber_start: first "return address" of a new fiber; calls r12(rbx).
asm(R"(
  .text
  .p2align 4
  .globl sluice_emu_switch
  .hidden sluice_emu_switch
  .type sluice_emu_switch,@function
sluice_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sluice_emu_switch,.-sluice_emu_switch

  .p2align 4
  .globl sluice_emu_fiber_start
  .hidden sluice_emu_fiber_start
  .type sluice_emu_fiber_start,@function
sluice_emu_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  movq %rbx, %rdi
  callq *%r12
  ud2
  .cfi_endproc
  .size sluice_emu_fiber_start,.-sluice_emu_fiber_start
)");
extern "C" __attribute__((visibility("hidden"))) void sluice_emu_switch(void** save_sp, void* load_sp);
extern "C" __attribute__((visibility("hidden"))) void sluice_emu_fiber_start();

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kStackBytes = 64 * 1024;
constexpr size_t kAltStackBytes = 64 * 1024;
constexpr size_t kFrontGuard = 64 * 1024;
constexpr size_t kBackGuard = 1024 * 1024;
constexpr size_t kMaxDynamicShared = 232448;  // 227 KiB, the sm_90 opt-in maximum
constexpr unsigned kMaxWorkers = 8;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Allocations with guard pages and canaries
// ---------------------------------------------------------------------------------------------
// Layout: [64 KiB guard][front canary][data, 256-aligned][tail canary < 256 B][1 MiB guard]. The
// guards are PROT_NONE address space (no memory). The data ends at most 255 bytes before the
// trailing guard, so a read or write from 256 bytes to 1 MiB past the end faults and is named; a
// write into the canary bytes is found by the check after every launch.
struct Alloc {
  char* map;
  size_t map_len;
  char* start;
  size_t bytes;
  size_t body;  // round_up(bytes, 256): data + tail canary
  unsigned long long id;
};
std::mutex g_alloc_mu;
std::map<uintptr_t, Alloc> g_allocs;  // keyed by start
unsigned long long g_alloc_next_id = 1;

unsigned char canary_byte(size_t i) { return static_cast<unsigned char>(0xA5u ^ (i * 131u)); }

// Finds the allocation whose mapping (guards included) holds addr. Caller holds g_alloc_mu.
const Alloc* find_alloc_locked(uintptr_t addr) {
  auto it = g_allocs.upper_bound(addr + kFrontGuard + kPage);
  while (it != g_allocs.begin()) {
    --it;
    const Alloc& a = it->second;
    uintptr_t lo = reinterpret_cast<uintptr_t>(a.map);
    if (addr >= lo && addr < lo + a.map_len) return &a;
    if (lo + a.map_len <= addr) break;  // mappings do not overlap: earlier ones end earlier
  }
  return nullptr;
}

// Returns an empty string or a description of the first modified canary byte of a.
std::string check_canaries_locked(const Alloc& a) {
  char* front = a.map + kFrontGuard;
  for (char* p = a.start - 1; p >= front; --p) {
    size_t i = static_cast<size_t>(p - front);
    if (static_cast<unsigned char>(*p) != canary_byte(i)) {
      return format("byte offset -%zu (before the start) of allocation #%llu (%zu bytes) was written",
                    static_cast<size_t>(a.start - p), a.id, a.bytes);
    }
  }
  for (size_t off = a.bytes; off < a.body; ++off) {
    if (static_cast<unsigned char>(a.start[off]) != canary_byte(off)) {
      return format("byte offset %zu (%zu bytes past the end) of allocation #%llu (%zu bytes) was written",
                    off, off - a.bytes + 1, a.id, a.bytes);
    }
  }
  return {};
}

void restore_canaries_locked(const Alloc& a) {
  char* front = a.map + kFrontGuard;
  for (char* p = front; p < a.start; ++p) *p = static_cast<char>(canary_byte(static_cast<size_t>(p - front)));
  for (size_t off = a.bytes; off < a.body; ++off) a.start[off] = static_cast<char>(canary_byte(off));
}

// ---------------------------------------------------------------------------------------------
// Per-host-thread memory: fiber stacks and the dynamic shared memory region (kept for the life of
// the pool thread that owns them)
// ---------------------------------------------------------------------------------------------
constexpr size_t kDynRegion = (kMaxDynamicShared + kPage - 1) / kPage * kPage;

char* map_region(size_t len) {
  void* p = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

// Grows `stacks` to n stacks (each: guard page + kStackBytes).
bool acquire_stacks(std::vector<char*>& stacks, size_t n) {
  while (stacks.size() < n) {
    char* m = map_region(kPage + kStackBytes);
    if (!m) return false;
    if (mprotect(m + kPage, kStackBytes, PROT_READ | PROT_WRITE) != 0) {
      munmap(m, kPage + kStackBytes);
      return false;
    }
    stacks.push_back(m);
  }
  return true;
}

// guard page + kDynRegion + guard page
char* acquire_dyn() {
  char* m = map_region(kPage + kDynRegion + kPage);
  if (!m) return nullptr;
  if (mprotect(m + kPage, kDynRegion, PROT_READ | PROT_WRITE) != 0) {
    munmap(m, kPage + kDynRegion + kPage);
    return nullptr;
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Kernel table
// ---------------------------------------------------------------------------------------------
struct KernelIndex {
  std::vector<const sluice_emu_kernel*> list;
  std::unordered_map<std::string_view, const sluice_emu_kernel*> by_name;
};
const KernelIndex& kernels() {
  static const KernelIndex idx = [] {
    KernelIndex k;
    for (const sluice_emu_kernel_table* const* t = sluice_emu_tables; *t; ++t) {
      for (unsigned i = 0; i < (*t)->count; ++i) {
        const sluice_emu_kernel* e = &(*t)->kernels[i];
        if (k.by_name.emplace(e->name, e).second) k.list.push_back(e);
      }
    }
    return k;
  }();
  return idx;
}

// ---------------------------------------------------------------------------------------------
// Fibers, blocks, workers
// ---------------------------------------------------------------------------------------------
using sluice_emu::WarpOp;

enum FiberState : unsigned char { kReady, kRunning, kBarrier, kWarp, kWarpGroup, kNamed, kDone };

struct Fiber {
  void* sp;
  char* stack;  // mapping: guard page + kStackBytes
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

struct Launch {
  const sluice_emu_kernel* kernel;
  unsigned grid[3];
  unsigned block[3];
  size_t dyn_bytes;
  void** params;
  unsigned long long seed;
  unsigned long long name_hash;
  unsigned long long nblocks;
  unsigned nthreads;
  std::mutex mu;
  std::condition_variable done;
  unsigned pending = 0;
  unsigned long long err_block = ~0ull;
  std::string error;
  void finish_one() {
    std::lock_guard<std::mutex> g(mu);
    if (--pending == 0) done.notify_all();
  }
  void report(unsigned long long block, std::string msg) {
    std::lock_guard<std::mutex> g(mu);
    if (block < err_block) {
      err_block = block;
      error = std::move(msg);
    }
  }
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
  char* dyn_region = nullptr;
  unsigned char* dyn_base = nullptr;
  size_t dyn_poison = 0;
  unsigned ndone = 0;
  unsigned long long rng = 0;
  void* sched_sp = nullptr;
  void* dead_sp = nullptr;
  bool failed = false;
  std::string error;
  unsigned long long block_linear = 0;
  uint3 bidx{};
  int bar_result = 0;
  // Static __shared__ variables seen on this host thread and the block that last poisoned them.
  struct StaticShared {
    const volatile void* p;
    size_t bytes;
    unsigned long long block;
  };
  std::vector<StaticShared> static_shared;
  unsigned long long block_serial = 0;
  unsigned long long spins = 0;  // emu_yield calls since the last barrier/warp op/exit
  std::vector<char> scratch;  // gather assembly buffer
  // fault handling
  sigjmp_buf jb;
  volatile bool catching = false;
  volatile int fault_sig = 0;
  volatile uintptr_t fault_addr = 0;
  volatile int fault_write = -1;
  Fiber* volatile fault_fiber = nullptr;
};

__attribute__((tls_model("initial-exec"))) thread_local Worker* t_worker = nullptr;
__attribute__((tls_model("initial-exec"))) thread_local Fiber* t_cur = nullptr;

unsigned long long splitmix(unsigned long long& s) {
  unsigned long long z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

unsigned pick_ready(Worker& w) {
  size_t n = w.ready.size();
  unsigned long long r = splitmix(w.rng) >> 32;
  size_t i = static_cast<size_t>((r * n) >> 32);
  unsigned idx = w.ready[i];
  w.ready[i] = w.ready.back();
  w.ready.pop_back();
  return idx;
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::Shfl: return "__shfl_sync";
    case WarpOp::ShflUp: return "__shfl_up_sync";
    case WarpOp::ShflDown: return "__shfl_down_sync";
    case WarpOp::ShflXor: return "__shfl_xor_sync";
    case WarpOp::Ballot: return "__ballot_sync";
    case WarpOp::Any: return "__any_sync";
    case WarpOp::All: return "__all_sync";
    case WarpOp::SyncWarp: return "__syncwarp";
    case WarpOp::Gather: return "emu_warp_gather";
    case WarpOp::ReduceAdd: return "__reduce_add_sync";
    case WarpOp::ReduceMin: return "__reduce_min_sync";
    case WarpOp::ReduceMax: return "__reduce_max_sync";
    case WarpOp::ReduceAnd: return "__reduce_and_sync";
    case WarpOp::ReduceOr: return "__reduce_or_sync";
    case WarpOp::ReduceXor: return "__reduce_xor_sync";
    case WarpOp::MatchAny: return "__match_any_sync";
    case WarpOp::MatchAll: return "__match_all_sync";
  }
  return "warp operation";
}

std::string where(const Worker& w) {
  const Launch& L = *w.L;
  return format("kernel %s block (%u,%u,%u)", L.kernel->name, w.bidx.x, w.bidx.y, w.bidx.z);
}
std::string thread_str(const Fiber& f) { return format("thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z); }

std::string describe(const Fiber& f) {
  std::string t = thread_str(f) + format(" [warp %u lane %u]", f.linear >> 5, f.linear & 31);
  switch (f.state) {
    case kDone: return t + " has exited";
    case kBarrier: return t + format(" waits at __syncthreads (%s:%u)", f.file, f.line);
    case kWarp:
      return t + format(" waits at %s(mask 0x%08x) (%s:%u)", op_name(f.op), f.mask, f.file, f.line);
    case kWarpGroup: return t + format(" waits at emu_warpgroup_gather (%s:%u)", f.file, f.line);
    case kNamed: return t + format(" waits at named barrier %d (%s:%u)", f.arg, f.file, f.line);
    case kReady:
    case kRunning: return t + " is running";
  }
  return t;
}

// Switches away from fiber f, which has set its waiting state (or kDone). Returns when f runs again.
void suspend(Worker& w, Fiber* f) {
  if (!w.failed && !w.ready.empty()) {
    unsigned idx = pick_ready(w);
    Fiber* n = &w.fibers[idx];
    n->state = kRunning;
    if (n == f) return;
    t_cur = n;
    threadIdx = n->tid;
    sluice_emu_switch(&f->sp, n->sp);
  } else {
    t_cur = nullptr;
    sluice_emu_switch(&f->sp, w.sched_sp);
  }
}

// Records an error for the block. In a fiber, abandons the block (never returns); in the scheduler
// context, returns so the caller can stop.
void block_fail(Worker& w, std::string msg) {
  if (!w.failed) {
    w.failed = true;
    w.error = std::move(msg);
  }
  if (t_cur) {
    t_cur = nullptr;
    sluice_emu_switch(&w.dead_sp, w.sched_sp);
    __builtin_unreachable();
  }
}

[[noreturn]] void fiber_fail(Worker& w, std::string msg) {
  block_fail(w, std::move(msg));
  __builtin_unreachable();
}

extern "C" void sluice_emu_fiber_main(Fiber* f) {
  Worker& w = *t_worker;
  w.L->kernel->entry(w.L->params);
  f->state = kDone;
  ++w.ndone;
  w.spins = 0;
  unsigned lane = f->linear & 31;
  Warp& W = w.warps[f->linear >> 5];
  W.live &= ~(1u << lane);
  for (unsigned i = 0; i < W.npend; ++i) {
    if (W.pend[i].mask & (1u << lane)) {
      unsigned first = static_cast<unsigned>(__builtin_ctz(W.pend[i].arrived));
      const Fiber& o = w.fibers[(f->linear & ~31u) + first];
      fiber_fail(w, where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u names lane %u (%s), which exited without "
                                      "executing it (lanes 0x%08x had arrived); a warp operation's mask must name "
                                      "exactly the lanes that execute it",
                                      f->linear >> 5, op_name(o.op), o.mask, o.file, o.line, lane,
                                      thread_str(*f).c_str(), W.pend[i].arrived));
    }
  }
  if (!w.wg_arrived.empty() && w.wg_arrived[f->linear / 128] != 0) {
    fiber_fail(w, where(w) + format(": %s exited while %u threads of warpgroup %u wait at emu_warpgroup_gather",
                                    thread_str(*f).c_str(), w.wg_arrived[f->linear / 128], f->linear / 128));
  }
  suspend(w, f);
  __builtin_trap();  // a finished fiber is never resumed
}

void init_fiber_stack(Fiber& f) {
  char* top = f.stack + kPage + kStackBytes;
  auto* s = reinterpret_cast<unsigned long long*>(top);
  s[-1] = reinterpret_cast<unsigned long long>(&sluice_emu_fiber_start);
  s[-2] = 0;                                                        // rbp
  s[-3] = reinterpret_cast<unsigned long long>(&f);                 // rbx: argument
  s[-4] = reinterpret_cast<unsigned long long>(&sluice_emu_fiber_main);  // r12: function
  s[-5] = 0;                                                        // r13
  s[-6] = 0;                                                        // r14
  s[-7] = 0;                                                        // r15
  s[-8] = 0x1f80ull | (0x037full << 32);                            // MXCSR, x87 control word
  f.sp = &s[-8];
}

void complete_warp_op(Worker& w, unsigned warp, const PendingWarpOp& p) {
  const unsigned base = warp * 32;
  const unsigned mask = p.mask;
  const Fiber& f0 = w.fibers[base + static_cast<unsigned>(__builtin_ctz(mask))];
  for (unsigned m = mask; m; m &= m - 1) {
    const Fiber& l = w.fibers[base + static_cast<unsigned>(__builtin_ctz(m))];
    if (l.op != f0.op || l.size != f0.size) {
      fiber_fail(w, where(w) + format(": lanes of warp %u reached different warp operations under mask 0x%08x: "
                                      "lane %u at %s (%s:%u), lane %u at %s (%s:%u)",
                                      warp, mask, f0.linear & 31, op_name(f0.op), f0.file, f0.line,
                                      l.linear & 31, op_name(l.op), l.file, l.line));
    }
  }
  const unsigned size = f0.size;
  switch (f0.op) {
    case WarpOp::Shfl:
    case WarpOp::ShflUp:
    case WarpOp::ShflDown:
    case WarpOp::ShflXor:
      for (unsigned m = mask; m; m &= m - 1) {
        unsigned lane = static_cast<unsigned>(__builtin_ctz(m));
        Fiber& l = w.fibers[base + lane];
        // PTX shfl.sync semantics: segments of `width` lanes; a source outside the segment (or
        // past its end for bfly) gives the lane's own value.
        unsigned seg = static_cast<unsigned>(32 - l.width);
        unsigned min_lane = lane & seg;
        unsigned max_lane = min_lane | (31u & ~seg);
        unsigned b = static_cast<unsigned>(l.arg);
        unsigned j = lane;
        bool ok = true;
        switch (l.op) {
          case WarpOp::Shfl: j = min_lane | (b & 31u & ~seg); ok = j <= max_lane; break;
          case WarpOp::ShflUp: ok = lane >= min_lane + b && b < 32u; j = ok ? lane - b : lane; break;
          case WarpOp::ShflDown: j = lane + b; ok = b < 32u && j <= max_lane; break;
          default: j = lane ^ (b & 31u); ok = j <= max_lane; break;
        }
        if (!ok) j = lane;
        if (mask & (1u << j)) {
          std::memcpy(l.out, w.fibers[base + j].in, size);
        } else {
          std::memset(l.out, 0xff, size);  // source lane not taking part: undefined on the GPU
        }
      }
      break;
    case WarpOp::Ballot:
    case WarpOp::Any:
    case WarpOp::All: {
      unsigned ballot = 0;
      for (unsigned m = mask; m; m &= m - 1) {
        unsigned lane = static_cast<unsigned>(__builtin_ctz(m));
        if (*static_cast<const int*>(w.fibers[base + lane].in) != 0) ballot |= 1u << lane;
      }
      for (unsigned m = mask; m; m &= m - 1) {
        Fiber& l = w.fibers[base + static_cast<unsigned>(__builtin_ctz(m))];
        if (f0.op == WarpOp::Ballot) *static_cast<unsigned*>(l.out) = ballot;
        else if (f0.op == WarpOp::Any) *static_cast<int*>(l.out) = ballot != 0;
        else *static_cast<int*>(l.out) = ballot == mask;
      }
      break;
    }
    case WarpOp::SyncWarp: break;
    case WarpOp::Gather: {
      // Assemble the 32 values once, then one contiguous copy per lane.
      w.scratch.resize(static_cast<size_t>(size) * 32);
      for (unsigned s = 0; s < 32; ++s) std::memcpy(&w.scratch[static_cast<size_t>(s) * size], w.fibers[base + s].in, size);
      for (unsigned i = 0; i < 32; ++i) std::memcpy(w.fibers[base + i].out, w.scratch.data(), w.scratch.size());
      break;
    }
    case WarpOp::ReduceAdd:
    case WarpOp::ReduceMin:
    case WarpOp::ReduceMax:
    case WarpOp::ReduceAnd:
    case WarpOp::ReduceOr:
    case WarpOp::ReduceXor: {
      bool sgn = f0.arg != 0;
      unsigned acc = *static_cast<const unsigned*>(f0.in);
      for (unsigned m = mask & (mask - 1); m; m &= m - 1) {
        unsigned v = *static_cast<const unsigned*>(w.fibers[base + static_cast<unsigned>(__builtin_ctz(m))].in);
        switch (f0.op) {
          case WarpOp::ReduceAdd: acc += v; break;
          case WarpOp::ReduceMin:
            acc = sgn ? static_cast<unsigned>(std::min(static_cast<int>(acc), static_cast<int>(v))) : std::min(acc, v);
            break;
          case WarpOp::ReduceMax:
            acc = sgn ? static_cast<unsigned>(std::max(static_cast<int>(acc), static_cast<int>(v))) : std::max(acc, v);
            break;
          case WarpOp::ReduceAnd: acc &= v; break;
          case WarpOp::ReduceOr: acc |= v; break;
          default: acc ^= v; break;
        }
      }
      for (unsigned m = mask; m; m &= m - 1) {
        *static_cast<unsigned*>(w.fibers[base + static_cast<unsigned>(__builtin_ctz(m))].out) = acc;
      }
      break;
    }
    case WarpOp::MatchAny:
    case WarpOp::MatchAll: {
      bool all_equal = true;
      for (unsigned m = mask; m; m &= m - 1) {
        unsigned lane = static_cast<unsigned>(__builtin_ctz(m));
        unsigned same = 0;
        for (unsigned k = mask; k; k &= k - 1) {
          unsigned o = static_cast<unsigned>(__builtin_ctz(k));
          if (std::memcmp(w.fibers[base + lane].in, w.fibers[base + o].in, size) == 0) same |= 1u << o;
        }
        if (same != mask) all_equal = false;
        *static_cast<unsigned*>(w.fibers[base + lane].out) = same;
      }
      if (f0.op == WarpOp::MatchAll) {
        for (unsigned m = mask; m; m &= m - 1) {
          *static_cast<unsigned*>(w.fibers[base + static_cast<unsigned>(__builtin_ctz(m))].out) =
              all_equal ? mask : 0u;
        }
      }
      break;
    }
  }
  for (unsigned m = mask; m; m &= m - 1) {
    unsigned idx = base + static_cast<unsigned>(__builtin_ctz(m));
    w.fibers[idx].state = kReady;
    w.ready.push_back(idx);
  }
}

// Called in the scheduler context when no fiber is ready and not all have exited. Either releases
// a barrier (returns true) or records why the block cannot continue (returns false).
bool resolve_quiescence(Worker& w) {
  const unsigned n = static_cast<unsigned>(w.fibers.size());
  for (unsigned wi = 0; wi < w.warps.size(); ++wi) {
    const Warp& W = w.warps[wi];
    if (W.npend == 0) continue;
    const PendingWarpOp& p = W.pend[0];
    const Fiber& a = w.fibers[wi * 32 + static_cast<unsigned>(__builtin_ctz(p.arrived))];
    std::string msg = where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u can never complete: lanes 0x%08x arrived",
                                        wi, op_name(a.op), p.mask, a.file, a.line, p.arrived);
    int listed = 0;
    for (unsigned m = p.mask & ~p.arrived; m && listed < 4; m &= m - 1, ++listed) {
      msg += "; " + describe(w.fibers[wi * 32 + static_cast<unsigned>(__builtin_ctz(m))]);
    }
    block_fail(w, msg + " (a warp operation's mask must name exactly the lanes that execute it)");
    return false;
  }
  for (unsigned g = 0; g < w.wg_arrived.size(); ++g) {
    if (w.wg_arrived[g] == 0) continue;
    std::string msg = where(w) + format(": emu_warpgroup_gather of warpgroup %u can never complete (%u of 128 arrived)",
                                        g, w.wg_arrived[g]);
    for (unsigned t = g * 128; t < g * 128 + 128; ++t) {
      if (w.fibers[t].state != kWarpGroup) {
        msg += "; " + describe(w.fibers[t]);
        break;
      }
    }
    block_fail(w, msg);
    return false;
  }
  for (unsigned id = 0; id < 16; ++id) {
    if (w.named[id].arrived == 0) continue;
    block_fail(w, where(w) + format(": named barrier %u can never complete (%u of %u threads arrived)", id,
                                    w.named[id].arrived, w.named[id].expected));
    return false;
  }
  // Every live fiber waits at __syncthreads.
  const Fiber* first = nullptr;
  const Fiber* exited = nullptr;
  unsigned count = 0;
  for (const Fiber& f : w.fibers) {
    if (f.state == kDone) {
      if (!exited) exited = &f;
      continue;
    }
    if (!first) first = &f;
    if (f.file != first->file || f.line != first->line || f.arg != first->arg) {
      block_fail(w, where(w) + format(": divergent __syncthreads: %s and %s", describe(*first).c_str(),
                                      describe(f).c_str()));
      return false;
    }
    if (f.pred) ++count;
  }
  if (exited) {
    block_fail(w, where(w) + format(": divergent __syncthreads: %u threads wait at the barrier at %s:%u, but %u "
                                    "threads of the block exited without reaching it (e.g. %s); every thread of "
                                    "the block must reach every barrier (no early return before a barrier)",
                                    n - w.ndone, first->file, first->line, w.ndone, thread_str(*exited).c_str()));
    return false;
  }
  const unsigned live = n;
  switch (first->arg) {
    case 1: w.bar_result = static_cast<int>(count); break;
    case 2: w.bar_result = count == live; break;
    case 3: w.bar_result = count != 0; break;
    default: w.bar_result = 0; break;
  }
  for (unsigned i = 0; i < n; ++i) {
    w.fibers[i].state = kReady;
    w.ready.push_back(i);
  }
  return true;
}

unsigned long long fnv1a(const char* s) {
  unsigned long long h = 0xcbf29ce484222325ull;
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 0x100000001b3ull;
  return h;
}

// Runs one block to completion on the current worker. Returns false on error (w.error set).
bool run_block(Worker& w, unsigned long long b) {
  const Launch& L = *w.L;
  w.block_linear = b;
  ++w.block_serial;
  w.bidx = uint3{static_cast<unsigned>(b % L.grid[0]), static_cast<unsigned>((b / L.grid[0]) % L.grid[1]),
                 static_cast<unsigned>(b / (static_cast<unsigned long long>(L.grid[0]) * L.grid[1]))};
  blockIdx = w.bidx;
  unsigned long long s = L.seed ^ (L.name_hash * 0x9e3779b97f4a7c15ull);
  s = splitmix(s) ^ (b * 0xd1b54a32d192ed03ull);
  w.rng = splitmix(s);
  if (w.dyn_poison) std::memset(w.dyn_base, 0xff, w.dyn_poison);
  const unsigned n = L.nthreads;
  w.ready.clear();
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    f.state = kReady;
    init_fiber_stack(f);
    w.ready.push_back(i);
  }
  for (unsigned wi = 0; wi < w.warps.size(); ++wi) {
    Warp& W = w.warps[wi];
    unsigned lanes = std::min(32u, n - wi * 32);
    W.exists = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    W.live = W.exists;
    W.npend = 0;
  }
  std::fill(w.wg_arrived.begin(), w.wg_arrived.end(), 0u);
  for (NamedBarrier& nb : w.named) nb = NamedBarrier{};
  w.ndone = 0;
  w.spins = 0;
  w.failed = false;
  for (;;) {
    if (w.failed) return false;
    if (w.ready.empty()) {
      if (w.ndone == n) return true;
      if (!resolve_quiescence(w)) return false;
      continue;
    }
    Fiber* f = &w.fibers[pick_ready(w)];
    f->state = kRunning;
    t_cur = f;
    threadIdx = f->tid;
    sluice_emu_switch(&w.sched_sp, f->sp);
    t_cur = nullptr;
  }
}

std::string describe_fault(Worker& w) {
  const uintptr_t addr = w.fault_addr;
  std::string who = where(w);
  if (w.fault_fiber) who += " " + thread_str(*w.fault_fiber);
  const char* kind = w.fault_write == 1 ? "write" : (w.fault_write == 0 ? "read" : "access");
  switch (w.fault_sig) {
    case SIGFPE: return who + ": arithmetic exception (integer division by zero or overflow)";
    case SIGILL: return who + ": illegal instruction (a trap or unreachable code was executed)";
    default: break;
  }
  for (const Fiber& f : w.fibers) {
    uintptr_t lo = reinterpret_cast<uintptr_t>(f.stack);
    if (addr >= lo && addr < lo + kPage) {
      return who + format(": fiber stack overflow (%zu KiB per thread): large local arrays?", kStackBytes / 1024);
    }
  }
  uintptr_t dyn = reinterpret_cast<uintptr_t>(w.dyn_base);
  if (dyn && addr + kPage >= dyn && addr < dyn + kDynRegion + kPage) {
    long long off = static_cast<long long>(addr) - static_cast<long long>(dyn);
    return who + format(": out-of-bounds dynamic shared memory %s at byte offset %lld (%zu bytes were requested at launch)",
                        kind, off, w.L->dyn_bytes);
  }
  {
    std::lock_guard<std::mutex> g(g_alloc_mu);
    if (const Alloc* a = find_alloc_locked(addr)) {
      long long off = static_cast<long long>(addr) - reinterpret_cast<long long>(a->start);
      return who + format(": out-of-bounds %s at byte offset %lld of allocation #%llu (%zu bytes)%s", kind, off, a->id,
                          a->bytes, off < 0 ? ", before its start" : ", past its end");
    }
  }
  if (addr < 65536) return who + format(": null pointer %s (address 0x%zx)", kind, static_cast<size_t>(addr));
  return who + format(": invalid memory %s at address 0x%zx, which is in no emu allocation (freed memory, or a "
                      "pointer that did not come from sluice_emu_alloc)",
                      kind, static_cast<size_t>(addr));
}

// Runs job `widx` of launch L (blocks widx, widx + nworkers, ...) on the calling pool thread.
void run_job(Worker& w, Launch* L, unsigned widx, unsigned nworkers) {
  w.L = L;
  w.failed = false;
  w.error.clear();
  blockDim = dim3(L->block[0], L->block[1], L->block[2]);
  gridDim = dim3(L->grid[0], L->grid[1], L->grid[2]);
  const unsigned n = L->nthreads;
  if (!w.dyn_region || !w.alt_ok || !acquire_stacks(w.stacks, n)) {
    L->report(widx, format("kernel %s: out of memory for emulator stacks", L->kernel->name));
    return;
  }
  w.dyn_poison = round_up(L->dyn_bytes, kPage);
  if (w.dyn_poison < kDynRegion) mprotect(w.dyn_base + w.dyn_poison, kDynRegion - w.dyn_poison, PROT_NONE);
  w.fibers.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    f = Fiber{};
    f.stack = w.stacks[i];
    f.linear = i;
    f.tid = uint3{i % L->block[0], (i / L->block[0]) % L->block[1], i / (L->block[0] * L->block[1])};
  }
  w.warps.resize((n + 31) / 32);
  w.wg_arrived.assign(n % 128 == 0 ? n / 128 : 0, 0u);
  if (sigsetjmp(w.jb, 1) == 0) {
    w.catching = true;
    for (unsigned long long b = widx; b < L->nblocks; b += nworkers) {
      if (!run_block(w, b)) {
        L->report(b, w.error);
        break;
      }
    }
    w.catching = false;
  } else {
    w.catching = false;
    L->report(w.block_linear, describe_fault(w));
  }
  t_cur = nullptr;
  if (w.dyn_poison < kDynRegion) mprotect(w.dyn_base + w.dyn_poison, kDynRegion - w.dyn_poison, PROT_READ | PROT_WRITE);
}

// The host threads that run blocks: started on demand (up to the largest SLUICE_EMU_THREADS
// asked for), shared by concurrent launches, alive for the rest of the process. Each keeps its
// alternate signal stack, dynamic shared memory region (whose address kernels may cache in a
// thread_local) and fiber stacks across launches. Which thread runs a job does not matter: a
// job's blocks, and their schedules, depend only on the launch and the job index.
struct Job {
  Launch* L;
  unsigned widx;
  unsigned nworkers;
};
struct Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> jobs;
  unsigned threads = 0;
};
Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: pool threads wait on it until the process exits
  return *p;
}

void pool_thread() {
  Worker w;
  t_worker = &w;
  char* alt = map_region(kAltStackBytes);
  w.alt_ok = alt && mprotect(alt, kAltStackBytes, PROT_READ | PROT_WRITE) == 0;
  if (w.alt_ok) {
    stack_t ss{};
    ss.ss_sp = alt;
    ss.ss_size = kAltStackBytes;
    w.alt_ok = sigaltstack(&ss, nullptr) == 0;
  }
  w.dyn_region = acquire_dyn();
  if (w.dyn_region) w.dyn_base = reinterpret_cast<unsigned char*>(w.dyn_region + kPage);
  Pool& p = pool();
  for (;;) {
    Job j;
    {
      std::unique_lock<std::mutex> lk(p.mu);
      p.cv.wait(lk, [&] { return !p.jobs.empty(); });
      j = p.jobs.front();
      p.jobs.pop_front();
    }
    run_job(w, j.L, j.widx, j.nworkers);
    j.L->finish_one();
  }
}

// ---------------------------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------------------------
constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction g_old_actions[4];

int signal_slot(int sig) {
  for (int i = 0; i < 4; ++i) {
    if (kSignals[i] == sig) return i;
  }
  return -1;
}

void on_fault(int sig, siginfo_t* si, void* uc) {
  Worker* w = t_worker;
  if (w && w->catching) {
    w->catching = false;
    w->fault_sig = sig;
    w->fault_addr = reinterpret_cast<uintptr_t>(si->si_addr);
    w->fault_write = -1;
    if (sig == SIGSEGV && uc) {
      // x86 page-fault error code: bit 1 set for a write.
      w->fault_write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
    }
    w->fault_fiber = t_cur;
    siglongjmp(w->jb, 1);
  }
  // Not ours: hand over to whatever was installed before (Rust's stack-overflow handler, ...).
  int slot = signal_slot(sig);
  const struct sigaction& old = g_old_actions[slot < 0 ? 0 : slot];
  if ((old.sa_flags & SA_SIGINFO) && old.sa_sigaction) {
    old.sa_sigaction(sig, si, uc);
    return;
  }
  if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN && old.sa_handler) {
    old.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);  // returning re-executes the faulting instruction, which now kills the process
}

void install_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int i = 0; i < 4; ++i) {
      struct sigaction sa{};
      sa.sa_sigaction = on_fault;
      sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
      sigemptyset(&sa.sa_mask);
      sigaction(kSignals[i], &sa, &g_old_actions[i]);
    }
  });
}

unsigned worker_count() {
  unsigned hw = std::thread::hardware_concurrency();
  unsigned n = hw == 0 ? 1 : std::min(hw, kMaxWorkers);
  if (const char* e = std::getenv("SLUICE_EMU_THREADS")) {
    char* end = nullptr;
    unsigned long v = std::strtoul(e, &end, 10);
    if (end != e && v > 0) n = static_cast<unsigned>(std::min<unsigned long>(v, 64));
  }
  return n;
}

int fail_launch(char* err, size_t cap, const std::string& msg, int code) {
  if (err && cap) std::snprintf(err, cap, "%s", msg.c_str());
  return code;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Intrinsics called from kernel code
// ---------------------------------------------------------------------------------------------
namespace sluice_emu {

static Worker& current_worker(const char* what) {
  Worker* w = t_worker;
  if (!w || !t_cur) {
    std::fprintf(stderr, "sluice emu: %s called outside an emulated kernel launch\n", what);
    std::abort();
  }
  return *w;
}

void warp_op(WarpOp op, unsigned mask, const void* in, void* out, unsigned size, int arg, int width,
             const std::source_location& loc) {
  Worker& w = current_worker(op_name(op));
  Fiber* f = t_cur;
  const unsigned lane = f->linear & 31;
  const unsigned wi = f->linear >> 5;
  Warp& W = w.warps[wi];
  const char* name = op_name(op);
  if (!(mask & (1u << lane))) {
    fiber_fail(w, where(w) + format(" warp %u: %s calls %s with mask 0x%08x, which does not include its own lane %u (%s:%u)",
                                    wi, thread_str(*f).c_str(), name, mask, lane, loc.file_name(), loc.line()));
  }
  if (mask & ~W.exists) {
    fiber_fail(w, where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u names lanes 0x%08x that do not exist "
                                    "(the block has %u threads)",
                                    wi, name, mask, loc.file_name(), loc.line(), mask & ~W.exists, w.L->nthreads));
  }
  if (mask & ~W.live) {
    unsigned gone = static_cast<unsigned>(__builtin_ctz(mask & ~W.live));
    fiber_fail(w, where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u names lane %u, which has exited", wi, name,
                                    mask, loc.file_name(), loc.line(), gone));
  }
  if (op == WarpOp::Gather && W.exists != 0xffffffffu) {
    fiber_fail(w, where(w) + format(" warp %u: emu_warp_gather at %s:%u needs a full warp", wi, loc.file_name(), loc.line()));
  }
  if (op <= WarpOp::ShflXor && (width < 1 || width > 32 || (width & (width - 1)) != 0)) {
    fiber_fail(w, where(w) + format(" warp %u: %s at %s:%u with width %d (must be a power of two <= 32)", wi, name,
                                    loc.file_name(), loc.line(), width));
  }
  w.spins = 0;
  f->op = op;
  f->mask = mask;
  f->size = size;
  f->arg = arg;
  f->width = width;
  f->in = in;
  f->out = out;
  f->file = loc.file_name();
  f->line = loc.line();
  f->state = kWarp;
  unsigned i = 0;
  while (i < W.npend && W.pend[i].mask != mask) ++i;
  if (i == W.npend) W.pend[W.npend++] = PendingWarpOp{mask, 0};
  W.pend[i].arrived |= 1u << lane;
  if (W.pend[i].arrived == mask) {
    PendingWarpOp p = W.pend[i];
    W.pend[i] = W.pend[--W.npend];
    complete_warp_op(w, wi, p);
  }
  suspend(w, f);
}

void warpgroup_gather(const void* in, void* out, unsigned size, const std::source_location& loc) {
  Worker& w = current_worker("emu_warpgroup_gather");
  Fiber* f = t_cur;
  if (w.wg_arrived.empty()) {
    fiber_fail(w, where(w) + format(": emu_warpgroup_gather at %s:%u needs a multiple of 128 threads per block (has %u)",
                                    loc.file_name(), loc.line(), w.L->nthreads));
  }
  const unsigned g = f->linear / 128;
  for (unsigned t = g * 128; t < g * 128 + 128; ++t) {
    if (w.fibers[t].state == kDone) {
      fiber_fail(w, where(w) + format(": emu_warpgroup_gather at %s:%u: %s of warpgroup %u has exited", loc.file_name(),
                                      loc.line(), thread_str(w.fibers[t]).c_str(), g));
    }
  }
  w.spins = 0;
  f->in = in;
  f->out = out;
  f->size = size;
  f->file = loc.file_name();
  f->line = loc.line();
  f->state = kWarpGroup;
  if (++w.wg_arrived[g] == 128) {
    w.wg_arrived[g] = 0;
    for (unsigned t = g * 128; t < g * 128 + 128; ++t) {
      const Fiber& o = w.fibers[t];
      if (o.size != size) {
        fiber_fail(w, where(w) + format(": emu_warpgroup_gather with different sizes (%u at %s:%u, %u at %s:%u)", size,
                                        f->file, f->line, o.size, o.file, o.line));
      }
    }
    w.scratch.resize(static_cast<size_t>(size) * 128);
    for (unsigned s = 0; s < 128; ++s) std::memcpy(&w.scratch[static_cast<size_t>(s) * size], w.fibers[g * 128 + s].in, size);
    for (unsigned t = g * 128; t < g * 128 + 128; ++t) {
      std::memcpy(w.fibers[t].out, w.scratch.data(), w.scratch.size());
      w.fibers[t].state = kReady;
      w.ready.push_back(t);
    }
  }
  suspend(w, f);
}

int barrier(int kind, int pred, const std::source_location& loc) {
  Worker& w = current_worker("__syncthreads");
  Fiber* f = t_cur;
  w.spins = 0;
  f->arg = kind;
  f->pred = pred != 0;
  f->file = loc.file_name();
  f->line = loc.line();
  f->state = kBarrier;
  suspend(w, f);
  return w.bar_result;
}

void named_barrier(unsigned id, unsigned count, const std::source_location& loc) {
  Worker& w = current_worker("named barrier");
  Fiber* f = t_cur;
  if (id >= 16 || count == 0 || count % 32 != 0 || count > w.L->nthreads) {
    fiber_fail(w, where(w) + format(": named barrier %u with %u threads at %s:%u (id must be < 16, count a multiple "
                                    "of 32 and at most the block size %u)",
                                    id, count, loc.file_name(), loc.line(), w.L->nthreads));
  }
  NamedBarrier& nb = w.named[id];
  if (nb.arrived != 0 && nb.expected != count) {
    fiber_fail(w, where(w) + format(": named barrier %u used with thread counts %u and %u (%s:%u)", id, nb.expected,
                                    count, loc.file_name(), loc.line()));
  }
  nb.expected = count;
  w.spins = 0;
  f->arg = static_cast<int>(id);
  f->file = loc.file_name();
  f->line = loc.line();
  f->state = kNamed;
  if (++nb.arrived == count) {
    nb = NamedBarrier{};
    for (unsigned i = 0; i < w.fibers.size(); ++i) {
      if (w.fibers[i].state == kNamed && w.fibers[i].arg == static_cast<int>(id)) {
        w.fibers[i].state = kReady;
        w.ready.push_back(i);
      }
    }
  }
  suspend(w, f);
}

void yield_now(const std::source_location& loc) {
  Worker& w = current_worker("emu_yield");
  Fiber* f = t_cur;
  if (++w.spins > (1ull << 22)) {
    fiber_fail(w, where(w) + format(" %s: spin-wait at %s:%u made no progress: 4 M yields without any barrier, warp "
                                    "operation or thread exit in the block (waiting for something no thread will do)",
                                    thread_str(*f).c_str(), loc.file_name(), loc.line()));
  }
  f->state = kReady;
  w.ready.push_back(f->linear);
  suspend(w, f);
}

void fail(const char* what, const char* file, unsigned line) {
  Worker& w = current_worker(what);
  fiber_fail(w, where(w) + format(" %s: %s at %s:%u", thread_str(*t_cur).c_str(), what, file, line));
}

unsigned live_lanes() {
  Worker& w = current_worker("__activemask");
  return w.warps[t_cur->linear >> 5].live;
}

void touch_shared(const volatile void* p, std::size_t bytes) {
  Worker* w = t_worker;
  if (!w) return;
  for (auto& v : w->static_shared) {
    if (v.p == p) {
      if (v.block != w->block_serial) {
        v.block = w->block_serial;
        std::memset(const_cast<void*>(p), 0xff, bytes);
      }
      return;
    }
  }
  w->static_shared.push_back(Worker::StaticShared{p, bytes, w->block_serial});
  std::memset(const_cast<void*>(p), 0xff, bytes);
}

unsigned char* dynamic_shared_base() {
  Worker* w = t_worker;
  return w ? w->dyn_base : nullptr;
}

}  // namespace sluice_emu

extern "C" void sluice_emu_assert_fail(const char* expr, const char* file, unsigned line) {
  std::string what = std::string("assertion `") + expr + "` failed";
  sluice_emu::fail(what.c_str(), file, line);
}

// ---------------------------------------------------------------------------------------------
// C ABI
// ---------------------------------------------------------------------------------------------
extern "C" void* sluice_emu_alloc(size_t bytes) {
  if (bytes > (size_t{1} << 46)) return nullptr;
  const size_t body = round_up(bytes, 256);
  const size_t body_pages = round_up(body, kPage);
  const size_t map_len = kFrontGuard + body_pages + kBackGuard;
  char* m = map_region(map_len);
  if (!m) return nullptr;
  if (body_pages && mprotect(m + kFrontGuard, body_pages, PROT_READ | PROT_WRITE) != 0) {
    munmap(m, map_len);
    return nullptr;
  }
  Alloc a{};
  a.map = m;
  a.map_len = map_len;
  a.start = m + kFrontGuard + body_pages - body;
  a.bytes = bytes;
  a.body = body;
  std::memset(a.start, 0xff, bytes);
  restore_canaries_locked(a);
  std::lock_guard<std::mutex> g(g_alloc_mu);
  a.id = g_alloc_next_id++;
  g_allocs.emplace(reinterpret_cast<uintptr_t>(a.start), a);
  return a.start;
}

extern "C" void sluice_emu_free(void* p) {
  if (!p) return;
  Alloc a{};
  {
    std::lock_guard<std::mutex> g(g_alloc_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end()) return;
    a = it->second;
    g_allocs.erase(it);
  }
  munmap(a.map, a.map_len);
}

extern "C" int sluice_emu_kernel_count(void) { return static_cast<int>(kernels().list.size()); }

extern "C" const char* sluice_emu_kernel_name(int i) {
  const KernelIndex& k = kernels();
  if (i < 0 || static_cast<size_t>(i) >= k.list.size()) return nullptr;
  return k.list[static_cast<size_t>(i)]->name;
}

extern "C" const char* sluice_emu_kernel_signature(const char* kernel) {
  if (!kernel) return nullptr;
  const KernelIndex& k = kernels();
  auto it = k.by_name.find(std::string_view(kernel));
  return it == k.by_name.end() ? nullptr : it->second->signature;
}

extern "C" int sluice_emu_launch(const char* kernel, const unsigned grid[3], const unsigned block[3],
                                 size_t dynamic_shared_bytes, void** params, unsigned long long seed, char* err,
                                 size_t err_cap) {
  if (err && err_cap) err[0] = '\0';
  if (!kernel || !grid || !block) return fail_launch(err, err_cap, "sluice_emu_launch: null argument", 1);
  const KernelIndex& idx = kernels();
  auto it = idx.by_name.find(std::string_view(kernel));
  if (it == idx.by_name.end()) {
    return fail_launch(err, err_cap,
                       format("kernel %s is not in the emulator's kernel table (%zu kernels compiled from kernels/cuda)",
                              kernel, idx.list.size()),
                       1);
  }
  const sluice_emu_kernel* k = it->second;
  unsigned long long nthreads = static_cast<unsigned long long>(block[0]) * block[1] * block[2];
  if (block[0] == 0 || block[1] == 0 || block[2] == 0 || nthreads > 1024 || block[0] > 1024 || block[1] > 1024 ||
      block[2] > 64) {
    return fail_launch(err, err_cap,
                       format("kernel %s: invalid block (%u,%u,%u): at most 1024 threads, (1024,1024,64) per dimension",
                              kernel, block[0], block[1], block[2]),
                       1);
  }
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535) {
    return fail_launch(err, err_cap,
                       format("kernel %s: invalid grid (%u,%u,%u)", kernel, grid[0], grid[1], grid[2]), 1);
  }
  if (dynamic_shared_bytes > kMaxDynamicShared) {
    return fail_launch(err, err_cap,
                       format("kernel %s: %zu bytes of dynamic shared memory requested, more than the %zu an sm_90 "
                              "block can have",
                              kernel, dynamic_shared_bytes, kMaxDynamicShared),
                       1);
  }
  if (k->nparams > 0 && !params) {
    return fail_launch(err, err_cap, format("kernel %s: takes %u parameters but params is null", kernel, k->nparams), 1);
  }
  for (unsigned i = 0; i < k->nparams; ++i) {
    if (!params[i]) return fail_launch(err, err_cap, format("kernel %s: params[%u] is null", kernel, i), 1);
  }
  // Every non-null pointer argument must point into (or one past) an emu allocation.
  std::vector<const void*> ptrs(k->nparams);
  std::vector<unsigned> ptr_index(k->nparams);
  unsigned nptrs = k->pointer_args(params, ptrs.data());
  k->pointer_arg_index(ptr_index.data());
  std::vector<uintptr_t> checked;  // starts of the allocations to check after the launch
  std::vector<unsigned> checked_arg;
  {
    std::lock_guard<std::mutex> g(g_alloc_mu);
    for (unsigned i = 0; i < nptrs; ++i) {
      if (!ptrs[i]) continue;
      uintptr_t p = reinterpret_cast<uintptr_t>(ptrs[i]);
      const Alloc* a = find_alloc_locked(p);
      uintptr_t s = a ? reinterpret_cast<uintptr_t>(a->start) : 0;
      if (!a || p < s || p > s + a->bytes) {
        return fail_launch(err, err_cap,
                           format("kernel %s: pointer argument %u (%p) does not point into memory from "
                                  "sluice_emu_alloc",
                                  kernel, ptr_index[i], ptrs[i]),
                           1);
      }
      if (std::find(checked.begin(), checked.end(), s) == checked.end()) {
        checked.push_back(s);
        checked_arg.push_back(ptr_index[i]);
      }
    }
  }

  install_signal_handlers();
  Launch L;
  L.kernel = k;
  std::memcpy(L.grid, grid, sizeof L.grid);
  std::memcpy(L.block, block, sizeof L.block);
  L.dyn_bytes = dynamic_shared_bytes;
  L.params = params;
  L.seed = seed;
  L.name_hash = fnv1a(k->name);
  L.nblocks = static_cast<unsigned long long>(grid[0]) * grid[1] * grid[2];
  L.nthreads = static_cast<unsigned>(nthreads);
  const unsigned nworkers = static_cast<unsigned>(std::min<unsigned long long>(worker_count(), L.nblocks));
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> g(p.mu);
    try {
      while (p.threads < nworkers) {
        std::thread(pool_thread).detach();
        ++p.threads;
      }
    } catch (const std::exception& e) {
      if (p.threads == 0) {
        return fail_launch(err, err_cap, format("kernel %s: could not start emulator threads: %s", kernel, e.what()), 1);
      }
    }
    L.pending = nworkers;
    for (unsigned i = 0; i < nworkers; ++i) p.jobs.push_back(Job{&L, i, nworkers});
    p.cv.notify_all();
  }
  {
    std::unique_lock<std::mutex> lk(L.mu);
    L.done.wait(lk, [&] { return L.pending == 0; });
  }
  if (!L.error.empty()) return fail_launch(err, err_cap, L.error, 2);

  std::lock_guard<std::mutex> g(g_alloc_mu);
  for (size_t i = 0; i < checked.size(); ++i) {
    auto a = g_allocs.find(checked[i]);
    if (a == g_allocs.end()) continue;
    std::string bad = check_canaries_locked(a->second);
    if (!bad.empty()) {
      restore_canaries_locked(a->second);  // report each overwrite once
      return fail_launch(err, err_cap,
                         format("kernel %s wrote out of bounds: %s (pointer argument %u)", kernel, bad.c_str(),
                                checked_arg[i]),
                         3);
    }
  }
  return 0;
}
