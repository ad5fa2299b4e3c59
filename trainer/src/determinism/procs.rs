//! Separate processes: hash seeds, thread pools, allocator state and the emulator's schedule
//! are per process, so run-to-run identity is only shown by comparing processes. Each run is
//! this binary again (`std::env::current_exe`) with the hidden `determinism record`, which
//! prints its record as one JSON line; the environment of the run (RAYON_NUM_THREADS,
//! SLUICE_EMU_THREADS, SLUICE_EMU_SEED) is set by the caller.

use super::class::{Class, Machine};
use super::record::{self, digest, Entry, Record};
use super::workloads::{self, Output};
use super::{DetError, Resolved};
use safetensors::tensor::TensorView;
use safetensors::Dtype as StDtype;
use sluice_kernels::{Backend, DType, Device};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Computes the record of this process: every selected workload on the device, digested;
/// with `dump`, every output is also written there (safetensors, tensors named by entry key).
pub fn compute_record(sel: &Resolved, dump: Option<&Path>) -> Result<Record, DetError> {
    let backend = Backend::open(sel.device).map_err(|e| {
        if e.is_bad_input() {
            DetError::Input(e.to_string())
        } else {
            DetError::Run(e.to_string())
        }
    })?;
    let mut outputs: Vec<Output> = Vec::new();
    let mut seconds = BTreeMap::new();
    for name in workloads::select(&sel.ops)? {
        let t = Instant::now();
        outputs.extend(workloads::run(&backend, name, sel.preset)?);
        seconds.insert(name.to_string(), t.elapsed().as_secs_f64());
    }
    if let Some(path) = dump {
        write_dump(path, &outputs)?;
    }
    let entries: Vec<Entry> = outputs
        .iter()
        .map(|o| Entry {
            op: o.op.clone(),
            case: o.case.clone(),
            tensor: o.tensor.clone(),
            shape: o.shape.clone(),
            dtype: o.dtype.name().to_string(),
            digest: digest(o.dtype, &o.shape, &o.bytes),
        })
        .collect();
    record::validate_entries(&entries).map_err(|m| DetError::Run(format!("internal: {m}")))?;
    let emu = sel.device == Device::Emu;
    Ok(Record {
        format: record::FORMAT.to_string(),
        kind: "record".to_string(),
        version: record::VERSION,
        digest_version: record::DIGEST_VERSION,
        preset: sel.preset.name().to_string(),
        device: sel.device.to_string(),
        class: Class::detect(&backend),
        machine: Machine::detect(),
        commit: env!("SLUICE_GIT_COMMIT").to_string(),
        threads: sluice_kernels::par::threads(),
        emu_threads: emu
            .then(|| std::env::var("SLUICE_EMU_THREADS").unwrap_or_else(|_| "unset".to_string())),
        emu_seed: match &backend {
            Backend::Emu(e) => Some(e.seed),
            _ => None,
        },
        runs: 1,
        ops: sel.ops.clone(),
        seconds,
        entries,
    })
}

fn st_dtype(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::BF16 => StDtype::BF16,
        DType::I32 => StDtype::I32,
        DType::U8 => StDtype::U8,
        DType::U64 => StDtype::U64,
    }
}

/// Writes every output to a safetensors file, each tensor named by its entry key.
fn write_dump(path: &Path, outputs: &[Output]) -> Result<(), DetError> {
    let bad = |m: String| DetError::Input(format!("{}: {m}", path.display()));
    let views: Vec<(String, TensorView<'_>)> = outputs
        .iter()
        .map(|o| {
            let key = format!("{} [{}] {}", o.op, o.case, o.tensor);
            TensorView::new(st_dtype(o.dtype), o.shape.clone(), &o.bytes)
                .map(|v| (key, v))
                .map_err(|e| DetError::Run(format!("internal: dump of {}: {e}", o.op)))
        })
        .collect::<Result<_, _>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| DetError::Run(format!("internal: dump: {e}")))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| bad(format!("cannot create its folder: {e}")))?;
    }
    std::fs::write(path, bytes).map_err(|e| bad(format!("cannot write it: {e}")))
}

/// Opens the device once in this process, so that a missing GPU or driver is reported as it
/// is rather than as a failed child (the emulator and the CPU always open).
pub fn check_device(device: Device) -> Result<(), DetError> {
    if let Device::Cuda(_) = device {
        Backend::open(device).map_err(|e| DetError::Run(e.to_string()))?;
    }
    Ok(())
}

/// One run's environment: variables to set for the child.
pub type Env = Vec<(&'static str, String)>;

/// Runs `sluice determinism record` for `sel` in a child process with `env` set; returns its
/// record. `label` names the run in errors.
pub fn spawn_record(
    sel: &Resolved,
    env: &Env,
    dump: Option<&Path>,
    label: &str,
) -> Result<Record, DetError> {
    let exe = std::env::current_exe()
        .map_err(|e| DetError::Run(format!("cannot find this sluice binary to re-run it: {e}")))?;
    let mut cmd = Command::new(&exe);
    cmd.args([
        "determinism",
        "record",
        "--device",
        &sel.device.to_string(),
        "--preset",
        sel.preset.name(),
    ]);
    if !sel.ops.is_empty() {
        cmd.arg("--ops").arg(sel.ops.join(","));
    }
    if let Some(d) = dump {
        cmd.arg("--dump").arg(d);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .map_err(|e| DetError::Run(format!("{label}: cannot start {}: {e}", exe.display())))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    if !out.status.success() {
        let msg = format!(
            "{label}: the record process failed ({}): {last}",
            out.status
        );
        return Err(if out.status.code() == Some(2) {
            DetError::Input(last.trim_start_matches("error: ").to_string())
        } else {
            DetError::Run(msg)
        });
    }
    record::parse::<Record>(&out.stdout, "record")
        .map_err(|m| DetError::Run(format!("{label}: its record is unreadable: {m}")))
}

/// The environment that pins the thread count of a run to `threads` (the CPU references'
/// pool and the emulator's block workers).
pub fn threads_env(threads: usize) -> Env {
    vec![
        ("RAYON_NUM_THREADS", threads.to_string()),
        ("SLUICE_EMU_THREADS", threads.to_string()),
    ]
}
