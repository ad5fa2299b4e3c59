//! NVTX ranges (named spans on an Nsight Systems / Nsight Compute timeline) around every kernel
//! launch on cuda, every bench row and every stage of a model step.
//!
//! NVTX 3 is header-only in C: the header's code reads `NVTX_INJECTION64_PATH` (set by `nsys`
//! and `ncu` when they trace NVTX), loads that tool library and calls its
//! `InitializeInjectionNvtx2` with an export table through which the tool fills the NVTX
//! function slots. No libnvToolsExt is involved (CUDA 13 no longer ships it, and cudarc's NVTX
//! binding needs it). This module is that header's loader, in Rust: the same export table
//! (callbacks, id 1; version info, id 3), the six callback modules with their slot counts
//! (core 16, CUDA 9, OpenCL 15, CUDA runtime 7, core2 16, sync 7), and the core module's
//! `RangePushA` (slot 9) and `RangePop` (slot 11) called when the tool filled them.
//!
//! Without a tool (the variable unset, the library not loadable, the tool declining) every
//! range is a no-op that costs one atomic load, and [`status`] says why. Ranges allocate
//! nothing: names are copied into a stack buffer (at most 127 bytes, longer ones cut).

use crate::device::Backend;
use std::ffi::{c_char, c_int, c_void, OsStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

/// Slot counts of the callback modules 1..=6 (each module's `NVTX_CBID_*_SIZE`).
const MODULE_SIZES: [usize; 6] = [16, 9, 15, 7, 16, 7];
const SLOT_COUNT: usize = 16 + 9 + 15 + 7 + 16 + 7;
/// Core module slots (`NVTX_CBID_CORE_RangePushA`, `NVTX_CBID_CORE_RangePop`).
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;
/// `NVTX_VERSION` of the NVTX 3 headers.
const NVTX_VERSION: u32 = 3;

/// The function slots a tool fills (`AtomicPtr` has the layout of a plain pointer).
static SLOTS: [AtomicPtr<c_void>; SLOT_COUNT] = [const { AtomicPtr::new(null_mut()) }; SLOT_COUNT];

/// One module's table: entry 0 and entry `size` null, entries 1..size point at slots, as the
/// NVTX headers lay out `functionTable_<MODULE>`.
struct Table(Vec<*mut *mut c_void>);
// SAFETY: the pointers point into the static SLOTS and are only handed to the tool.
unsafe impl Send for Table {}
unsafe impl Sync for Table {}

fn tables() -> &'static [Table] {
    static TABLES: OnceLock<Vec<Table>> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut start = 0;
        MODULE_SIZES
            .iter()
            .map(|&size| {
                let mut t = vec![null_mut(); size + 1];
                for (i, entry) in t.iter_mut().enumerate().take(size).skip(1) {
                    *entry = SLOTS[start + i].as_ptr();
                }
                start += size;
                Table(t)
            })
            .collect()
    })
}

#[repr(C)]
struct ExportCallbacks {
    struct_size: usize,
    get_module_function_table: extern "C" fn(c_int, *mut *mut *mut *mut c_void, *mut u32) -> c_int,
}

#[repr(C)]
struct ExportVersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: extern "C" fn(u32),
}

static CALLBACKS: ExportCallbacks = ExportCallbacks {
    struct_size: std::mem::size_of::<ExportCallbacks>(),
    get_module_function_table,
};
static VERSION_INFO: ExportVersionInfo = ExportVersionInfo {
    struct_size: std::mem::size_of::<ExportVersionInfo>(),
    version: NVTX_VERSION,
    reserved0: 0,
    set_injection_nvtx_version,
};

extern "C" fn set_injection_nvtx_version(_version: u32) {}

extern "C" fn get_module_function_table(
    module: c_int,
    out_table: *mut *mut *mut *mut c_void,
    out_size: *mut u32,
) -> c_int {
    let Some(table) = usize::try_from(module)
        .ok()
        .and_then(|m| m.checked_sub(1))
        .and_then(|m| tables().get(m))
    else {
        return 0;
    };
    // SAFETY: the tool passes writable out-pointers or null, as the NVTX protocol requires.
    unsafe {
        if !out_table.is_null() {
            *out_table = table.0.as_ptr() as *mut *mut *mut c_void;
        }
        if !out_size.is_null() {
            *out_size = (table.0.len() - 1) as u32;
        }
    }
    1
}

extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        1 => &CALLBACKS as *const ExportCallbacks as *const c_void,
        3 => &VERSION_INFO as *const ExportVersionInfo as *const c_void,
        _ => std::ptr::null(),
    }
}

/// Whether ranges reach a tool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// A tool (the library at this path) took the ranges.
    Active(String),
    /// Ranges are no-ops, for this reason.
    Inactive(String),
}

