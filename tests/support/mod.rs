//! Plumbing shared by the `kernel_runner_*` integration tests (each uses it with `mod support;`):
//! a scratch directory per run, input tensors and string params written to safetensors,
//! outputs read back as f32, and a run that must fail as bad input.

// Each test file uses only some of these.
#![allow(dead_code)]

use sluice_kernels::io::{read_safetensors, write_safetensors};
use sluice_kernels::{Backend, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under the system temp dir, unique to this process and call (tests run in
/// parallel).
pub fn scratch_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tag = tag.replace(':', "_");
    let dir = std::env::temp_dir().join(format!("sluice-test-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `tensors` (owned or borrowed) and the string metadata `params` to `path`.
pub fn write_tensors<T: Borrow<Tensor>>(
    path: &Path,
    tensors: &[(&str, T)],
    params: &[(&str, &str)],
) {
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t.borrow())).collect();
    let meta: BTreeMap<String, String> = params
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    write_safetensors(path, &named, &meta).unwrap();
}

/// Writes `tensors` and `params` to `dir/in.safetensors` and returns that path.
pub fn write_input<T: Borrow<Tensor>>(
    dir: &Path,
    tensors: &[(&str, T)],
    params: &[(&str, &str)],
) -> PathBuf {
    let path = dir.join("in.safetensors");
    write_tensors(&path, tensors, params);
    path
}

/// The tensor `name` of the safetensors file at `path`, as f32.
pub fn read_f32(path: &Path, name: &str) -> Vec<f32> {
    let f = read_safetensors(path, &Backend::Cpu).unwrap();
    f.tensors[name].to_vec::<f32>().unwrap()
}

/// Runs `op` on the CPU with `tensors` and `params` in a scratch dir named by `tag`; the run must
/// fail as bad input (exit code 2). Returns the error message.
pub fn run_bad_input<T: Borrow<Tensor>>(
    op: &str,
    tag: &str,
    tensors: &[(&str, T)],
    params: &[(&str, &str)],
) -> String {
    let dir = scratch_dir(&format!("{op}-{tag}"));
    let input = write_input(&dir, tensors, params);
    let err = run_kernel(op, &input, &dir.join("out.safetensors"), Device::Cpu)
        .err()
        .unwrap_or_else(|| panic!("{op} {tag}: bad input must be an error"));
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        err.is_bad_input(),
        "{op} {tag}: {err} should be bad input (exit code 2)"
    );
    err.to_string()
}
