//! Any CUDA file under the emulator at run time (`sluice emu check`): the file is rewritten
//! ([`super::rewrite`]), compiled by the host C++ compiler with the emulator's headers and
//! instrumentation, linked with a copy of the emulator runtime into a shared object, and loaded.
//!
//! The emulator's sources are embedded in this crate, so an installed `sluice` binary needs only
//! g++ (and binutils' addr2line for source lines in findings). They are written once per
//! emulator version to a cache folder (`SLUICE_EMU_CACHE`, else `$XDG_CACHE_HOME/sluice/emu`,
//! else `~/.cache/sluice/emu`, else the system temporary folder) together with the compiled
//! runtime; each compiled file is cached there too, keyed by its contents and path.
//!
//! A loaded module stays loaded for the rest of the process: its runtime's host threads live as
//! long (as the built-in emulator's do).

use super::build_flags::{COMMON_FLAGS, INSTRUMENT_FLAGS, RUNTIME_SOURCES};
use super::rewrite::{kernel_declarations, rewrite_source};
use super::{Api, EmuBuffer, EmuFinding, LaunchOptions};
use std::ffi::c_void;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

/// The emulator's sources, as files of the cache's `emu-<hash>/` folder.
const EMBEDDED: &[(&str, &str)] = &[
    ("sluice_emu.h", include_str!("../../emu/sluice_emu.h")),
    (
        "sluice_emu_half.h",
        include_str!("../../emu/sluice_emu_half.h"),
    ),
    ("emu_api.h", include_str!("../../emu/emu_api.h")),
    ("emu_internal.h", include_str!("../../emu/emu_internal.h")),
    ("runtime.cpp", include_str!("../../emu/runtime.cpp")),
    ("memory.cpp", include_str!("../../emu/memory.cpp")),
    ("check.cpp", include_str!("../../emu/check.cpp")),
    ("async.cpp", include_str!("../../emu/async.cpp")),
    ("profile.cpp", include_str!("../../emu/profile.cpp")),
    (
        "include/assert.h",
        include_str!("../../emu/include/assert.h"),
    ),
    ("include/cuda.h", include_str!("../../emu/include/cuda.h")),
    (
        "include/cuda_bf16.h",
        include_str!("../../emu/include/cuda_bf16.h"),
    ),
    (
        "include/cuda_fp16.h",
        include_str!("../../emu/include/cuda_fp16.h"),
    ),
    (
        "include/cuda_runtime.h",
        include_str!("../../emu/include/cuda_runtime.h"),
    ),
    (
        "include/cuda_runtime_api.h",
        include_str!("../../emu/include/cuda_runtime_api.h"),
    ),
    (
        "include/device_functions.h",
        include_str!("../../emu/include/device_functions.h"),
    ),
    (
        "include/device_launch_parameters.h",
        include_str!("../../emu/include/device_launch_parameters.h"),
    ),
    (
        "include/math_constants.h",
        include_str!("../../emu/include/math_constants.h"),
    ),
    (
        "include/math_functions.h",
        include_str!("../../emu/include/math_functions.h"),
    ),
    (
        "include/sm_80_intrinsics.h",
        include_str!("../../emu/include/sm_80_intrinsics.h"),
    ),
    (
        "include/vector_types.h",
        include_str!("../../emu/include/vector_types.h"),
    ),
    // sluice's device helpers, for `#include <sluice/hopper.cuh>` and friends.
    (
        "include/sluice/hopper.cuh",
        include_str!("../../cuda/common/hopper.cuh"),
    ),
    (
        "include/sluice/mma.cuh",
        include_str!("../../cuda/common/mma.cuh"),
    ),
    (
        "include/sluice/cp_async.cuh",
        include_str!("../../cuda/common/cp_async.cuh"),
    ),
];

/// Why a file could not be compiled.
#[derive(Debug)]
pub enum CompileError {
    /// The input is unusable (missing file, no kernel); the message says why.
    Input(String),
    /// The compiler rejected the file; its messages went to stderr as it printed them.
    Compiler(String),
    /// The cache folder or the compiler could not be used.
    Environment(String),
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompileError::Input(m) | CompileError::Compiler(m) | CompileError::Environment(m) => {
                f.write_str(m)
            }
        }
    }
}

