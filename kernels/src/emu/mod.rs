//! The `emu` device: device memory and kernel launches of the CUDA-on-CPU emulator
//! (kernels/emu, C ABI in kernels/emu/emu_api.h, built by build_emu.rs). See docs/emulator.md.
//!
//! Device memory is host memory from `sluice_emu_alloc`: page aligned, with inaccessible
//! redzones around it. Kernel code is instrumented, so every access is checked (bounds to the
//! byte, races, asynchronous results read before their wait); a launch that finds a problem
//! returns its findings. Launches are synchronous.
//!
//! Submodules: [`rewrite`] (CUDA source -> emulator C++), [`compile`] (a CUDA file compiled and
//! loaded at run time, for `sluice emu check`), [`build_flags`] (shared with the build).

pub mod build_flags;
pub mod compile;
mod findings;
pub mod profile;
pub mod rewrite;

pub use findings::{CodeLocation, EmuFinding};

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::NonNull;

/// `sluice_emu_options` of emu_api.h.
#[repr(C)]
pub(crate) struct RawOptions {
    checks: c_int,
    race: c_int,
    param_names: *const *const c_char,
    profile: c_int,
    sample_blocks: *const u64,
    sample_weights: *const f64,
    nsample: u64,
    on_profile: Option<profile::ProfileFn>,
    profile_ctx: *mut c_void,
}

/// `sluice_emu_finding` of emu_api.h.
#[repr(C)]
pub(crate) struct RawFinding {
    kind: *const c_char,
    message: *const c_char,
    file: *const c_char,
    line: u32,
    object: *const c_char,
    vaddr: u64,
    object2: *const c_char,
    vaddr2: u64,
    count: u64,
}

pub(crate) type FindingFn = unsafe extern "C" fn(ctx: *mut c_void, finding: *const RawFinding);

extern "C" {
    fn sluice_emu_alloc(bytes: usize) -> *mut c_void;
    fn sluice_emu_free(p: *mut c_void);
    fn sluice_emu_launch_ex(
        kernel: *const c_char,
        grid: *const u32,
        block: *const u32,
        dynamic_shared_bytes: usize,
        params: *mut *mut c_void,
        seed: u64,
        opts: *const RawOptions,
        on_finding: Option<FindingFn>,
        ctx: *mut c_void,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn sluice_emu_kernel_count() -> c_int;
    fn sluice_emu_kernel_name(i: c_int) -> *const c_char;
    fn sluice_emu_kernel_signature(kernel: *const c_char) -> *const c_char;
}

/// The C ABI of one emulator instance: the one linked into this crate, or one loaded from a
/// module compiled at run time ([`compile::EmuModule`]).
#[derive(Clone, Copy)]
pub(crate) struct Api {
    pub alloc: unsafe extern "C" fn(usize) -> *mut c_void,
    pub free: unsafe extern "C" fn(*mut c_void),
    pub launch_ex: unsafe extern "C" fn(
        *const c_char,
        *const u32,
        *const u32,
        usize,
        *mut *mut c_void,
        u64,
        *const RawOptions,
        Option<FindingFn>,
        *mut c_void,
        *mut c_char,
        usize,
    ) -> c_int,
    pub kernel_count: unsafe extern "C" fn() -> c_int,
    pub kernel_name: unsafe extern "C" fn(c_int) -> *const c_char,
    pub kernel_signature: unsafe extern "C" fn(*const c_char) -> *const c_char,
}

pub(crate) const BUILTIN: Api = Api {
    alloc: sluice_emu_alloc,
    free: sluice_emu_free,
    launch_ex: sluice_emu_launch_ex,
    kernel_count: sluice_emu_kernel_count,
    kernel_name: sluice_emu_kernel_name,
    kernel_signature: sluice_emu_kernel_signature,
};

/// The host C++ compiler that built the emulated kernels (the first line of its `--version`):
/// emu's bits depend on it, so it is part of the numerics class of `sluice determinism`.
pub const COMPILER: &str = env!("SLUICE_EMU_CXX");
/// Extra compiler flags the emulated kernels were built with (`SLUICE_EMU_CFLAGS`; usually
/// empty).
pub const EXTRA_FLAGS: &str = env!("SLUICE_EMU_CXX_FLAGS");

/// Which checks a launch runs (docs/emulator.md, "What is checked").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checks {
    /// The process default: `SLUICE_EMU_CHECKS` (full, bounds or off; full when unset).
    #[default]
    Default,
    /// Only what the scheduler finds (barriers, warp masks) and faults.
    Off,
    /// Bounds, asynchronous ordering, barriers and warp masks.
    Bounds,
    /// Everything; races on the launches the race policy picks (or as [`LaunchOptions::race`] says).
    Full,
}

