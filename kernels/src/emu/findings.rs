//! Findings of an emulated launch: collected from the C callback, their code addresses turned into
//! source lines with `addr2line` (binutils, present wherever g++ is), and formatted one per line.

use super::RawFinding;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr};
use std::fmt;
use std::process::Command;
use std::sync::Mutex;

/// Source locations already looked up (or known to be unresolvable: None), per object and
/// address: a test that meets the same finding under several seeds runs addr2line once.
type LineCache = BTreeMap<(String, u64), Option<CodeLocation>>;
static LINES: Mutex<LineCache> = Mutex::new(BTreeMap::new());

/// A source location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeLocation {
    pub file: String,
    pub line: u32,
    /// The outermost caller when the access was inlined from another file (a helper header).
    pub called_from: Option<(String, u32)>,
}

impl fmt::Display for CodeLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if self.line > 0 {
            write!(f, ":{}", self.line)?;
        }
        if let Some((file, line)) = &self.called_from {
            write!(f, " (inlined into {file}:{line})")?;
        }
        Ok(())
    }
}

/// One finding of a launch.
#[derive(Debug, Clone)]
pub struct EmuFinding {
    /// race, out-of-bounds, divergent-barrier, shuffle-mask, async-read-before-wait,
    /// async-operand-before-wait, missing-proxy-fence, swizzle-mismatch, kernel-error, or `more`
    /// (findings beyond the emulator's limit per launch).
    pub kind: String,
    /// What happened: kernel, block, thread and, where they apply, buffer and offset.
    pub message: String,
    /// Where (the access, barrier or warp operation), when known.
    pub location: Option<CodeLocation>,
    /// For a race: the earlier conflicting access, when known.
    pub other: Option<CodeLocation>,
    /// Occurrences folded into this finding (same kind and place).
    pub count: u64,
}

impl fmt::Display for EmuFinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)?;
        if let Some(l) = &self.location {
            write!(f, " at {l}")?;
        }
        if let Some(l) = &self.other {
            write!(f, "; the earlier access is at {l}")?;
        }
        if self.count > 1 {
            write!(f, " [{} times]", self.count)?;
        }
        Ok(())
    }
}

/// An owned copy of a `sluice_emu_finding`.
pub(crate) struct RawOwned {
    kind: String,
    message: String,
    file: Option<(String, u32)>,
    code: Option<(String, u64)>,
    code2: Option<(String, u64)>,
    count: u64,
}

