//! Profiles of emulated launches: the counters of kernels/emu/profile.cpp (docs/emulator.md,
//! "Profiling"), collected per launch while a [`Recording`] is active on the calling thread.
//!
//! A recording is per thread (launches are synchronous and run on the thread that calls the op),
//! so parallel tests never see each other's launches. While it is active every emu launch of
//! the thread is profiled: in full, or on a sample of its blocks chosen by the recording's
//! [`Sampling`], each sampled block weighted by the number of blocks it stands for.

use super::findings::{symbolize, CodeLocation};
use super::{Api, RawOptions};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr};

/// `sluice_emu_profile_site` of emu_api.h.
#[repr(C)]
pub(crate) struct RawSite {
    object: *const c_char,
    vaddr: u64,
    file: *const c_char,
    line: u32,
    counters: [f64; NCOUNTERS],
    unique_read: u64,
    unique_written: u64,
    width_min: u32,
    width_max: u32,
    ntensor: u32,
    tensor_shape: *const *const c_char,
    tensor_count: *const f64,
}

/// `sluice_emu_profile_buffer` of emu_api.h.
#[repr(C)]
pub(crate) struct RawBuffer {
    param: u32,
    bytes: u64,
    unique_read: u64,
    unique_written: u64,
}

/// `sluice_emu_profile` of emu_api.h.
#[repr(C)]
pub(crate) struct RawProfile {
    blocks_total: u64,
    blocks_run: u64,
    sites: *const RawSite,
    nsites: u32,
    buffers: *const RawBuffer,
    nbuffers: u32,
}

pub(crate) type ProfileFn = unsafe extern "C" fn(ctx: *mut c_void, profile: *const RawProfile);

/// The unique-byte keys of [`Counters::values`] (beside the runtime's counters).
pub const UNIQUE_READ: &str = "unique_bytes_read";
pub const UNIQUE_WRITTEN: &str = "unique_bytes_written";

/// SLUICE_EMU_PROFILE_COUNTERS of emu_api.h.
pub const NCOUNTERS: usize = 26;

extern "C" {
    fn sluice_emu_profile_counter_name(i: i32) -> *const c_char;
    fn sluice_emu_set_lazy_alloc(lazy: i32) -> i32;
}

/// The counters' names, in the runtime's order (the JSON keys of `sluice emu profile`).
pub fn counter_names() -> Vec<&'static str> {
    (0..NCOUNTERS as i32)
        .map(|i| {
            // SAFETY: 0 <= i < NCOUNTERS; the result is a static NUL-terminated string.
            let p = unsafe { sluice_emu_profile_counter_name(i) };
            assert!(
                !p.is_null(),
                "emu_api.h and profile.rs disagree on the counters"
            );
            // SAFETY: non-null results are static NUL-terminated ASCII strings.
            unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("?")
        })
        .collect()
}

/// Counts of one site, one kernel or one op. Values are weighted by the sample weights, so a
/// sampled launch gives estimates (fractional); a full launch gives exact integers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    /// By counter name (every name of [`counter_names`]).
    pub values: BTreeMap<&'static str, f64>,
    /// Tensor-core instructions by shape, e.g. `mma.m16n8k16.bf16`.
    pub tensor_instructions: BTreeMap<String, f64>,
    /// The access widths (bytes per lane) of the memory instructions counted here, by kind
    /// (`global_load`, `global_store`, `shared_load`, `shared_store`, `atomic`).
    pub widths: BTreeMap<&'static str, std::collections::BTreeSet<u32>>,
}

impl Counters {
    fn zero() -> Counters {
        let mut values: BTreeMap<&'static str, f64> =
            counter_names().into_iter().map(|n| (n, 0.0)).collect();
        values.insert(UNIQUE_READ, 0.0);
        values.insert(UNIQUE_WRITTEN, 0.0);
        Counters {
            values,
            tensor_instructions: BTreeMap::new(),
            widths: BTreeMap::new(),
        }
    }

    /// The value of counter `name` (0 for an unknown name).
    pub fn get(&self, name: &str) -> f64 {
        self.values.get(name).copied().unwrap_or(0.0)
    }

    pub fn add(&mut self, other: &Counters) {
        for (k, v) in &other.values {
            *self.values.entry(k).or_insert(0.0) += v;
        }
        for (k, v) in &other.tensor_instructions {
            *self.tensor_instructions.entry(k.clone()).or_insert(0.0) += v;
        }
        for (k, v) in &other.widths {
            self.widths.entry(k).or_default().extend(v);
        }
    }

