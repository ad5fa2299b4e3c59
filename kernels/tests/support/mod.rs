//! Shared by the emulator's own tests (emu_planted.rs, emu_hopper.rs): a raw launch with every
//! check on, and the lines of the planted-bug kernels.

use sluice_kernels::emu::{emu_launch_checked, Checks, EmuFinding, LaunchOptions};
use std::ffi::c_void;

/// One block-row launch (grid x `grid`, block x `block`) with every check and race detection on
/// whatever SLUICE_EMU_RACE says; `params` as cuLaunchKernel takes them. Its findings (empty:
/// clean); panics if the kernel did not run at all.
pub fn checked_launch(
    kernel: &str,
    grid: u32,
    block: u32,
    shared: usize,
    params: &mut [*mut c_void],
    seed: u64,
) -> Vec<EmuFinding> {
    let opts = LaunchOptions {
        checks: Checks::Full,
        race: Some(true),
        param_names: None,
    };
    emu_launch_checked(
        kernel,
        [grid, 1, 1],
        [block, 1, 1],
        shared,
        params,
        seed,
        &opts,
    )
    .unwrap_or_else(|e| panic!("{kernel} did not run: {e}"))
}

/// The line of kernels/emu/tests/planted.cu that contains `marker` (exactly once).
#[allow(dead_code)] // emu_wgmma_rs.rs has its own source file (marker_line)
pub fn planted_line(marker: &str) -> u32 {
    marker_line(include_str!("../../emu/tests/planted.cu"), marker)
}

/// The line of `src` that contains `marker` (exactly once).
pub fn marker_line(src: &str, marker: &str) -> u32 {
    let hits: Vec<u32> = src
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains(marker))
        .map(|(i, _)| i as u32 + 1)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "marker {marker:?} must occur once in the source"
    );
    hits[0]
}
