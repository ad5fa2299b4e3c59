//! Every op family: signature, CPU reference and launch (one file each).

use crate::runner::OpSpec;

pub mod attention;
pub mod paged_attention;

/// The ops of `sluice kernel`, in `--list` order.
pub static RUNNER_OPS: &[&OpSpec] = &[
    &attention::FORWARD_SPEC,
    &attention::BACKWARD_SPEC,
    &paged_attention::SPEC,
];
