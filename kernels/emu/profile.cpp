// profile.cpp — the emulator as a profiler: what a GPU's memory pipeline and instruction counters
// would see for a launch, counted from the same access hooks the checker uses (docs/emulator.md,
// "Profiling").
//
// Requests. A request is one warp-level execution of one memory instruction. The fibers of a warp
// run one after another (they switch only at barriers and warp operations), so the lanes' accesses
// are grouped afterwards: within one epoch (the stretch between two warp-synchronous points the
// lanes pass together: warp operations, barriers), lane L's k-th execution of code site S (one
// instrumented load or store, known by its code address) joins the k-th executions of S by the
// other lanes of its warp in the same epoch. Lanes that run a loop more often than others make
// extra requests with fewer lanes, as a divergent loop does on the GPU; a site that different
// lanes reach in different rounds of a loop with a warp operation in it (a winner writing its
// result each round) makes one request per round. The grouping depends only on what each lane
// executes, never on the schedule, so every count is the same under every schedule seed.
//
// Per request: global memory counts bytes, distinct 32-byte sectors and 128-byte lines, and the
// ideal sectors ceil(unique bytes / 32); shared memory counts wavefronts by the bank rule (32 banks
// of 4 bytes; lanes reading one word are served once; 8- and 16-byte accesses in half- and
// quarter-warp phases) against the ideal ceil(unique bytes / 128). Emulated instructions
// (ldmatrix, mma, wgmma, cp.async, bulk copies) report their own footprint and their emulation's
// internal accesses are not counted (Fiber::prof_quiet).
//
// A sampled launch runs only the listed blocks; each block's counts are added with its weight.
#include "emu_internal.h"

#include <algorithm>
#include <unordered_map>

#include <sys/mman.h>

namespace sluice_emu::rt {

namespace {

const char* const kCounterNames[kProfCounters] = {
    "global_load_requests",   "global_load_bytes",      "global_load_sectors",
    "global_load_lines",      "global_load_ideal_sectors",
    "global_store_requests",  "global_store_bytes",     "global_store_sectors",
    "global_store_lines",     "global_store_ideal_sectors",
    "shared_load_requests",   "shared_load_wavefronts", "shared_load_ideal_wavefronts",
    "shared_store_requests",  "shared_store_wavefronts", "shared_store_ideal_wavefronts",
    "tensor_flops",           "special_function_calls", "async_copy_bytes",
    "barriers",               "shuffles",               "atomics",
    "warp_votes",             "ldmatrix_instructions",  "wgmma_operand_wavefronts",
    "async_copy_instructions",
};

struct SiteKey {
  uintptr_t pc;      // code address of an instrumented access (0 for source-line sites)
  const char* file;  // source line of an emulated instruction, barrier or warp operation
  unsigned line;
  bool operator==(const SiteKey& o) const { return pc == o.pc && file == o.file && line == o.line; }
};
struct SiteHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<uintptr_t>()(k.pc) ^ (std::hash<const void*>()(k.file) * 31) ^ (k.line * 0x9e3779b9u);
  }
};
struct ByteMap;
struct SiteData {
  SiteKey key;
  double c[kProfCounters] = {};
  std::vector<std::pair<const char*, double>> tensor;  // by shape (string literals)
  std::vector<ByteMap*> maps;  // full launches: this site's unique bytes, one map per buffer
  uint32_t width_min = UINT32_MAX, width_max = 0;  // bytes per lane of the site's accesses
};

enum RecKind : uint8_t { kRecGlobalLoad, kRecGlobalStore, kRecSharedLoad, kRecSharedStore, kRecAtomic };
// One lane's access, grouped into requests at the end of the block.
struct Rec {
  uint64_t addr;
  uint32_t site;
  uint32_t epoch; // the lane's warp-synchronous epoch (Fiber::sync_epoch)
  uint32_t occ;   // the lane's execution count of the site in this epoch before this one
  uint32_t size;
  uint16_t warp;
  uint8_t lane;
  uint8_t kind;
};

// Unique bytes of one global buffer: one bit per byte read, one per byte written.
struct ByteMap {
  uintptr_t start = 0;
  size_t bytes = 0;
  unsigned param = 0;
  std::atomic<uint64_t>* read = nullptr;
  std::atomic<uint64_t>* written = nullptr;
  size_t words = 0;
};

