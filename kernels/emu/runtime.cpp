// runtime.cpp — the emulator's scheduler and C ABI (emu_api.h). See docs/emulator.md.
//
// Structure (the other runtime sources: memory.cpp, check.cpp, async.cpp; emu_internal.h):
//   * context switch: ~20 lines of x86-64 assembly (callee-saved registers + MXCSR/x87 control
//     word); swapcontext would make a system call per switch.
//   * Worker: one host thread of a launch. It runs whole blocks, one at a time: the launch's
//     blocks in a seed-shuffled order, split round-robin between the workers (so results never
//     depend on timing). Each CUDA thread of the block is a Fiber on a pooled 64 KiB stack with a
//     guard page below it.
//   * Fibers run until they block (barrier, warp op, exit); then a ready fiber is drawn from the
//     block's generator (seeded by seed, kernel name and block index) and switched to directly.
//     When none is ready the worker's scheduler context decides: block done, barrier released,
//     or an error (deadlock: divergent barrier, early exit, unmatched warp op).
//   * Faults (SIGSEGV/SIGBUS/SIGFPE/SIGILL) inside a worker are caught on an alternate signal
//     stack and siglongjmp'd back to the worker, which names the allocation and offset.
//   * Findings (check.cpp, async.cpp and the scheduler's own: divergent barriers, bad warp masks)
//     are collected per launch, deduplicated, and handed to the caller after the launch.
#include "emu_internal.h"

#include <chrono>
#include <csignal>
#include <cstdarg>
#include <deque>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <link.h>
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

