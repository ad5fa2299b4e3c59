// emu_api.h — C ABI of the CUDA-on-CPU emulator (implemented in runtime.cpp; used by
// kernels/src/emu.rs). See docs/emulator.md.
#ifndef SLUICE_EMU_API_H
#define SLUICE_EMU_API_H
#include <stddef.h>

// The C ABI stays visible when the runtime is built with -fvisibility=hidden (the modules of
// `sluice emu check`, loaded with dlopen).
#define SLUICE_EMU_EXPORT __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// Device memory of the emu device: host memory in the emulator's arena, with inaccessible redzones
// around it; every checked access is compared with its bounds to the byte. The returned pointer is
// 4096-byte aligned and never NULL on success (also for bytes == 0); NULL on failure. Fresh memory
// is filled with 0xFF bytes (NaN as f32 and bf16).
SLUICE_EMU_EXPORT void* sluice_emu_alloc(size_t bytes);
// Frees memory from sluice_emu_alloc; NULL is ignored.
SLUICE_EMU_EXPORT void sluice_emu_free(void* p);

// Calls one kernel with its arguments unpacked from params (params[i] points at argument i).
typedef void (*sluice_emu_entry)(void** params);

// Options of one launch.
typedef struct sluice_emu_options {
  // -1: the process default (SLUICE_EMU_CHECKS: full, bounds or off); 0: off; 1: bounds, async
  // ordering, barriers and warp masks; 2: everything, races included.
  int checks;
  // -1: the process policy (SLUICE_EMU_RACE: sample, all or off); 0: no race detection; 1: race
  // detection (needs checks == 2).
  int race;
  // NULL, or one name per kernel parameter, used to name buffers in findings.
  const char* const* param_names;
  // Profiling (docs/emulator.md, "Profiling"): non-zero counts every memory request, tensor-core
  // instruction, special-function call, barrier and shuffle of the launch and hands the profile to
  // on_profile after the launch.
  int profile;
  // With profile: NULL to run every block, or the linear indices of the blocks to run (a sample),
  // each with the weight its counts are scaled by (weights NULL: every block counts 1).
  const unsigned long long* sample_blocks;
  const double* sample_weights;
  unsigned long long nsample;
  // With profile: receives the launch's profile (valid only during the call).
  void (*on_profile)(void* ctx, const struct sluice_emu_profile* profile);
  void* profile_ctx;
} sluice_emu_options;

// ---- profiles (kernels/emu/profile.cpp) ----
// Counter i of a site is named sluice_emu_profile_counter_name(i); the names are the JSON keys of
// `sluice emu profile` (global_load_requests, shared_load_wavefronts, ...).
#define SLUICE_EMU_PROFILE_COUNTERS 26
SLUICE_EMU_EXPORT const char* sluice_emu_profile_counter_name(int i);

// One code site: a memory instruction (located by code address, for addr2line) or an emulated
// instruction, barrier or warp operation (located by its source line).
typedef struct sluice_emu_profile_site {
  const char* object;  // object file and address in it (for addr2line), or NULL
  unsigned long long vaddr;
  const char* file;    // source file and line when the runtime knows them, or NULL
  unsigned line;
  double counters[SLUICE_EMU_PROFILE_COUNTERS];  // weighted by the sample weights
  // Unique global bytes this site read and wrote (full launches only; 0 otherwise).
  unsigned long long unique_read;
  unsigned long long unique_written;
  // Smallest and largest access of one lane at this site, in bytes (0 for non-memory sites).
  unsigned width_min;
  unsigned width_max;
  unsigned ntensor;                 // tensor-core instructions at this site, by shape
  const char* const* tensor_shape;  // e.g. "mma.m16n8k16.bf16"
  const double* tensor_count;
} sluice_emu_profile_site;

// Unique bytes of one global buffer (a pointer argument of the launch), full launches only.
typedef struct sluice_emu_profile_buffer {
  unsigned param;  // parameter index
  unsigned long long bytes;
  unsigned long long unique_read;
  unsigned long long unique_written;
} sluice_emu_profile_buffer;

typedef struct sluice_emu_profile {
  unsigned long long blocks_total;  // blocks of the grid
  unsigned long long blocks_run;    // blocks profiled (== blocks_total for a full launch)
  const sluice_emu_profile_site* sites;
  unsigned nsites;
  const sluice_emu_profile_buffer* buffers;  // NULL unless every block ran
  unsigned nbuffers;
} sluice_emu_profile;

// Profile mode of the allocator: 0 (the default) fills fresh memory with 0xFF bytes (NaN); 1
// leaves it untouched (zero pages that cost no resident memory until written), so that large
// profiled shapes fit in memory. Returns the previous mode.
SLUICE_EMU_EXPORT int sluice_emu_set_lazy_alloc(int lazy);

// One finding of a launch. The strings live until the callback returns.
typedef struct sluice_emu_finding {
  const char* kind;     // race, out-of-bounds, divergent-barrier, shuffle-mask,
                        // async-read-before-wait, kernel-error, or "more" (findings not shown)
  const char* message;  // kernel, block, thread, buffer and offset where they apply
  const char* file;     // source line known to the runtime (barriers, warp ops, emulated
  unsigned line;        // instructions), or NULL
  const char* object;   // object file and address in it of the access (for addr2line), or NULL
  unsigned long long vaddr;
  const char* object2;  // the same for the earlier access a race conflicts with, or NULL
  unsigned long long vaddr2;
  unsigned long long count;  // occurrences folded into this finding
} sluice_emu_finding;
typedef void (*sluice_emu_finding_fn)(void* ctx, const sluice_emu_finding* finding);

