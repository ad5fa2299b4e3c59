// async.cpp — asynchronous operations of the emulated GPU: mbarriers, bulk copies (cp.async.bulk,
// completing on an mbarrier), cp.async (completing at cp.async.wait_group) and wgmma (results
// visible at wgmma.wait_group).
//
// Each is modelled as asynchronous: its destination is written only when the operation completes
// (the mbarrier phase it signals, or the issuing thread's wait), and until then the destination is
// tagged, so a read of it is an `async-read-before-wait` finding (a write, a `race`). A wgmma's
// accumulator (registers on the GPU, a stack array here) is filled with NaN at issue and receives
// the result at the matching wait; reads of it in between are findings too (check.cpp, t_watch).
//
// Emulated threads switch only at barriers, warp operations and yields, so the bookkeeping here
// needs no locks: one host thread runs the whole block.
#include "emu_internal.h"

namespace sluice_emu::rt {

namespace {

Worker& current(const char* what) {
  Worker* w = t_worker;
  if (!w || !t_cur) {
    std::fprintf(stderr, "sluice emu: %s called outside an emulated kernel launch\n", what);
    std::abort();
  }
  return *w;
}

Region* shared_region(Worker& w, uintptr_t a) {
  Region* r = region_of(a);
  if (r && r->kind != RegionKind::Global && r->owner == &w) return r;
  return nullptr;
}

MBarrier* find_mbarrier(Worker& w, uintptr_t a) {
  for (MBarrier& m : w.mbarriers) {
    if (m.addr == a) return &m;
  }
  return nullptr;
}

MBarrier& initialised_mbarrier(Worker& w, void* bar, const char* what, const std::source_location& loc) {
  MBarrier* m = find_mbarrier(w, reinterpret_cast<uintptr_t>(bar));
  if (!m) {
    fiber_fail(w, "kernel-error",
               where(w) + " " + thread_str(*t_cur) +
                   format(": %s at %s:%u on an mbarrier that this block never initialised (%s)", what, loc.file_name(),
                          loc.line(), describe_address(w, reinterpret_cast<uintptr_t>(bar), 8).c_str()),
               loc.file_name(), loc.line());
  }
  return *m;
}

// Proxy tags (Region::proxy_tag): bits 0-10 the thread + 1 whose generic-proxy write is the
// granule's last (0: none, or landed by the async proxy), bits 11-26 that thread's count of
// fence.proxy.async at the write (the write is fenced once the count moves on), bits 27-29 the
// swizzle mode + 1 of the tensor copy that landed it (0: not a tensor copy).
constexpr uint32_t kProxyWriterMask = 0x7ffu, kProxyFenceShift = 11, kProxySwizzleShift = 27;

void set_proxy(Region& r, uintptr_t a, size_t n, uint32_t tag) {
  if (!r.proxy_tag || n == 0) return;
  const size_t g0 = (a - r.start) / kGranule, g1 = (a - r.start + n - 1) / kGranule;
  for (size_t g = g0; g <= g1; ++g) r.proxy_tag[g] = tag;
  if (g0 < r.proxy_lo) r.proxy_lo = g0;
  if (g1 + 1 > r.proxy_hi) r.proxy_hi = g1 + 1;
}

const char* swizzle_name(unsigned mode) {
  static const char* const names[] = {"no swizzle", "32-byte swizzle", "64-byte swizzle", "128-byte swizzle"};
  return mode < 4 ? names[mode] : "an unknown swizzle";
}

void set_tags(Region& r, uintptr_t a, size_t n, uint16_t tag) {
  const size_t g0 = (a - r.start) / kGranule, g1 = (a - r.start + n - 1) / kGranule;
  for (size_t g = g0; g <= g1; ++g) r.async_tag[g] = tag;
  if (tag) {
    if (g0 < r.tagged_lo) r.tagged_lo = g0;
    if (g1 + 1 > r.tagged_hi) r.tagged_hi = g1 + 1;
  }
}

unsigned new_op(Worker& w, const AsyncOp& op) {
  unsigned idx;
  if (!w.async_free.empty()) {
    idx = w.async_free.back();
    w.async_free.pop_back();
    w.async_ops[idx] = op;
  } else {
    if (w.async_ops.size() >= 65535) {
      fiber_fail(w, "kernel-error",
                 where(w) + format(": more than 65535 asynchronous copies in flight in one block (%s:%u)", op.file,
                                   op.line),
                 op.file, op.line);
    }
    idx = static_cast<unsigned>(w.async_ops.size());
    w.async_ops.push_back(op);
  }
  ++w.async_live;
  return idx;
}

// The copy lands: data written, tags and race records of the destination cleared. A bulk copy's
// data is then recorded as written by the async agent of its mbarrier (`agent`, or none), so a
// thread that reads it without having waited on that mbarrier races with it (check.cpp).
void land(Worker& w, unsigned idx, unsigned agent = 0) {
  AsyncOp& op = w.async_ops[idx];
  if (!op.live) return;
  std::memcpy(op.dst, op.staged.empty() ? op.src : op.staged.data(), op.bytes);
  if (Region* r = shared_region(w, reinterpret_cast<uintptr_t>(op.dst))) {
    set_tags(*r, reinterpret_cast<uintptr_t>(op.dst), op.bytes, 0);
    // Written by the async proxy (bulk and tensor copies): nothing to fence; the layout it landed in.
    if (op.kind != AsyncKind::CpAsync) {
      set_proxy(*r, reinterpret_cast<uintptr_t>(op.dst), op.bytes, static_cast<uint32_t>(op.swizzle_tag) << kProxySwizzleShift);
    }
  }
  race_forget(reinterpret_cast<uintptr_t>(op.dst), op.bytes);
  if (agent) race_record_write_by(w, agent, reinterpret_cast<uintptr_t>(op.dst), op.bytes, op.file, op.line);
  op.live = false;
  --w.async_live;
  w.async_free.push_back(idx);
}

// The async agent of mbarrier m (kAgentBase + its index in the block), or 0 past kMaxAgents.
unsigned agent_of(const Worker& w, const MBarrier& m) {
  const size_t i = static_cast<size_t>(&m - w.mbarriers.data());
  return i < kMaxAgents ? kAgentBase + static_cast<unsigned>(i) : 0;
}

void complete_if_done(Worker& w, MBarrier& m) {
  if (m.pending != 0 || m.tx != 0) return;
  const unsigned agent = agent_of(w, m);
  for (unsigned idx : m.ops) land(w, idx, agent);
  // The phase's releases, with the agent's landed writes, become what a wait acquires.
  if (agent && !m.ops.empty()) race_release(w, agent, m.arrivals);
  m.ops.clear();
  m.done = m.arrivals;
  m.arrivals.stamp = UINT16_MAX;
  m.pending = m.expected;
  ++m.completed;
}

// Checks and tags the destination of an asynchronous copy; returns its op index.
unsigned issue_copy(Worker& w, AsyncKind kind, void* dst, const void* src, unsigned bytes, uintptr_t bar,
                    const std::source_location& loc) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  check_access(reinterpret_cast<uintptr_t>(src), bytes, 0, 0, loc.file_name(), loc.line());
  check_access(d, bytes, kAccWrite, 0, loc.file_name(), loc.line());
  Region* r = shared_region(w, d);
  if (!r) {
    fiber_fail(w, "out-of-bounds",
               where(w) + " " + thread_str(*t_cur) +
                   format(": the destination of the %s at %s:%u is not this block's shared memory (%s)",
                          kind == AsyncKind::Bulk ? "bulk copy" : "cp.async", loc.file_name(), loc.line(),
                          describe_address(w, d, bytes).c_str()),
               loc.file_name(), loc.line());
  }
  // Profile: a cp.async is a per-lane global load (grouped into warp requests like kernel loads);
  // a bulk copy is one thread's instruction that moves `bytes` (counted by bytes).
  if (kind == AsyncKind::CpAsync) prof_global_read(w, reinterpret_cast<uintptr_t>(src), bytes, loc.file_name(), loc.line());
  else prof_mark_read(w, reinterpret_cast<uintptr_t>(src), bytes);
  prof_add(w, kAsyncBytes, bytes, loc.file_name(), loc.line());
  prof_add(w, kAsyncInstr, 1, loc.file_name(), loc.line());
  AsyncOp op{kind, true, static_cast<char*>(dst), static_cast<const char*>(src), bytes, bar, t_cur->linear, -1,
             loc.file_name(), loc.line()};
  unsigned idx = new_op(w, op);
  set_tags(*r, d, bytes, static_cast<uint16_t>(idx + 1));
  return idx;
}

}  // namespace

