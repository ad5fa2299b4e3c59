//! Bench rows: one JSON object per finished case, appended to a JSONL file and flushed the
//! moment the case finishes, so a run cut short (a timeout, a crash, a machine taken back)
//! keeps every row it finished. The report is built from that file alone.

use super::{fmt_time, H200_BF16_FLOPS, H200_COPY_BANDWIDTH};
use super::{H200_NOMINAL_BANDWIDTH, H200_NOMINAL_BF16_FLOPS};
use crate::error::{Error, Result};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One finished case (or one that failed, with `error` set and no timing).
#[derive(Clone, Debug)]
pub struct Row(pub Value);

impl Row {
    fn str(&self, k: &str) -> &str {
        self.0[k].as_str().unwrap_or("")
    }
    fn num(&self, k: &str) -> Option<f64> {
        self.0[k].as_f64()
    }
    pub fn op(&self) -> &str {
        self.str("op")
    }
    pub fn pass(&self) -> &str {
        self.str("pass")
    }
    pub fn check(&self) -> &str {
        self.str("check")
    }
    pub fn median_s(&self) -> Option<f64> {
        self.num("median_s").filter(|&t| t > 0.0)
    }
}

/// Appends rows to a JSONL file, one line each, flushed and synced per row.
pub struct RowWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl RowWriter {
    /// Creates (truncates) the file.
    pub fn create(path: &Path) -> Result<RowWriter> {
        let file = std::fs::File::create(path).map_err(|e| io_err(path, e))?;
        Ok(RowWriter {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes one row as one line and forces it to disk before returning: whatever happens to
    /// the process next, the row is in the file.
    pub fn write(&mut self, row: &Row) -> Result<()> {
        let mut line = serde_json::to_string(&row.0)
            .map_err(|e| Error::Invalid(format!("internal: a bench row is not JSON: {e}")))?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.sync_data())
            .map_err(|e| io_err(&self.path, e))
    }
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Reads the rows of a JSONL file. A last line without its newline (the process was killed
/// while writing it) is dropped; any other line that is not a JSON object is an error naming
/// its line number.
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    let mut rows = Vec::new();
    for (i, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| {
            Error::Invalid(format!(
                "{}: line {} is not a bench row ({e})",
                path.display(),
                i + 1
            ))
        })?;
        if !v.is_object() || v["op"].as_str().is_none() {
            return Err(Error::Invalid(format!(
                "{}: line {} is not a bench row (no \"op\")",
                path.display(),
                i + 1
            )));
        }
        rows.push(Row(v));
    }
    Ok(rows)
}

/// Which correctness tests passed on the GPU in this run: lines `ok BINARY::TEST@MODE` or
/// `FAILED BINARY::TEST@MODE` (MODE `default` or `wgmma`), written by .gpu/run.sh from the
/// test phase's libtest output with SLUICE_REQUIRE_CUDA=1 (so a test cannot pass by skipping).
#[derive(Clone, Debug, Default)]
pub struct Verification {
    results: Vec<(bool, String, String, String)>,
}

/// A row's standing against the tests of the same run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Verified,
    /// Its test failed in this run.
    Failed,
    /// Its test did not run (or only skipped) in this run.
    Unverified,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Verified => "verified",
            Verdict::Failed => "TEST FAILED",
            Verdict::Unverified => "UNVERIFIED",
        }
    }
}

impl Verification {
    /// Parses the file's text; a malformed line is an error naming it.
    pub fn parse(text: &str) -> Result<Verification> {
        let mut results = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let bad = || {
                Error::Invalid(format!(
                    "verification line {}: `{line}` is not `ok|FAILED BINARY::TEST@MODE`",
                    i + 1
                ))
            };
            let (status, rest) = line.split_once(' ').ok_or_else(bad)?;
            let ok = match status {
                "ok" => true,
                "FAILED" => false,
                _ => return Err(bad()),
            };
            let (test, mode) = rest.rsplit_once('@').ok_or_else(bad)?;
            let (binary, name) = test.split_once("::").ok_or_else(bad)?;
            results.push((ok, binary.to_string(), name.to_string(), mode.to_string()));
        }
        Ok(Verification { results })
    }

    /// The verdict for a case's `check` (`BINARY::FRAGMENT` or `BINARY::FRAGMENT@MODE`).
    pub fn verdict(&self, check: &str) -> Verdict {
        let (test, mode) = check.rsplit_once('@').unwrap_or((check, "default"));
        let Some((binary, fragment)) = test.split_once("::") else {
            return Verdict::Unverified;
        };
        let matching = self
            .results
            .iter()
            .filter(|(_, b, n, m)| b == binary && m == mode && n.contains(fragment));
        let mut any = false;
        for (ok, ..) in matching {
            if !ok {
                return Verdict::Failed;
            }
            any = true;
        }
        if any {
            Verdict::Verified
        } else {
            Verdict::Unverified
        }
    }
}

/// The ceilings measured in this run (from its `ceiling` rows), where present.
struct Ceilings {
    copy_bw: Option<f64>,
    gemm_flops: Option<f64>,
}

fn measured_ceilings(rows: &[Row]) -> Ceilings {
    let rate = |op: &str, per: fn(&Row) -> f64| {
        rows.iter()
            .filter(|r| r.pass() == "ceiling" && r.op() == op)
            .filter_map(|r| r.median_s().map(|t| per(r) / t))
            .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))))
    };
    Ceilings {
        copy_bw: rate("d2d_copy", |r| r.num("bytes").unwrap_or(0.0)),
        gemm_flops: rate("cublas_gemm_bf16", |r| r.num("flops").unwrap_or(0.0)),
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", 100.0 * x)
}

