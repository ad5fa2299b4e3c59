//! `sluice bench`: kernel timings against the H200 roofline, with GPU telemetry (DESIGN 7).

use sluice_kernels::bench::{json_report, markdown_table, time_case, BenchCase};
use sluice_kernels::bench_cases::all_cases;
use sluice_kernels::emu::profile::{Recording, Sampling};
use sluice_kernels::profiler::{bound, report, OpProfile};
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
    /// On emu: run each case once more under the profiler and add its counters and the H200
    /// bound to the report (docs/emulator.md, "Profiling").
    pub profile: bool,
}

/// Runs the cases and returns the markdown report.
pub fn run_bench(opts: &BenchOptions<'_>) -> Result<String> {
    let backend = Backend::open(opts.device)?;
    if opts.profile && !matches!(backend, Backend::Emu(_)) {
        return Err(Error::Invalid(
            "--profile needs --device emu (the profiler is the emulator's)".into(),
        ));
    }
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
    let mut profiles = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        eprintln!("[{}/{}] {} {}", i + 1, cases.len(), case.op, case.shape);
        results.push(time_case(case, &backend, opts.budget_s, 200)?);
        if opts.profile {
            profiles.push(profile_case(case, &backend)?);
        }
    }
    let on_gpu = matches!(opts.device, Device::Cuda(_));
    let mut report = format!("# sluice bench on {}\n\n", describe(&backend));
    report.push_str(&markdown_table(&results, on_gpu));
    if opts.profile {
        report.push_str(&profile_table(&profiles));
    }
    match sluice_kernels::cuda::nvml_summary() {
        Ok(t) => report.push_str(&format!("\nTelemetry (NVML):\n\n```\n{t}\n```\n")),
        Err(e) => report.push_str(&format!("\nTelemetry: {e}\n")),
    }
    let io = |p: &Path, e: std::io::Error| Error::Io {
        path: p.display().to_string(),
        message: e.to_string(),
    };
    if let Some(p) = opts.json {
        let mut json = json_report(&results, &opts.device.to_string());
        if let serde_json::Value::Array(rows) = &mut json {
            for (row, profile) in rows.iter_mut().zip(&profiles) {
                row["profile"] = report::to_json(profile);
            }
        }
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

/// Runs a case once more under the emulator's profiler (every block).
fn profile_case(case: &BenchCase, backend: &Backend) -> Result<OpProfile> {
    let mut run = (case.prepare)(backend)?;
    let recording = Recording::start(Sampling::full()).map_err(Error::Invalid)?;
    let ran = run(backend);
    let kernels = recording.finish();
    ran?;
    Ok(OpProfile {
        op: case.op.to_string(),
        shape: case.shape.clone(),
        preset: "bench".into(),
        op_flops: case.flops,
        compulsory_bytes: case.bytes,
        kernels,
    })
}

/// The profiler's columns: counts per case and the H200 bound (a model).
fn profile_table(profiles: &[OpProfile]) -> String {
    let mut out = String::from(
        "\nProfile (emulator counts; the bound is a model: docs/emulator.md, \"Profiling\"):\n\n\
         | op | shape | launches | global sectors / ideal | shared wavefronts / ideal | tensor share | H200 bound | bound by |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for p in profiles {
        let t = report::op_totals(p);
        let sectors = t.get("global_load_sectors") + t.get("global_store_sectors");
        let ideal = t.get("global_load_ideal_sectors") + t.get("global_store_ideal_sectors");
        let waves = t.get("shared_load_wavefronts") + t.get("shared_store_wavefronts");
        let ideal_waves =
            t.get("shared_load_ideal_wavefronts") + t.get("shared_store_ideal_wavefronts");
        let ratio = |a: f64, b: f64| {
            if b > 0.0 {
                format!("{:.2}x", a / b)
            } else {
                "-".into()
            }
        };
        let (_, share, _) = report::tensor_share(p);
        let b = bound::bound(&p.kernels, p.compulsory_bytes);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0}% | {} | {} |\n",
            p.op,
            p.shape,
            p.kernels.len(),
            ratio(sectors, ideal),
            ratio(waves, ideal_waves),
            share * 100.0,
            sluice_kernels::bench::fmt_time(b.seconds),
            b.binding
        ));
    }
    out
}