void async_block_start(Worker& w) {
  for (Region* r : {&w.shared.dyn, &w.shared.stat}) {
    if (!w.shared_ok || r->tagged_lo >= r->tagged_hi) continue;
    std::memset(r->async_tag + r->tagged_lo, 0, (r->tagged_hi - r->tagged_lo) * sizeof(uint16_t));
    r->tagged_lo = SIZE_MAX;
    r->tagged_hi = 0;
  }
  for (Region* r : {&w.shared.dyn, &w.shared.stat}) {
    if (!w.shared_ok || r->proxy_lo >= r->proxy_hi) continue;
    std::memset(r->proxy_tag + r->proxy_lo, 0, (r->proxy_hi - r->proxy_lo) * sizeof(uint32_t));
    r->proxy_lo = SIZE_MAX;
    r->proxy_hi = 0;
  }
  w.async_ops.clear();
  w.async_free.clear();
  w.async_live = 0;
  w.mbarriers.clear();
  for (Fiber& f : w.fibers) {
    f.wgmma.clear();
    f.wgmma_groups = 0;
    f.cp_groups = 0;
    f.proxy_fences = 0;
  }
  t_watch = nullptr;
}

void proxy_note_write(Worker& w, Region& r, uintptr_t a, size_t n) {
  (void)w;
  const Fiber& f = *t_cur;
  set_proxy(r, a, n, (f.linear + 1u) | (static_cast<uint32_t>(f.proxy_fences) << kProxyFenceShift));
}

