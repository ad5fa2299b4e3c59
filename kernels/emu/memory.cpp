// memory.cpp — the emulator's memory: one reserved arena holding every global allocation and every
// host thread's shared-memory windows, and the map from 64 KiB chunks of it to their Region.
//
// Global allocation layout (a span of whole chunks):
//   [4 KiB redzone][data, 4 KiB aligned][slack to the page end][>= 64 KiB redzone]
// The data pages are readable and writable; the redzones are PROT_NONE. The checker compares every
// checked access with the region's data bounds, so an access one byte past the end is reported
// to the byte (before it happens); an unchecked access (checks off) past the last data page
// faults.
#include "emu_internal.h"

#include <sys/mman.h>

namespace sluice_emu::rt {

uintptr_t g_arena_lo = 0;
size_t g_arena_size = 0;
std::atomic<Region*>* g_region_map = nullptr;

namespace {

constexpr size_t kArenaBytes = size_t{1} << 37;  // 128 GiB of address space
constexpr size_t kChunk = size_t{1} << kChunkShift;
constexpr size_t kFrontRedzone = kPage;
constexpr size_t kBackRedzone = 64 * 1024;

std::mutex g_mu;
std::map<size_t, size_t> g_free;             // free spans: first chunk -> chunks
size_t g_next_chunk = 0;                     // chunks past this one were never used
std::map<uintptr_t, Region*> g_allocs;       // global allocations by data start
std::vector<Region*> g_spare_regions;        // Region objects are recycled, never deleted
unsigned long long g_next_id = 1;

char* map_none(size_t len) {
  void* p = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

// Returns `n` chunks of the arena (index of the first) or SIZE_MAX. Caller holds g_mu.
size_t take_chunks_locked(size_t n) {
  for (auto it = g_free.begin(); it != g_free.end(); ++it) {
    if (it->second >= n) {
      size_t first = it->first, len = it->second;
      g_free.erase(it);
      if (len > n) g_free.emplace(first + n, len - n);
      return first;
    }
  }
  if (g_next_chunk + n > kArenaBytes / kChunk) return SIZE_MAX;
  size_t first = g_next_chunk;
  g_next_chunk += n;
  return first;
}

// Returns chunks to the free list, merging neighbours. Caller holds g_mu.
void give_chunks_locked(size_t first, size_t n) {
  auto next = g_free.lower_bound(first);
  if (next != g_free.end() && next->first == first + n) {
    n += next->second;
    next = g_free.erase(next);
  }
  if (next != g_free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      prev->second += n;
      return;
    }
  }
  g_free.emplace(first, n);
}

void register_span(Region* r) {
  for (uintptr_t c = r->lo; c < r->hi; c += kChunk) {
    g_region_map[(c - g_arena_lo) >> kChunkShift].store(r, std::memory_order_release);
  }
}
void unregister_span(const Region* r) {
  for (uintptr_t c = r->lo; c < r->hi; c += kChunk) {
    g_region_map[(c - g_arena_lo) >> kChunkShift].store(nullptr, std::memory_order_release);
  }
}

Region* new_region_locked() {
  if (!g_spare_regions.empty()) {
    Region* r = g_spare_regions.back();
    g_spare_regions.pop_back();
    return r;
  }
  return new Region();
}

// A span of `bytes` (rounded up to chunks) in the arena, PROT_NONE; 0 on failure.
uintptr_t take_span(size_t bytes) {
  std::lock_guard<std::mutex> g(g_mu);
  size_t first = take_chunks_locked(round_up(bytes, kChunk) / kChunk);
  return first == SIZE_MAX ? 0 : g_arena_lo + first * kChunk;
}

}  // namespace

bool arena_init() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    char* arena = map_none(kArenaBytes);
    if (!arena) return;
    const size_t map_bytes = (kArenaBytes / kChunk) * sizeof(std::atomic<Region*>);
    void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      munmap(arena, kArenaBytes);
      return;
    }
    g_region_map = static_cast<std::atomic<Region*>*>(m);  // zero pages: every entry null
    g_arena_lo = reinterpret_cast<uintptr_t>(arena);
    g_arena_size = kArenaBytes;
    ok = true;
  });
  return ok;
}

Slot* race_shadow(Region& r) {
  Slot* s = r.race.load(std::memory_order_acquire);
  if (s || r.race_granules == 0) return s;
  const size_t len = r.race_granules * kSlotsPerGranule * sizeof(Slot);
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  Slot* expected = nullptr;
  if (!r.race.compare_exchange_strong(expected, static_cast<Slot*>(m))) {
    munmap(m, len);  // another launch mapped it first
    return expected;
  }
  return static_cast<Slot*>(m);
}

void clear_race_shadow(Region& r) {
  Slot* s = r.race.load(std::memory_order_acquire);
  if (!s || r.touched_lo >= r.touched_hi) {
    r.touched_lo = SIZE_MAX;
    r.touched_hi = 0;
    return;
  }
  const size_t lo = r.touched_lo * kSlotsPerGranule * sizeof(Slot);
  const size_t hi = r.touched_hi * kSlotsPerGranule * sizeof(Slot);
  char* base = reinterpret_cast<char*>(s);
  if (hi - lo < 256 * 1024) {
    std::memset(base + lo, 0, hi - lo);
  } else {
    // Whole pages go back to the kernel (they read as zero again); the partial ends are cleared.
    size_t plo = round_up(lo, kPage), phi = hi / kPage * kPage;
    std::memset(base + lo, 0, plo - lo);
    madvise(base + plo, phi - plo, MADV_DONTNEED);
    std::memset(base + phi, 0, hi - phi);
  }
  r.touched_lo = SIZE_MAX;
  r.touched_hi = 0;
}