    /// L1 wavefronts: distinct global lines per request (loads and stores) plus shared-memory
    /// wavefronts (ldmatrix included) plus the wgmma operand model.
    pub fn l1_wavefronts(&self) -> f64 {
        self.get("global_load_lines")
            + self.get("global_store_lines")
            + self.get("shared_load_wavefronts")
            + self.get("shared_store_wavefronts")
            + self.get("wgmma_operand_wavefronts")
    }
}

/// Unique bytes of one global buffer (full launches only).
#[derive(Debug, Clone, PartialEq)]
pub struct BufferBytes {
    /// Index of the kernel parameter.
    pub param: u32,
    pub bytes: u64,
    pub unique_read: u64,
    pub unique_written: u64,
}

/// The profile of one launch.
#[derive(Debug, Clone)]
pub struct KernelProfile {
    pub name: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: usize,
    pub blocks_total: u64,
    pub blocks_profiled: u64,
    pub totals: Counters,
    /// By source line (`FILE:LINE`, or `HEADER:LINE (inlined into FILE:LINE)`), in the order of
    /// the site names.
    pub lines: BTreeMap<String, Counters>,
    /// Empty unless every block ran.
    pub buffers: Vec<BufferBytes>,
}

impl KernelProfile {
    /// Whether every block of the grid ran (unique bytes are known only then).
    pub fn is_full(&self) -> bool {
        self.blocks_profiled == self.blocks_total
    }
}

/// How the blocks of one kernel's launches are sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strata {
    /// Run every block (launches whose outputs steer later launches: routing, sorting, scans).
    Full,
    /// Strata by the block index along one grid axis (0 = x, 1 = y, 2 = z): the axis values are
    /// cut into at most `max_blocks` contiguous ranges and each range gets an equal share of the
    /// sample, spread evenly over its blocks. For grids whose per-block work varies along one
    /// axis (query tiles of causal attention, ragged segments).
    Axis(usize),
    /// One stratum: blocks spread evenly over the linear block index.
    Uniform,
}

/// The sampling of a recording: at most `max_blocks` blocks per launch (None: every block), and
/// the strata of each kernel, by name.
#[derive(Clone, Copy)]
pub struct Sampling {
    pub max_blocks: Option<u64>,
    pub strata: fn(&str) -> Strata,
}

impl Sampling {
    /// Every block of every launch.
    pub fn full() -> Sampling {
        Sampling {
            max_blocks: None,
            strata: |_| Strata::Full,
        }
    }
}

/// The blocks to run for a launch and the weight of each (the number of blocks it stands for).
/// None: run every block.
pub fn sample_blocks(
    grid: [u32; 3],
    strata: Strata,
    max_blocks: u64,
) -> Option<(Vec<u64>, Vec<f64>)> {
    let dims = grid.map(u64::from);
    let total = dims[0] * dims[1] * dims[2];
    if strata == Strata::Full || total <= max_blocks || max_blocks == 0 {
        return None;
    }
    let axis = match strata {
        Strata::Axis(a) if a < 3 => a,
        _ => 3,
    };
    // The stratum variable: the axis value (or the linear index for Uniform).
    let (levels, others) = if axis == 3 {
        (total, 1)
    } else {
        (dims[axis], total / dims[axis])
    };
    let nstrata = if axis == 3 { 1 } else { levels.min(max_blocks) };
    // The budget spread over the strata, the remainder to the first ones (so a request of N
    // blocks profiles N whenever the grid has them).
    let (per, extra) = (max_blocks / nstrata, max_blocks % nstrata);
    let mut blocks = Vec::new();
    let mut weights = Vec::new();
    for s in 0..nstrata {
        // Levels [lo, hi) of this stratum, its blocks enumerated level-major (so the picks,
        // spread evenly over the enumeration, are spread evenly over the levels first).
        let lo = s * levels / nstrata;
        let hi = (s + 1) * levels / nstrata;
        let len = hi - lo;
        let size = len * others;
        let picks = (per + u64::from(s < extra)).min(size);
        for j in 0..picks {
            let idx = ((2 * j + 1) * size) / (2 * picks);
            let level = lo + idx / others;
            let other = idx % others;
            let linear = if axis == 3 {
                level
            } else {
                // Rebuild the linear block index from the axis value and the other coordinates.
                let mut c = [0u64; 3];
                c[axis] = level;
                let rest: Vec<usize> = (0..3).filter(|&d| d != axis).collect();
                c[rest[0]] = other % dims[rest[0]];
                c[rest[1]] = other / dims[rest[0]];
                c[0] + dims[0] * (c[1] + dims[1] * c[2])
            };
            blocks.push(linear);
            weights.push(size as f64 / picks as f64);
        }
    }
    Some((blocks, weights))
}