/// 64-bit FNV-1a (a cache key, not a security boundary).
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for b in (p.len() as u64).to_le_bytes().iter().chain(p.iter()) {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn compiler() -> String {
    std::env::var("SLUICE_EMU_CXX")
        .or_else(|_| std::env::var("CXX"))
        .unwrap_or_else(|_| "g++".to_string())
}

/// The cache folder (see the module documentation).
pub fn cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os("SLUICE_EMU_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("sluice").join("emu");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(h).join(".cache").join("sluice").join("emu");
    }
    std::env::temp_dir().join("sluice-emu-cache")
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A fresh private folder under `root` for building something that is then renamed into place.
fn scratch_dir(root: &Path, what: &str) -> Result<PathBuf, CompileError> {
    let n = UNIQUE.fetch_add(1, Ordering::Relaxed);
    let dir = root.join(format!(".{what}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| {
        CompileError::Environment(format!(
            "cannot create the emulator cache folder {}: {e} (set SLUICE_EMU_CACHE to a writable folder)",
            dir.display()
        ))
    })?;
    Ok(dir)
}

fn run(cmd: &mut Command, what: &str) -> Result<(), CompileError> {
    let status = cmd.stdin(Stdio::null()).status().map_err(|e| {
        CompileError::Environment(format!("cannot run {what} ({:?}): {e}", cmd.get_program()))
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(CompileError::Compiler(format!("{what} failed ({status})")))
    }
}

/// Flags of every object of a module. Thread-locals use the general-dynamic model: a loaded
/// module gets only a small static TLS block, too small for a namespace-scope `__shared__` array
/// (a `thread_local` under the emulator).
fn base_flags(emu: &Path) -> Vec<String> {
    let mut f: Vec<String> = COMMON_FLAGS
        .iter()
        .map(|s| {
            if s.starts_with("-ftls-model=") {
                "-ftls-model=global-dynamic".to_string()
            } else {
                s.to_string()
            }
        })
        .collect();
    f.extend(
        [
            "-O2",
            "-g",
            "-fPIC",
            "-fvisibility=hidden",
            "-DSLUICE_EMU_MODULE=1",
            "-w",
            "-include",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    f.push(emu.join("sluice_emu.h").display().to_string());
    f.push(format!("-I{}", emu.join("include").display()));
    f.push(format!("-I{}", emu.display()));
    f
}

/// The emulator's sources and compiled runtime in the cache (built on first use).
fn emulator_dir(root: &Path, cxx: &str) -> Result<(PathBuf, u64), CompileError> {
    let flags = base_flags(Path::new("")).join(" ");
    let mut parts: Vec<&[u8]> = vec![cxx.as_bytes(), flags.as_bytes()];
    for (name, text) in EMBEDDED {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    let hash = fnv(&parts);
    let dir = root.join(format!("emu-{hash:016x}"));
    if dir.join("complete").is_file() {
        return Ok((dir, hash));
    }
    let tmp = scratch_dir(root, "emu")?;
    let io = |e: std::io::Error| {
        CompileError::Environment(format!(
            "cannot write the emulator sources to {}: {e}",
            tmp.display()
        ))
    };
    for (name, text) in EMBEDDED {
        let p = tmp.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        std::fs::write(&p, text).map_err(io)?;
    }
    // The runtime's objects, compiled in parallel, without instrumentation.
    let flags = base_flags(&tmp);
    let mut children = Vec::new();
    for src in RUNTIME_SOURCES {
        let obj = tmp.join(src.replace(".cpp", ".o"));
        let child = Command::new(cxx)
            .args(&flags)
            .arg("-c")
            .arg(tmp.join(src))
            .arg("-o")
            .arg(&obj)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| {
                CompileError::Environment(format!(
                    "cannot run the C++ compiler `{cxx}`: {e} (set SLUICE_EMU_CXX)"
                ))
            })?;
        children.push((src, child));
    }
    let mut failed = None;
    for (src, mut child) in children {
        match child.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => {
                failed = Some(format!(
                    "compiling the emulator runtime ({src}) failed ({s})"
                ))
            }
            Err(e) => failed = Some(format!("compiling the emulator runtime ({src}): {e}")),
        }
    }
    if let Some(m) = failed {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(CompileError::Environment(m));
    }
    std::fs::write(tmp.join("complete"), b"").map_err(io)?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process built it first: use theirs.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("complete").is_file() {
            return Err(CompileError::Environment(format!(
                "cannot move the emulator runtime into {}",
                dir.display()
            )));
        }
    }
    Ok((dir, hash))
}

/// Compiles `source` (a CUDA file with at least one `extern "C" __global__` kernel) into an
/// emulator module and returns its path (cached: an unchanged file is not compiled again).
/// Compiler messages go to stderr as the compiler prints them.
pub fn compile(source: &Path) -> Result<PathBuf, CompileError> {
    let text = std::fs::read_to_string(source)
        .map_err(|e| CompileError::Input(format!("cannot read {}: {e}", source.display())))?;
    let kernels = kernel_declarations(&text);
    if kernels.is_empty() {
        return Err(CompileError::Input(format!(
            "{} declares no `extern \"C\" __global__ void NAME(...)` kernel",
            source.display()
        )));
    }
    let abs = std::fs::canonicalize(source).unwrap_or_else(|_| source.to_path_buf());
    let root = cache_root();
    std::fs::create_dir_all(&root).map_err(|e| {
        CompileError::Environment(format!(
            "cannot create the emulator cache folder {}: {e} (set SLUICE_EMU_CACHE to a writable folder)",
            root.display()
        ))
    })?;
    let cxx = compiler();
    let (emu, emu_hash) = emulator_dir(&root, &cxx)?;
    let key = fnv(&[
        text.as_bytes(),
        abs.display().to_string().as_bytes(),
        &emu_hash.to_le_bytes(),
    ]);
    let module = root.join(format!("module-{key:016x}.so"));
    if module.is_file() {
        return Ok(module);
    }

    // One translation unit: the rewritten file, then its kernel table.
    let quoted = abs
        .display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let mut tu = format!("#line 1 \"{quoted}\"\n{}\n", rewrite_source(&text));
    tu.push_str("#line 1 \"<sluice emu check: kernel table>\"\n#include \"emu_api.h\"\n");
    tu.push_str("static const sluice_emu_kernel sluice_emu_kernels_[] = {\n");
    for (name, _) in &kernels {
        tu.push_str(&format!("    SLUICE_EMU_KERNEL({name}),\n"));
    }
    tu.push_str(&format!(
        "}};\nstatic const sluice_emu_kernel_table sluice_emu_table_ = {{sluice_emu_kernels_, {}}};\n\
         extern \"C\" const sluice_emu_kernel_table* const sluice_emu_tables[] = {{&sluice_emu_table_, nullptr}};\n",
        kernels.len()
    ));
    let tmp = scratch_dir(&root, "module")?;
    let cpp = tmp.join("kernel.cpp");
    std::fs::write(&cpp, tu)
        .map_err(|e| CompileError::Environment(format!("cannot write {}: {e}", cpp.display())))?;
    let obj = tmp.join("kernel.o");
    let built = (|| {
        run(
            Command::new(&cxx)
                .args(base_flags(&emu))
                .args(INSTRUMENT_FLAGS)
                .arg("-c")
                .arg(&cpp)
                .arg("-o")
                .arg(&obj),
            &format!("compiling {}", source.display()),
        )?;
        let so = tmp.join("module.so");
        run(
            Command::new(&cxx)
                .args(["-shared", "-fPIC", "-Wl,-Bsymbolic", "-o"])
                .arg(&so)
                .arg(&obj)
                .args(
                    RUNTIME_SOURCES
                        .iter()
                        .map(|s| emu.join(s.replace(".cpp", ".o"))),
                )
                .args(["-lpthread", "-ldl"]),
            "linking the emulator module",
        )?;
        std::fs::rename(&so, &module).map_err(|e| {
            CompileError::Environment(format!(
                "cannot move the module into {}: {e}",
                module.display()
            ))
        })
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    built.map(|()| module)
}

/// A loaded emulator module: its own copy of the emulator runtime with the kernels of one file.
pub struct EmuModule {
    api: Api,
    path: PathBuf,
}

impl EmuModule {
    /// Loads a module made by [`compile`]. It stays loaded for the rest of the process.
    pub fn load(path: &Path) -> Result<EmuModule, String> {
        // SAFETY: loading runs the module's static initialisers, which are the emulator
        // runtime's and the compiled file's (C++ globals of a CUDA source); the module was built
        // by `compile` from the embedded emulator sources.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load the emulator module {}: {e}", path.display()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is one of the C ABI functions of emu_api.h, whose Rust type
                // here is the same as the declaration there (Api's field types).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: no {} ({e})", path.display(), $name))?
            };
        }
        let api = Api {
            alloc: sym!("sluice_emu_alloc"),
            free: sym!("sluice_emu_free"),
            launch_ex: sym!("sluice_emu_launch_ex"),
            kernel_count: sym!("sluice_emu_kernel_count"),
            kernel_name: sym!("sluice_emu_kernel_name"),
            kernel_signature: sym!("sluice_emu_kernel_signature"),
        };
        // Never unloaded: the module's host threads run its code until the process exits.
        std::mem::forget(lib);
        Ok(EmuModule {
            api,
            path: path.to_path_buf(),
        })
    }

    /// The module file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The kernels of the module.
    pub fn kernel_names(&self) -> Vec<String> {
        self.api.kernel_names()
    }

    /// The parameter signature of a kernel (as [`super::emu_kernel_signature`]).
    pub fn kernel_signature(&self, kernel: &str) -> Option<String> {
        self.api.kernel_signature(kernel)
    }

    /// Device memory of this module's emulator.
    pub fn alloc(&self, bytes: usize) -> Result<EmuBuffer, String> {
        EmuBuffer::alloc_in(self.api, bytes)
    }

    /// Runs a kernel of the module with every check the options ask for. Ok(findings) when it
    /// ran (empty: clean), Err when it could not run.
    ///
    /// # Safety
    /// `params[i]` must point at a value of the kernel's i-th parameter type, and every pointer
    /// argument must be a buffer from this module's [`EmuModule::alloc`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        params: &mut [*mut c_void],
        seed: u64,
        opts: &LaunchOptions,
    ) -> Result<Vec<EmuFinding>, String> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.api
                .launch(kernel, grid, block, shared_bytes, params, seed, opts)
        }
    }

    /// [`EmuModule::launch`] with the profiler on (every block): the findings and the profile
    /// (`sluice emu check --profile`).
    ///
    /// # Safety
    /// As [`EmuModule::launch`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_profiled(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        params: &mut [*mut c_void],
        seed: u64,
        opts: &LaunchOptions,
    ) -> Result<(Vec<EmuFinding>, Option<super::profile::KernelProfile>), String> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            super::profile::launch_profiled(
                &self.api,
                kernel,
                grid,
                block,
                shared_bytes,
                params,
                seed,
                opts,
            )
        }
    }
}
