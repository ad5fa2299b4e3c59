//! `sluice bench`: time ops on a device and set them against the H200 roofline.
//!
//! Each case knows the bytes it must move and the FLOPs it must do (counted from the op's
//! math, not measured), so a timing becomes an achieved bandwidth or FLOP rate and a fraction
//! of what the machine can do at best.

use crate::device::Backend;
use crate::error::Result;
use std::time::Instant;

/// H200 copy bandwidth measured on the target machine (bytes/s).
pub const H200_COPY_BANDWIDTH: f64 = 4.3e12;
/// H200 dense bf16 GEMM throughput measured on the target machine (FLOP/s).
pub const H200_BF16_FLOPS: f64 = 790e12;

/// A prepared run of one op: calling it once runs the op once on the given backend (the one
/// its inputs were prepared on).
pub type BenchRun = Box<dyn FnMut(&Backend) -> Result<()>>;

/// Builds a case's inputs on a backend and returns the run to time.
pub type BenchPrepare = Box<dyn Fn(&Backend) -> Result<BenchRun>>;

/// One benchmark case.
pub struct BenchCase {
    pub op: &'static str,
    /// The shape in words, e.g. `M=N=K=512 f32`.
    pub shape: String,
    /// Bytes the op must read and write at minimum.
    pub bytes: f64,
    /// Floating-point operations the op must do.
    pub flops: f64,
    /// Builds the inputs on a backend and returns the closure to time.
    pub prepare: BenchPrepare,
}

/// The timing of one case.
pub struct BenchResult {
    pub op: &'static str,
    pub shape: String,
    pub median_s: f64,
    pub min_s: f64,
    pub iterations: usize,
    pub bytes: f64,
    pub flops: f64,
}

impl BenchResult {
    pub fn gbps(&self) -> f64 {
        self.bytes / self.median_s / 1e9
    }
    pub fn tflops(&self) -> f64 {
        self.flops / self.median_s / 1e12
    }
    /// The H200 roofline time: the larger of the bandwidth and the compute bound.
    pub fn h200_roofline_s(&self) -> f64 {
        (self.bytes / H200_COPY_BANDWIDTH).max(self.flops / H200_BF16_FLOPS)
    }
}

/// Times a case: one warm-up run, then runs until `budget_s` has passed (at least 3, at most
/// `max_iters`), synchronising the device after each run so the time is the op's.
pub fn time_case(
    case: &BenchCase,
    backend: &Backend,
    budget_s: f64,
    max_iters: usize,
) -> Result<BenchResult> {
    let mut run = (case.prepare)(backend)?;
    run(backend)?;
    backend.synchronize()?;
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < budget_s && times.len() < max_iters) {
        let t0 = Instant::now();
        run(backend)?;
        backend.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(BenchResult {
        op: case.op,
        shape: case.shape.clone(),
        median_s: times[times.len() / 2],
        min_s: times[0],
        iterations: times.len(),
        bytes: case.bytes,
        flops: case.flops,
    })
}

/// A markdown table of results. On cuda the last column is the fraction of the H200 roofline.
pub fn markdown_table(results: &[BenchResult], on_gpu: bool) -> String {
    let mut out = String::from(
        "| op | shape | median | min | GB/s | TFLOP/s | H200 roofline | of roofline |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let roof = r.h200_roofline_s();
        let frac = if on_gpu {
            format!("{:.0}%", 100.0 * roof / r.median_s)
        } else {
            "n/a (not a GPU)".to_string()
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.3} | {} | {} |\n",
            r.op,
            r.shape,
            fmt_time(r.median_s),
            fmt_time(r.min_s),
            r.gbps(),
            r.tflops(),
            fmt_time(roof),
            frac
        ));
    }
    out
}

/// A JSON array of results.
pub fn json_report(results: &[BenchResult], device: &str) -> serde_json::Value {
    serde_json::Value::Array(
        results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "op": r.op, "shape": r.shape, "device": device,
                    "median_s": r.median_s, "min_s": r.min_s, "iterations": r.iterations,
                    "bytes": r.bytes, "flops": r.flops, "gbps": r.gbps(), "tflops": r.tflops(),
                    "h200_roofline_s": r.h200_roofline_s(),
                })
            })
            .collect(),
    )
}

pub fn fmt_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}