const AsyncOp* async_pending_at(const Worker& w, const Region& r, uintptr_t a, size_t n) {
  if (!r.async_tag) return nullptr;
  const size_t g0 = (a - r.start) / kGranule, g1 = (a - r.start + n - 1) / kGranule;
  for (size_t g = g0; g <= g1; ++g) {
    if (uint16_t t = r.async_tag[g]) {
      const AsyncOp& op = w.async_ops[t - 1u];
      if (op.live) return &op;
    }
  }
  return nullptr;
}

}  // namespace sluice_emu::rt

// ---------------------------------------------------------------------------------------------
// Entry points used by kernels/cuda/common (declared in sluice_emu.h)
// ---------------------------------------------------------------------------------------------
namespace sluice_emu {
using namespace rt;

void mbarrier_init(void* bar, unsigned count, const std::source_location& loc) {
  Worker& w = current("mbarrier_init");
  const uintptr_t a = reinterpret_cast<uintptr_t>(bar);
  check_access(a, 8, kAccWrite | kAccAtomic, 0, loc.file_name(), loc.line());
  if (count == 0 || count > (1u << 20) - 1) {
    fiber_fail(w, "kernel-error",
               where(w) + format(": mbarrier_init with %u expected arrivals at %s:%u", count, loc.file_name(), loc.line()),
               loc.file_name(), loc.line());
  }
  MBarrier* m = find_mbarrier(w, a);
  if (!m) {
    w.mbarriers.push_back(MBarrier{a, 0, 0, 0, 0, {}, {}, {}});
    m = &w.mbarriers.back();
  }
  m->expected = m->pending = count;
  m->tx = 0;
  m->completed = 0;
  m->ops.clear();
  m->arrivals.stamp = m->done.stamp = UINT16_MAX;
}

void mbarrier_expect_tx(void* bar, unsigned bytes, const std::source_location& loc) {
  Worker& w = current("mbarrier_expect_tx");
  check_access(reinterpret_cast<uintptr_t>(bar), 8, kAccWrite | kAccAtomic, 0, loc.file_name(), loc.line());
  initialised_mbarrier(w, bar, "mbarrier_expect_tx", loc).tx += bytes;
}

void mbarrier_arrive(void* bar, const std::source_location& loc) {
  Worker& w = current("mbarrier_arrive");
  check_access(reinterpret_cast<uintptr_t>(bar), 8, kAccWrite | kAccAtomic, 0, loc.file_name(), loc.line());
  MBarrier& m = initialised_mbarrier(w, bar, "mbarrier_arrive", loc);
  if (m.pending == 0) {
    fiber_fail(w, "kernel-error",
               where(w) + " " + thread_str(*t_cur) +
                   format(": mbarrier_arrive at %s:%u on a phase that expects no more arrivals", loc.file_name(),
                          loc.line()),
               loc.file_name(), loc.line());
  }
  race_release(w, t_cur->linear, m.arrivals);  // release: this thread's accesses so far
  --m.pending;
  complete_if_done(w, m);
}

bool mbarrier_test_wait(void* bar, unsigned parity, const std::source_location& loc) {
  Worker& w = current("mbarrier_wait");
  check_access(reinterpret_cast<uintptr_t>(bar), 8, kAccAtomic, 0, loc.file_name(), loc.line());
  const MBarrier& m = initialised_mbarrier(w, bar, "mbarrier_wait", loc);
  const bool done = (m.completed & 1u) != (parity & 1u);
  if (done) race_acquire(w, t_cur->linear, m.done);  // acquire: the phase's releases and landings
  return done;
}

void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, void* bar, const std::source_location& loc) {
  Worker& w = current("bulk_copy_g2s");
  if (bytes == 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    fiber_fail(w, "kernel-error",
               where(w) + " " + thread_str(*t_cur) +
                   format(": bulk copy of %u bytes from %p to %p at %s:%u (the size must be a non-zero multiple of 16 "
                          "and both addresses 16-byte aligned)",
                          bytes, src, dst, loc.file_name(), loc.line()),
               loc.file_name(), loc.line());
  }
  check_access(reinterpret_cast<uintptr_t>(bar), 8, kAccWrite | kAccAtomic, 0, loc.file_name(), loc.line());
  MBarrier& m = initialised_mbarrier(w, bar, "bulk_copy_g2s", loc);
  unsigned idx = issue_copy(w, AsyncKind::Bulk, dst, src, bytes, reinterpret_cast<uintptr_t>(bar), loc);
  m.ops.push_back(idx);
  m.tx -= bytes;  // the bytes arrive (complete_tx); they become visible with the phase
  complete_if_done(w, m);
}

