//! Records against each other, and `sluice determinism run`.
//!
//! Two records agree when they hold the same entries with the same digests. Where a digest
//! differs and both runs were dumped (`--dump`), the first differing element is found in the
//! dumps and shown with both values (and their bits).

use super::procs::{self, Env};
use super::record::{self, Entry, Record};
use super::{DetError, Resolved};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How two records differ in one entry.
#[derive(Clone, Debug, PartialEq)]
pub enum Mismatch {
    /// Same entry, other bits (the entry as in the first record, the other digest).
    Digest { entry: Entry, other: Entry },
    /// Only in the first record.
    OnlyInFirst(Entry),
    /// Only in the second record.
    OnlyInSecond(Entry),
}

impl Mismatch {
    pub fn op(&self) -> &str {
        match self {
            Mismatch::Digest { entry, .. }
            | Mismatch::OnlyInFirst(entry)
            | Mismatch::OnlyInSecond(entry) => &entry.op,
        }
    }
}

/// Every entry in which `a` and `b` differ, in `a`'s order (then `b`'s extras).
pub fn compare(a: &[Entry], b: &[Entry]) -> Vec<Mismatch> {
    let bk: BTreeMap<String, &Entry> = b.iter().map(|e| (e.key(), e)).collect();
    let ak: BTreeSet<String> = a.iter().map(Entry::key).collect();
    let mut out = Vec::new();
    for e in a {
        match bk.get(&e.key()) {
            Some(o) if o.digest == e.digest && o.shape == e.shape && o.dtype == e.dtype => {}
            Some(o) => out.push(Mismatch::Digest {
                entry: e.clone(),
                other: (*o).clone(),
            }),
            None => out.push(Mismatch::OnlyInFirst(e.clone())),
        }
    }
    for e in b {
        if !ak.contains(&e.key()) {
            out.push(Mismatch::OnlyInSecond(e.clone()));
        }
    }
    out
}

/// The ops of some mismatches, each once, in order.
pub fn ops_of(ms: &[Mismatch]) -> Vec<String> {
    let mut seen = Vec::new();
    for m in ms {
        if !seen.iter().any(|s: &String| s == m.op()) {
            seen.push(m.op().to_string());
        }
    }
    seen
}

/// The first element in which two tensors' bytes differ: its index (flat and per dimension)
/// and both values, rendered.
pub fn first_difference(
    dtype: &str,
    shape: &[usize],
    a: &[u8],
    b: &[u8],
) -> Option<(usize, Vec<usize>, String, String)> {
    let size = match dtype {
        "F32" | "I32" => 4,
        "BF16" => 2,
        "U8" => 1,
        "U64" => 8,
        _ => return None,
    };
    let i = a
        .chunks(size)
        .zip(b.chunks(size))
        .position(|(x, y)| x != y)?;
    let mut index = vec![0; shape.len()];
    let mut rest = i;
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            index[d] = rest % n;
            rest /= n;
        }
    }
    let show = |bytes: &[u8]| -> String {
        let e = &bytes[i * size..(i + 1) * size];
        match dtype {
            "F32" => {
                let bits = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                format!("{:e} (0x{bits:08x})", f32::from_bits(bits))
            }
            "BF16" => {
                let bits = u16::from_le_bytes([e[0], e[1]]);
                format!("{:e} (0x{bits:04x})", f32::from_bits((bits as u32) << 16))
            }
            "I32" => i32::from_le_bytes([e[0], e[1], e[2], e[3]]).to_string(),
            "U8" => e[0].to_string(),
            _ => {
                let v = u64::from_le_bytes(e.try_into().unwrap_or([0; 8]));
                format!("{v} (as f64 bits: {:e})", f64::from_bits(v))
            }
        }
    };
    Some((i, index, show(a), show(b)))
}

/// The bytes of the tensor named `key` in a dump.
fn dumped(path: &Path, key: &str) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let t = st
        .tensor(key)
        .map_err(|_| format!("{}: no tensor `{key}`", path.display()))?;
    Ok(t.data().to_vec())
}