/// A launch recorded but not resolved yet: source lines are looked up once, at the end, for
/// every launch together (one addr2line run instead of one per launch).
struct Pending {
    raw: OwnedProfile,
    kernel: String,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
}

struct Active {
    sampling: Sampling,
    launches: Vec<Pending>,
    /// Launches run (sampled as usual) but are not kept: an op's setup (see [`Unrecorded`]).
    paused: bool,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// While alive, every emu launch of this thread is profiled; [`Recording::finish`] returns the
/// profiles in launch order. Lazy allocation (see [`LazyAlloc`]) is separate.
pub struct Recording {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Recording {
    /// Starts recording on this thread. Err if a recording is already active here.
    pub fn start(sampling: Sampling) -> Result<Recording, String> {
        ACTIVE.with(|a| {
            let mut a = a.borrow_mut();
            if a.is_some() {
                return Err("a profile recording is already active on this thread".to_string());
            }
            *a = Some(Active {
                sampling,
                launches: Vec::new(),
                paused: false,
            });
            Ok(Recording {
                _not_send: std::marker::PhantomData,
            })
        })
    }

    /// Stops recording and returns the launches' profiles.
    pub fn finish(self) -> Vec<KernelProfile> {
        let pending = ACTIVE.with(|a| {
            a.borrow_mut()
                .take()
                .map(|a| a.launches)
                .unwrap_or_default()
        });
        std::mem::forget(self);
        let codes: Vec<(String, u64)> = pending
            .iter()
            .flat_map(|p| p.raw.sites.iter().filter_map(|s| s.code.clone()))
            .collect();
        let located = symbolize(&codes);
        pending
            .into_iter()
            .map(|p| resolve(p.raw, &located, &p.kernel, p.grid, p.block, p.shared_bytes))
            .collect()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().take());
    }
}

/// Whether this thread's launches run under a recording with a block budget (sampled). Kernels
/// with a persistent grid then give each block two tiles instead of a 132-SM share
/// (kernels/src/ops/gemm_hopper.rs), so that sampling blocks samples tiles: the grid changes no
/// bits and no per-tile count, only the few per-block set-up instructions.
pub fn sampling_blocks() -> bool {
    ACTIVE.with(|a| {
        a.borrow()
            .as_ref()
            .is_some_and(|a| a.sampling.max_blocks.is_some())
    })
}

/// While alive, this thread's launches still run sampled (so a setup at a doc shape stays as
/// fast as the profiled part) but are left out of the active recording, if any: what an op
/// runs only to build its inputs (the MoE backward's row runs the forward for its saved state).
pub struct Unrecorded {
    previous: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Unrecorded {
    pub fn start() -> Unrecorded {
        let previous = ACTIVE.with(|a| {
            a.borrow_mut()
                .as_mut()
                .map(|a| std::mem::replace(&mut a.paused, true))
                .unwrap_or(false)
        });
        Unrecorded {
            previous,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for Unrecorded {
    fn drop(&mut self) {
        ACTIVE.with(|a| {
            if let Some(a) = a.borrow_mut().as_mut() {
                a.paused = self.previous;
            }
        });
    }
}

/// While alive, fresh emu memory is left untouched (zero pages that take no resident memory
/// until written) instead of being filled with NaN, and [`crate::Tensor`] skips its poison and
/// zero fills on emu: the profile mode that lets the doc shapes fit in this machine's memory.
/// Process-wide; restores the previous mode on drop.
pub struct LazyAlloc {
    previous: i32,
}

static LAZY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl LazyAlloc {
    pub fn enable() -> LazyAlloc {
        // SAFETY: no preconditions; returns the previous mode.
        let previous = unsafe { sluice_emu_set_lazy_alloc(1) };
        LAZY.store(true, std::sync::atomic::Ordering::SeqCst);
        LazyAlloc { previous }
    }
}

impl Drop for LazyAlloc {
    fn drop(&mut self) {
        // SAFETY: as in enable.
        unsafe { sluice_emu_set_lazy_alloc(self.previous) };
        LAZY.store(self.previous != 0, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether fresh emu memory is lazy (zero, untouched) right now.
pub fn lazy_alloc() -> bool {
    LAZY.load(std::sync::atomic::Ordering::SeqCst)
}

/// What a profiled launch needs from the caller: the sample, and where the profile goes.
pub(crate) struct Request {
    blocks: Vec<u64>,
    weights: Vec<f64>,
    pub(crate) raw: Option<OwnedProfile>,
}

/// The active recording's request for a launch of `kernel`, or None when not recording.
pub(crate) fn request(kernel: &str, grid: [u32; 3]) -> Option<Request> {
    ACTIVE.with(|a| {
        let a = a.borrow();
        let active = a.as_ref()?;
        let strata = (active.sampling.strata)(kernel);
        let (blocks, weights) = active
            .sampling
            .max_blocks
            .and_then(|m| sample_blocks(grid, strata, m))
            .unwrap_or_default();
        Some(Request {
            blocks,
            weights,
            raw: None,
        })
    })
}

impl Request {
    /// Fills the profile fields of the launch options; `self` must stay where it is until the
    /// launch returns (the runtime writes through the context pointer).
    pub(crate) fn options(&mut self, raw: &mut RawOptions) {
        raw.profile = 1;
        // Race records change no count and cost the most; a recording never needs them.
        raw.race = 0;
        if !self.blocks.is_empty() {
            raw.sample_blocks = self.blocks.as_ptr();
            raw.sample_weights = self.weights.as_ptr();
            raw.nsample = self.blocks.len() as u64;
        }
        raw.on_profile = Some(collect);
        raw.profile_ctx = (self as *mut Request).cast();
    }
}

/// The runtime's profile, copied out of the callback.
pub(crate) struct OwnedProfile {
    blocks_total: u64,
    blocks_run: u64,
    sites: Vec<OwnedSite>,
    buffers: Vec<BufferBytes>,
}

struct OwnedSite {
    code: Option<(String, u64)>,
    file: Option<(String, u32)>,
    counters: [f64; NCOUNTERS],
    unique: (u64, u64),
    width: (u32, u32),
    tensor: Vec<(String, f64)>,
}

fn owned(p: *const c_char) -> Option<String> {
    // SAFETY: the runtime passes null or NUL-terminated strings valid during the callback.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The profile callback (emu_api.h `on_profile`): copies everything out.
///
/// # Safety
/// `ctx` is the `Request` that set up the launch; `p` is valid for the call.
unsafe extern "C" fn collect(ctx: *mut c_void, p: *const RawProfile) {
    // SAFETY: the caller's contract.
    let (req, p) = unsafe { (&mut *ctx.cast::<Request>(), &*p) };
    let raw_sites: &[RawSite] = if p.nsites == 0 {
        &[]
    } else {
        // SAFETY: the runtime passes nsites sites.
        unsafe { std::slice::from_raw_parts(p.sites, p.nsites as usize) }
    };
    let sites = raw_sites
        .iter()
        .map(|s| {
            let tensor = (0..s.ntensor as usize)
                .map(|i| {
                    // SAFETY: ntensor entries in each array, valid during the call.
                    let (shape, count) =
                        unsafe { (*s.tensor_shape.add(i), *s.tensor_count.add(i)) };
                    (owned(shape).unwrap_or_default(), count)
                })
                .collect();
            OwnedSite {
                code: owned(s.object).map(|o| (o, s.vaddr)),
                file: owned(s.file).map(|f| (f, s.line)),
                counters: s.counters,
                unique: (s.unique_read, s.unique_written),
                width: (s.width_min, s.width_max),
                tensor,
            }
        })
        .collect();
    let buffers = if p.nbuffers == 0 || p.buffers.is_null() {
        Vec::new()
    } else {
        // SAFETY: the runtime passes nbuffers buffers.
        unsafe { std::slice::from_raw_parts(p.buffers, p.nbuffers as usize) }
            .iter()
            .map(|b| BufferBytes {
                param: b.param,
                bytes: b.bytes,
                unique_read: b.unique_read,
                unique_written: b.unique_written,
            })
            .collect()
    };
    req.raw = Some(OwnedProfile {
        blocks_total: p.blocks_total,
        blocks_run: p.blocks_run,
        sites,
        buffers,
    });
}

/// Turns a launch's raw profile into a [`KernelProfile`] (source lines resolved) and appends it
/// to the active recording.
pub(crate) fn record(
    req: Request,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
) {
    let Some(raw) = req.raw else { return };
    ACTIVE.with(|a| {
        if let Some(active) = a.borrow_mut().as_mut().filter(|a| !a.paused) {
            active.launches.push(Pending {
                raw,
                kernel: kernel.to_string(),
                grid,
                block,
                shared_bytes,
            });
        }
    });
}

/// A source file named relative to the workspace when it is one of sluice's own.
fn short_path(file: &str) -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../");
    let root = std::path::Path::new(root)
        .canonicalize()
        .map(|p| format!("{}/", p.display()))
        .unwrap_or_else(|_| root.to_string());
    file.strip_prefix(&root).unwrap_or(file).to_string()
}

fn site_name(loc: &CodeLocation) -> String {
    let mut s = short_path(&loc.file);
    if loc.line > 0 {
        s.push_str(&format!(":{}", loc.line));
    }
    if let Some((f, l)) = &loc.called_from {
        s.push_str(&format!(" (inlined into {}:{l})", short_path(f)));
    }
    s
}

fn resolve(
    raw: OwnedProfile,
    located: &BTreeMap<(String, u64), CodeLocation>,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
) -> KernelProfile {
    let names = counter_names();
    let mut lines: BTreeMap<String, Counters> = BTreeMap::new();
    let mut totals = Counters::zero();
    for s in raw.sites {
        let site = match (&s.file, &s.code) {
            (Some((f, l)), _) => site_name(&CodeLocation {
                file: f.clone(),
                line: *l,
                called_from: None,
            }),
            (None, Some(code)) => located
                .get(code)
                .map(site_name)
                .unwrap_or_else(|| format!("{}+{:#x}", code.0, code.1)),
            (None, None) => "?".to_string(),
        };
        let mut c = Counters::zero();
        for (i, n) in names.iter().enumerate() {
            c.values.insert(n, s.counters[i]);
        }
        for (shape, count) in s.tensor {
            *c.tensor_instructions.entry(shape).or_insert(0.0) += count;
        }
        // Unique bytes are known for full launches only (NaN: unknown, `null` in JSON). Per
        // line they are the bytes that line touched; the totals come from the buffers (a byte
        // touched by two lines counts once).
        let full = raw.blocks_run == raw.blocks_total;
        let unknown = |v: u64| if full { v as f64 } else { f64::NAN };
        if s.width.1 > 0 {
            // A kernel access site is one instruction of one kind: the kind is the counter it
            // counted requests in.
            for kind in ["global_load", "global_store", "shared_load", "shared_store"] {
                if c.get(&format!("{kind}_requests")) > 0.0 {
                    let w = c.widths.entry(kind).or_default();
                    w.insert(s.width.0);
                    w.insert(s.width.1);
                }
            }
            if c.get("atomics") > 0.0 {
                let w = c.widths.entry("atomic").or_default();
                w.insert(s.width.0);
                w.insert(s.width.1);
            }
        }
        c.values.insert(UNIQUE_READ, unknown(s.unique.0));
        c.values.insert(UNIQUE_WRITTEN, unknown(s.unique.1));
        totals.add(&c);
        lines.entry(site).or_insert_with(Counters::zero).add(&c);
    }
    let full = raw.blocks_run == raw.blocks_total;
    let sum = |f: fn(&BufferBytes) -> u64| -> f64 {
        if full {
            raw.buffers.iter().map(|b| f(b) as f64).sum()
        } else {
            f64::NAN
        }
    };
    totals.values.insert(UNIQUE_READ, sum(|b| b.unique_read));
    totals
        .values
        .insert(UNIQUE_WRITTEN, sum(|b| b.unique_written));
    KernelProfile {
        name: kernel.to_string(),
        grid,
        block,
        shared_bytes,
        blocks_total: raw.blocks_total,
        blocks_profiled: raw.blocks_run,
        totals,
        lines,
        buffers: raw.buffers,
    }
}

/// Runs one launch on `api` with profiling, outside any recording (for `sluice emu check
/// --profile`): returns the findings and the profile.
///
/// # Safety
/// As [`Api::launch`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_profiled(
    api: &Api,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: usize,
    params: &mut [*mut c_void],
    seed: u64,
    opts: &super::LaunchOptions,
) -> Result<(Vec<super::EmuFinding>, Option<KernelProfile>), String> {
    let mut req = Request {
        blocks: Vec::new(),
        weights: Vec::new(),
        raw: None,
    };
    // SAFETY: the caller's contract; req lives until the launch returns.
    let found = unsafe {
        api.launch_with(
            kernel,
            grid,
            block,
            shared_bytes,
            params,
            seed,
            opts,
            Some(&mut req),
        )
    }?;
    let profile = req.raw.map(|raw| {
        let codes: Vec<(String, u64)> = raw.sites.iter().filter_map(|s| s.code.clone()).collect();
        let located = symbolize(&codes);
        resolve(raw, &located, kernel, grid, block, shared_bytes)
    });
    Ok((found, profile))
}