// The emulator's tensor map: 16 words that kernels/src/tensor_map.rs writes (and only it).
//   [0] kTensorMapMagic  [1] global address  [2] rank | element bytes << 8 | swizzle << 16
//   [3..7] size of dimensions 0..4 (elements)  [8..11] byte strides of dimensions 1..4
//   [12] box sizes of dimensions 0..3, 16 bits each  [13] box size of dimension 4
constexpr unsigned long long kTensorMapMagic = 0x534c55494345544dull;  // "SLUICETM"

void tensor_copy_g2s(void* dst, const void* map_p, const int* coords, unsigned rank, void* bar,
                     const std::source_location& loc) {
  Worker& w = current("tensor_copy_g2s");
  const unsigned long long* map = static_cast<const unsigned long long*>(map_p);
  auto fail = [&](const std::string& why) {
    fiber_fail(w, "kernel-error",
               where(w) + " " + thread_str(*t_cur) + format(": tensor copy at %s:%u: ", loc.file_name(), loc.line()) + why,
               loc.file_name(), loc.line());
  };
  if (map[0] != kTensorMapMagic) fail("the tensor map was not encoded by sluice's host side (kernels/src/tensor_map.rs)");
  const unsigned map_rank = map[2] & 0xff, elem = (map[2] >> 8) & 0xff, swizzle = (map[2] >> 16) & 0xff;
  if (map_rank != rank) fail(format("a %uD copy with a rank-%u tensor map", rank, map_rank));
  const char* base = reinterpret_cast<const char*>(static_cast<uintptr_t>(map[1]));
  unsigned long long dims[5] = {1, 1, 1, 1, 1}, strides[5] = {0, 0, 0, 0, 0};
  unsigned box[5] = {1, 1, 1, 1, 1};
  for (unsigned i = 0; i < rank; ++i) {
    dims[i] = map[3 + i];
    if (i > 0) strides[i] = map[8 + i - 1];
    box[i] = i < 4 ? static_cast<unsigned>((map[12] >> (16 * i)) & 0xffff) : static_cast<unsigned>(map[13] & 0xffff);
  }
  strides[0] = elem;
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  if (d % 128 != 0) fail(format("the shared-memory destination %p is not 128-byte aligned", dst));
  const unsigned row_bytes = box[0] * elem;
  if (row_bytes == 0 || row_bytes % 16 != 0 || row_bytes > 256 * 8) {
    fail(format("a box row of %u bytes (a non-zero multiple of 16 is needed)", row_bytes));
  }
  const unsigned span = swizzle ? 16u << swizzle : 0;  // 32, 64 or 128 bytes
  if (swizzle && row_bytes != span) {
    fail(format("a box row of %u bytes with the %s (the emulator models swizzled boxes whose rows are exactly "
                "the swizzle span)",
                row_bytes, swizzle_name(swizzle)));
  }
  unsigned long long rows = 1;
  for (unsigned i = 1; i < rank; ++i) rows *= box[i];
  const unsigned bytes = static_cast<unsigned>(rows * row_bytes);
  check_access(reinterpret_cast<uintptr_t>(bar), 8, kAccWrite | kAccAtomic, 0, loc.file_name(), loc.line());
  MBarrier& m = initialised_mbarrier(w, bar, "tensor_copy_g2s", loc);
  check_access(d, bytes, kAccWrite, 0, loc.file_name(), loc.line());
  Region* r = shared_region(w, d);
  if (!r) fail("the destination is not this block's shared memory (" + describe_address(w, d, bytes) + ")");
  // Gather the box (zero outside the tensor), each row placed where the swizzle puts it: the
  // 16-byte chunk c of the row at canonical offset o lands at chunk c ^ ((address >> 7) & mask)
  // of the same 128-byte line, mask 1/3/7 for 32/64/128 bytes (the PTX ISA's swizzle modes).
  std::vector<char> staged(bytes, 0);
  const uintptr_t mask = swizzle ? (1u << swizzle) - 1 : 0;
  for (unsigned long long row = 0; row < rows; ++row) {
    long long off = 0;
    bool inside = true;
    unsigned long long rest = row;
    for (unsigned i = 1; i < rank; ++i) {
      const long long c = static_cast<long long>(coords[i]) + static_cast<long long>(rest % box[i]);
      rest /= box[i];
      if (c < 0 || static_cast<unsigned long long>(c) >= dims[i]) inside = false;
      off += c * static_cast<long long>(strides[i]);
    }
    char row_data[256 * 8];
    std::memset(row_data, 0, row_bytes);
    if (inside) {
      const long long c0 = coords[0];
      const long long lo = std::max(0LL, c0), hi = std::min(static_cast<long long>(dims[0]), c0 + box[0]);
      if (hi > lo) {
        const char* src = base + off + lo * elem;
        const size_t n = static_cast<size_t>(hi - lo) * elem;
        check_access(reinterpret_cast<uintptr_t>(src), n, 0, 0, loc.file_name(), loc.line());
        prof_mark_read(w, reinterpret_cast<uintptr_t>(src), n);
        std::memcpy(row_data + (lo - c0) * elem, src, n);
      }
    }
    for (unsigned b = 0; b < row_bytes; b += 16) {
      const uintptr_t canon = d + row * row_bytes + b;
      const uintptr_t phys = canon ^ (((canon >> 7) & mask) << 4);
      std::memcpy(staged.data() + (phys - d), row_data + b, 16);
    }
  }
  prof_add(w, kAsyncBytes, bytes, loc.file_name(), loc.line());
  prof_add(w, kAsyncInstr, 1, loc.file_name(), loc.line());
  AsyncOp op{AsyncKind::Tensor, true, static_cast<char*>(dst), nullptr, bytes, reinterpret_cast<uintptr_t>(bar),
             t_cur->linear, -1, loc.file_name(), loc.line(), {}, static_cast<uint8_t>(swizzle + 1)};
  const unsigned idx = new_op(w, op);
  w.async_ops[idx].staged = std::move(staged);
  set_tags(*r, d, bytes, static_cast<uint16_t>(idx + 1));
  m.ops.push_back(idx);
  m.tx -= bytes;  // complete_tx of the whole box, zero-filled bytes included
  complete_if_done(w, m);
}

