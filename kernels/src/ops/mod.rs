//! Every op family: signature, CPU reference and launch (one file each).

use crate::runner::OpSpec;

pub mod attention;
pub mod attention_tile;
pub mod attention_wgmma;
pub mod block_reduce;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod gemm_chain;
pub mod gemm_epilogue;
pub mod gemm_hopper;
pub mod gemm_small;
pub mod is_gate_loss;
pub mod moe;
pub mod newton_schulz;
pub mod optim;
pub mod paged_attention;
pub mod philox;
pub mod rmsnorm;
pub mod rope;
pub mod row_reduce;
pub mod sample;
pub mod swiglu;
pub mod topk;

/// The ops of `sluice kernel`, in `--list` order: DESIGN.md section 7's table first, then the
/// supporting ops of the model.
pub static RUNNER_OPS: &[&OpSpec] = &[
    &gemm::SPEC,
    &topk::SPEC,
    &sample::SPEC,
    &is_gate_loss::SPEC,
    &newton_schulz::SPEC,
    &moe::FORWARD_SPEC,
    &moe::BACKWARD_SPEC,
    &attention::FORWARD_SPEC,
    &attention::BACKWARD_SPEC,
    &paged_attention::SPEC,
    &rmsnorm::SPEC,
    &rmsnorm::BACKWARD_SPEC,
    &rope::SPEC,
    &rope::BACKWARD_SPEC,
    &swiglu::SPEC,
    &swiglu::BACKWARD_SPEC,
    &embedding::SPEC,
    &embedding::BACKWARD_SPEC,
    &elementwise::RESIDUAL_ADD_SPEC,
    &elementwise::SOFTMAX_SPEC,
    &elementwise::SOFTMAX_BACKWARD_SPEC,
    &elementwise::TRANSPOSE_SPEC,
    &paged_attention::KV_APPEND_SPEC,
    &paged_attention::PREFILL_SPEC,
    &optim::ADAMW_SPEC,
    &optim::SQ_NORM_SPEC,
    &optim::MUON_GATHER_SPEC,
    &optim::MUON_APPLY_SPEC,
    &optim::CAST_BF16_SPEC,
];
