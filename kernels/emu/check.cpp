// check.cpp — the emulator's sanitizer: bounds and race checks of every memory access of kernel code.
//
// Kernel translation units are compiled with GCC's ThreadSanitizer instrumentation and no
// sanitizer runtime (kernels/src/emu/build_flags.rs), so every load and store of memory that may
// be shared becomes a call to one of the __tsan_* functions below with the address (and size);
// volatile accesses have their own calls (treated as relaxed atomics, as PTX treats them). Only addresses inside the emulator's arena (global allocations and the
// shared-memory windows, memory.cpp) are checked; everything else (fiber stacks, host memory) is
// let through at the cost of one compare, except a wgmma accumulator whose result is pending.
//
// Bounds: exact to the byte against the region's data (global allocation, dynamic shared memory as
// requested at launch, each static __shared__ array with redzones between them).
//
// Races: four records per 8-byte granule (emu_internal.h, Slot). An access conflicts with a
// record of another thread when their bytes overlap, at least one writes, not both are atomics,
// and they are not ordered. Accesses of different blocks of one launch are never ordered. Within
// a block, a __syncthreads (or a named barrier of the whole block) orders everything before it
// before everything after it: it starts a new barrier interval. Inside an interval, ordering is
// happens-before through vector clocks (the FastTrack scheme): each thread has a clock, and a
// record keeps the accessing thread's clock. Synchronisation releases and acquires clocks:
//   - __syncwarp(mask) and a named barrier of part of the block: every participant acquires what
//     every other one had (its clock and what it had acquired);
//   - mbarrier_arrive releases the thread's clocks into the phase; a wait that observes the phase
//     complete acquires them (with the async agent's clock of the copies that landed on it);
// and a releasing thread's clock then advances. An access by u is ordered after a record
// (t, c) of the same interval when u has acquired t's clock c or later. Transitive: a producer
// -> consumer -> producer ring of full/empty mbarriers orders the consumer's reads of a stage
// before the producer's next copy into it, with no block-wide barrier.
// Bulk copies land (their data written, at phase completion) as writes of an async agent, one per
// mbarrier (thread index kAgentBase + i): a thread that reads the data without having waited on
// that mbarrier (or acquired from one that did) races with the agent.
// Records live for one block (shared memory) or one launch (global memory). A granule with four
// live records evicts one (reads first), which can hide a race but never invents one.
#include "emu_internal.h"