void fence_proxy_async(const std::source_location&) {
  current("fence_proxy_async");
  ++t_cur->proxy_fences;
}

void async_proxy_read(const void* p, unsigned bytes, unsigned swizzle, const std::source_location& loc) {
  Worker& w = current("async_proxy_read");
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  // Bounds, a copy in flight, races: the operand's bytes as a read by the issuing thread (the
  // emulation's per-thread element reads are not instrumented; hopper.cuh).
  check_access(a, bytes, 0, 0, loc.file_name(), loc.line());
  if (w.L->checks != kChecksFull || bytes == 0) return;
  Region* r = shared_region(w, a);
  if (!r || !r->proxy_tag) return;
  const size_t g0 = (a - r->start) / kGranule, g1 = (a - r->start + bytes - 1) / kGranule;
  for (size_t g = g0; g <= g1; ++g) {
    const uint32_t tag = r->proxy_tag[g];
    const unsigned writer = tag & kProxyWriterMask;
    if (writer && writer <= w.fibers.size() &&
        ((tag >> kProxyFenceShift) & 0xffffu) == w.fibers[writer - 1].proxy_fences) {
      report(w, "missing-proxy-fence",
             where(w) + " " + thread_str(*t_cur) +
                 format(": the wgmma at %s:%u reads %s through the async proxy, written by %s through the generic "
                        "proxy with no fence.proxy.async (fence_proxy_async_shared) after the write",
                        loc.file_name(), loc.line(), describe_address(w, r->start + g * kGranule, 8).c_str(),
                        thread_str(w.fibers[writer - 1]).c_str()),
             0, 0, loc.file_name(), loc.line());
      return;
    }
    const unsigned landed = (tag >> kProxySwizzleShift) & 7u;
    if (landed && landed - 1 != swizzle) {
      report(w, "swizzle-mismatch",
             where(w) + " " + thread_str(*t_cur) +
                 format(": the wgmma at %s:%u reads %s with %s, but a tensor copy landed it with %s", loc.file_name(),
                        loc.line(), describe_address(w, r->start + g * kGranule, 8).c_str(), swizzle_name(swizzle),
                        swizzle_name(landed - 1)),
             0, 0, loc.file_name(), loc.line());
      return;
    }
  }
}