std::atomic<int> g_lazy_alloc{0};

void* global_alloc(size_t bytes) {
  if (bytes > (size_t{1} << 40) || !arena_init()) return nullptr;
  const size_t data_pages = round_up(bytes, kPage);
  const size_t span = round_up(kFrontRedzone + data_pages + kBackRedzone, kChunk);
  uintptr_t lo = take_span(span);
  if (!lo) return nullptr;
  char* start = reinterpret_cast<char*>(lo + kFrontRedzone);
  if (data_pages && mprotect(start, data_pages, PROT_READ | PROT_WRITE) != 0) {
    std::lock_guard<std::mutex> g(g_mu);
    give_chunks_locked((lo - g_arena_lo) / kChunk, span / kChunk);
    return nullptr;
  }
  // Fresh memory reads as NaN (f32 and bf16), unless the profiler asked for lazy memory (fresh
  // zero pages that take no resident memory until written).
  if (!g_lazy_alloc.load(std::memory_order_relaxed)) std::memset(start, 0xff, bytes);
  std::lock_guard<std::mutex> g(g_mu);
  Region* r = new_region_locked();
  r->kind = RegionKind::Global;
  r->lo = lo;
  r->hi = lo + span;
  r->start = reinterpret_cast<uintptr_t>(start);
  r->bytes = bytes;
  r->id = g_next_id++;
  r->race.store(nullptr, std::memory_order_relaxed);
  r->race_granules = round_up(bytes, kGranule) / kGranule;
  r->touched_lo = SIZE_MAX;
  r->touched_hi = 0;
  r->race_launch.store(0, std::memory_order_relaxed);
  r->owner = nullptr;
  g_allocs[r->start] = r;
  register_span(r);
  return start;
}

void global_free(void* p) {
  if (!p) return;
  Region* r = nullptr;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end()) return;
    r = it->second;
    g_allocs.erase(it);
    unregister_span(r);
  }
  // Drop the pages (and make the span inaccessible) before the span can be reused.
  mmap(reinterpret_cast<void*>(r->lo), r->hi - r->lo, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
       -1, 0);
  if (Slot* s = r->race.exchange(nullptr)) munmap(s, r->race_granules * kSlotsPerGranule * sizeof(Slot));
  std::lock_guard<std::mutex> g(g_mu);
  give_chunks_locked((r->lo - g_arena_lo) / kChunk, (r->hi - r->lo) / kChunk);
  g_spare_regions.push_back(r);
}

namespace {
bool init_window(Region& r, RegionKind kind, size_t span, Worker* owner) {
  uintptr_t lo = take_span(span);
  if (!lo) return false;
  if (mprotect(reinterpret_cast<void*>(lo), span, PROT_READ | PROT_WRITE) != 0) return false;
  r.kind = kind;
  r.lo = lo;
  r.hi = lo + span;
  r.start = lo;
  r.bytes = kind == RegionKind::StaticShared ? span : 0;
  r.race_granules = span / kGranule;
  r.owner = owner;
  const size_t tag_bytes = span / kGranule * sizeof(uint16_t);
  void* t = mmap(nullptr, tag_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (t == MAP_FAILED) return false;
  r.async_tag = static_cast<uint16_t*>(t);
  void* pt = mmap(nullptr, span / kGranule * sizeof(uint32_t), PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (pt == MAP_FAILED) return false;
  r.proxy_tag = static_cast<uint32_t*>(pt);
  std::lock_guard<std::mutex> g(g_mu);
  register_span(&r);
  return true;
}
}  // namespace

bool shared_windows_init(SharedWindows& s, Worker* owner) {
  if (!arena_init()) return false;
  if (!init_window(s.dyn, RegionKind::DynShared, kDynSpan, owner)) return false;
  if (!init_window(s.stat, RegionKind::StaticShared, kStatSpan, owner)) return false;
  void* m = mmap(nullptr, kStatSpan * sizeof(uint16_t), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  s.stat_owner = static_cast<uint16_t*>(m);
  return true;
}

void shared_windows_set_dynamic(SharedWindows& s, size_t bytes) {
  s.dyn.bytes = bytes;
  const size_t keep = round_up(bytes, kPage);
  if (keep < kDynSpan) mprotect(reinterpret_cast<void*>(s.dyn.start + keep), kDynSpan - keep, PROT_NONE);
}

void shared_windows_restore(SharedWindows& s) {
  const size_t keep = round_up(s.dyn.bytes, kPage);
  if (keep < kDynSpan) mprotect(reinterpret_cast<void*>(s.dyn.start + keep), kDynSpan - keep, PROT_READ | PROT_WRITE);
}

void shared_windows_reset_static(SharedWindows& s) {
  for (const StaticArray& a : s.arrays) std::memset(s.stat_owner + a.off, 0, a.bytes * sizeof(uint16_t));
  s.arrays.clear();
  s.stat_used = kStaticRedzone;
  s.stat_data = 0;
}

}  // namespace sluice_emu::rt

extern "C" int sluice_emu_set_lazy_alloc(int lazy) {
  return sluice_emu::rt::g_lazy_alloc.exchange(lazy ? 1 : 0);
}