namespace sluice_emu::rt {

thread_local Fiber* t_watch SLUICE_EMU_FAST_TLS = nullptr;

uintptr_t code_base() { return reinterpret_cast<uintptr_t>(&sluice_emu_launch); }

namespace {

int32_t rel_pc(uintptr_t pc) {
  if (!pc) return 0;
  long long d = static_cast<long long>(pc) - static_cast<long long>(code_base());
  return (d > INT32_MIN && d < INT32_MAX && d != 0) ? static_cast<int32_t>(d) : 0;
}
uintptr_t abs_pc(int32_t rel) { return rel ? code_base() + static_cast<long long>(rel) : 0; }

const char* access_word(unsigned flags) {
  if (flags & kAccAtomic) return (flags & kAccWrite) ? "atomic (or volatile) write" : "atomic (or volatile) read";
  return (flags & kAccWrite) ? "write" : "read";
}

const StaticArray* static_array_near(const SharedWindows& s, size_t off) {
  const StaticArray* best = nullptr;
  for (const StaticArray& a : s.arrays) {
    if (a.off <= off && (!best || a.off > best->off)) best = &a;
  }
  if (!best) {
    for (const StaticArray& a : s.arrays) {
      if (!best || a.off < best->off) best = &a;
    }
  }
  return best;
}

// "global buffer `x` (argument 0, allocation #3 of 68 bytes)" and the offset of a in it.
std::string region_name(const Worker& w, const Region& r, uintptr_t a, long long* off) {
  switch (r.kind) {
    case RegionKind::Global: {
      *off = static_cast<long long>(a) - static_cast<long long>(r.start);
      const Launch& L = *w.L;
      for (const auto& [s, index] : L.pointer_args) {
        if (s != r.start) continue;
        if (L.param_names && L.param_names[index]) {
          return format("global buffer `%s` (argument %u, allocation #%llu of %zu bytes)", L.param_names[index], index,
                        r.id, r.bytes);
        }
        return format("global buffer of argument %u (allocation #%llu of %zu bytes)", index, r.id, r.bytes);
      }
      return format("global allocation #%llu (%zu bytes)", r.id, r.bytes);
    }
    case RegionKind::DynShared:
      *off = static_cast<long long>(a) - static_cast<long long>(r.start);
      return format("dynamic shared memory (%zu bytes requested at launch)", r.bytes);
    case RegionKind::StaticShared: {
      const SharedWindows& s = w.shared;
      size_t woff = a - r.start;
      const StaticArray* arr = woff < kStatSpan ? static_array_near(s, woff) : nullptr;
      if (!arr) {
        *off = static_cast<long long>(woff);
        return "the static shared memory window";
      }
      *off = static_cast<long long>(woff) - static_cast<long long>(arr->off);
      return format("static shared array `%s` (%zu bytes, declared at %s:%u)", arr->name, arr->bytes, arr->file,
                    arr->line);
    }
  }
  return "memory";
}

size_t region_data_bytes(const Worker& w, const Region& r, uintptr_t a) {
  if (r.kind != RegionKind::StaticShared) return r.bytes;
  const StaticArray* arr = static_array_near(w.shared, a - r.start);
  return arr ? arr->bytes : 0;
}

void report_oob(Worker& w, const Region* r, uintptr_t a, size_t n, unsigned flags, uintptr_t pc, const char* file,
                unsigned line) {
  w.last_oob_addr = a;
  std::string what;
  if (!r) {
    what = format("%s of %zu bytes at address 0x%zx, which is in no live emu allocation (freed memory?)",
                  access_word(flags), n, static_cast<size_t>(a));
  } else {
    long long off = 0;
    std::string name = region_name(w, *r, a, &off);
    size_t bytes = region_data_bytes(w, *r, a);
    const char* side = off < 0 ? "before its start" : "past its end";
    if (off >= 0 && static_cast<size_t>(off) < bytes) side = "running past its end";
    what = format("%s of %zu bytes at byte offset %lld of %s: %s (valid offsets 0..%lld)", access_word(flags), n, off,
                  name.c_str(), side, static_cast<long long>(bytes) - 1);
  }
  report(w, "out-of-bounds", where(w) + " " + thread_str(*t_cur) + ": " + what, pc, 0, file, line);
}

bool in_bounds(Worker& w, Region& r, uintptr_t a, size_t n) {
  switch (r.kind) {
    case RegionKind::Global: return a >= r.start && a + n <= r.start + r.bytes;
    case RegionKind::DynShared: return r.owner == &w && a >= r.start && a + n <= r.start + r.bytes;
    case RegionKind::StaticShared: {
      if (r.owner != &w || a < r.start || a + n > r.start + kStatSpan) return false;
      const size_t off = a - r.start;
      const uint16_t first = w.shared.stat_owner[off];
      return first != 0 && first == w.shared.stat_owner[off + n - 1];
    }
  }
  return false;
}

// ---- races ----------------------------------------------------------------------------------

// Column of thread or agent t in the vector clocks.
inline unsigned vc_col(const Worker& w, unsigned t) {
  return t < kAgentBase ? t : w.L->nthreads + (t - kAgentBase);
}
// t's own clock in the current interval (1 at its start).
inline uint16_t clock_of(const Worker& w, unsigned t) {
  const unsigned c = vc_col(w, t);
  return w.clk_stamp[c] == w.bar ? w.clk[c] : 1;
}
// Entry `col` of the clocks thread u acquired in the current interval.
inline uint16_t acquired_of(const Worker& w, unsigned u, unsigned col) {
  const VectorClock& v = w.acquired[u];
  return v.stamp == w.bar ? v.c[col] : 0;
}
// The vector clock made current for this interval (zeroed when it belongs to an earlier one).
void fresh(const Worker& w, VectorClock& v) {
  if (v.stamp == w.bar && v.c.size() == w.vc_cols) return;
  v.c.assign(w.vc_cols, 0);
  v.stamp = w.bar;
}
// t's clock advances after a release; at UINT16_MAX releases in one interval the records could
// no longer tell them apart, so race detection ends for the block (as for barriers).
void advance(Worker& w, unsigned t) {
  const unsigned c = vc_col(w, t);
  const uint16_t now = clock_of(w, t);
  if (now == UINT16_MAX) {
    w.race = false;
    return;
  }
  w.clk[c] = static_cast<uint16_t>(now + 1);
  w.clk_stamp[c] = w.bar;
}

bool ordered_in_block(const Worker& w, const Slot& s, unsigned me) {
  if (s.bar != w.bar) return true;  // a __syncthreads completed after the record
  if (me >= kAgentBase) return true;  // a landing: its destination was checked when the copy was issued
  return acquired_of(w, me, vc_col(w, s.thread)) >= s.clk;
}

void report_race(Worker& w, const Region& r, uintptr_t a, const Slot& s, unsigned me, unsigned flags, uintptr_t pc,
                 const char* file, unsigned line) {
  const Launch& L = *w.L;
  const bool same_block = s.block == static_cast<uint32_t>(w.block_linear + 1);
  const bool atomic = s.flags & kSlotAtomic;
  const char* prior = (s.flags & kSlotWrite) ? (atomic ? "atomic (or volatile) write" : "write")
                                             : (atomic ? "atomic (or volatile) read" : "read");
  std::string other = s.thread >= kAgentBase
                          ? format("the bulk copies completing on mbarrier #%u of the block (landed data)",
                                   s.thread - kAgentBase)
                          : thread_str_linear(L, s.thread);
  std::string why;
  if (!same_block) {
    other += " of " + block_str(L, s.block - 1);
    why = "in the same launch (blocks are not ordered: only atomics may share an address)";
  } else if (s.thread >= kAgentBase) {
    why = "with no wait on that mbarrier (or barrier after one) ordering them";
  } else if ((s.thread >> 5) == (me >> 5)) {
    why = "of the same warp with no __syncthreads, __syncwarp or mbarrier between them";
  } else {
    why = "of the same block with no __syncthreads, named barrier or mbarrier between them";
  }
  long long off = 0;
  std::string name = region_name(w, r, a, &off);
  report(w, "race",
         where(w) + " " + thread_str(*t_cur) +
             format(": %s at byte offset %lld of %s conflicts with a %s by %s %s", access_word(flags), off, name.c_str(),
                    prior, other.c_str(), why.c_str()),
         pc, abs_pc(s.pc), file, line);
}

void check_granule(Worker& w, Region& r, Slot* g, uintptr_t granule_addr, uint8_t mask, unsigned me, unsigned flags,
                   uintptr_t pc, const char* file, unsigned line) {
  const uint32_t blk = static_cast<uint32_t>(w.block_linear + 1);
  const uint8_t sflags = static_cast<uint8_t>(((flags & kAccWrite) ? kSlotWrite : 0) | ((flags & kAccAtomic) ? kSlotAtomic : 0));
  const uint16_t ws = clock_of(w, me);
  int same = -1, empty = -1, mine = -1, read = -1;
  for (int i = 0; i < static_cast<int>(kSlotsPerGranule); ++i) {
    Slot& s = g[i];
    if (s.block == 0) {
      if (empty < 0) empty = i;
      continue;
    }
    const bool own = s.block == blk && s.thread == me;
    if (own) {
      if (s.bar == w.bar && s.clk == ws && s.flags == sflags) same = i;
      else if (mine < 0) mine = i;
      continue;
    }
    if (!(s.flags & kSlotWrite) && read < 0) read = i;
    if (!(s.mask & mask)) continue;
    if (!(s.flags & kSlotWrite) && !(sflags & kSlotWrite)) continue;
    if ((s.flags & kSlotAtomic) && (sflags & kSlotAtomic)) continue;
    if (s.block == blk && ordered_in_block(w, s, me)) continue;
    uint8_t both = s.mask & mask;
    report_race(w, r, granule_addr + static_cast<unsigned>(__builtin_ctz(both)), s, me, flags, pc, file, line);
  }
  const int32_t rp = rel_pc(pc);
  if (same >= 0) {
    g[same].mask |= mask;
    g[same].pc = rp;
    return;
  }
  int victim = empty >= 0 ? empty : (mine >= 0 ? mine : read);
  if (victim < 0) victim = static_cast<int>((w.rng = w.rng * 6364136223846793005ull + 1442695040888963407ull) >> 62);
  g[victim] = Slot{blk, rp, w.bar, ws, static_cast<uint16_t>(me), mask, sflags};
}

void race_check(Worker& w, Region& r, uintptr_t a, size_t n, unsigned me, unsigned flags, uintptr_t pc,
                const char* file, unsigned line) {
  Slot* shadow = race_shadow(r);
  if (!shadow) return;
  if (r.kind == RegionKind::Global &&
      r.race_launch.exchange(w.L->serial, std::memory_order_relaxed) != w.L->serial) {
    std::lock_guard<std::mutex> g(w.L->fmu);
    w.L->race_regions.push_back(&r);
  }
  const size_t off = a - r.start;
  const size_t g0 = off / kGranule, g1 = (off + n - 1) / kGranule;
  if (g0 < r.touched_lo) r.touched_lo = g0;
  if (g1 + 1 > r.touched_hi) r.touched_hi = g1 + 1;
  for (size_t gi = g0; gi <= g1; ++gi) {
    const size_t lo = std::max(off, gi * kGranule), hi = std::min(off + n, gi * kGranule + kGranule);
    const uint8_t mask = static_cast<uint8_t>(((1u << (hi - lo)) - 1u) << (lo - gi * kGranule));
    check_granule(w, r, shadow + gi * kSlotsPerGranule, r.start + gi * kGranule, mask, me, flags, pc, file, line);
  }
}

}  // namespace

std::string describe_address(const Worker& w, uintptr_t a, size_t) {
  Region* r = region_of(a);
  if (!r) return format("address 0x%zx", static_cast<size_t>(a));
  long long off = 0;
  std::string name = region_name(w, *r, a, &off);
  return format("byte offset %lld of %s", off, name.c_str());
}

void check_access(uintptr_t a, size_t n, unsigned flags, uintptr_t pc, const char* file, unsigned line) {
  Worker* w = t_worker;
  if (!w || !t_cur || !w->L || w->L->checks == kChecksOff || n == 0) return;
  Region* r = region_of(a);
  if (!r) {
    if (a - g_arena_lo < g_arena_size) report_oob(*w, nullptr, a, n, flags, pc, file, line);
    return;
  }
  if (!in_bounds(*w, *r, a, n)) {
    report_oob(*w, r, a, n, flags, pc, file, line);
    return;
  }
  if (r->kind != RegionKind::Global && w->async_live) {
    if (const AsyncOp* op = async_pending_at(*w, *r, a, n)) {
      long long off = 0;
      std::string name = region_name(*w, *r, a, &off);
      const char* what = op->kind == AsyncKind::Bulk ? "bulk copy" : op->kind == AsyncKind::Tensor ? "tensor copy" : "cp.async";
      const char* until = op->kind == AsyncKind::CpAsync ? "its cp.async wait" : "its mbarrier phase completes";
      report(*w, (flags & kAccWrite) ? "race" : "async-read-before-wait",
             where(*w) + " " + thread_str(*t_cur) +
                 format(": %s at byte offset %lld of %s, the destination of a %s issued by %s at %s:%u, before %s",
                        access_word(flags), off, name.c_str(), what, thread_str(w->fibers[op->fiber]).c_str(), op->file,
                        op->line, until),
             pc, 0, file, line);
    }
  }
  if (r->kind != RegionKind::Global && (flags & kAccWrite) && w->L->checks == kChecksFull) proxy_note_write(*w, *r, a, n);
  if (w->race) race_check(*w, *r, a, n, t_cur->linear, flags, pc, file, line);
}

void race_block_start(Worker& w) {
  w.bar = 0;
  w.vc_cols = w.L->nthreads + kMaxAgents;
  w.clk.assign(w.vc_cols, 1);
  w.clk_stamp.assign(w.vc_cols, UINT16_MAX);  // no interval: every clock reads as 1
  w.acquired.resize(w.L->nthreads);
  for (VectorClock& v : w.acquired) v.stamp = UINT16_MAX;
  if (w.shared_ok) {
    clear_race_shadow(w.shared.dyn);
    clear_race_shadow(w.shared.stat);
  }
}

void race_barrier(Worker& w) {
  if (w.bar == UINT16_MAX - 1) {
    w.race = false;  // 65534 barriers in one block: the records cannot tell intervals apart
    return;
  }
  ++w.bar;  // every clock of the last interval is stale from here
}

void race_sync_group(Worker& w, const unsigned* threads, unsigned n) {
  if (!w.race || n < 2) return;
  // The join of every participant's acquired clocks and own clock, then given to each.
  VectorClock& join = w.sync_join;
  join.c.assign(w.vc_cols, 0);
  join.stamp = w.bar;
  for (unsigned i = 0; i < n; ++i) {
    const unsigned t = threads[i];
    const VectorClock& v = w.acquired[t];
    if (v.stamp == w.bar) {
      for (unsigned c = 0; c < w.vc_cols; ++c) join.c[c] = std::max(join.c[c], v.c[c]);
    }
    join.c[t] = std::max(join.c[t], clock_of(w, t));
  }
  for (unsigned i = 0; i < n; ++i) {
    w.acquired[threads[i]].c = join.c;
    w.acquired[threads[i]].stamp = w.bar;
    advance(w, threads[i]);
  }
}

void race_release(Worker& w, unsigned t, VectorClock& into) {
  if (!w.race) return;
  fresh(w, into);
  if (t < kAgentBase) {
    const VectorClock& v = w.acquired[t];
    if (v.stamp == w.bar) {
      for (unsigned c = 0; c < w.vc_cols; ++c) into.c[c] = std::max(into.c[c], v.c[c]);
    }
  }
  const unsigned col = vc_col(w, t);
  into.c[col] = std::max(into.c[col], clock_of(w, t));
  advance(w, t);
}

void race_acquire(Worker& w, unsigned t, const VectorClock& from) {
  if (!w.race || from.stamp != w.bar) return;
  VectorClock& v = w.acquired[t];
  fresh(w, v);
  for (unsigned c = 0; c < w.vc_cols; ++c) v.c[c] = std::max(v.c[c], from.c[c]);
}

void race_forget(uintptr_t a, size_t n) {
  Region* r = region_of(a);
  if (!r || n == 0) return;
  Slot* s = r->race.load(std::memory_order_acquire);
  if (!s || a < r->start) return;
  const size_t g0 = (a - r->start) / kGranule, g1 = (a - r->start + n - 1) / kGranule;
  if (g1 >= r->race_granules) return;
  std::memset(s + g0 * kSlotsPerGranule, 0, (g1 - g0 + 1) * kSlotsPerGranule * sizeof(Slot));
}

void race_record_write(Worker& w, const Fiber& f, uintptr_t a, size_t n, const char* file, unsigned line) {
  race_record_write_by(w, f.linear, a, n, file, line);
}

void race_record_write_by(Worker& w, unsigned t, uintptr_t a, size_t n, const char* file, unsigned line) {
  if (!w.race) return;
  Region* r = region_of(a);
  if (!r || !in_bounds(w, *r, a, n)) return;
  race_check(w, *r, a, n, t, kAccWrite, 0, file, line);
}

// Static __shared__ variables: placed in the host thread's static window with redzones between
// them, laid out per launch in the order the blocks first reach their declarations, and filled
// with 0xFF bytes (NaN) the first time each block reaches the declaration.
void* static_shared_slot(const void* key, std::size_t bytes, std::size_t align, const char* name, const char* file,
                         unsigned line) {
  Worker* w = t_worker;
  if (!w || !t_cur) {
    std::fprintf(stderr, "sluice emu: static __shared__ %s used outside an emulated kernel launch\n", name);
    std::abort();
  }
  SharedWindows& s = w->shared;
  StaticArray* arr = nullptr;
  for (StaticArray& x : s.arrays) {
    if (x.key == key) {
      arr = &x;
      break;
    }
  }
  if (!arr) {
    if (align < 16) align = 16;
    const size_t off = round_up(s.stat_used, align);
    if (s.stat_data + bytes > kMaxStaticShared || off + bytes + kStaticRedzone > kStatSpan || s.arrays.size() >= 65535) {
      fiber_fail(*w, "kernel-error",
                 where(*w) + format(": static __shared__ `%s` (%zu bytes) at %s:%u takes the block's static shared "
                                    "memory past the %zu bytes CUDA allows",
                                    name, bytes, file, line, kMaxStaticShared),
                 file, line);
    }
    s.arrays.push_back(StaticArray{key, name, file, line, off, bytes, 0});
    const uint16_t idx = static_cast<uint16_t>(s.arrays.size());
    for (size_t i = 0; i < bytes; ++i) s.stat_owner[off + i] = idx;
    s.stat_used = off + bytes + kStaticRedzone;
    s.stat_data += bytes;
    arr = &s.arrays.back();
  }
  char* p = reinterpret_cast<char*>(s.stat.start) + arr->off;
  if (arr->block != w->block_serial) {
    arr->block = w->block_serial;
    std::memset(p, 0xff, arr->bytes);
  }
  return p;
}

void atomic_access(const volatile void* p, unsigned size, const void* ra) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), pc = reinterpret_cast<uintptr_t>(ra) - 1;
  Worker* w = t_worker;
  if (w && w->prof && t_cur && a - g_arena_lo < g_arena_size) prof_access(*w, a, size, kAccWrite | kAccRmw, pc);
  check_access(a, size, kAccWrite | kAccAtomic, pc);
}

