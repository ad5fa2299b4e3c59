//! Compiler flags of the emulator, shared by the build (kernels/build_emu.rs, through `#[path]`)
//! and `sluice emu check` (which compiles a user's file at run time). g++ only.

/// Flags for every emulator translation unit (runtime and kernels alike). The header is
/// force-included (`-include sluice_emu.h`) by the caller, which also adds the include paths.
/// `-fno-extern-tls-init`: a block-scope `extern thread_local` in a function template otherwise
/// calls a TLS init function that does not exist (g++ 12).
pub const COMMON_FLAGS: &[&str] = &[
    "-std=c++20",
    "-fno-extern-tls-init",
    "-ftls-model=initial-exec",
    "-fno-strict-aliasing",
    "-DSLUICE_EMU=1",
    // A CUtensorMap kernel parameter is 128-byte aligned; GCC notes that such a by-value
    // parameter's ABI changed in GCC 4.6. The emulator's caller and callee are built together.
    "-Wno-psabi",
];

/// Flags that instrument kernel code: every load and store of memory that may be shared (not a
/// local that stays in registers or on the stack unescaped) becomes a call to the emulator's
/// checker (`__tsan_{read,write}N`, `__tsan_volatile_*`, `__tsan_{read,write}_range` in
/// kernels/emu/check.cpp). GCC's ThreadSanitizer pass is used for its instrumentation only: no
/// sanitizer runtime is linked, and the emulator implements the callbacks. (The AddressSanitizer
/// pass was tried first: it checks an address once per basic block, so the store of a
/// read-modify-write goes unseen and a lost update cannot be found.)
pub const INSTRUMENT_FLAGS: &[&str] = &[
    "-fsanitize=thread",
    "--param",
    "tsan-instrument-func-entry-exit=0",
    "--param",
    "tsan-distinguish-volatile=1",
    "-Wno-tsan",
    // The profiler counts the accesses the compiler emits: keep one host access per source
    // access, as nvcc emits one ld/st per access (no loop or SLP vectorisation, no merging of
    // neighbouring stores). kernels/tests/emu_profile.rs checks the widths against the PTX.
    // -fno-tree-sra keeps a float2/float4 copy one 8- or 16-byte access (scalar replacement
    // would split it into 4-byte ones, where nvcc emits ld/st.v2/.v4).
    "-fno-tree-vectorize",
    "-fno-store-merging",
    "-fno-tree-sra",
    // Kernel translation units only: sluice_emu.h counts the C library's special functions here.
    "-DSLUICE_EMU_KERNEL_TU=1",
];

/// The emulator runtime's own sources (kernels/emu), compiled without instrumentation.
pub const RUNTIME_SOURCES: &[&str] = &[
    "runtime.cpp",
    "memory.cpp",
    "check.cpp",
    "async.cpp",
    "profile.cpp",
];