// Runs kernel `kernel` over the grid, like cuLaunchKernel. Returns 0 when it ran with no finding;
// 1 when it could not run (unknown kernel, bad grid or block, bad pointer argument; err says why);
// 2 when it ran and found problems: each is passed to on_finding (if not NULL), and err holds them
// one per line (truncated to err_cap). opts may be NULL (process defaults).
SLUICE_EMU_EXPORT int sluice_emu_launch_ex(const char* kernel, const unsigned grid[3], const unsigned block[3],
                         size_t dynamic_shared_bytes, void** params, unsigned long long seed,
                         const sluice_emu_options* opts, sluice_emu_finding_fn on_finding, void* ctx,
                         char* err, size_t err_cap);
// sluice_emu_launch_ex with the process defaults and no callback.
SLUICE_EMU_EXPORT int sluice_emu_launch(const char* kernel, const unsigned grid[3], const unsigned block[3],
                      size_t dynamic_shared_bytes, void** params, unsigned long long seed, char* err,
                      size_t err_cap);
SLUICE_EMU_EXPORT int sluice_emu_kernel_count(void);
SLUICE_EMU_EXPORT const char* sluice_emu_kernel_name(int i);
// One character per kernel parameter ('p' pointer, 'i' int, 'u' unsigned, 'l' long long,
// 'L' unsigned long long, 'f' float, 'd' double, 'T' CUtensorMap, '?' other), or NULL for an
// unknown kernel.
SLUICE_EMU_EXPORT const char* sluice_emu_kernel_signature(const char* kernel);

// ---- kernel table (generated by kernels/build_emu.rs) ----
typedef struct sluice_emu_kernel {
  const char* name;
  sluice_emu_entry entry;
  unsigned nparams;
  const char* signature;  // see sluice_emu_kernel_signature
  // Writes the values of the pointer parameters to out (at most nparams) and returns how many.
  unsigned (*pointer_args)(void** params, const void** out);
  // Parameter index of each pointer written by pointer_args.
  unsigned (*pointer_arg_index)(unsigned* out);
} sluice_emu_kernel;
typedef struct sluice_emu_kernel_table {
  const sluice_emu_kernel* kernels;
  unsigned count;
} sluice_emu_kernel_table;
// NULL-terminated list of every generated table (the generated registry defines it).
extern const sluice_emu_kernel_table* const sluice_emu_tables[];

#ifdef __cplusplus
}

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

// Used by the generated wrappers: builds a table entry for kernel function F.
namespace sluice_emu {
template <class... A, size_t... I>
inline void invoke_impl(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<A>*>(p[I])...);
}
template <class... A, size_t... I>
inline unsigned pointers_impl(void (*)(A...), void** p, const void** out, std::index_sequence<I...>) {
  unsigned n = 0;
  ((std::is_pointer_v<A> ? (out[n++] = reinterpret_cast<const void*>(*static_cast<const std::uintptr_t*>(p[I])), 0) : 0), ...);
  return n;
}
template <class... A, size_t... I>
inline unsigned pointer_index_impl(void (*)(A...), unsigned* out, std::index_sequence<I...>) {
  unsigned n = 0;
  ((std::is_pointer_v<A> ? (out[n++] = static_cast<unsigned>(I), 0) : 0), ...);
  return n;
}
template <class T> constexpr char type_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) return 'p';
  else if constexpr (std::is_same_v<U, int>) return 'i';
  else if constexpr (std::is_same_v<U, unsigned>) return 'u';
  else if constexpr (std::is_same_v<U, long long> || (std::is_same_v<U, long> && sizeof(long) == 8)) return 'l';
  else if constexpr (std::is_same_v<U, unsigned long long> || (std::is_same_v<U, unsigned long> && sizeof(long) == 8)) return 'L';
  else if constexpr (std::is_same_v<U, float>) return 'f';
  else if constexpr (std::is_same_v<U, double>) return 'd';
  else if constexpr (sizeof(U) == 128 && alignof(U) >= 64) return 'T';  // CUtensorMap
  else return '?';
}
template <class... A> struct SignatureOf {
  static constexpr char value[sizeof...(A) + 1] = {type_code<A>()..., '\0'};
};
template <class... A> constexpr const char* signature(void (*)(A...)) { return SignatureOf<A...>::value; }
template <class... A> constexpr unsigned arity(void (*)(A...)) { return sizeof...(A); }
template <auto F> void entry(void** p) {
  invoke_impl(F, p, std::make_index_sequence<arity(F)>{});
}
template <auto F> unsigned pointer_args(void** p, const void** out) {
  return pointers_impl(F, p, out, std::make_index_sequence<arity(F)>{});
}
template <auto F> unsigned pointer_arg_index(unsigned* out) {
  return pointer_index_impl(F, out, std::make_index_sequence<arity(F)>{});
}
}  // namespace sluice_emu
#define SLUICE_EMU_KERNEL(name)                                                             \
  sluice_emu_kernel {                                                                       \
    #name, &::sluice_emu::entry<&name>, ::sluice_emu::arity(&name), ::sluice_emu::signature(&name), \
        &::sluice_emu::pointer_args<&name>, &::sluice_emu::pointer_arg_index<&name>          \
  }
#endif

#endif