namespace sluice_emu::rt {

thread_local Worker* t_worker SLUICE_EMU_FAST_TLS = nullptr;
thread_local Fiber* t_cur SLUICE_EMU_FAST_TLS = nullptr;

std::string format(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

namespace {

constexpr size_t kStackBytes = 64 * 1024;
constexpr size_t kAltStackBytes = 64 * 1024;
constexpr unsigned kMaxWorkers = 8;

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

}  // namespace

std::string block_str(const Launch& L, unsigned long long b) {
  return format("block (%u,%u,%u)", static_cast<unsigned>(b % L.grid[0]), static_cast<unsigned>((b / L.grid[0]) % L.grid[1]),
                static_cast<unsigned>(b / (static_cast<unsigned long long>(L.grid[0]) * L.grid[1])));
}
std::string where(const Worker& w) {
  return format("kernel %s block (%u,%u,%u)", w.L->kernel->name, w.bidx.x, w.bidx.y, w.bidx.z);
}
std::string thread_str(const Fiber& f) { return format("thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z); }
std::string thread_str_linear(const Launch& L, unsigned i) {
  return format("thread (%u,%u,%u)", i % L.block[0], (i / L.block[0]) % L.block[1], i / (L.block[0] * L.block[1]));
}

void Launch::add(Finding f) {
  std::lock_guard<std::mutex> g(fmu);
  for (Finding& e : findings) {
    if (e.kind == f.kind && e.pc == f.pc && e.pc2 == f.pc2 && e.line == f.line &&
        (e.file == f.file || (e.file && f.file && std::strcmp(e.file, f.file) == 0)) &&
        (e.pc != 0 || e.line != 0 || e.message == f.message)) {
      ++e.count;
      return;
    }
  }
  if (findings.size() >= kMaxFindings) {
    ++dropped;
    return;
  }
  findings.push_back(std::move(f));
}

void report(Worker& w, const char* kind, std::string msg, uintptr_t pc, uintptr_t pc2, const char* file, unsigned line) {
  Finding f;
  f.kind = kind;
  f.message = std::move(msg);
  f.pc = pc;
  f.pc2 = pc2;
  f.file = file;
  f.line = line;
  w.L->add(std::move(f));
}

namespace {

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

void switch_to(Fiber* n) {
  t_cur = n;
  t_watch = n->wgmma.empty() ? nullptr : n;
  threadIdx = n->tid;
}

// Switches away from fiber f, which has set its waiting state (or kDone). Returns when f runs again.
void suspend(Worker& w, Fiber* f) {
  if (!w.failed && !w.ready.empty()) {
    unsigned idx = pick_ready(w);
    Fiber* n = &w.fibers[idx];
    n->state = kRunning;
    if (n == f) {
      switch_to(f);
      return;
    }
    switch_to(n);
    sluice_emu_switch(&f->sp, n->sp);
  } else {
    t_cur = nullptr;
    t_watch = nullptr;
    sluice_emu_switch(&f->sp, w.sched_sp);
  }
}

// Records a finding and marks the block failed. In a fiber, abandons the block (never returns);
// in the scheduler context, returns so the caller can stop.
void block_fail(Worker& w, const char* kind, std::string msg, const char* file = nullptr, unsigned line = 0) {
  if (!w.failed) {
    w.failed = true;
    report(w, kind, std::move(msg), 0, 0, file, line);
  }
  if (t_cur) {
    t_cur = nullptr;
    t_watch = nullptr;
    sluice_emu_switch(&w.dead_sp, w.sched_sp);
    __builtin_unreachable();
  }
}

void complete_warp_op(Worker& w, unsigned warp, const PendingWarpOp& p);

}  // namespace

[[noreturn]] void fiber_fail(Worker& w, const char* kind, std::string msg, const char* file, unsigned line) {
  block_fail(w, kind, std::move(msg), file, line);
  __builtin_unreachable();
}

namespace {

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
      fiber_fail(w, "shuffle-mask",
                 where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u names lane %u (%s), which exited without "
                                   "executing it (lanes 0x%08x had arrived); a warp operation's mask must name "
                                   "exactly the lanes that execute it",
                                   f->linear >> 5, op_name(o.op), o.mask, o.file, o.line, lane,
                                   thread_str(*f).c_str(), W.pend[i].arrived),
                 o.file, o.line);
    }
  }
  if (!w.wg_arrived.empty() && w.wg_arrived[f->linear / 128] != 0) {
    fiber_fail(w, "shuffle-mask",
               where(w) + format(": %s exited while %u threads of warpgroup %u wait at emu_warpgroup_gather",
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
      fiber_fail(w, "shuffle-mask",
                 where(w) + format(": lanes of warp %u reached different warp operations under mask 0x%08x: "
                                   "lane %u at %s (%s:%u), lane %u at %s (%s:%u)",
                                   warp, mask, f0.linear & 31, op_name(f0.op), f0.file, f0.line,
                                   l.linear & 31, op_name(l.op), l.file, l.line),
                 f0.file, f0.line);
    }
  }
  const unsigned size = f0.size;
  switch (f0.op) {
    case WarpOp::Shfl:
    case WarpOp::ShflUp:
    case WarpOp::ShflDown:
    case WarpOp::ShflXor: prof_add(w, kShuffles, 1, f0.file, f0.line); break;
    case WarpOp::SyncWarp:
    case WarpOp::Gather: break;  // a gather is the emulator's own (mma/ldmatrix operands)
    default: prof_add(w, kVotes, 1, f0.file, f0.line); break;
  }
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
    case WarpOp::SyncWarp:
      if (w.race) {
        unsigned lanes[32], nl = 0;
        for (unsigned m = mask; m; m &= m - 1) lanes[nl++] = base + static_cast<unsigned>(__builtin_ctz(m));
        race_sync_group(w, lanes, nl);
      }
      break;
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
  // A warp operation of every live lane is a convergence point for the profiler's grouping
  // (one of part of the warp is not: the other lanes did not pass it).
  const bool whole_warp = mask == w.warps[warp].live;
  for (unsigned m = mask; m; m &= m - 1) {
    unsigned idx = base + static_cast<unsigned>(__builtin_ctz(m));
    w.fibers[idx].state = kReady;
    if (whole_warp) ++w.fibers[idx].sync_epoch;
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
    block_fail(w, "shuffle-mask", msg + " (a warp operation's mask must name exactly the lanes that execute it)", a.file,
               a.line);
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
    block_fail(w, "shuffle-mask", msg);
    return false;
  }
  for (unsigned id = 0; id < 16; ++id) {
    if (w.named[id].arrived == 0) continue;
    block_fail(w, "divergent-barrier",
               where(w) + format(": named barrier %u can never complete (%u of %u threads arrived)", id,
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
      block_fail(w, "divergent-barrier",
                 where(w) + format(": divergent __syncthreads: %s and %s", describe(*first).c_str(), describe(f).c_str()),
                 first->file, first->line);
      return false;
    }
    if (f.pred) ++count;
  }
  if (exited) {
    block_fail(w, "divergent-barrier",
               where(w) + format(": divergent __syncthreads: %u threads wait at the barrier at %s:%u, but %u "
                                 "threads of the block exited without reaching it (e.g. %s); every thread of "
                                 "the block must reach every barrier (no early return before a barrier)",
                                 n - w.ndone, first->file, first->line, w.ndone, thread_str(*exited).c_str()),
               first->file, first->line);
    return false;
  }
  const unsigned live = n;
  switch (first->arg) {
    case 1: w.bar_result = static_cast<int>(count); break;
    case 2: w.bar_result = count == live; break;
    case 3: w.bar_result = count != 0; break;
    default: w.bar_result = 0; break;
  }
  if (w.race) race_barrier(w);
  prof_add(w, kBarriers, static_cast<double>(w.warps.size()), first->file, first->line);  // one per warp
  for (unsigned i = 0; i < n; ++i) {
    w.fibers[i].state = kReady;
    ++w.fibers[i].sync_epoch;
    w.ready.push_back(i);
  }
  return true;
}

unsigned long long fnv1a(const char* s) {
  unsigned long long h = 0xcbf29ce484222325ull;
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 0x100000001b3ull;
  return h;
}

// Runs one block to completion on the current worker. Returns false on error.
bool run_block(Worker& w, unsigned long long b, double weight) {
  const Launch& L = *w.L;
  w.block_weight = weight;
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
    f.sync_epoch = 0;
    f.prof_quiet = 0;
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
  w.race = L.race;
  race_block_start(w);
  async_block_start(w);
  prof_block_begin(w);
  for (;;) {
    if (w.failed) {
      prof_block_end(w);
      return false;
    }
    if (w.ready.empty()) {
      if (w.ndone == n) {
        prof_block_end(w);
        return true;
      }
      if (!resolve_quiescence(w)) {
        prof_block_end(w);
        return false;
      }
      continue;
    }
    Fiber* f = &w.fibers[pick_ready(w)];
    f->state = kRunning;
    switch_to(f);
    sluice_emu_switch(&w.sched_sp, f->sp);
    t_cur = nullptr;
    t_watch = nullptr;
  }
}

std::string describe_fault(Worker& w, const char** kind) {
  const uintptr_t addr = w.fault_addr;
  std::string who = where(w);
  if (w.fault_fiber) who += " " + thread_str(*w.fault_fiber);
  const char* what = w.fault_write == 1 ? "write" : (w.fault_write == 0 ? "read" : "access");
  *kind = "kernel-error";
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
  *kind = "out-of-bounds";
  if (region_of(addr) || addr - g_arena_lo < g_arena_size) {
    return who + ": out-of-bounds " + what + " at " + describe_address(w, addr, 1);
  }
  if (addr < 65536) return who + format(": null pointer %s (address 0x%zx)", what, static_cast<size_t>(addr));
  return who + format(": invalid memory %s at address 0x%zx, which is in no emu allocation (freed memory, or a "
                      "pointer that did not come from sluice_emu_alloc)",
                      what, static_cast<size_t>(addr));
}

// Runs job `widx` of launch L (blocks widx, widx + nworkers, ... of the launch order) on the
// calling pool thread.
void run_job(Worker& w, Launch* L, unsigned widx, unsigned nworkers) {
  w.L = L;
  w.failed = false;
  blockDim = dim3(L->block[0], L->block[1], L->block[2]);
  gridDim = dim3(L->grid[0], L->grid[1], L->grid[2]);
  const unsigned n = L->nthreads;
  if (!w.shared_ok || !w.alt_ok || !acquire_stacks(w.stacks, n)) {
    w.bidx = uint3{0, 0, 0};
    report(w, "kernel-error", format("kernel %s: out of memory for emulator stacks or shared memory", L->kernel->name));
    return;
  }
  w.dyn_poison = round_up(L->dyn_bytes, kPage);
  shared_windows_set_dynamic(w.shared, L->dyn_bytes);
  shared_windows_reset_static(w.shared);
  w.fibers.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    f.stack = w.stacks[i];
    f.linear = i;
    f.tid = uint3{i % L->block[0], (i / L->block[0]) % L->block[1], i / (L->block[0] * L->block[1])};
    f.state = kReady;
    f.wgmma.clear();
  }
  w.warps.resize((n + 31) / 32);
  w.wg_arrived.assign(n % 128 == 0 ? n / 128 : 0, 0u);
  w.last_oob_addr = 0;
  prof_job_begin(w);
  if (sigsetjmp(w.jb, 1) == 0) {
    w.catching = true;
    if (L->sample_blocks.empty()) {
      for (unsigned long long i = widx; i < L->nblocks; i += nworkers) {
        const unsigned long long b = (i * L->order_mul + L->order_add) % L->nblocks;
        if (!run_block(w, b, 1.0)) break;
      }
    } else {
      // A profiled sample: the listed blocks only, each with its weight.
      const auto& blocks = L->sample_blocks;
      for (unsigned long long i = widx; i < blocks.size(); i += nworkers) {
        const double weight = L->sample_weights.empty() ? 1.0 : L->sample_weights[i];
        if (!run_block(w, blocks[i], weight)) break;
      }
    }
    w.catching = false;
  } else {
    w.catching = false;
    const char* kind = nullptr;
    std::string msg = describe_fault(w, &kind);
    // The checker reports an out-of-bounds access before it happens; the fault that follows is
    // the same access.
    if (!(w.fault_sig == SIGSEGV && w.last_oob_addr && w.fault_addr >= w.last_oob_addr &&
          w.fault_addr < w.last_oob_addr + 64)) {
      report(w, kind, std::move(msg));
    }
  }
  t_cur = nullptr;
  t_watch = nullptr;
  prof_job_end(w);
  shared_windows_restore(w.shared);
}

// The host threads that run blocks: started on demand (up to the largest SLUICE_EMU_THREADS
// asked for), shared by concurrent launches, alive for the rest of the process. Each keeps its
// alternate signal stack, shared-memory windows (whose address kernels may cache in a
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
  Worker* wp = new Worker();  // lives as long as the thread (forever)
  Worker& w = *wp;
  t_worker = &w;
  char* alt = map_region(kAltStackBytes);
  w.alt_ok = alt && mprotect(alt, kAltStackBytes, PROT_READ | PROT_WRITE) == 0;
  if (w.alt_ok) {
    stack_t ss{};
    ss.ss_sp = alt;
    ss.ss_size = kAltStackBytes;
    w.alt_ok = sigaltstack(&ss, nullptr) == 0;
  }
  w.shared_ok = shared_windows_init(w.shared, &w);
  if (w.shared_ok) w.dyn_base = reinterpret_cast<unsigned char*>(w.shared.dyn.start);
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
  // Not ours: hand over to whatever was installed before (Rust's stack-overflow handler, another
  // copy of this runtime in a loaded `sluice emu check` module, ...).
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

// ---------------------------------------------------------------------------------------------
// Check policy: SLUICE_EMU_CHECKS = full (default) | bounds | off; SLUICE_EMU_RACE = all | off |
// sample (default): with `sample`, race detection runs on launches 1, 2, 4, 8, 16, ... of each
// kernel in the process (every launch under `sluice emu check`, which asks for it).
// ---------------------------------------------------------------------------------------------
int default_checks() {
  static const int level = [] {
    const char* e = std::getenv("SLUICE_EMU_CHECKS");
    if (!e || !*e || std::strcmp(e, "full") == 0) return static_cast<int>(kChecksFull);
    if (std::strcmp(e, "bounds") == 0) return static_cast<int>(kChecksBounds);
    if (std::strcmp(e, "off") == 0) return static_cast<int>(kChecksOff);
    std::fprintf(stderr, "sluice emu: SLUICE_EMU_CHECKS=%s is not full, bounds or off; using full\n", e);
    return static_cast<int>(kChecksFull);
  }();
  return level;
}

enum class RacePolicy { All, Off, Sample };
RacePolicy race_policy() {
  static const RacePolicy p = [] {
    const char* e = std::getenv("SLUICE_EMU_RACE");
    if (!e || !*e || std::strcmp(e, "sample") == 0) return RacePolicy::Sample;
    if (std::strcmp(e, "all") == 0) return RacePolicy::All;
    if (std::strcmp(e, "off") == 0) return RacePolicy::Off;
    std::fprintf(stderr, "sluice emu: SLUICE_EMU_RACE=%s is not all, off or sample; using sample\n", e);
    return RacePolicy::Sample;
  }();
  return p;
}

bool race_for_launch(const sluice_emu_kernel* k) {
  switch (race_policy()) {
    case RacePolicy::All: return true;
    case RacePolicy::Off: return false;
    case RacePolicy::Sample: break;
  }
  static std::mutex mu;
  static std::unordered_map<const sluice_emu_kernel*, unsigned long long> counts;
  std::lock_guard<std::mutex> g(mu);
  const unsigned long long c = ++counts[k];
  return (c & (c - 1)) == 0;  // launches 1, 2, 4, 8, ...
}

// A block order for the launch: i -> (i * mul + add) mod n with mul coprime to n, drawn from the seed.
void choose_block_order(Launch& L) {
  const unsigned long long n = L.nblocks;
  if (n <= 1) return;
  unsigned long long s = L.seed ^ (L.name_hash * 0xd1b54a32d192ed03ull) ^ 0x5851f42d4c957f2dull;
  L.order_add = splitmix(s) % n;
  for (int tries = 0; tries < 64; ++tries) {
    unsigned long long m = splitmix(s) % n;
    if (m == 0) continue;
    unsigned long long a = m, b = n;
    while (b) {
      unsigned long long t = a % b;
      a = b;
      b = t;
    }
    if (a == 1) {
      L.order_mul = m;
      return;
    }
  }
  L.order_mul = 1;
}

std::atomic<unsigned long long> g_launch_serial{0};

int fail_launch(char* err, size_t cap, const std::string& msg, int code) {
  if (err && cap) std::snprintf(err, cap, "%s", msg.c_str());
  return code;
}

}  // namespace

CodeLocation locate_code(uintptr_t pc) {
  struct Query {
    uintptr_t pc;
    CodeLocation out;
  } q{pc, {}};
  if (!pc) return {};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        Query& q = *static_cast<Query*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
          if (q.pc >= lo && q.pc < lo + ph.p_memsz) {
            static std::string exe = [] {
              char buf[4096];
              ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
              return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
            }();
            q.out.object = (info->dlpi_name && *info->dlpi_name) ? info->dlpi_name : exe.c_str();
            q.out.vaddr = q.pc - info->dlpi_addr;
            return 1;
          }
        }
        return 0;
      },
      &q);
  return q.out;
}

