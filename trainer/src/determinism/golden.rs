//! Golden digests, per numerics class: `DIR/<class key>/<preset>.json`, committed under
//! tests/golden/. `sluice determinism check --golden DIR` first requires run-to-run identity
//! (separate processes), then compares with the golden of this machine's class:
//!
//! - no golden for the class: it says so, names the classes that have one, and passes on
//!   run-to-run identity alone (another CPU, libm or compiler may rightly give other bits);
//! - an entry whose bits changed, an op of the run missing from the golden, or an op of the
//!   golden the run no longer produces: it fails, naming the ops and how to bless them;
//! - `--bless --reason "..."`: rewrites the golden with this run's digests and appends the
//!   reason, the commit, the date and the ops that changed to the golden's history.

use super::class::Class;
use super::compare::{self, Mismatch};
use super::procs::Env;
use super::record::{self, Entry, Record};
use super::{DetError, Resolved};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One rewrite of a golden.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Blessing {
    /// UTC date, YYYY-MM-DD.
    pub date: String,
    pub commit: String,
    pub reason: String,
    /// Ops whose bits changed, were added, or are no longer produced.
    pub changed: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

/// A golden file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Golden {
    pub format: String,
    pub kind: String,
    pub version: u64,
    pub digest_version: u64,
    pub class: Class,
    pub preset: String,
    pub device: String,
    pub entries: Vec<Entry>,
    pub history: Vec<Blessing>,
}

impl record::WithEntries for Golden {
    fn entries(&self) -> &[Entry] {
        &self.entries
    }
    fn without_entries(&self) -> Self {
        Golden {
            entries: Vec::new(),
            ..self.clone()
        }
    }
}

/// Where the golden of `class` and `preset` lives under `dir`.
pub fn path_of(dir: &Path, class: &Class, preset: &str) -> PathBuf {
    dir.join(&class.key).join(format!("{preset}.json"))
}

/// Reads and validates a golden file (bad input, exit 2, when it is not one of this version).
pub fn read(path: &Path) -> Result<Golden, DetError> {
    let g: Golden = record::read_file(path, "golden")?;
    record::validate_entries(&g.entries)
        .map_err(|m| DetError::Input(format!("{}: {m}", path.display())))?;
    Ok(g)
}

/// The class folders under `dir` that hold a golden of `preset`.
fn classes_with_goldens(dir: &Path, preset: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().join(format!("{preset}.json")).is_file())
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Days since 1970-01-01 as a civil date (H. Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (y, m, d) = civil(secs.div_euclid(86_400));
    format!("{y:04}-{m:02}-{d:02}")
}

/// The golden's entries of the ops `record` covers (all of them when it ran every workload).
fn in_scope<'a>(golden: &'a Golden, record: &Record) -> Vec<&'a Entry> {
    golden
        .entries
        .iter()
        .filter(|e| record.ops.is_empty() || record.ops.iter().any(|o| o == &e.op))
        .collect()
}

/// The command that blesses this selection.
fn bless_command(sel: &Resolved, dir: &Path) -> String {
    let mut c = format!(
        "sluice determinism check --golden {} --device {} --preset {}",
        dir.display(),
        sel.device,
        sel.preset
    );
    if !sel.ops.is_empty() {
        c.push_str(&format!(" --ops {}", sel.ops.join(",")));
    }
    c.push_str(" --bless --reason \"why the bits changed\"");
    c
}

/// Compares `record` (already identical across runs) with the golden at `path`; Ok(list of
/// mismatches) or bad input when the golden is for another class or preset.
pub fn compare_with(
    golden: &Golden,
    record: &Record,
    path: &Path,
) -> Result<Vec<Mismatch>, DetError> {
    if golden.class.key != record.class.key {
        return Err(DetError::Input(format!(
            "{}: this golden is for numerics class {}, not this machine's {}",
            path.display(),
            golden.class.key,
            record.class.key
        )));
    }
    if golden.preset != record.preset {
        return Err(DetError::Input(format!(
            "{}: this golden is for preset {}, not {}",
            path.display(),
            golden.preset,
            record.preset
        )));
    }
    let scope: Vec<Entry> = in_scope(golden, record).into_iter().cloned().collect();
    Ok(compare::compare(&scope, &record.entries))
}

/// The ops of mismatches by kind: (changed, added: only in the run, removed: only in the
/// golden).
fn classify(ms: &[Mismatch]) -> (Vec<String>, Vec<String>, Vec<String>) {
    let pick = |f: &dyn Fn(&Mismatch) -> bool| {
        let sel: Vec<Mismatch> = ms.iter().filter(|m| f(m)).cloned().collect();
        compare::ops_of(&sel)
    };
    (
        pick(&|m| matches!(m, Mismatch::Digest { .. })),
        pick(&|m| matches!(m, Mismatch::OnlyInSecond(_))),
        pick(&|m| matches!(m, Mismatch::OnlyInFirst(_))),
    )
}