fn owned(p: *const c_char) -> Option<String> {
    // SAFETY: the emulator passes null or NUL-terminated strings valid during the callback.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The callback given to `sluice_emu_launch_ex`: copies each finding into the Vec at `ctx`.
///
/// # Safety
/// `ctx` must point at a live `Vec<RawOwned>` and `f` at a valid finding.
pub(crate) unsafe extern "C" fn collect(ctx: *mut c_void, f: *const RawFinding) {
    // SAFETY: the caller's contract (Api::launch passes its own Vec and the emulator a valid finding).
    let (out, f) = unsafe { (&mut *ctx.cast::<Vec<RawOwned>>(), &*f) };
    out.push(RawOwned {
        kind: owned(f.kind).unwrap_or_default(),
        message: owned(f.message).unwrap_or_default(),
        file: owned(f.file).map(|file| (file, f.line)),
        code: owned(f.object).map(|o| (o, f.vaddr)),
        code2: owned(f.object2).map(|o| (o, f.vaddr2)),
        count: f.count,
    });
}

/// The emulator's own sources (headers, generated kernel tables): a frame in them is never the
/// place to show. In the tree they live in kernels/emu; for `sluice emu check` in the cache's
/// `emu-<hash>` folder, or the generated kernel table.
fn is_emulator_source(file: &str) -> bool {
    let mut parts = file.rsplit('/');
    let name = parts.next().unwrap_or(file);
    let in_emu_dir = file.contains("/kernels/emu/") && !file.contains("/kernels/emu/tests/");
    let in_cache = file.split('/').any(|p| p.starts_with("emu-")) && !name.ends_with(".cuh");
    matches!(name, "sluice_emu.h" | "sluice_emu_half.h" | "emu_api.h")
        || in_emu_dir
        || in_cache
        || file.starts_with("<sluice emu check")
        || file.contains("/emu_gen/")
}

/// Source locations of code addresses, one `addr2line` run per object file for the addresses not
/// looked up before. Addresses it cannot resolve (no debug information, no addr2line) are absent
/// from the result.
pub(crate) fn symbolize(addrs: &[(String, u64)]) -> BTreeMap<(String, u64), CodeLocation> {
    let mut cache = LINES.lock().unwrap_or_else(|e| e.into_inner());
    let mut by_object: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (o, a) in addrs {
        if !cache.contains_key(&(o.clone(), *a)) {
            by_object.entry(o.as_str()).or_default().push(*a);
        }
    }
    let mut out = BTreeMap::new();
    for (object, mut list) in by_object {
        list.sort_unstable();
        list.dedup();
        let Ok(run) = Command::new("addr2line")
            .arg("-e")
            .arg(object)
            .args(["-i", "-a"])
            .args(list.iter().map(|a| format!("{a:#x}")))
            .output()
        else {
            continue;
        };
        if !run.status.success() {
            continue;
        }
        // Output: for each address a line `0x...`, then one `file:line` per inlined frame,
        // innermost first.
        let text = String::from_utf8_lossy(&run.stdout);
        let mut frames: Vec<(String, u32)> = Vec::new();
        let mut current: Option<u64> = None;
        let mut flush = |addr: Option<u64>, frames: &mut Vec<(String, u32)>| {
            if let Some(a) = addr {
                if let Some(loc) = pick(frames) {
                    out.insert((object.to_string(), a), loc);
                }
            }
            frames.clear();
        };
        for line in text.lines() {
            if let Some(hex) = line.strip_prefix("0x") {
                flush(current, &mut frames);
                current = u64::from_str_radix(hex.trim(), 16).ok();
            } else if let Some((file, rest)) = line.rsplit_once(':') {
                let num: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                if let Ok(n) = num.parse::<u32>() {
                    if n > 0 && file != "??" {
                        frames.push((file.to_string(), n));
                    }
                }
            }
        }
        flush(current, &mut frames);
    }
    for (o, a) in addrs {
        let key = (o.clone(), *a);
        let found = out.get(&key).cloned();
        cache.entry(key).or_insert(found);
    }
    addrs
        .iter()
        .filter_map(|k| Some((k.clone(), cache.get(k)?.clone()?)))
        .collect()
}

/// The frame to show: the innermost outside the emulator's headers, with the outermost caller
/// when that is in another file.
fn pick(frames: &[(String, u32)]) -> Option<CodeLocation> {
    let (file, line) = frames
        .iter()
        .find(|(f, _)| !is_emulator_source(f))
        .or(frames.first())?
        .clone();
    let outer = frames.iter().rev().find(|(f, _)| !is_emulator_source(f))?;
    let called_from = (outer.0 != file).then(|| outer.clone());
    Some(CodeLocation {
        file,
        line,
        called_from,
    })
}

/// Turns collected findings into [`EmuFinding`]s with source lines.
pub(crate) fn resolve(raw: Vec<RawOwned>) -> Vec<EmuFinding> {
    let addrs: Vec<(String, u64)> = raw
        .iter()
        .flat_map(|r| [r.code.clone(), r.code2.clone()])
        .flatten()
        .collect();
    let lines = if addrs.is_empty() {
        BTreeMap::new()
    } else {
        symbolize(&addrs)
    };
    let locate = |code: &Option<(String, u64)>| -> Option<CodeLocation> {
        let (o, a) = code.as_ref()?;
        Some(lines.get(&(o.clone(), *a)).cloned().unwrap_or_else(|| {
            let name = o.rsplit('/').next().unwrap_or(o);
            CodeLocation {
                file: format!("{name}+{a:#x}"),
                line: 0,
                called_from: None,
            }
        }))
    };
    raw.into_iter()
        .map(|r| {
            let location = locate(&r.code).or_else(|| {
                r.file.as_ref().map(|(file, line)| CodeLocation {
                    file: file.clone(),
                    line: *line,
                    called_from: None,
                })
            });
            EmuFinding {
                other: locate(&r.code2),
                kind: r.kind,
                message: r.message,
                location,
                count: r.count,
            }
        })
        .collect()
}