namespace {

void deliver(const Finding& f, sluice_emu_finding_fn fn, void* ctx) {
  const CodeLocation a = locate_code(f.pc), b = locate_code(f.pc2);
  sluice_emu_finding out{};
  out.kind = f.kind.c_str();
  out.message = f.message.c_str();
  out.file = f.file;
  out.line = f.line;
  out.object = a.object;
  out.vaddr = a.vaddr;
  out.object2 = b.object;
  out.vaddr2 = b.vaddr;
  out.count = f.count;
  fn(ctx, &out);
}

}  // namespace
}  // namespace sluice_emu::rt

// ---------------------------------------------------------------------------------------------
// Intrinsics called from kernel code
// ---------------------------------------------------------------------------------------------
namespace sluice_emu {
using namespace rt;

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
  const char* file = loc.file_name();
  const unsigned line = loc.line();
  if (!(mask & (1u << lane))) {
    fiber_fail(w, "shuffle-mask",
               where(w) + format(" warp %u: %s calls %s with mask 0x%08x, which does not include its own lane %u (%s:%u)",
                                 wi, thread_str(*f).c_str(), name, mask, lane, file, line),
               file, line);
  }
  if (mask & ~W.exists) {
    fiber_fail(w, "shuffle-mask",
               where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u names lanes 0x%08x that do not exist "
                                 "(the block has %u threads)",
                                 wi, name, mask, file, line, mask & ~W.exists, w.L->nthreads),
               file, line);
  }
  if (mask & ~W.live) {
    unsigned gone = static_cast<unsigned>(__builtin_ctz(mask & ~W.live));
    fiber_fail(w, "shuffle-mask",
               where(w) + format(" warp %u: %s(mask 0x%08x) at %s:%u names lane %u, which has exited", wi, name, mask,
                                 file, line, gone),
               file, line);
  }
  if (op == WarpOp::Gather && W.exists != 0xffffffffu) {
    fiber_fail(w, "shuffle-mask", where(w) + format(" warp %u: emu_warp_gather at %s:%u needs a full warp", wi, file, line),
               file, line);
  }
  if (op <= WarpOp::ShflXor && (width < 1 || width > 32 || (width & (width - 1)) != 0)) {
    fiber_fail(w, "shuffle-mask",
               where(w) + format(" warp %u: %s at %s:%u with width %d (must be a power of two <= 32)", wi, name, file,
                                 line, width),
               file, line);
  }
  w.spins = 0;
  f->op = op;
  f->mask = mask;
  f->size = size;
  f->arg = arg;
  f->width = width;
  f->in = in;
  f->out = out;
  f->file = file;
  f->line = line;
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
    fiber_fail(w, "shuffle-mask",
               where(w) + format(": emu_warpgroup_gather at %s:%u needs a multiple of 128 threads per block (has %u)",
                                 loc.file_name(), loc.line(), w.L->nthreads),
               loc.file_name(), loc.line());
  }
  const unsigned g = f->linear / 128;
  for (unsigned t = g * 128; t < g * 128 + 128; ++t) {
    if (w.fibers[t].state == kDone) {
      fiber_fail(w, "shuffle-mask",
                 where(w) + format(": emu_warpgroup_gather at %s:%u: %s of warpgroup %u has exited", loc.file_name(),
                                   loc.line(), thread_str(w.fibers[t]).c_str(), g),
                 loc.file_name(), loc.line());
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
        fiber_fail(w, "shuffle-mask",
                   where(w) + format(": emu_warpgroup_gather with different sizes (%u at %s:%u, %u at %s:%u)", size,
                                     f->file, f->line, o.size, o.file, o.line));
      }
    }
    w.scratch.resize(static_cast<size_t>(size) * 128);
    for (unsigned s = 0; s < 128; ++s) std::memcpy(&w.scratch[static_cast<size_t>(s) * size], w.fibers[g * 128 + s].in, size);
    for (unsigned t = g * 128; t < g * 128 + 128; ++t) {
      std::memcpy(w.fibers[t].out, w.scratch.data(), w.scratch.size());
      w.fibers[t].state = kReady;
      ++w.fibers[t].sync_epoch;
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
    fiber_fail(w, "divergent-barrier",
               where(w) + format(": named barrier %u with %u threads at %s:%u (id must be < 16, count a multiple "
                                 "of 32 and at most the block size %u)",
                                 id, count, loc.file_name(), loc.line(), w.L->nthreads),
               loc.file_name(), loc.line());
  }
  NamedBarrier& nb = w.named[id];
  if (nb.arrived != 0 && nb.expected != count) {
    fiber_fail(w, "divergent-barrier",
               where(w) + format(": named barrier %u used with thread counts %u and %u (%s:%u)", id, nb.expected, count,
                                 loc.file_name(), loc.line()),
               loc.file_name(), loc.line());
  }
  nb.expected = count;
  w.spins = 0;
  f->arg = static_cast<int>(id);
  f->file = loc.file_name();
  f->line = loc.line();
  f->state = kNamed;
  if (++nb.arrived == count) {
    nb = NamedBarrier{};
    prof_add(w, kBarriers, count / 32.0, loc.file_name(), loc.line());  // one per warp
    // A named barrier of the whole block orders memory like __syncthreads; one of part of the
    // block orders its participants' accesses (check.cpp, "Races").
    std::vector<unsigned> participants;
    for (unsigned i = 0; i < w.fibers.size(); ++i) {
      if (w.fibers[i].state == kNamed && w.fibers[i].arg == static_cast<int>(id)) {
        w.fibers[i].state = kReady;
        ++w.fibers[i].sync_epoch;
        w.ready.push_back(i);
        participants.push_back(i);
      }
    }
    if (w.race) {
      if (count == w.L->nthreads) race_barrier(w);
      else race_sync_group(w, participants.data(), static_cast<unsigned>(participants.size()));
    }
  }
  suspend(w, f);
}