void cp_async(void* dst, const void* src, unsigned bytes, const std::source_location& loc) {
  Worker& w = current("cp_async");
  if ((bytes != 4 && bytes != 8 && bytes != 16) || reinterpret_cast<uintptr_t>(dst) % bytes != 0 ||
      reinterpret_cast<uintptr_t>(src) % bytes != 0) {
    fiber_fail(w, "kernel-error",
               where(w) + " " + thread_str(*t_cur) +
                   format(": cp.async of %u bytes from %p to %p at %s:%u (4, 8 or 16 bytes, both addresses aligned to "
                          "the size)",
                          bytes, src, dst, loc.file_name(), loc.line()),
               loc.file_name(), loc.line());
  }
  issue_copy(w, AsyncKind::CpAsync, dst, src, bytes, 0, loc);
}

void cp_async_commit(const std::source_location&) {
  Worker& w = current("cp_async_commit");
  Fiber& f = *t_cur;
  bool any = false;
  for (AsyncOp& op : w.async_ops) {
    if (op.live && op.kind == AsyncKind::CpAsync && op.fiber == f.linear && op.group < 0) {
      op.group = f.cp_groups;
      any = true;
    }
  }
  (void)any;  // an empty group is legal
  ++f.cp_groups;
}

void cp_async_wait(int n, const std::source_location& loc) {
  Worker& w = current("cp_async_wait");
  Fiber& f = *t_cur;
  const int done_below = f.cp_groups - n;
  for (unsigned i = 0; i < w.async_ops.size(); ++i) {
    AsyncOp& op = w.async_ops[i];
    if (!op.live || op.kind != AsyncKind::CpAsync || op.fiber != f.linear || op.group < 0 || op.group >= done_below) {
      continue;
    }
    const uintptr_t d = reinterpret_cast<uintptr_t>(op.dst);
    const unsigned bytes = op.bytes;
    land(w, i);
    // The data is this thread's write from now on: other threads need a barrier to read it, and
    // cp.async writes through the generic proxy, so the async proxy needs a fence to read it.
    race_record_write(w, f, d, bytes, loc.file_name(), loc.line());
    if (Region* r = shared_region(w, d)) proxy_note_write(w, *r, d, bytes);
  }
}

