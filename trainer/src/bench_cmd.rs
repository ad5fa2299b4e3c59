//! `sluice bench`: kernel timings against the H200 roofline and the ceilings measured in the
//! same run (DESIGN 7). One harness on every device (`sluice_kernels::bench::harness`): CUDA
//! events on cuda, the wall clock on cpu and emu (and the report says which). Each row is
//! appended to a JSONL file the moment its case finishes; the report is built from that file,
//! so a run cut short keeps every finished row, and `--report-from` rebuilds the report later.

use serde_json::json;
use sluice_kernels::bench::rows::error_row;
use sluice_kernels::bench::telemetry::{self, Sampler};
use sluice_kernels::bench::{
    markdown_report, read_rows, time_case, BenchCase, Pass, Row, RowWriter, TimingConfig,
    Verification,
};
use sluice_kernels::bench_cases::{all_cases, cases_json, Preset};
use sluice_kernels::emu::profile::{Recording, Sampling};
use sluice_kernels::profiler::{bound, report, OpProfile};
use sluice_kernels::{Backend, Device, Error, Result};
use std::path::{Path, PathBuf};

/// Options of one `sluice bench` run.
pub struct BenchOptions<'a> {
    pub device: Device,
    /// Only ops whose name contains one of these (comma-separated).
    pub filter: Option<&'a str>,
    pub preset: Preset,
    pub timing: TimingConfig,
    /// Where rows stream (one JSON object per line, written as each case finishes). Default:
    /// `bench-rows.jsonl` in the system's temporary folder.
    pub jsonl: Option<&'a Path>,
    /// Also write the rows as one JSON array here at the end.
    pub json: Option<&'a Path>,
    pub markdown: Option<&'a Path>,
    /// The GPU run's test results (`ok|FAILED BINARY::TEST@MODE` lines): rows whose test
    /// passed are verified, the rest UNVERIFIED.
    pub verified: Option<&'a Path>,
    /// On emu: run each case once more under the profiler and add its counters and the H200
    /// bound to the report (docs/emulator.md, "Profiling").
    pub profile: bool,
}

/// The outcome of a bench run: the report, and how many cases failed to run.
pub struct BenchOutcome {
    pub report: String,
    pub failed: usize,
}

fn io(p: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: p.display().to_string(),
        message: e.to_string(),
    }
}

fn read_verification(path: Option<&Path>) -> Result<Option<Verification>> {
    path.map(|p| {
        let text = std::fs::read_to_string(p).map_err(|e| io(p, e))?;
        Verification::parse(&text)
    })
    .transpose()
}

/// Every case of a preset: the kernels' table (ceilings, ops) then the model steps.
pub fn cases(preset: Preset) -> Result<Vec<BenchCase>> {
    let mut all = all_cases(preset);
    all.extend(crate::bench_steps::step_cases(preset)?);
    Ok(all)
}

/// The case table of a preset as JSON (for scripts/peers/ and the dry run's checks).
pub fn list_json(preset: Preset) -> Result<String> {
    Ok(serde_json::to_string_pretty(&cases_json(&cases(preset)?)).unwrap_or_default())
}

/// Rebuilds the report from a rows file (a finished or a cut run).
pub fn report_from(jsonl: &Path, verified: Option<&Path>) -> Result<String> {
    let rows = read_rows(jsonl)?;
    let v = read_verification(verified)?;
    Ok(markdown_report(
        &format!(
            "sluice bench ({} rows from {})",
            rows.len(),
            jsonl.display()
        ),
        &rows,
        v.as_ref(),
    ))
}

