//! The per-process invariances (DESIGN 2, promise 1): the same bits whatever the thread count
//! (1, 2 and every core: separate processes, since a pool's size is fixed per process) and,
//! on emu, whatever the emulator's schedule seed (which shuffles thread, warp and block order:
//! a missing barrier shows up as a result that changes with it).

use super::Verdict;
use crate::determinism::compare::{self, Mismatch};
use crate::determinism::procs::{self, Env};
use crate::determinism::record::Record;
use crate::determinism::{DetError, Resolved};
use sluice_kernels::Device;

/// The first mismatch between `base` and `other`, named.
fn first(base: &Record, other: &Record, a: &str, b: &str) -> Option<String> {
    let ms = compare::compare(&base.entries, &other.entries);
    let m = ms.first()?;
    let what = match m {
        Mismatch::Digest { entry, .. } => format!("{} has other bits", entry.describe()),
        Mismatch::OnlyInFirst(e) => format!("{} only with {a}", e.describe()),
        Mismatch::OnlyInSecond(e) => format!("{} only with {b}", e.describe()),
    };
    Some(format!(
        "{b} vs {a}: {what} ({} differing tensor{} in all, of {})",
        ms.len(),
        if ms.len() == 1 { "" } else { "s" },
        compare::ops_of(&ms).join(", ")
    ))
}

/// Records of `sel` under each environment; the first that differs from the first, named.
fn across(sel: &Resolved, runs: &[(String, Env)]) -> Result<(usize, Option<String>), DetError> {
    let mut records = Vec::new();
    for (label, env) in runs {
        records.push(procs::spawn_record(sel, env, None, label)?);
    }
    for (i, r) in records.iter().enumerate().skip(1) {
        if let Some(m) = first(&records[0], r, &runs[0].0, &runs[i].0) {
            return Ok((records[0].entries.len(), Some(m)));
        }
    }
    Ok((records[0].entries.len(), None))
}

/// The thread counts of the thread probe: 1, 2 and every core, each once.
pub fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut v = vec![1, 2, cores];
    v.sort_unstable();
    v.dedup();
    v
}

/// Every selected workload in separate processes with 1, 2 and all cores' threads (the CPU
/// references' pool and the emulator's block workers).
pub fn thread_count(sel: &Resolved) -> Result<Verdict, DetError> {
    let runs: Vec<(String, Env)> = thread_counts()
        .into_iter()
        .map(|t| {
            let label = format!("{t} thread{}", if t == 1 { "" } else { "s" });
            (label, procs::threads_env(t))
        })
        .collect();
    let (n, found) = across(sel, &runs)?;
    Ok(match found {
        Some(m) => Verdict::fail(m),
        None => Verdict::pass(format!(
            "{n} tensors, the same bits with {} threads (separate processes)",
            thread_counts()
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    })
}

/// emu only: every selected workload in separate processes under schedule seeds 1, 2 and 3.
pub fn schedule_seed(sel: &Resolved) -> Result<Verdict, DetError> {
    if sel.device != Device::Emu {
        return Ok(Verdict::skipped(format!(
            "{} has no schedule seed (the emulator's thread, warp and block shuffle)",
            sel.device
        )));
    }
    let runs: Vec<(String, Env)> = [1u64, 2, 3]
        .iter()
        .map(|s| {
            (
                format!("seed {s}"),
                vec![("SLUICE_EMU_SEED", s.to_string())],
            )
        })
        .collect();
    let (n, found) = across(sel, &runs)?;
    Ok(match found {
        Some(m) => Verdict::fail(m),
        None => Verdict::pass(format!(
            "{n} tensors, the same bits under schedule seeds 1, 2 and 3 (separate processes)"
        )),
    })
}