std::atomic<uint64_t>* map_bits(size_t words) {
  void* p = mmap(nullptr, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<std::atomic<uint64_t>*>(p);
}

void set_bits(std::atomic<uint64_t>* bits, size_t lo, size_t hi) {
  while (lo < hi) {
    const size_t word = lo / 64, bit = lo % 64;
    const size_t n = std::min<size_t>(64 - bit, hi - lo);
    const uint64_t mask = (n == 64 ? ~0ull : ((1ull << n) - 1)) << bit;
    if ((bits[word].load(std::memory_order_relaxed) & mask) != mask) bits[word].fetch_or(mask, std::memory_order_relaxed);
    lo += n;
  }
}

unsigned long long count_bits(const std::atomic<uint64_t>* bits, size_t words) {
  unsigned long long n = 0;
  for (size_t i = 0; i < words; ++i) n += static_cast<unsigned long long>(__builtin_popcountll(bits[i].load()));
  return n;
}

}  // namespace

struct ProfileWorker {
  std::unordered_map<SiteKey, uint32_t, SiteHash> index;
  std::vector<SiteData> sites;
  std::vector<Rec> recs;
  // [fiber][site]: (epoch, executions of the site so far in that epoch)
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> occ;
  std::vector<uint64_t> scratch;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
};

struct ProfileLaunch {
  std::mutex mu;
  std::vector<ProfileWorker*> workers;  // finished jobs' counts
  std::vector<ByteMap> maps;            // full launches only: per buffer
  // Full launches only: per (site, buffer), shared by the workers (created under mu).
  std::unordered_map<SiteKey, std::vector<ByteMap*>, SiteHash> site_maps;
  bool full = true;
};