/// Writes one line per mismatch between run `a_label` and `b_label`; with the two runs' dumps,
/// the first differing element and both values under each differing digest.
pub fn report(
    ms: &[Mismatch],
    a_label: &str,
    b_label: &str,
    dumps: Option<(&Path, &Path)>,
    out: &mut dyn Write,
) {
    for m in ms {
        let line = match m {
            Mismatch::Digest { entry, other } => {
                let mut line = format!(
                    "DIFFERS {}: {b_label} has other bits than {a_label} (digest {}.. vs {}..)",
                    entry.describe(),
                    &entry.digest[..12],
                    &other.digest[..12]
                );
                if entry.shape != other.shape || entry.dtype != other.dtype {
                    line.push_str(&format!(
                        "; in {b_label} it is {:?} {}",
                        other.shape, other.dtype
                    ));
                } else {
                    line.push_str(&element_line(entry, a_label, b_label, dumps));
                }
                line
            }
            Mismatch::OnlyInFirst(e) => format!("MISSING {}: only in {a_label}", e.describe()),
            Mismatch::OnlyInSecond(e) => format!("MISSING {}: only in {b_label}", e.describe()),
        };
        let _ = writeln!(out, "{line}");
    }
}

/// `\n  first difference at ...` from the dumps, or a hint to use `--dump`.
fn element_line(
    entry: &Entry,
    a_label: &str,
    b_label: &str,
    dumps: Option<(&Path, &Path)>,
) -> String {
    let Some((da, db)) = dumps else {
        return String::new();
    };
    let key = entry.key();
    match (dumped(da, &key), dumped(db, &key)) {
        (Ok(a), Ok(b)) => match first_difference(&entry.dtype, &entry.shape, &a, &b) {
            Some((flat, index, va, vb)) => format!(
                "\n  first difference at {index:?} (element {flat}): {a_label} {va}, {b_label} {vb}"
            ),
            None => {
                "\n  (the dumps hold the same bytes: the digests were computed from other data)"
                    .to_string()
            }
        },
        (Err(e), _) | (_, Err(e)) => format!("\n  (no element shown: {e})"),
    }
}

