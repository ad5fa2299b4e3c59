//! `sluice kernel <op> --in X.safetensors --out Y.safetensors --device D` (DESIGN.md section 7).

use sluice_kernels::io::{read_safetensors, write_safetensors};
use sluice_kernels::runner::{self, OpCall};
use sluice_kernels::{Backend, Device, Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Metadata keys other tools write that are not op parameters.
const FOREIGN_METADATA: &[&str] = &["format"];

/// Runs one op on the tensors of `input` and writes its outputs to `output`.
/// Returns a one-line summary of what ran.
pub fn run_kernel(op: &str, input: &Path, output: &Path, device: Device) -> Result<String> {
    let spec = runner::find(op)?;
    let backend = Backend::open(device)?;
    let file = read_safetensors(input, &backend).map_err(|e| match e {
        // An unreadable input is the caller's problem: report it as bad input.
        Error::Io { path, message } => Error::Invalid(format!("--in {path}: {message}")),
        other => other,
    })?;
    let params: BTreeMap<String, String> = file
        .metadata
        .into_iter()
        .filter(|(k, _)| !FOREIGN_METADATA.contains(&k.as_str()))
        .collect();
    let call = OpCall::new(spec, file.tensors, params.clone())?;
    let outputs = (spec.run)(&backend, &call)?;
    backend.synchronize()?;
    let mut meta = params;
    meta.insert("op".into(), op.to_string());
    meta.insert("device".into(), device.to_string());
    let named: Vec<(&str, &sluice_kernels::Tensor)> =
        outputs.iter().map(|(n, t)| (*n, t)).collect();
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            path: dir.display().to_string(),
            message: format!("cannot create the --out folder: {e}"),
        })?;
    }
    write_safetensors(output, &named, &meta)?;
    let shapes = outputs
        .iter()
        .map(|(n, t)| format!("{n}{:?} {}", t.shape(), t.dtype()))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(format!(
        "{op} on {device}: wrote {shapes} to {}",
        output.display()
    ))
}
