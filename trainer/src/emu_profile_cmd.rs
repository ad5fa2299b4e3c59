//! `sluice emu profile OP [--preset doc|small | --in F.safetensors] [--blocks N] [--json F]`
//! (DESIGN.md section 7, docs/emulator.md "Profiling"): one op of the kernel runner under the
//! emulator's profiler. Prints a table per kernel, the ten worst source lines, the op's FLOPs
//! against the tensor cores' and a lower bound on H200 time; `--json` writes the same as JSON.
//! Exit 0 on success, 2 on bad usage (unknown op or preset, `--blocks 0`, an unreadable or
//! misshapen input), 1 when the op itself fails.

use clap::Args;
use sluice_kernels::emu::profile::LazyAlloc;
use sluice_kernels::io::read_safetensors;
use sluice_kernels::profiler::{self, cases, report, OpProfile, Preset, ProfileCase};
use sluice_kernels::{runner, Backend, Device, Error};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// The op, as `sluice kernel --list` names it.
    pub op: String,
    /// Shapes: `small` (seconds; the default) or `doc` (the shapes of docs/perf/<family>.md).
    #[arg(long, value_name = "doc|small", conflicts_with = "input")]
    pub preset: Option<String>,
    /// Profile the op on these named tensors instead (as `sluice kernel OP --in F`).
    #[arg(long = "in", value_name = "F.safetensors")]
    pub input: Option<PathBuf>,
    /// Profile at most N blocks of each launch (a stratified sample, counts scaled by the
    /// blocks each sampled block stands for); launches that steer later ones run in full.
    /// Default: every block, except 32 at `--preset doc`.
    #[arg(long, value_name = "N")]
    pub blocks: Option<u64>,
    /// Write the profile as JSON to this file (only when the whole profile succeeded).
    #[arg(long, value_name = "F")]
    pub json: Option<PathBuf>,
}

/// A failure of the command: bad usage (exit 2) or a failed run (exit 1).
enum Failure {
    Usage(String),
    Run(String),
}

fn classify(e: Error) -> Failure {
    if e.is_bad_input() {
        Failure::Usage(e.to_string())
    } else {
        Failure::Run(e.to_string())
    }
}

/// Runs `sluice emu profile`.
pub fn profile(args: &ProfileArgs) -> ExitCode {
    match run(args, &mut std::io::stdout()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(2)
        }
        Err(Failure::Run(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(1)
        }
    }
}

fn run(args: &ProfileArgs, out: &mut dyn std::io::Write) -> Result<(), Failure> {
    runner::find(&args.op).map_err(classify)?;
    if args.blocks == Some(0) {
        return Err(Failure::Usage("--blocks must be at least 1".into()));
    }
    let backend = Backend::open(Device::Emu).map_err(classify)?;
    let started = Instant::now();
    let profile = match &args.input {
        Some(path) => profile_file(&backend, &args.op, path, args.blocks)?,
        None => {
            let preset =
                Preset::parse(args.preset.as_deref().unwrap_or("small")).map_err(classify)?;
            profiler::profile_op(&backend, &args.op, preset, args.blocks).map_err(classify)?
        }
    };
    let text = report::to_text(&profile);
    let json = report::to_json(&profile);
    if let Some(path) = &args.json {
        write_json(path, &json).map_err(Failure::Usage)?;
    }
    writeln!(
        out,
        "{text}\n  profiled in {:.1} s on the emulator (counts are exact for every profiled block; the bound and occupancy are models)",
        started.elapsed().as_secs_f64()
    )
    .map_err(|e| Failure::Run(e.to_string()))?;
    Ok(())
}

/// The op on the tensors of a file: FLOPs unknown (the op's math is not derived from arbitrary
/// inputs), compulsory bytes the file's tensors.
fn profile_file(
    backend: &Backend,
    op: &str,
    path: &Path,
    blocks: Option<u64>,
) -> Result<OpProfile, Failure> {
    let file = read_safetensors(path, backend).map_err(|e| match e {
        Error::Io { path, message } => Failure::Usage(format!("--in {path}: {message}")),
        other => classify(other),
    })?;
    let bytes: f64 = file.tensors.values().map(|t| t.len_bytes() as f64).sum();
    let params = file
        .metadata
        .into_iter()
        .filter(|(k, _)| k != "format")
        .collect();
    let shape = file
        .tensors
        .iter()
        .map(|(n, t)| format!("{n}{:?}", t.shape()))
        .collect::<Vec<_>>()
        .join(" ");
    let name = runner::find(op).map_err(classify)?.name;
    let case = ProfileCase {
        op: name,
        shape: format!("{} ({shape})", path.display()),
        op_flops: f64::NAN,
        compulsory_bytes: bytes,
        tensors: file.tensors,
        params,
        // The op's own strata: sampling every launch uniformly would, for example, take the
        // same query tile of every head of an attention grid whose x extent divides the stride.
        strata: cases::strata_of(name),
    };
    let mut p = profiler::profile_case(backend, case, blocks).map_err(classify)?;
    p.preset = "file".into();
    Ok(p)
}

/// Writes `value` to `path` whole or not at all (a temporary file renamed into place).
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("--json {}: {e}", dir.display()))?;
    }
    let tmp = path.with_extension("json.partial");
    std::fs::write(&tmp, text + "\n").map_err(|e| format!("--json {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("--json {}: {e}", path.display()))
}

/// Every op's case at `preset`, profiled one after another (`sluice emu profile --all`); used by
/// the CI test that every op profiles.
pub fn profile_all(preset: Preset, blocks: Option<u64>) -> Result<Vec<OpProfile>, String> {
    let backend = Backend::open(Device::Emu).map_err(|e| e.to_string())?;
    let _lazy = (preset == Preset::Doc).then(LazyAlloc::enable);
    cases::ops()
        .into_iter()
        .map(|op| {
            profiler::profile_op(&backend, op, preset, blocks).map_err(|e| format!("{op}: {e}"))
        })
        .collect()
}