namespace {

uint32_t site_of(ProfileWorker& p, const SiteKey& k) {
  auto it = p.index.find(k);
  if (it != p.index.end()) return it->second;
  const uint32_t i = static_cast<uint32_t>(p.sites.size());
  p.sites.push_back(SiteData{k, {}, {}});
  p.index.emplace(k, i);
  return i;
}

ByteMap* byte_map(Launch& L, uintptr_t a) {
  if (!L.profile) return nullptr;
  for (ByteMap& m : L.profile->maps) {
    if (a >= m.start && a < m.start + m.bytes) return &m;
  }
  return nullptr;
}

// The map of site `s` for the buffer holding a (created on first use).
ByteMap* site_map(Worker& w, SiteData& s, const ByteMap& buffer) {
  for (ByteMap* m : s.maps) {
    if (m->start == buffer.start) return m;
  }
  ProfileLaunch& p = *w.L->profile;
  std::lock_guard<std::mutex> g(p.mu);
  std::vector<ByteMap*>& shared = p.site_maps[s.key];
  ByteMap* found = nullptr;
  for (ByteMap* m : shared) {
    if (m->start == buffer.start) found = m;
  }
  if (!found) {
    found = new ByteMap(buffer);
    found->read = map_bits(found->words);
    found->written = map_bits(found->words);
    if (!found->read || !found->written) {
      delete found;
      return nullptr;
    }
    shared.push_back(found);
  }
  s.maps.push_back(found);
  return found;
}

void mark(Worker& w, SiteData* s, uintptr_t a, size_t n, bool write) {
  ByteMap* m = byte_map(*w.L, a);
  if (!m) return;
  const size_t lo = a - m->start, hi = std::min(m->bytes, lo + n);
  set_bits(write ? m->written : m->read, lo, hi);
  if (ByteMap* sm = s ? site_map(w, *s, *m) : nullptr) set_bits(write ? sm->written : sm->read, lo, hi);
}

void record(Worker& w, uint32_t site, uintptr_t a, size_t n, RecKind kind) {
  ProfileWorker& p = *w.prof;
  const Fiber& f = *t_cur;
  SiteData& s = p.sites[site];
  s.width_min = std::min<uint32_t>(s.width_min, static_cast<uint32_t>(n));
  s.width_max = std::max<uint32_t>(s.width_max, static_cast<uint32_t>(n));
  auto& occ = p.occ[f.linear];
  if (occ.size() <= site) occ.resize(site + 1, {0u, 0u});
  auto& [epoch, count] = occ[site];
  if (epoch != f.sync_epoch) {
    epoch = f.sync_epoch;
    count = 0;
  }
  p.recs.push_back(Rec{a, site, epoch, count++, static_cast<uint32_t>(n), static_cast<uint16_t>(f.linear >> 5),
                       static_cast<uint8_t>(f.linear & 31), kind});
}

// Shared-memory wavefronts of one request: per phase (32, 16 or 8 lanes for accesses of at most 4,
// 8 or 16 bytes), the most distinct 4-byte words that fall in one bank.
double shared_wavefronts(const Rec* r, size_t n, std::vector<uint64_t>& words) {
  const uint32_t size = r[0].size;
  const unsigned phase_lanes = size <= 4 ? 32 : (size <= 8 ? 16 : 8);
  double total = 0;
  for (unsigned phase = 0; phase < 32 / phase_lanes; ++phase) {
    words.clear();
    for (size_t i = 0; i < n; ++i) {
      if (r[i].lane / phase_lanes != phase) continue;
      for (uint64_t wd = r[i].addr >> 2; wd <= (r[i].addr + r[i].size - 1) >> 2; ++wd) words.push_back(wd);
    }
    if (words.empty()) continue;
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    unsigned per_bank[32] = {};
    unsigned most = 0;
    for (uint64_t wd : words) most = std::max(most, ++per_bank[wd & 31]);
    total += most;
  }
  return total;
}

// Distinct units of 2^shift bytes touched by a request, and its unique bytes.
uint64_t distinct_units(const Rec* r, size_t n, unsigned shift, std::vector<uint64_t>& units) {
  units.clear();
  for (size_t i = 0; i < n; ++i) {
    for (uint64_t u = r[i].addr >> shift; u <= (r[i].addr + r[i].size - 1) >> shift; ++u) units.push_back(u);
  }
  std::sort(units.begin(), units.end());
  return static_cast<uint64_t>(std::unique(units.begin(), units.end()) - units.begin());
}

uint64_t unique_bytes(const Rec* r, size_t n, std::vector<std::pair<uint64_t, uint64_t>>& iv) {
  // Sort the lanes' [addr, addr + size) by start and merge.
  iv.clear();
  for (size_t i = 0; i < n; ++i) iv.emplace_back(r[i].addr, r[i].addr + r[i].size);
  std::sort(iv.begin(), iv.end());
  uint64_t total = 0, cur_lo = iv[0].first, cur_hi = iv[0].second;
  for (size_t i = 1; i < iv.size(); ++i) {
    if (iv[i].first > cur_hi) {
      total += cur_hi - cur_lo;
      cur_lo = iv[i].first;
      cur_hi = iv[i].second;
    } else {
      cur_hi = std::max(cur_hi, iv[i].second);
    }
  }
  return total + (cur_hi - cur_lo);
}

void account_request(ProfileWorker& p, const Rec* r, size_t n, double weight) {
  SiteData& s = p.sites[r[0].site];
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; ++i) bytes += r[i].size;
  const uint64_t unique = unique_bytes(r, n, p.spans);
  switch (r[0].kind) {
    case kRecGlobalLoad:
    case kRecGlobalStore: {
      const bool load = r[0].kind == kRecGlobalLoad;
      s.c[load ? kGldReq : kGstReq] += weight;
      s.c[load ? kGldBytes : kGstBytes] += weight * static_cast<double>(bytes);
      s.c[load ? kGldSectors : kGstSectors] += weight * static_cast<double>(distinct_units(r, n, 5, p.scratch));
      s.c[load ? kGldLines : kGstLines] += weight * static_cast<double>(distinct_units(r, n, 7, p.scratch));
      s.c[load ? kGldIdeal : kGstIdeal] += weight * static_cast<double>((unique + 31) / 32);
      break;
    }
    case kRecSharedLoad:
    case kRecSharedStore: {
      const bool load = r[0].kind == kRecSharedLoad;
      s.c[load ? kSldReq : kSstReq] += weight;
      s.c[load ? kSldWaves : kSstWaves] += weight * shared_wavefronts(r, n, p.scratch);
      s.c[load ? kSldIdeal : kSstIdeal] += weight * static_cast<double>((unique + 127) / 128);
      break;
    }
    case kRecAtomic: s.c[kAtomics] += weight; break;
  }
}

}  // namespace