/// Options of one checked launch.
#[derive(Debug, Clone, Default)]
pub struct LaunchOptions {
    pub checks: Checks,
    /// Race detection: None = the process policy (`SLUICE_EMU_RACE`: sample, all or off).
    pub race: Option<bool>,
    /// One name per kernel parameter, to name buffers in findings.
    pub param_names: Option<Vec<String>>,
}

/// A buffer of emu device memory, freed on drop. Fresh memory holds 0xFF bytes (NaN as f32/bf16).
pub struct EmuBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
    api: Api,
}

// SAFETY: an EmuBuffer owns its mapping exclusively (like a Box<[u8]>); the emulator's allocator is
// thread-safe, and shared access only hands out `&[u8]`, so moving or sharing it across threads is
// as sound as for a Vec<u8>.
unsafe impl Send for EmuBuffer {}
// SAFETY: see Send; `&EmuBuffer` allows only reads.
unsafe impl Sync for EmuBuffer {}

impl EmuBuffer {
    /// Allocates `bytes` bytes (0 is allowed) of emu device memory.
    pub fn alloc(bytes: usize) -> Result<EmuBuffer, String> {
        Self::alloc_in(BUILTIN, bytes)
    }

    pub(crate) fn alloc_in(api: Api, bytes: usize) -> Result<EmuBuffer, String> {
        // SAFETY: sluice_emu_alloc has no preconditions; it returns null on failure.
        let p = unsafe { (api.alloc)(bytes) };
        NonNull::new(p.cast::<u8>())
            .map(|ptr| EmuBuffer { ptr, bytes, api })
            .ok_or_else(|| format!("emu device: cannot allocate {bytes} bytes"))
    }

    /// Device address of the first byte (page aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Mutable device address of the first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// The contents as host bytes (emu device memory is host memory).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for reads of `bytes` bytes for the life of self (the mapping is
        // freed only in Drop); launches are synchronous, so no kernel writes while this borrow lives
        // unless the caller launched through a raw pointer on another thread, which the `&self`
        // borrow does not permit through this type.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    /// The contents as mutable host bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in as_bytes; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }
}

impl Drop for EmuBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from this api's alloc and is freed exactly once, here.
        unsafe { (self.api.free)(self.ptr.as_ptr().cast()) }
    }
}

impl std::fmt::Debug for EmuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmuBuffer({:p}, {} bytes)", self.ptr, self.bytes)
    }
}

