//! Every op family: signature, CPU reference and launch (one file each).

use crate::runner::OpSpec;

pub mod is_gate_loss;
pub mod philox;
pub mod row_reduce;
pub mod sample;

/// The ops of `sluice kernel`, in `--list` order.
pub static RUNNER_OPS: &[&OpSpec] = &[&sample::SPEC, &is_gate_loss::SPEC];