/// Runs the cases, streaming rows, and returns the report built from the rows file.
pub fn run_bench(opts: &BenchOptions<'_>) -> Result<BenchOutcome> {
    opts.timing.validate()?;
    let verification = read_verification(opts.verified)?;
    let backend = Backend::open(opts.device)?;
    if opts.profile && !matches!(backend, Backend::Emu(_)) {
        return Err(Error::Invalid(
            "--profile needs --device emu (the profiler is the emulator's)".into(),
        ));
    }
    // A comma-separated list: a case runs if its op contains any of the names.
    let wanted: Vec<&str> = opts
        .filter
        .map(|f| {
            f.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let cases: Vec<_> = cases(opts.preset)?
        .into_iter()
        .filter(|c| wanted.is_empty() || wanted.iter().any(|w| c.op.contains(w)))
        .collect();
    if cases.is_empty() {
        return Err(Error::Invalid(format!(
            "no bench case matches `{}`",
            opts.filter.unwrap_or("")
        )));
    }
    let default_jsonl = std::env::temp_dir().join("bench-rows.jsonl");
    let jsonl: PathBuf = opts.jsonl.map_or(default_jsonl, Path::to_path_buf);
    let mut writer = RowWriter::create(&jsonl)?;
    let on_cuda = matches!(backend, Backend::Cuda(_));
    let no_telemetry = if on_cuda {
        telemetry::unavailable()
    } else {
        Some(format!("not sampled: {} is not a GPU", opts.device))
    };
    let mut profiles = Vec::new();
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        eprintln!(
            "[{}/{}] {} {} {}",
            i + 1,
            cases.len(),
            case.op,
            case.pass.name(),
            case.shape
        );
        let row = run_case(case, &backend, opts, no_telemetry.as_deref());
        if row.0["error"].is_string() {
            failed += 1;
        }
        writer.write(&row)?;
        // After the row is on disk: a reader of stderr may rely on the row being in the file.
        eprintln!("row {} written: {} {}", i + 1, case.op, case.shape);
        if opts.profile {
            // One entry per row, None where the row was skipped (it has nothing to profile).
            let skipped = case.cuda_only && backend.cuda().is_none();
            profiles.push(if skipped {
                None
            } else {
                Some(profile_case(case, &backend)?)
            });
        }
    }
    let rows = read_rows(&jsonl)?;
    let mut report = markdown_report(
        &format!(
            "sluice bench on {} (preset {})",
            describe(&backend),
            opts.preset.name()
        ),
        &rows,
        verification.as_ref(),
    );
    report.push_str(&format!("\nRows: {}\n", jsonl.display()));
    if on_cuda {
        report.push_str(&match sluice_kernels::nvtx::status() {
            sluice_kernels::nvtx::Status::Active(tool) => {
                format!("NVTX ranges (every launch, row and step stage): to {tool}\n")
            }
            sluice_kernels::nvtx::Status::Inactive(why) => format!("NVTX ranges: off, {why}\n"),
        });
    }
    if opts.profile {
        report.push_str(&profile_table(&profiles));
    }
    if let Some(p) = opts.json {
        let mut arr: Vec<serde_json::Value> = rows.into_iter().map(|r: Row| r.0).collect();
        for (row, profile) in arr.iter_mut().zip(&profiles) {
            if let Some(profile) = profile {
                row["profile"] = report::to_json(profile);
            }
        }
        std::fs::write(p, serde_json::to_string_pretty(&arr).unwrap_or_default())
            .map_err(|e| io(p, e))?;
    }
    if let Some(p) = opts.markdown {
        std::fs::write(p, &report).map_err(|e| io(p, e))?;
    }
    Ok(BenchOutcome { report, failed })
}

/// Times one case into a row; a case that cannot run becomes a row saying why (the run goes
/// on: one broken kernel must not cost the others' figures).
fn run_case(
    case: &BenchCase,
    backend: &Backend,
    opts: &BenchOptions<'_>,
    no_telemetry: Option<&str>,
) -> Row {
    let mut base = json!({
        "op": case.op, "pass": case.pass.name(), "path": case.path, "shape": case.shape,
        "device": opts.device.to_string(), "preset": opts.preset.name(), "check": case.check,
        "bytes": case.bytes, "flops": case.flops,
    });
    if case.cuda_only && backend.cuda().is_none() {
        base["skipped"] = json!(format!("{} runs only on cuda", case.op));
        return Row(base);
    }
    let sampler = match (no_telemetry, backend.cuda()) {
        (None, Some(c)) => Sampler::start(c.ordinal() as u32).map_err(|e| e.to_string()),
        (Some(why), _) => Err(why.to_string()),
        (None, None) => Err("not a GPU".to_string()),
    };
    // A model step runs hundreds of kernels: a few samples say enough and keep the run short.
    let timing = if case.pass == Pass::Step {
        TimingConfig {
            warmup: 1,
            samples: opts.timing.samples.min(5),
            ..opts.timing.clone()
        }
    } else {
        opts.timing.clone()
    };
    // The row on an Nsight timeline (a no-op without a tool, and off cuda).
    let timed = {
        let label = format!(
            "bench {} {} {} {}",
            case.op,
            case.pass.name(),
            case.path,
            case.shape
        );
        let _row = sluice_kernels::nvtx::range_on(backend, &label);
        time_case(case, backend, &timing)
    };
    match sampler.and_then(Sampler::finish) {
        Ok(t) => base["telemetry"] = t,
        Err(why) => base["telemetry_unavailable"] = json!(why),
    }
    match timed {
        Ok(t) => {
            for (k, v) in [
                ("clock", json!(t.clock.name())),
                ("median_s", json!(t.median_s)),
                ("min_s", json!(t.min_s)),
                ("max_s", json!(t.max_s)),
                ("samples", json!(t.samples)),
                ("batch", json!(t.batch)),
                ("cold_l2", json!(t.cold_l2)),
                ("launches_per_run", json!(t.per_run.launches)),
                ("host_syncs_per_run", json!(t.per_run.host_syncs)),
                ("allocs_per_run", json!(t.per_run.storage_allocs)),
                ("timed_allocs", json!(t.timed_allocs)),
            ] {
                base[k] = v;
            }
            Row(base)
        }
        Err(e) => error_row(base, &e.to_string()),
    }
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
fn profile_table(profiles: &[Option<OpProfile>]) -> String {
    let mut out = String::from(
        "\nProfile (emulator counts; the bound is a model: docs/emulator.md, \"Profiling\"):\n\n\
         | op | shape | launches | global sectors / ideal | shared wavefronts / ideal | tensor share | H200 bound | bound by |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for p in profiles.iter().flatten() {
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