namespace {
void check_watch(uintptr_t a, size_t n, unsigned flags, uintptr_t pc) {
  Worker* w = t_worker;
  Fiber* f = t_watch;
  if (!w || !f || f != t_cur || w->L->checks == kChecksOff) return;
  for (const PendingWgmma& p : f->wgmma) {
    const uintptr_t d = reinterpret_cast<uintptr_t>(p.d);
    if (a < d + p.bytes && d < a + n) {
      report(*w, "async-read-before-wait",
             where(*w) + " " + thread_str(*f) +
                 format(": %s of the accumulator of the wgmma issued at %s:%u before the wgmma_wait that makes its "
                        "result visible",
                        access_word(flags), p.file, p.line),
             pc);
      return;
    }
    // The register-source form reads A from the thread's registers while it runs: touching them
    // before the wait is undefined (the PTX ISA, wgmma.mma_async); a write may change the product.
    const uintptr_t ra = reinterpret_cast<uintptr_t>(p.a);
    if (p.a && a < ra + p.a_bytes && ra < a + n) {
      report(*w, "async-operand-before-wait",
             where(*w) + " " + thread_str(*f) +
                 format(": %s of the A registers of the wgmma issued at %s:%u before the wgmma_wait that ends it "
                        "(the instruction reads them asynchronously)",
                        access_word(flags), p.file, p.line),
             pc);
      return;
    }
  }
}

inline __attribute__((always_inline)) void hook(uintptr_t a, size_t n, unsigned flags, void* ra) {
  if (__builtin_expect(a - g_arena_lo < g_arena_size, 0)) {
    // Only kernel code reaches the hooks, so this is where the profiler sees its accesses (the
    // runtime's own checks of emulated instructions are counted by those instructions).
    Worker* w = t_worker;
    if (__builtin_expect(w != nullptr && w->prof != nullptr, 0) && t_cur) {
      prof_access(*w, a, n, flags, reinterpret_cast<uintptr_t>(ra) - 1);
    }
    check_access(a, n, flags, reinterpret_cast<uintptr_t>(ra) - 1);
  } else if (__builtin_expect(t_watch != nullptr, 0)) {
    check_watch(a, n, flags, reinterpret_cast<uintptr_t>(ra) - 1);
  }
}
}  // namespace

}  // namespace sluice_emu::rt

