//! TEST-ONLY faults of `sluice determinism` (feature `planted-faults`, never in a normal build;
//! inert unless `SLUICE_PLANT` names them): two workloads that break determinism on purpose,
//! so the tests can show the tool catches and names them. The kernels crate plants the rest in
//! its CPU references (kernels/src/planted.rs).
//!
//! - `nondeterministic` adds the workload `planted_hash_sum`: 64 sums of 4096 floats, each
//!   added up in the iteration order of a `HashMap` with std's per-process random keys, so the
//!   bits change from process to process (the classic hash-order bug).
//! - `racy_kernel` adds the workload `planted_racy_sum` (emu only): the emulator's planted
//!   block reduction with a missing `__syncthreads` (kernels/emu/tests/planted.cu), launched
//!   with race detection off, so its result depends on the schedule seed.

use super::workloads::Output;
use super::DetError;
use sluice_kernels::Backend;

/// The trainer's own faults, with what they do.
pub const FAULTS: &[(&str, &str)] = &[
    (
        "nondeterministic",
        "adds the workload planted_hash_sum (sums in per-process hash order)",
    ),
    (
        "racy_kernel",
        "adds the workload planted_racy_sum (emu: a block sum with a missing barrier)",
    ),
];

/// Checks `SLUICE_PLANT`: without the feature it must be unset; with it, every name must be a
/// fault of this crate or the kernels crate.
pub fn check_env() -> Result<(), DetError> {
    let set = std::env::var("SLUICE_PLANT").unwrap_or_default();
    if set.trim().is_empty() {
        return Ok(());
    }
    #[cfg(not(feature = "planted-faults"))]
    {
        Err(DetError::Input(format!(
            "SLUICE_PLANT={set:?} is set, but this sluice was built without the test-only \
             feature `planted-faults`; unset it"
        )))
    }
    #[cfg(feature = "planted-faults")]
    {
        let known: Vec<&str> = FAULTS
            .iter()
            .chain(sluice_kernels::planted::FAULTS)
            .map(|f| f.0)
            .collect();
        for name in sluice_kernels::planted::planted() {
            if !known.contains(&name.as_str()) {
                return Err(DetError::Input(format!(
                    "SLUICE_PLANT names `{name}`, which is no planted fault; the faults are: {}",
                    known.join(", ")
                )));
            }
        }
        Ok(())
    }
}

/// The planted workloads in force in this process.
pub fn workloads() -> Vec<&'static str> {
    #[cfg(feature = "planted-faults")]
    {
        let mut v = Vec::new();
        if sluice_kernels::planted::active("nondeterministic") {
            v.push("planted_hash_sum");
        }
        if sluice_kernels::planted::active("racy_kernel") {
            v.push("planted_racy_sum");
        }
        v
    }
    #[cfg(not(feature = "planted-faults"))]
    Vec::new()
}

/// Runs a planted workload.
pub fn run(backend: &Backend, name: &str) -> Result<Vec<Output>, DetError> {
    match name {
        "planted_hash_sum" => Ok(vec![hash_sum()?]),
        "planted_racy_sum" => racy_sum(backend).map(|o| vec![o]),
        other => Err(DetError::Run(format!(
            "internal: no planted workload `{other}`"
        ))),
    }
}

fn hash_sum() -> Result<Output, DetError> {
    use std::collections::HashMap;
    let x = super::op_cases::host_values(64 * 4096, 0x4a54)
        .map_err(|e| DetError::Run(format!("planted_hash_sum: {e}")))?;
    let sums: Vec<f32> = x
        .chunks(4096)
        .map(|c| {
            let m: HashMap<usize, f32> = c.iter().copied().enumerate().collect();
            m.values().fold(0.0f32, |acc, &v| acc + v)
        })
        .collect();
    Ok(Output::of_slice(
        "planted_hash_sum",
        "f32 64 sums of 4096",
        "sums",
        &sums,
    ))
}

fn racy_sum(backend: &Backend) -> Result<Output, DetError> {
    use sluice_kernels::emu::{emu_launch_checked, Checks, EmuBuffer, LaunchOptions};
    use std::ffi::c_void;
    let Backend::Emu(emu) = backend else {
        return Err(DetError::Input(
            "planted_racy_sum runs on emu only (it is an emulated kernel)".to_string(),
        ));
    };
    let err = |e: String| DetError::Run(format!("planted_racy_sum: {e}"));
    let n = 4096usize;
    let no_race = LaunchOptions {
        checks: Checks::Bounds,
        race: Some(false),
        param_names: None,
    };
    let mut sums = Vec::new();
    for launch in 0..8u64 {
        let x = super::op_cases::host_values(n, 0x5ace + launch).map_err(|e| err(e.to_string()))?;
        let mut xb = EmuBuffer::alloc(n * 4).map_err(err)?;
        xb.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(&x));
        let out = EmuBuffer::alloc(4).map_err(err)?;
        let mut slots: [u64; 3] = [xb.as_ptr() as u64, out.as_ptr() as u64, n as u64];
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| (s as *mut u64).cast::<c_void>())
            .collect();
        // Sound: the kernel's parameters are (const float*, float*, int); each slot holds an
        // emu device address or the int in its low bytes (little endian), as cuLaunchKernel
        // expects, and both buffers outlive the synchronous launch.
        let found = emu_launch_checked(
            "emutest_block_sum_racy",
            [1, 1, 1],
            [256, 1, 1],
            0,
            &mut params,
            emu.seed.wrapping_mul(1000).wrapping_add(launch),
            &no_race,
        )
        .map_err(err)?;
        if let Some(f) = found.first() {
            return Err(err(f.to_string()));
        }
        sums.push(f32::from_le_bytes(
            out.as_bytes()
                .try_into()
                .map_err(|_| err("the output is not 4 bytes".into()))?,
        ));
    }
    Ok(Output::of_slice(
        "planted_racy_sum",
        "f32 8 block sums of 4096",
        "sums",
        &sums,
    ))
}
