//! Every op family: signature, CPU reference and launch (one file each).

use crate::runner::OpSpec;

pub mod gemm;

/// The ops of `sluice kernel`, in `--list` order.
pub static RUNNER_OPS: &[&OpSpec] = &[&gemm::SPEC];
