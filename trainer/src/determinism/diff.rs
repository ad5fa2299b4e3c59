//! `sluice determinism diff A.json B.json`: two records (from `run --json`, on any machines
//! and commits) side by side: every entry whose digest differs (op, tensor, shape, dtype) or
//! that only one holds, and what else differs between the records (machine, numerics class,
//! commit, device, preset, thread count, schedule seed). Exit 0 only when the digests agree.

use super::compare::{self, Mismatch};
use super::record::{read_record, Record};
use super::DetError;
use std::io::Write;
use std::path::Path;

/// The record-level differences, as `field: a vs b`.
pub fn context_differences(a: &Record, b: &Record) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmp = |name: &str, x: String, y: String| {
        if x != y {
            out.push(format!("{name}: {x} vs {y}"));
        }
    };
    cmp("commit", a.commit.clone(), b.commit.clone());
    cmp("device", a.device.clone(), b.device.clone());
    cmp("preset", a.preset.clone(), b.preset.clone());
    cmp("threads", a.threads.to_string(), b.threads.to_string());
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".to_string());
    cmp("emu threads", opt(&a.emu_threads), opt(&b.emu_threads));
    let seed = |s: Option<u64>| s.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    cmp("emu schedule seed", seed(a.emu_seed), seed(b.emu_seed));
    cmp("ops selected", a.ops.join(","), b.ops.join(","));
    cmp("agreeing runs", a.runs.to_string(), b.runs.to_string());
    cmp(
        "machine",
        a.machine.hostname.clone(),
        b.machine.hostname.clone(),
    );
    cmp(
        "cpu",
        a.machine.cpu_model.clone(),
        b.machine.cpu_model.clone(),
    );
    cmp(
        "cores",
        a.machine.cores.to_string(),
        b.machine.cores.to_string(),
    );
    cmp("os", a.machine.os.clone(), b.machine.os.clone());
    cmp("numerics class", a.class.key.clone(), b.class.key.clone());
    out.extend(
        a.class
            .differences(&b.class)
            .into_iter()
            .map(|d| format!("  {d}")),
    );
    out
}

pub fn diff_command(a_path: &Path, b_path: &Path, out: &mut dyn Write) -> Result<(), DetError> {
    let a = read_record(a_path)?;
    let b = read_record(b_path)?;
    let (la, lb) = (a_path.display().to_string(), b_path.display().to_string());
    let _ = writeln!(
        out,
        "A = {la}: {} on {}, commit {}, class {}",
        a.device, a.machine.hostname, a.commit, a.class.key
    );
    let _ = writeln!(
        out,
        "B = {lb}: {} on {}, commit {}, class {}",
        b.device, b.machine.hostname, b.commit, b.class.key
    );
    let context = context_differences(&a, &b);
    if context.is_empty() {
        let _ = writeln!(
            out,
            "the records differ in nothing but their digests (if at all)"
        );
    } else {
        let _ = writeln!(out, "what else differs:");
        for c in &context {
            let _ = writeln!(out, "  {c}");
        }
    }
    let ms = compare::compare(&a.entries, &b.entries);
    if ms.is_empty() {
        let _ = writeln!(
            out,
            "digests agree: {} tensors of {} workloads",
            a.entries.len(),
            a.seconds.len()
        );
        return Ok(());
    }
    let _ = writeln!(out, "digests that differ:");
    for m in &ms {
        let _ = match m {
            Mismatch::Digest { entry, other } => {
                let shape = if entry.shape != other.shape || entry.dtype != other.dtype {
                    format!(
                        " (shape {:?} {} in A, {:?} {} in B)",
                        entry.shape, entry.dtype, other.shape, other.dtype
                    )
                } else {
                    String::new()
                };
                writeln!(out, "  {}{shape}", entry.describe())
            }
            Mismatch::OnlyInFirst(e) => writeln!(out, "  {} only in A", e.describe()),
            Mismatch::OnlyInSecond(e) => writeln!(out, "  {} only in B", e.describe()),
        };
    }
    let changed = ms
        .iter()
        .filter(|m| matches!(m, Mismatch::Digest { .. }))
        .count();
    Err(DetError::Failed(format!(
        "{changed} of {} tensors differ, {} in one record only; ops: {}",
        a.entries.len(),
        ms.len() - changed,
        compare::ops_of(&ms).join(", ")
    )))
}