namespace sluice_emu {
void* static_shared_slot(const void* key, std::size_t bytes, std::size_t align, const char* name, const char* file,
                         unsigned line) {
  return rt::static_shared_slot(key, bytes, align, name, file, line);
}
void atomic_access(const volatile void* p, unsigned size, const void* ra) { rt::atomic_access(p, size, ra); }
}  // namespace sluice_emu

// The callbacks of GCC's ThreadSanitizer instrumentation (the ones it emits with
// tsan-instrument-func-entry-exit=0 and tsan-distinguish-volatile=1).
using sluice_emu::rt::hook;
using sluice_emu::rt::kAccAtomic;
using sluice_emu::rt::kAccWrite;
#define SLUICE_EMU_HOOK(N)                                                                                  \
  extern "C" void __tsan_read##N(void* a) { hook(reinterpret_cast<uintptr_t>(a), N, 0, __builtin_return_address(0)); } \
  extern "C" void __tsan_write##N(void* a) {                                                                \
    hook(reinterpret_cast<uintptr_t>(a), N, kAccWrite, __builtin_return_address(0));                        \
  }                                                                                                         \
  extern "C" void __tsan_unaligned_read##N(void* a) {                                                       \
    hook(reinterpret_cast<uintptr_t>(a), N, 0, __builtin_return_address(0));                                \
  }                                                                                                         \
  extern "C" void __tsan_unaligned_write##N(void* a) {                                                      \
    hook(reinterpret_cast<uintptr_t>(a), N, kAccWrite, __builtin_return_address(0));                        \
  }                                                                                                         \
  extern "C" void __tsan_volatile_read##N(void* a) {                                                        \
    hook(reinterpret_cast<uintptr_t>(a), N, kAccAtomic, __builtin_return_address(0));                       \
  }                                                                                                         \
  extern "C" void __tsan_volatile_write##N(void* a) {                                                       \
    hook(reinterpret_cast<uintptr_t>(a), N, kAccWrite | kAccAtomic, __builtin_return_address(0));           \
  }
SLUICE_EMU_HOOK(1)
SLUICE_EMU_HOOK(2)
SLUICE_EMU_HOOK(4)
SLUICE_EMU_HOOK(8)
SLUICE_EMU_HOOK(16)
#undef SLUICE_EMU_HOOK
extern "C" void __tsan_read_range(void* a, size_t n) {
  hook(reinterpret_cast<uintptr_t>(a), n, sluice_emu::rt::kAccRange, __builtin_return_address(0));
}
extern "C" void __tsan_write_range(void* a, size_t n) {
  hook(reinterpret_cast<uintptr_t>(a), n, kAccWrite | sluice_emu::rt::kAccRange, __builtin_return_address(0));
}
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_vptr_update(void**, void*) {}
extern "C" void __tsan_vptr_read(void**) {}
extern "C" void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