void prof_access(Worker& w, uintptr_t a, size_t n, unsigned flags, uintptr_t pc) {
  if (t_cur->prof_quiet || n == 0) return;
  Region* r = region_of(a);
  if (!r) return;
  const bool global = r->kind == RegionKind::Global;
  RecKind kind;
  if (flags & kAccRmw) kind = kRecAtomic;
  else if (flags & kAccWrite) kind = global ? kRecGlobalStore : kRecSharedStore;
  else kind = global ? kRecGlobalLoad : kRecSharedLoad;
  if ((flags & kAccRange) && n > 1) {
    // An aggregate copy of a struct aligned below its size (a {float, float} pair): nvcc moves
    // it field by field, so count one instruction per naturally aligned piece (4 bytes where the
    // address allows, else 2, else 1), each its own site at the same source line.
    const size_t piece = (a % 4 == 0 && n % 4 == 0) ? 4 : ((a % 2 == 0 && n % 2 == 0) ? 2 : 1);
    for (size_t off = 0, j = 1; off < n; off += piece, ++j) {
      const uint32_t site = site_of(*w.prof, SiteKey{pc, nullptr, static_cast<unsigned>(j)});
      record(w, site, a + off, piece, kind);
      if (global) mark(w, &w.prof->sites[site], a + off, piece, (flags & kAccWrite) != 0);
    }
    return;
  }
  const uint32_t site = site_of(*w.prof, SiteKey{pc, nullptr, 0});
  record(w, site, a, n, kind);
  if (global) {
    SiteData& s = w.prof->sites[site];
    mark(w, &s, a, n, (flags & kAccWrite) != 0);
    if (flags & kAccRmw) mark(w, &s, a, n, false);
  }
}

void prof_add(Worker& w, ProfCounter c, double v, const char* file, unsigned line) {
  if (!w.prof) return;
  w.prof->sites[site_of(*w.prof, SiteKey{0, file, line})].c[c] += v * w.block_weight;
}

void prof_global_read(Worker& w, uintptr_t a, size_t n, const char* file, unsigned line) {
  if (!w.prof) return;
  const uint32_t site = site_of(*w.prof, SiteKey{0, file, line});
  record(w, site, a, n, kRecGlobalLoad);
  mark(w, &w.prof->sites[site], a, n, false);
}

void prof_mark_read(Worker& w, uintptr_t a, size_t n) {
  if (w.prof) mark(w, nullptr, a, n, false);
}

void prof_tensor(Worker& w, const char* shape, double flops, const char* file, unsigned line) {
  if (!w.prof) return;
  SiteData& s = w.prof->sites[site_of(*w.prof, SiteKey{0, file, line})];
  s.c[kTensorFlops] += flops * w.block_weight;
  for (auto& [name, count] : s.tensor) {
    if (name == shape) {
      count += w.block_weight;
      return;
    }
  }
  s.tensor.emplace_back(shape, w.block_weight);
}

ProfileLaunch* prof_launch_begin(Launch& L) {
  auto* p = new ProfileLaunch();
  p->full = L.sample_blocks.empty();
  if (p->full) {
    for (const auto& [start, param] : L.pointer_args) {
      Region* r = region_of(start);
      if (!r || r->bytes == 0) continue;
      bool seen = false;
      for (const ByteMap& m : p->maps) seen = seen || m.start == r->start;
      if (seen) continue;
      ByteMap m;
      m.start = r->start;
      m.bytes = r->bytes;
      m.param = param;
      m.words = (r->bytes + 63) / 64;
      m.read = map_bits(m.words);
      m.written = map_bits(m.words);
      if (!m.read || !m.written) {
        p->full = false;  // no memory for the byte maps: report no unique bytes rather than wrong ones
        break;
      }
      p->maps.push_back(m);
    }
  }
  return p;
}

void prof_job_begin(Worker& w) {
  if (!w.L->profile) {
    w.prof = nullptr;
    return;
  }
  w.prof = new ProfileWorker();
  w.prof->occ.resize(w.L->nthreads);
}

void prof_block_begin(Worker& w) {
  if (!w.prof) return;
  for (auto& o : w.prof->occ) std::fill(o.begin(), o.end(), std::pair<uint32_t, uint32_t>{0u, 0u});
  w.prof->recs.clear();
}