/// Loads the NVTX tool at `path` (what [`status`] does with `NVTX_INJECTION64_PATH`) and lets
/// it fill the function slots. Public so tests can load a tool of their own.
pub fn load(path: Option<&OsStr>) -> Status {
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return Status::Inactive(
            "no NVTX tool attached (NVTX_INJECTION64_PATH is unset; nsys and ncu set it when \
             they trace NVTX)"
                .into(),
        );
    };
    let shown = path.to_string_lossy().into_owned();
    type Init = unsafe extern "C" fn(extern "C" fn(u32) -> *const c_void) -> c_int;
    // SAFETY: loading the tool runs its initialisers: the library is the one the profiler
    // asked every NVTX client to load, exactly what the NVTX headers do.
    let lib = match unsafe { libloading::Library::new(path) } {
        Ok(lib) => lib,
        Err(e) => return Status::Inactive(format!("cannot load the NVTX tool {shown}: {e}")),
    };
    // SAFETY: the symbol's type is the NVTX protocol's `NvtxInitializeInjectionNvtxFunc_t`.
    let init: Init = match unsafe { lib.get::<Init>(b"InitializeInjectionNvtx2\0") } {
        Ok(f) => *f,
        Err(e) => {
            return Status::Inactive(format!(
                "the NVTX tool {shown} has no InitializeInjectionNvtx2: {e}"
            ))
        }
    };
    // SAFETY: the export table and the slots it hands out are 'static.
    if unsafe { init(get_export_table) } == 0 {
        return Status::Inactive(format!("the NVTX tool {shown} declined to initialise"));
    }
    // The tool's functions now sit in SLOTS: keep its code loaded for the whole process.
    std::mem::forget(lib);
    if slot(CORE_RANGE_PUSH_A).is_null() || slot(CORE_RANGE_POP).is_null() {
        return Status::Inactive(format!(
            "the NVTX tool {shown} provides no nvtxRangePushA/nvtxRangePop"
        ));
    }
    Status::Active(shown)
}

fn slot(i: usize) -> *mut c_void {
    SLOTS[i].load(Ordering::Acquire)
}

/// Whether ranges reach a tool, deciding on first use from `NVTX_INJECTION64_PATH`.
pub fn status() -> &'static Status {
    static STATUS: OnceLock<Status> = OnceLock::new();
    STATUS.get_or_init(|| load(std::env::var_os("NVTX_INJECTION64_PATH").as_deref()))
}

/// An open range; closes when dropped.
#[must_use = "the range closes when this is dropped"]
pub struct Range {
    open: bool,
}

impl Drop for Range {
    fn drop(&mut self) {
        let pop = slot(CORE_RANGE_POP);
        if self.open && !pop.is_null() {
            // SAFETY: the tool stored an `int (*)(void)` (nvtxRangePop) in this slot.
            let pop: extern "C" fn() -> c_int = unsafe { std::mem::transmute(pop) };
            pop();
        }
    }
}

/// Opens a range named `name` where a tool is attached; else a no-op.
pub fn range(name: &str) -> Range {
    if !matches!(status(), Status::Active(_)) {
        return Range { open: false };
    }
    let push = slot(CORE_RANGE_PUSH_A);
    if push.is_null() {
        return Range { open: false };
    }
    let mut buf = [0u8; 128];
    let bytes = name.as_bytes();
    let n = bytes
        .iter()
        .take(buf.len() - 1)
        .position(|&b| b == 0)
        .unwrap_or(bytes.len().min(buf.len() - 1));
    buf[..n].copy_from_slice(&bytes[..n]);
    // SAFETY: the tool stored an `int (*)(const char*)` (nvtxRangePushA) in this slot; buf is
    // NUL-terminated and outlives the call (tools copy the message).
    let push: extern "C" fn(*const c_char) -> c_int = unsafe { std::mem::transmute(push) };
    push(buf.as_ptr() as *const c_char);
    Range { open: true }
}

/// A range only where `backend` is a GPU: the emulator and the CPU have no timeline to mark.
pub fn range_on(backend: &Backend, name: &str) -> Range {
    match backend {
        Backend::Cuda(_) => range(name),
        _ => Range { open: false },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_have_the_headers_layout() {
        let t = tables();
        assert_eq!(t.len(), 6);
        let mut start = 0;
        for (table, &size) in t.iter().zip(&MODULE_SIZES) {
            assert_eq!(table.0.len(), size + 1);
            assert!(table.0[0].is_null() && table.0[size].is_null());
            assert_eq!(table.0[1], SLOTS[start + 1].as_ptr());
            start += size;
        }
        let (mut out, mut size) = (null_mut(), 0u32);
        assert_eq!(get_module_function_table(1, &mut out, &mut size), 1);
        assert_eq!(size, 16);
        assert_eq!(get_module_function_table(0, &mut out, &mut size), 0);
        assert_eq!(get_module_function_table(7, &mut out, &mut size), 0);
        assert!(get_export_table(2).is_null() && !get_export_table(3).is_null());
    }

    #[test]
    fn no_tool_is_a_stated_no_op() {
        match load(None) {
            Status::Inactive(why) => assert!(why.contains("NVTX_INJECTION64_PATH"), "{why}"),
            s => panic!("{s:?}"),
        }
        match load(Some(OsStr::new("/nonexistent/libtool.so"))) {
            Status::Inactive(why) => assert!(why.contains("cannot load"), "{why}"),
            s => panic!("{s:?}"),
        }
        // The CPU device never opens a range, whatever the tool.
        assert!(!range_on(&Backend::Cpu, "x").open);
    }
}
