//! Strata: how each op's launches are sampled, by kernel name (the profiler samples blocks
//! within each stratum; see [`Strata`]).

use crate::emu::profile::Strata;

/// Every block does the same work.
pub(super) fn uniform(_: &str) -> Strata {
    Strata::Uniform
}

/// Grid x indexes query (or key) token tiles: causal rows see more keys the later they sit in
/// their sequence (dkdv: keys are seen by more queries the earlier they sit), and sequences
/// differ in length. The delta kernel (one thread per row) is uniform.
pub(super) fn attention_strata(kernel: &str) -> Strata {
    if kernel.starts_with("attention_bwd_delta") {
        Strata::Uniform
    } else {
        Strata::Axis(0)
    }
}

/// Decode: grid x is the sequence (work ∝ its context length); prefill: grid x is the query
/// token tile (causal, per-sequence contexts); kv_append: token tiles (padding rows skip).
pub(super) fn paged_strata(_: &str) -> Strata {
    Strata::Axis(0)
}

/// Grid x is the vocabulary id: a block sums the rows of that id's occurrences (skewed).
pub(super) fn embedding_backward_strata(_: &str) -> Strata {
    Strata::Axis(0)
}

/// MoE: the router and everything that decides the routing or the segment offsets runs in
/// full (the x/w_router widening, the router GEMM `gemm_f32`, its softmax/sigmoid, top-k, the
/// gates, the counting sort, the aux loss over the offsets). With BF16 inputs only router GEMMs
/// are `gemm_f32` (the backward's dx_router shares the name, so it runs in full too). The
/// grouped expert GEMMs have row tiles of ragged segments then an idle tail along x; the f32
/// weight gradient has the segment on z; the rest is elementwise. (Doc shapes: [`moe_doc_strata`].)
pub(super) fn moe_strata(kernel: &str) -> Strata {
    const FULL: &[&str] = &[
        "moe_widen_bf16",
        "gemm_f32",
        "elementwise_softmax",
        "moe_sigmoid",
        "topk_",
        "moe_gates",
        "moe_sort_",
        "moe_aux_loss",
    ];
    if FULL.iter().any(|p| kernel.starts_with(p)) {
        Strata::Full
    } else if kernel.ends_with("segment_tn") {
        // The weight gradients: blockIdx.z is the expert, whose K is its token count.
        Strata::Axis(2)
    } else if kernel.starts_with("gemm_") {
        Strata::Axis(0)
    } else {
        Strata::Uniform
    }
}

/// MoE at the doc shape: as [`moe_strata`], but the router's product and softmax are sampled
/// too (the widening of x stays full, so the sampled rows' logits are real and spread over
/// every expert). Run in full they took about 10 minutes of the forward's emulation (the SIMT f32
/// router product is 2.1 G multiply-adds), past the 5-minute budget. Rows outside the sample
/// keep zero logits, tie, and go to experts 0..k-1; the top-k, gates, counting sort and aux loss
/// still run in full on what they get. The grouped GEMMs' work moves by the tail tiles only: at
/// T = 16384, top-8 of 64 experts, 128-row tiles, balanced routing makes 64 x 16 = 1024 row
/// tiles, the skewed one 8 x 115 + 56 x 2 = 1032 (under 1% more); unique bytes are not reported
/// for sampled launches anyway.
pub(super) fn moe_doc_strata(kernel: &str) -> Strata {
    const SAMPLED_ROUTER: &[&str] = &["gemm_f32", "elementwise_softmax", "moe_sigmoid"];
    if SAMPLED_ROUTER.iter().any(|p| kernel.starts_with(p)) {
        Strata::Uniform
    } else {
        moe_strata(kernel)
    }
}