void prof_block_end(Worker& w) {
  if (!w.prof) return;
  ProfileWorker& p = *w.prof;
  std::sort(p.recs.begin(), p.recs.end(), [](const Rec& a, const Rec& b) {
    if (a.site != b.site) return a.site < b.site;
    if (a.warp != b.warp) return a.warp < b.warp;
    if (a.epoch != b.epoch) return a.epoch < b.epoch;
    if (a.occ != b.occ) return a.occ < b.occ;
    return a.lane < b.lane;
  });
  size_t i = 0;
  while (i < p.recs.size()) {
    size_t j = i + 1;
    while (j < p.recs.size() && p.recs[j].site == p.recs[i].site && p.recs[j].warp == p.recs[i].warp &&
           p.recs[j].epoch == p.recs[i].epoch && p.recs[j].occ == p.recs[i].occ) {
      ++j;
    }
    account_request(p, &p.recs[i], j - i, w.block_weight);
    i = j;
  }
  p.recs.clear();
}

void prof_job_end(Worker& w) {
  if (!w.prof) return;
  std::lock_guard<std::mutex> g(w.L->profile->mu);
  w.L->profile->workers.push_back(w.prof);
  w.prof = nullptr;
}

void prof_launch_end(Launch& L, void (*fn)(void*, const sluice_emu_profile*), void* ctx) {
  ProfileLaunch* p = L.profile;
  if (!p) return;
  // Merge the workers' sites by key, then sort them by key, so the output never depends on which
  // host thread ran which block.
  std::unordered_map<SiteKey, size_t, SiteHash> index;
  std::vector<SiteData> merged;
  for (ProfileWorker* pw : p->workers) {
    for (SiteData& s : pw->sites) {
      auto it = index.find(s.key);
      if (it == index.end()) {
        index.emplace(s.key, merged.size());
        merged.push_back(s);
        continue;
      }
      SiteData& m = merged[it->second];
      for (unsigned c = 0; c < kProfCounters; ++c) m.c[c] += s.c[c];
      m.width_min = std::min(m.width_min, s.width_min);
      m.width_max = std::max(m.width_max, s.width_max);
      for (auto& [shape, count] : s.tensor) {
        bool found = false;
        for (auto& [mshape, mcount] : m.tensor) {
          if (mshape == shape) {
            mcount += count;
            found = true;
          }
        }
        if (!found) m.tensor.emplace_back(shape, count);
      }
    }
    delete pw;
  }
  std::sort(merged.begin(), merged.end(), [](const SiteData& a, const SiteData& b) {
    if (a.key.pc != b.key.pc) return a.key.pc < b.key.pc;
    if (a.key.line != b.key.line) return a.key.line < b.key.line;
    return std::less<const void*>()(a.key.file, b.key.file);
  });
  std::vector<sluice_emu_profile_site> sites(merged.size());
  std::vector<std::vector<const char*>> shapes(merged.size());
  std::vector<std::vector<double>> counts(merged.size());
  std::vector<std::string> objects(merged.size());
  for (size_t i = 0; i < merged.size(); ++i) {
    const SiteData& s = merged[i];
    sluice_emu_profile_site& o = sites[i];
    o = sluice_emu_profile_site{};
    if (s.key.pc) {
      const CodeLocation loc = locate_code(s.key.pc);
      if (loc.object) objects[i] = loc.object;
      o.object = loc.object ? objects[i].c_str() : nullptr;
      o.vaddr = loc.vaddr;
    }
    o.file = s.key.file;
    o.line = s.key.line;
    if (p->full) {
      auto it = p->site_maps.find(s.key);
      if (it != p->site_maps.end()) {
        for (const ByteMap* m : it->second) {
          o.unique_read += count_bits(m->read, m->words);
          o.unique_written += count_bits(m->written, m->words);
        }
      }
    }
    std::copy(s.c, s.c + kProfCounters, o.counters);
    o.width_min = s.width_max ? s.width_min : 0;
    o.width_max = s.width_max;
    for (const auto& [shape, count] : s.tensor) {
      shapes[i].push_back(shape);
      counts[i].push_back(count);
    }
    o.ntensor = static_cast<unsigned>(shapes[i].size());
    o.tensor_shape = shapes[i].data();
    o.tensor_count = counts[i].data();
  }
  std::vector<sluice_emu_profile_buffer> buffers;
  if (p->full) {
    for (const ByteMap& m : p->maps) {
      buffers.push_back(sluice_emu_profile_buffer{m.param, m.bytes, count_bits(m.read, m.words),
                                                  count_bits(m.written, m.words)});
    }
  }
  sluice_emu_profile out{};
  out.blocks_total = L.nblocks;
  out.blocks_run = L.sample_blocks.empty() ? L.nblocks : L.sample_blocks.size();
  out.sites = sites.data();
  out.nsites = static_cast<unsigned>(sites.size());
  out.buffers = p->full ? buffers.data() : nullptr;
  out.nbuffers = p->full ? static_cast<unsigned>(buffers.size()) : 0;
  if (fn) fn(ctx, &out);
  for (ByteMap& m : p->maps) {
    if (m.read) munmap(m.read, m.words * 8);
    if (m.written) munmap(m.written, m.words * 8);
  }
  for (auto& [key, maps] : p->site_maps) {
    for (ByteMap* m : maps) {
      munmap(m->read, m->words * 8);
      munmap(m->written, m->words * 8);
      delete m;
    }
  }
  delete p;
  L.profile = nullptr;
}

}  // namespace sluice_emu::rt

