//! Every op family: signature, CPU reference and launch (one file each).

pub mod topk;

use crate::runner::OpSpec;

pub mod gemm;

/// The ops of `sluice kernel`, in `--list` order.
pub static RUNNER_OPS: &[&OpSpec] = &[&gemm::SPEC, &topk::SPEC];
