//! The `emu` device: device memory and kernel launches of the CUDA-on-CPU emulator
//! (kernels/emu, C ABI in kernels/emu/emu_api.h, built by build_emu.rs). See docs/emulator.md.
//!
//! Device memory is host memory from `sluice_emu_alloc`: 256-byte aligned, with guard pages and
//! canary bytes around it so the emulator can name the allocation and byte offset of an
//! out-of-bounds access. Launches are synchronous.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::NonNull;

extern "C" {
    fn sluice_emu_alloc(bytes: usize) -> *mut c_void;
    fn sluice_emu_free(p: *mut c_void);
    fn sluice_emu_launch(
        kernel: *const c_char,
        grid: *const u32,
        block: *const u32,
        dynamic_shared_bytes: usize,
        params: *mut *mut c_void,
        seed: u64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn sluice_emu_kernel_count() -> c_int;
    fn sluice_emu_kernel_name(i: c_int) -> *const c_char;
    fn sluice_emu_kernel_signature(kernel: *const c_char) -> *const c_char;
}

/// A buffer of emu device memory, freed on drop. Fresh memory holds 0xFF bytes (NaN as f32/bf16).
pub struct EmuBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
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
        // SAFETY: sluice_emu_alloc has no preconditions; it returns null on failure.
        let p = unsafe { sluice_emu_alloc(bytes) };
        NonNull::new(p.cast::<u8>())
            .map(|ptr| EmuBuffer { ptr, bytes })
            .ok_or_else(|| format!("emu device: cannot allocate {bytes} bytes"))
    }

    /// Device address of the first byte (256-byte aligned).
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
        // SAFETY: ptr came from sluice_emu_alloc and is freed exactly once, here.
        unsafe { sluice_emu_free(self.ptr.as_ptr().cast()) }
    }
}

impl std::fmt::Debug for EmuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmuBuffer({:p}, {} bytes)", self.ptr, self.bytes)
    }
}

/// The parameter signature of an emulated kernel: one character per parameter ('p' pointer,
/// 'i' int, 'u' unsigned, 'l' long long, 'L' unsigned long long, 'f' float, 'd' double,
/// '?' other); `None` if no such kernel was compiled.
pub fn emu_kernel_signature(kernel: &str) -> Option<String> {
    let name = CString::new(kernel).ok()?;
    // SAFETY: name is a valid NUL-terminated string; the result is null or points at a static
    // NUL-terminated string of the kernel table.
    let sig = unsafe { sluice_emu_kernel_signature(name.as_ptr()) };
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

/// Runs `kernel` under the emulator, like cuLaunchKernel: `params[i]` points at the value of the
/// kernel's i-th parameter (at least as many bytes as that parameter's type). Returns the
/// emulator's message (naming the kernel, block and what went wrong) on error.
pub fn emu_launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
    params: &mut [*mut c_void],
    seed: u64,
) -> Result<(), String> {
    let name =
        CString::new(kernel).map_err(|_| format!("kernel name {kernel:?} contains a NUL byte"))?;
    let signature = emu_kernel_signature(kernel).ok_or_else(|| {
        format!("kernel {kernel} is not in the emulator's kernel table (is it declared `extern \"C\" __global__` in kernels/cuda?)")
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
    let mut err = vec![0u8; 4096];
    // SAFETY: name is NUL-terminated; grid and block are 3 u32s; params has exactly one non-null
    // pointer per kernel parameter (checked above against the compiled signature) and the caller
    // guarantees each points at a value of that parameter's type; err is writable for its length.
    // The launch is synchronous: nothing is used after it returns.
    let rc = unsafe {
        sluice_emu_launch(
            name.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            shared_bytes,
            params.as_mut_ptr(),
            seed,
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let len = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    let msg = String::from_utf8_lossy(&err[..len]).into_owned();
    Err(if msg.is_empty() {
        format!("kernel {kernel}: emulated launch failed (code {rc})")
    } else {
        msg
    })
}

/// Names of every kernel compiled into the emulator, in table order.
pub fn emu_kernel_names() -> Vec<String> {
    // SAFETY: no preconditions.
    let n = unsafe { sluice_emu_kernel_count() };
    (0..n)
        .filter_map(|i| {
            // SAFETY: 0 <= i < count; the result is a static NUL-terminated string (or null).
            let p = unsafe { sluice_emu_kernel_name(i) };
            // SAFETY: non-null results are static NUL-terminated strings.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}