extern "C" const char* sluice_emu_profile_counter_name(int i) {
  return (i >= 0 && i < static_cast<int>(sluice_emu::rt::kProfCounters)) ? sluice_emu::rt::kCounterNames[i] : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Entry points of the emulated instructions (sluice_emu.h)
// ---------------------------------------------------------------------------------------------
namespace sluice_emu {
using namespace rt;

namespace {
Worker* profiling() {
  Worker* w = t_worker;
  return (w && w->prof && t_cur && !t_cur->prof_quiet) ? w : nullptr;
}
}  // namespace

void prof_quiet(int delta) {
  if (t_cur) t_cur->prof_quiet += delta;
}

void prof_tensor_op(const char* shape, double flops, const std::source_location& loc) {
  if (Worker* w = profiling()) prof_tensor(*w, shape, flops, loc.file_name(), loc.line());
}

void prof_ldmatrix(const void* const* rows, unsigned matrices, const std::source_location& loc) {
  Worker* w = profiling();
  if (!w) return;
  // Each 8x8 matrix is one phase: its 8 rows of 16 bytes (4 words each) go through the banks
  // together; distinct words in one bank are serialised.
  double waves = 0;
  std::vector<uint64_t> words;
  for (unsigned m = 0; m < matrices; ++m) {
    words.clear();
    for (unsigned r = 0; r < 8; ++r) {
      const uint64_t a = reinterpret_cast<uintptr_t>(rows[8 * m + r]);
      for (uint64_t wd = a >> 2; wd <= (a + 15) >> 2; ++wd) words.push_back(wd);
    }
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    unsigned per_bank[32] = {}, most = 0;
    for (uint64_t wd : words) most = std::max(most, ++per_bank[wd & 31]);
    waves += most;
  }
  // Ideal: the unique bytes of all rows over 128-byte wavefronts.
  words.clear();
  for (unsigned r = 0; r < 8 * matrices; ++r) {
    const uint64_t a = reinterpret_cast<uintptr_t>(rows[r]);
    for (uint64_t b = a; b < a + 16; ++b) words.push_back(b);
  }
  std::sort(words.begin(), words.end());
  const uint64_t unique = static_cast<uint64_t>(std::unique(words.begin(), words.end()) - words.begin());
  prof_add(*w, kSldReq, 1, loc.file_name(), loc.line());
  prof_add(*w, kSldWaves, waves, loc.file_name(), loc.line());
  prof_add(*w, kSldIdeal, static_cast<double>((unique + 127) / 128), loc.file_name(), loc.line());
  prof_add(*w, kLdmatrix, 1, loc.file_name(), loc.line());
}

void prof_wgmma_operands(unsigned bytes, const std::source_location& loc) {
  if (Worker* w = profiling()) prof_add(*w, kWgmmaOperandWaves, (bytes + 127) / 128, loc.file_name(), loc.line());
}

void prof_sfu(const std::source_location& loc) {
  if (Worker* w = profiling()) prof_add(*w, kSfu, 1, loc.file_name(), loc.line());
}

}  // namespace sluice_emu
