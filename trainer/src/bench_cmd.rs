//! `sluice bench`: kernel timings against the H200 roofline, with GPU telemetry (DESIGN 7).

use sluice_kernels::bench::{json_report, markdown_table, time_case};
use sluice_kernels::bench_cases::all_cases;
use sluice_kernels::{Backend, Device, Error, Result};
use std::path::Path;

/// Options of one `sluice bench` run.
pub struct BenchOptions<'a> {
    pub device: Device,
    /// Only ops whose name contains this.
    pub filter: Option<&'a str>,
    /// Small sizes only (the default off a GPU).
    pub quick: bool,
    /// Seconds to spend timing each case.
    pub budget_s: f64,
    pub json: Option<&'a Path>,
    pub markdown: Option<&'a Path>,
}

/// Runs the cases and returns the markdown report.
pub fn run_bench(opts: &BenchOptions<'_>) -> Result<String> {
    let backend = Backend::open(opts.device)?;
    let cases: Vec<_> = all_cases(opts.quick)
        .into_iter()
        .filter(|c| opts.filter.is_none_or(|f| c.op.contains(f)))
        .collect();
    if cases.is_empty() {
        return Err(Error::Invalid(format!(
            "no bench case matches `{}`",
            opts.filter.unwrap_or("")
        )));
    }
    let mut results = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        eprintln!("[{}/{}] {} {}", i + 1, cases.len(), case.op, case.shape);
        results.push(time_case(case, &backend, opts.budget_s, 200)?);
    }
    let on_gpu = matches!(opts.device, Device::Cuda(_));
    let mut report = format!("# sluice bench on {}\n\n", describe(&backend));
    report.push_str(&markdown_table(&results, on_gpu));
    match sluice_kernels::cuda::nvml_summary() {
        Ok(t) => report.push_str(&format!("\nTelemetry (NVML):\n\n```\n{t}\n```\n")),
        Err(e) => report.push_str(&format!("\nTelemetry: {e}\n")),
    }
    let io = |p: &Path, e: std::io::Error| Error::Io {
        path: p.display().to_string(),
        message: e.to_string(),
    };
    if let Some(p) = opts.json {
        let json = json_report(&results, &opts.device.to_string());
        std::fs::write(p, serde_json::to_string_pretty(&json).unwrap_or_default())
            .map_err(|e| io(p, e))?;
    }
    if let Some(p) = opts.markdown {
        std::fs::write(p, &report).map_err(|e| io(p, e))?;
    }
    Ok(report)
}

fn describe(backend: &Backend) -> String {
    match backend {
        Backend::Cuda(c) => {
            let (maj, min) = c.compute_capability();
            format!("{} (cuda:{}, sm_{maj}{min})", c.name(), c.ordinal())
        }
        Backend::Emu(_) => {
            "the emulator (emu: CUDA kernels on the CPU; timings are not GPU timings)".into()
        }
        Backend::Cpu => format!(
            "cpu ({} threads)",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        ),
    }
}