void yield_now(const std::source_location& loc) {
  Worker& w = current_worker("emu_yield");
  Fiber* f = t_cur;
  if (++w.spins > (1ull << 22)) {
    fiber_fail(w, "kernel-error",
               where(w) + format(" %s: spin-wait at %s:%u made no progress: 4 M yields without any barrier, warp "
                                 "operation or thread exit in the block (waiting for something no thread will do)",
                                 thread_str(*f).c_str(), loc.file_name(), loc.line()),
               loc.file_name(), loc.line());
  }
  f->state = kReady;
  w.ready.push_back(f->linear);
  suspend(w, f);
}

void fail(const char* what, const char* file, unsigned line) {
  Worker& w = current_worker(what);
  fiber_fail(w, "kernel-error", where(w) + format(" %s: %s at %s:%u", thread_str(*t_cur).c_str(), what, file, line),
             file, line);
}

unsigned live_lanes() {
  Worker& w = current_worker("__activemask");
  return w.warps[t_cur->linear >> 5].live;
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
using namespace sluice_emu::rt;

extern "C" void* sluice_emu_alloc(size_t bytes) { return global_alloc(bytes); }

extern "C" void sluice_emu_free(void* p) { global_free(p); }

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

extern "C" int sluice_emu_launch_ex(const char* kernel, const unsigned grid[3], const unsigned block[3],
                                    size_t dynamic_shared_bytes, void** params, unsigned long long seed,
                                    const sluice_emu_options* opts, sluice_emu_finding_fn on_finding, void* ctx,
                                    char* err, size_t err_cap) {
  if (err && err_cap) err[0] = '\0';
  if (!kernel || !grid || !block) return fail_launch(err, err_cap, "sluice_emu_launch: null argument", 1);
  const KernelIndex& idx = kernels();
  auto it = idx.by_name.find(std::string_view(kernel));
  if (it == idx.by_name.end()) {
    return fail_launch(err, err_cap,
                       format("kernel %s is not in the emulator's kernel table (%zu kernels compiled)", kernel,
                              idx.list.size()),
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
    return fail_launch(err, err_cap, format("kernel %s: invalid grid (%u,%u,%u)", kernel, grid[0], grid[1], grid[2]), 1);
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
  if (!arena_init()) return fail_launch(err, err_cap, "the emulator cannot reserve its address space", 1);

  Launch L;
  // Every non-null pointer argument must point into (or one past) an emu allocation.
  std::vector<const void*> ptrs(k->nparams);
  std::vector<unsigned> ptr_index(k->nparams);
  const unsigned nptrs = k->pointer_args(params, ptrs.data());
  k->pointer_arg_index(ptr_index.data());
  for (unsigned i = 0; i < nptrs; ++i) {
    if (!ptrs[i]) continue;
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptrs[i]);
    Region* r = region_of(p);
    if (!r || r->kind != RegionKind::Global || p < r->start || p > r->start + r->bytes) {
      return fail_launch(err, err_cap,
                         format("kernel %s: pointer argument %u (%p) does not point into memory from "
                                "sluice_emu_alloc",
                                kernel, ptr_index[i], ptrs[i]),
                         1);
    }
    L.pointer_args.emplace_back(r->start, ptr_index[i]);
  }

  install_signal_handlers();
  L.kernel = k;
  std::memcpy(L.grid, grid, sizeof L.grid);
  std::memcpy(L.block, block, sizeof L.block);
  L.dyn_bytes = dynamic_shared_bytes;
  L.params = params;
  L.param_names = opts ? opts->param_names : nullptr;
  L.seed = seed;
  L.name_hash = fnv1a(k->name);
  L.nblocks = static_cast<unsigned long long>(grid[0]) * grid[1] * grid[2];
  L.nthreads = static_cast<unsigned>(nthreads);
  L.serial = ++g_launch_serial;
  L.checks = (opts && opts->checks >= 0) ? std::min(opts->checks, static_cast<int>(kChecksFull)) : default_checks();
  const int race_opt = opts ? opts->race : -1;
  L.race = L.checks == kChecksFull && (race_opt >= 0 ? race_opt != 0 : race_for_launch(k));
  choose_block_order(L);
  if (opts && opts->profile) {
    if (opts->sample_blocks && opts->nsample) {
      L.sample_blocks.assign(opts->sample_blocks, opts->sample_blocks + opts->nsample);
      for (unsigned long long b : L.sample_blocks) {
        if (b >= L.nblocks) {
          return fail_launch(err, err_cap,
                             format("kernel %s: sampled block %llu is outside the grid of %llu blocks", kernel, b,
                                    L.nblocks),
                             1);
        }
      }
      if (opts->sample_weights) L.sample_weights.assign(opts->sample_weights, opts->sample_weights + opts->nsample);
    }
    L.profile = prof_launch_begin(L);
  }
  // Race detection runs the blocks on one host thread, in the launch order: its records of
  // global memory are then exact and its findings reproducible.
  const unsigned long long runnable = L.sample_blocks.empty() ? L.nblocks : L.sample_blocks.size();
  const unsigned nworkers =
      L.race ? 1u : static_cast<unsigned>(std::min<unsigned long long>(worker_count(), runnable));
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
        if (L.profile) prof_launch_end(L, nullptr, nullptr);
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
  for (Region* r : L.race_regions) clear_race_shadow(*r);
  if (L.profile) prof_launch_end(L, opts->on_profile, opts->profile_ctx);
  if (L.findings.empty()) return 0;

  std::string text;
  for (const Finding& f : L.findings) {
    if (on_finding) deliver(f, on_finding, ctx);
    if (!text.empty()) text += '\n';
    text += f.kind + ": " + f.message;
    if (f.file) text += format(" (%s:%u)", f.file, f.line);
    if (f.count > 1) text += format(" [%llu times]", f.count);
  }
  if (L.dropped) {
    std::string more = format("%llu more findings not shown", L.dropped);
    if (on_finding) {
      sluice_emu_finding extra{};
      extra.kind = "more";
      extra.message = more.c_str();
      extra.count = L.dropped;
      on_finding(ctx, &extra);
    }
    text += "\n" + more;
  }
  return fail_launch(err, err_cap, text, 2);
}

extern "C" int sluice_emu_launch(const char* kernel, const unsigned grid[3], const unsigned block[3],
                                 size_t dynamic_shared_bytes, void** params, unsigned long long seed, char* err,
                                 size_t err_cap) {
  return sluice_emu_launch_ex(kernel, grid, block, dynamic_shared_bytes, params, seed, nullptr, nullptr, nullptr, err,
                              err_cap);
}