impl Api {
    pub(crate) fn kernel_signature(&self, kernel: &str) -> Option<String> {
        let name = CString::new(kernel).ok()?;
        // SAFETY: name is a valid NUL-terminated string; the result is null or points at a static
        // NUL-terminated string of the kernel table.
        let sig = unsafe { (self.kernel_signature)(name.as_ptr()) };
        if sig.is_null() {
            return None;
        }
        // SAFETY: non-null results are static NUL-terminated strings.
        Some(
            unsafe { CStr::from_ptr(sig) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    pub(crate) fn kernel_names(&self) -> Vec<String> {
        // SAFETY: no preconditions.
        let n = unsafe { (self.kernel_count)() };
        (0..n)
            .filter_map(|i| {
                // SAFETY: 0 <= i < count; the result is a static NUL-terminated string (or null).
                let p = unsafe { (self.kernel_name)(i) };
                // SAFETY: non-null results are static NUL-terminated strings.
                (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            })
            .collect()
    }

    /// Runs a launch; Ok(findings) when it ran (empty: clean), Err when it could not run.
    ///
    /// # Safety
    /// `params[i]` must point at a value of the kernel's i-th parameter type (at least as many
    /// bytes), and every pointer argument must be memory of this emulator instance.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        params: &mut [*mut c_void],
        seed: u64,
        opts: &LaunchOptions,
    ) -> Result<Vec<EmuFinding>, String> {
        // Profiled when a recording is active on this thread (emu::profile::Recording).
        let mut req = profile::request(kernel, grid);
        // SAFETY: the caller's contract; req lives until the launch returns.
        let found = unsafe {
            self.launch_with(
                kernel,
                grid,
                block,
                shared_bytes,
                params,
                seed,
                opts,
                req.as_mut(),
            )
        }?;
        if let Some(req) = req {
            profile::record(req, kernel, grid, block, shared_bytes);
        }
        Ok(found)
    }

    /// [`Api::launch`] with an explicit profile request (None: not profiled).
    ///
    /// # Safety
    /// As [`Api::launch`]; `req` must stay alive until the call returns.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_with(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        params: &mut [*mut c_void],
        seed: u64,
        opts: &LaunchOptions,
        req: Option<&mut profile::Request>,
    ) -> Result<Vec<EmuFinding>, String> {
        let name = CString::new(kernel)
            .map_err(|_| format!("kernel name {kernel:?} contains a NUL byte"))?;
        let signature = self.kernel_signature(kernel).ok_or_else(|| {
            format!("kernel {kernel} is not in the emulator's kernel table (is it declared `extern \"C\" __global__`?)")
        })?;
        if signature.len() != params.len() {
            return Err(format!(
                "kernel {kernel} takes {} parameters ({signature}), the launch passed {}",
                signature.len(),
                params.len()
            ));
        }
        if let Some(i) = params.iter().position(|p| p.is_null()) {
            return Err(format!("kernel {kernel}: params[{i}] is null"));
        }
        let names: Vec<CString> = opts
            .param_names
            .iter()
            .flatten()
            .map(|n| CString::new(n.as_str()).unwrap_or_default())
            .collect();
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        if opts.param_names.is_some() && name_ptrs.len() != params.len() {
            return Err(format!(
                "kernel {kernel}: {} parameter names for {} parameters",
                name_ptrs.len(),
                params.len()
            ));
        }
        let mut raw = RawOptions {
            profile: 0,
            sample_blocks: std::ptr::null(),
            sample_weights: std::ptr::null(),
            nsample: 0,
            on_profile: None,
            profile_ctx: std::ptr::null_mut(),
            checks: match opts.checks {
                Checks::Default => -1,
                Checks::Off => 0,
                Checks::Bounds => 1,
                Checks::Full => 2,
            },
            race: opts.race.map_or(-1, c_int::from),
            param_names: if name_ptrs.is_empty() {
                std::ptr::null()
            } else {
                name_ptrs.as_ptr()
            },
        };
        if let Some(req) = req {
            req.options(&mut raw);
        }
        let mut collected: Vec<findings::RawOwned> = Vec::new();
        let mut err = vec![0u8; 1 << 16];
        // SAFETY: name is NUL-terminated; grid and block are 3 u32s; params has one non-null
        // pointer per kernel parameter (checked above against the compiled signature) and the
        // caller guarantees each points at a value of that parameter's type; raw and the names it
        // points at outlive the call; the callback only pushes into `collected`, which outlives
        // the call; err is writable for its length. The launch is synchronous.
        let rc = unsafe {
            (self.launch_ex)(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                params.as_mut_ptr(),
                seed,
                &raw,
                Some(findings::collect),
                (&mut collected as *mut Vec<findings::RawOwned>).cast(),
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        match rc {
            0 => Ok(Vec::new()),
            2 => Ok(findings::resolve(collected)),
            _ => {
                let len = err.iter().position(|&b| b == 0).unwrap_or(err.len());
                let msg = String::from_utf8_lossy(&err[..len]).into_owned();
                Err(if msg.is_empty() {
                    format!("kernel {kernel}: emulated launch failed (code {rc})")
                } else {
                    msg
                })
            }
        }
    }
}

/// The parameter signature of an emulated kernel: one character per parameter ('p' pointer,
/// 'i' int, 'u' unsigned, 'l' long long, 'L' unsigned long long, 'f' float, 'd' double,
/// '?' other); `None` if no such kernel was compiled.
pub fn emu_kernel_signature(kernel: &str) -> Option<String> {
    BUILTIN.kernel_signature(kernel)
}

/// Runs `kernel` under the emulator, like cuLaunchKernel: `params[i]` points at the value of the
/// kernel's i-th parameter (at least as many bytes as that parameter's type). Any finding of the
/// checks (docs/emulator.md) is an error: the message holds them one per line, each naming the
/// kernel, block, thread and, where known, buffer, offset and source line.
pub fn emu_launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
    params: &mut [*mut c_void],
    seed: u64,
) -> Result<(), String> {
    let found = emu_launch_checked(
        kernel,
        grid,
        block,
        shared_bytes,
        params,
        seed,
        &LaunchOptions::default(),
    )?;
    if found.is_empty() {
        return Ok(());
    }
    Err(found
        .iter()
        .map(|f| f.to_string())
        .collect::<Vec<_>>()
        .join("\n"))
}

/// [`emu_launch`] with explicit options, returning the findings (empty: the launch was clean).
/// Err when the launch could not run at all (unknown kernel, bad grid, bad pointer argument).
pub fn emu_launch_checked(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
    params: &mut [*mut c_void],
    seed: u64,
    opts: &LaunchOptions,
) -> Result<Vec<EmuFinding>, String> {
    // SAFETY: the contract of emu_launch (params point at values of the parameter types; the
    // emulator itself rejects pointer arguments that are not its memory).
    unsafe { BUILTIN.launch(kernel, grid, block, shared_bytes, params, seed, opts) }
}

/// Names of every kernel compiled into the emulator, in table order.
pub fn emu_kernel_names() -> Vec<String> {
    BUILTIN.kernel_names()
}