/// The markdown report of a run's rows. `verification` None: the rows come from a device
/// whose timings are not GPU timings, or no test phase ran; every cuda row is then UNVERIFIED.
pub fn markdown_report(title: &str, rows: &[Row], verification: Option<&Verification>) -> String {
    let c = measured_ceilings(rows);
    let mut out = format!("# {title}\n\n");
    let on_gpu = rows.iter().any(|r| r.str("clock") == "cuda-events");
    out.push_str(&format!(
        "{} rows. Clock: {}. Fractions: of the H200 roofline with nominal peaks ({} TB/s, {} TFLOP/s bf16), \
         and of the ceilings measured in this run (copy {}, cuBLAS bf16 GEMM {}).\n\n",
        rows.len(),
        if on_gpu {
            "CUDA events around the launches only"
        } else {
            "wall clock (not a GPU: the fractions are not meaningful and are left out)"
        },
        H200_NOMINAL_BANDWIDTH / 1e12,
        H200_NOMINAL_BF16_FLOPS / 1e12,
        c.copy_bw.map_or("not measured".into(), |b| format!("{:.0} GB/s", b / 1e9)),
        c.gemm_flops.map_or("not measured".into(), |f| format!("{:.0} TFLOP/s", f / 1e12)),
    ));
    out.push_str(
        "| op | pass | path | shape | clock | median | min .. max | n x batch | GB/s | TFLOP/s | of nominal roofline | of measured ceilings | launches / syncs per run | allocs in timed loop | status |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let status = if let Some(e) = r.0["error"].as_str() {
            format!("ERROR: {e}")
        } else if let Some(why) = r.0["skipped"].as_str() {
            format!("SKIPPED: {why}")
        } else if r.str("clock") != "cuda-events" {
            "not a GPU timing".to_string()
        } else if r.pass() == "ceiling" {
            "ceiling".to_string()
        } else {
            verification
                .map_or(Verdict::Unverified, |v| v.verdict(r.check()))
                .name()
                .to_string()
        };
        let Some(t) = r.median_s() else {
            out.push_str(&format!(
                "| {} | {} | {} | {} | - | - | - | - | - | - | - | - | - | - | {} |\n",
                r.op(),
                r.pass(),
                r.str("path"),
                r.str("shape"),
                status
            ));
            continue;
        };
        let bytes = r.num("bytes").unwrap_or(0.0);
        let flops = r.num("flops").unwrap_or(0.0);
        let nominal = (bytes / H200_NOMINAL_BANDWIDTH).max(flops / H200_NOMINAL_BF16_FLOPS);
        let measured = (bytes / c.copy_bw.unwrap_or(H200_COPY_BANDWIDTH))
            .max(flops / c.gemm_flops.unwrap_or(H200_BF16_FLOPS));
        let (of_nominal, of_measured) = if on_gpu && r.pass() != "ceiling" {
            let m = if c.copy_bw.is_some() || c.gemm_flops.is_some() {
                pct(measured / t)
            } else {
                "no ceiling rows".into()
            };
            (pct(nominal / t), m)
        } else {
            ("-".into(), "-".into())
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} .. {} | {} x {} | {:.1} | {:.3} | {} | {} | {} / {} | {} | {} |\n",
            r.op(),
            r.pass(),
            r.str("path"),
            r.str("shape"),
            r.str("clock"),
            fmt_time(t),
            fmt_time(r.num("min_s").unwrap_or(0.0)),
            fmt_time(r.num("max_s").unwrap_or(0.0)),
            r.0["samples"],
            r.0["batch"],
            bytes / t / 1e9,
            flops / t / 1e12,
            of_nominal,
            of_measured,
            r.0["launches_per_run"],
            r.0["host_syncs_per_run"],
            r.0["timed_allocs"],
            status
        ));
    }
    let telemetry: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            r.0["telemetry"].as_object().map(|t| {
                format!(
                    "- {} {}: {}",
                    r.op(),
                    r.str("shape"),
                    Value::Object(t.clone())
                )
            })
        })
        .collect();
    if !telemetry.is_empty() {
        out.push_str("\nTelemetry (NVML, sampled during each row):\n\n");
        out.push_str(&telemetry.join("\n"));
        out.push('\n');
    } else if let Some(why) = rows
        .iter()
        .find_map(|r| r.0["telemetry_unavailable"].as_str())
    {
        out.push_str(&format!("\nTelemetry: {why}\n"));
    }
    out
}

/// A row for a case that failed to run: the error in place of the timing.
pub fn error_row(base: Value, error: &str) -> Row {
    let mut v = base;
    v["error"] = json!(error);
    Row(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_last_line_is_dropped_and_a_bad_line_is_named() {
        let dir = std::env::temp_dir().join(format!("sluice-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("rows.jsonl");
        std::fs::write(&p, "{\"op\":\"gemm\"}\n{\"op\":\"top").unwrap();
        assert_eq!(read_rows(&p).unwrap().len(), 1);
        std::fs::write(&p, "{\"op\":\"gemm\"}\nnot json\n").unwrap();
        let e = read_rows(&p).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn verdicts_follow_the_tests_of_the_run() {
        let v = Verification::parse(
            "ok gemm::cuda_matches_reference@default\n\
             FAILED gemm::cuda_matches_reference@wgmma\n\
             ok topk::cuda_matches_reference@default\n",
        )
        .unwrap();
        assert_eq!(v.verdict("gemm::cuda_matches"), Verdict::Verified);
        assert_eq!(v.verdict("gemm::cuda_matches@wgmma"), Verdict::Failed);
        assert_eq!(v.verdict("moe::cuda_matches"), Verdict::Unverified);
        assert!(Verification::parse("maybe gemm::x@default").is_err());
    }
}