void wgmma_accumulator(const float* d, float* out, unsigned bytes) {
  current("wgmma");
  const Fiber& f = *t_cur;
  for (auto it = f.wgmma.rbegin(); it != f.wgmma.rend(); ++it) {
    if (it->d == d) {
      std::memcpy(out, it->value, bytes);
      return;
    }
  }
  std::memcpy(out, d, bytes);
}

void wgmma_issue(float* d, const float* value, unsigned bytes, const std::source_location& loc, const void* a,
                 unsigned a_bytes) {
  Worker& w = current("wgmma");
  Fiber& f = *t_cur;
  if (bytes > sizeof(PendingWgmma::value)) {
    fiber_fail(w, "kernel-error", where(w) + format(": wgmma accumulator of %u bytes at %s:%u", bytes, loc.file_name(), loc.line()),
               loc.file_name(), loc.line());
  }
  PendingWgmma p;
  p.d = d;
  p.bytes = bytes;
  p.a = a;
  p.a_bytes = a_bytes;
  p.group = -1;
  p.file = loc.file_name();
  p.line = loc.line();
  std::memcpy(p.value, value, bytes);
  f.wgmma.push_back(p);
  std::memset(d, 0xff, bytes);  // NaN until the wait: a read before it shows up in the results too
  t_watch = &f;
}

void wgmma_commit(const std::source_location&) {
  current("wgmma_commit");
  Fiber& f = *t_cur;
  for (PendingWgmma& p : f.wgmma) {
    if (p.group < 0) p.group = f.wgmma_groups;
  }
  ++f.wgmma_groups;
}

void wgmma_wait(int n, const std::source_location&) {
  current("wgmma_wait");
  Fiber& f = *t_cur;
  const int done_below = f.wgmma_groups - n;
  size_t keep = 0;
  for (size_t i = 0; i < f.wgmma.size(); ++i) {
    PendingWgmma& p = f.wgmma[i];
    if (p.group >= 0 && p.group < done_below) {
      std::memcpy(p.d, p.value, p.bytes);
    } else {
      if (keep != i) f.wgmma[keep] = p;
      ++keep;
    }
  }
  f.wgmma.resize(keep);
  t_watch = f.wgmma.empty() ? nullptr : &f;
}

}  // namespace sluice_emu