/// `sluice determinism check --golden DIR [--bless --reason R]`.
pub fn check_command(
    sel: &Resolved,
    dir: &Path,
    runs: usize,
    bless: Option<&str>,
    out: &mut dyn Write,
) -> Result<(), DetError> {
    if runs < 1 {
        return Err(DetError::Input("--runs must be at least 1".to_string()));
    }
    super::procs::check_device(sel.device)?;
    let _ = writeln!(
        out,
        "determinism check: {runs} processes on {} (preset {}) against {}",
        sel.device,
        sel.preset,
        dir.display()
    );
    let (records, _) = compare::collect_runs(sel, runs, &Env::new(), &|_| None, out)?;
    let record = &records[0];
    for (i, r) in records.iter().enumerate().skip(1) {
        let ms = compare::compare(&record.entries, &r.entries);
        if !ms.is_empty() {
            compare::report(&ms, "run 1", &format!("run {}", i + 1), None, out);
            return Err(DetError::Failed(format!(
                "not deterministic: {} differ between runs (no golden can hold them; `sluice \
                 determinism run --dump DIR` shows the elements)",
                compare::ops_of(&ms).join(", ")
            )));
        }
    }
    let path = path_of(dir, &record.class, &record.preset);
    let _ = writeln!(out, "numerics class: {}", record.class.key);
    if !path.exists() {
        if let Some(reason) = bless {
            let ops = compare::ops_of(
                &record
                    .entries
                    .iter()
                    .cloned()
                    .map(Mismatch::OnlyInSecond)
                    .collect::<Vec<_>>(),
            );
            let g = Golden {
                format: record::FORMAT.to_string(),
                kind: "golden".to_string(),
                version: record::VERSION,
                digest_version: record::DIGEST_VERSION,
                class: record.class.clone(),
                preset: record.preset.clone(),
                device: record.device.clone(),
                entries: record.entries.clone(),
                history: vec![Blessing {
                    date: today(),
                    commit: record.commit.clone(),
                    reason: reason.to_string(),
                    changed: Vec::new(),
                    added: ops,
                    removed: Vec::new(),
                }],
            };
            record::write_entries_json(&path, &g)?;
            let _ = writeln!(
                out,
                "blessed: wrote {} ({} tensors, a new class)",
                path.display(),
                g.entries.len()
            );
            return Ok(());
        }
        let others = classes_with_goldens(dir, &record.preset);
        let _ = writeln!(
            out,
            "no golden for numerics class {} (preset {}) in {}; goldens exist for: {}. Checked \
             run-to-run identity only: {} tensors, the same bits in {runs} processes.",
            record.class.key,
            record.preset,
            dir.display(),
            if others.is_empty() {
                "none".to_string()
            } else {
                others.join(", ")
            },
            record.entries.len()
        );
        return Ok(());
    }
    let mut golden = read(&path)?;
    let ms = compare_with(&golden, record, &path)?;
    let (changed, added, removed) = classify(&ms);
    if let Some(reason) = bless {
        if ms.is_empty() {
            let _ = writeln!(
                out,
                "nothing to bless: {} tensors match {} already",
                record.entries.len(),
                path.display()
            );
            return Ok(());
        }
        // Keep the golden's entries of ops this run did not cover; take the run's for the rest.
        let mut entries: Vec<Entry> = golden
            .entries
            .iter()
            .filter(|e| !(record.ops.is_empty() || record.ops.iter().any(|o| o == &e.op)))
            .cloned()
            .collect();
        entries.extend(record.entries.iter().cloned());
        golden.entries = entries;
        golden.class = record.class.clone();
        golden.history.push(Blessing {
            date: today(),
            commit: record.commit.clone(),
            reason: reason.to_string(),
            changed: changed.clone(),
            added: added.clone(),
            removed: removed.clone(),
        });
        record::write_entries_json(&path, &golden)?;
        let _ = writeln!(
            out,
            "blessed: rewrote {} (changed: {}; added: {}; removed: {})",
            path.display(),
            list(&changed),
            list(&added),
            list(&removed)
        );
        return Ok(());
    }
    if ms.is_empty() {
        let last = golden.history.last();
        let _ = writeln!(
            out,
            "ok: {} tensors match {}{}",
            record.entries.len(),
            path.display(),
            last.map(|b| format!(" (blessed {} at {}: {})", b.date, b.commit, b.reason))
                .unwrap_or_default()
        );
        return Ok(());
    }
    compare::report(&ms, "the golden", "this run", None, out);
    let mut what = Vec::new();
    if !changed.is_empty() {
        what.push(format!("the bits of {} changed", changed.join(", ")));
    }
    if !added.is_empty() {
        what.push(format!("{} not in the golden", added.join(", ")));
    }
    if !removed.is_empty() {
        what.push(format!(
            "{} in the golden but not produced",
            removed.join(", ")
        ));
    }
    Err(DetError::Failed(format!(
        "golden check failed against {}: {}. If intended, bless it: {}",
        path.display(),
        what.join("; "),
        bless_command(sel, dir)
    )))
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(19_723), (2024, 1, 1));
        assert_eq!(civil(20_423), (2025, 12, 1));
        assert_eq!(today().len(), 10);
    }
}