/// `sluice determinism run`: `runs` separate processes, each digesting every selected
/// workload; exit 1 (Err Failed) when any differs from the first, naming op and tensor.
pub fn run_command(
    sel: &Resolved,
    runs: usize,
    json: Option<&Path>,
    dump: Option<&Path>,
    out: &mut dyn Write,
) -> Result<(), DetError> {
    if runs < 2 {
        return Err(DetError::Input(format!(
            "--runs {runs}: at least 2 runs are needed to compare"
        )));
    }
    procs::check_device(sel.device)?;
    let dump_path = |i: usize| dump.map(|d| d.join(format!("run-{i}.safetensors")));
    let _ = writeln!(
        out,
        "determinism run: {runs} processes on {} (preset {}{})",
        sel.device,
        sel.preset,
        if sel.ops.is_empty() {
            String::new()
        } else {
            format!(", ops {}", sel.ops.join(","))
        }
    );
    let start = Instant::now();
    let (records, _) = collect_runs(sel, runs, &Env::new(), &dump_path, out)?;
    let first = &records[0];
    let mut failed: Vec<String> = Vec::new();
    let mut keep_dumps = BTreeSet::new();
    for (i, r) in records.iter().enumerate().skip(1) {
        let ms = compare(&first.entries, &r.entries);
        if ms.is_empty() {
            continue;
        }
        keep_dumps.insert(1);
        keep_dumps.insert(i + 1);
        let (pa, pb) = (dump_path(1), dump_path(i + 1));
        let dumps = pa.as_deref().zip(pb.as_deref());
        report(&ms, "run 1", &format!("run {}", i + 1), dumps, out);
        for op in ops_of(&ms) {
            if !failed.contains(&op) {
                failed.push(op);
            }
        }
    }
    // Dumps of runs that matched run 1 add nothing; keep those that show a difference.
    for i in 1..=runs {
        if let Some(p) = dump_path(i) {
            if keep_dumps.contains(&i) {
                let _ = writeln!(out, "dump kept: {}", p.display());
            } else {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    let mut summary = first.clone();
    summary.runs = if failed.is_empty() { runs } else { 1 };
    if let Some(path) = json {
        record::write_entries_json(path, &summary)?;
    }
    print_table(first, out);
    let total = start.elapsed().as_secs_f64();
    if failed.is_empty() {
        let _ = writeln!(
            out,
            "identical: {} tensors of {} workloads, the same bits in {runs} processes ({total:.1} s)",
            first.entries.len(),
            first.seconds.len()
        );
        Ok(())
    } else {
        let hint = if dump.is_none() {
            " (--dump DIR shows the first differing element and both values)"
        } else {
            ""
        };
        Err(DetError::Failed(format!(
            "not deterministic: {} differ between runs{hint}",
            failed.join(", ")
        )))
    }
}

/// Runs `runs` record processes one after another, with `env`; returns their records and
/// each process's wall time. A progress line per run goes to `out`.
pub fn collect_runs(
    sel: &Resolved,
    runs: usize,
    env: &Env,
    dump_path: &dyn Fn(usize) -> Option<PathBuf>,
    out: &mut dyn Write,
) -> Result<(Vec<Record>, Vec<f64>), DetError> {
    let mut records = Vec::with_capacity(runs);
    let mut times = Vec::with_capacity(runs);
    for i in 1..=runs {
        let t = Instant::now();
        let label = format!("run {i}");
        let r = procs::spawn_record(sel, env, dump_path(i).as_deref(), &label)?;
        let secs = t.elapsed().as_secs_f64();
        let _ = writeln!(
            out,
            "  {label}: {} tensors in {secs:.1} s ({} threads)",
            r.entries.len(),
            r.threads
        );
        times.push(secs);
        records.push(r);
    }
    Ok((records, times))
}

/// One line per workload: tensors and seconds (in the first run).
fn print_table(r: &Record, out: &mut dyn Write) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &r.entries {
        *counts.entry(e.op.as_str()).or_default() += 1;
    }
    let _ = writeln!(
        out,
        "  {:<20} {:>8} {:>9}",
        "workload", "tensors", "seconds"
    );
    // In run order (the record keeps them by name).
    for op in super::workloads::names() {
        if let Some(secs) = r.seconds.get(op) {
            let _ = writeln!(
                out,
                "  {op:<20} {:>8} {secs:>9.2}",
                counts.get(op).copied().unwrap_or(0)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(op: &str, tensor: &str, digest: char) -> Entry {
        Entry {
            op: op.into(),
            case: "c".into(),
            tensor: tensor.into(),
            shape: vec![2, 2],
            dtype: "F32".into(),
            digest: digest.to_string().repeat(64),
        }
    }

    #[test]
    fn mismatches_name_op_and_tensor() {
        let a = vec![entry("gemm", "c", 'a'), entry("topk", "values", 'b')];
        let b = vec![entry("gemm", "c", 'c'), entry("softmax", "y", 'd')];
        let ms = compare(&a, &b);
        assert_eq!(ms.len(), 3);
        assert_eq!(ops_of(&ms), vec!["gemm", "topk", "softmax"]);
        let mut text = Vec::new();
        report(&ms, "run 1", "run 2", None, &mut text);
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains("DIFFERS gemm [c] c [2, 2] F32: run 2 has other bits"),
            "{text}"
        );
        assert!(text.contains("MISSING topk [c] values"), "{text}");
        assert!(compare(&a, &a).is_empty());
    }

    #[test]
    fn first_difference_shows_index_and_bits() {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut b = a.clone();
        b[8] ^= 1;
        let (flat, index, va, vb) = first_difference("F32", &[2, 2], &a, &b).unwrap();
        assert_eq!((flat, index), (2, vec![1, 0]));
        assert_eq!(va, "3e0 (0x40400000)");
        assert_eq!(vb, "3.0000002e0 (0x40400001)");
        assert!(first_difference("F32", &[2, 2], &a, &a).is_none());
    }
}
