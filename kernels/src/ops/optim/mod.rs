//! `optim`: the optimizer kernels over a parameter arena (kernels in kernels/cuda/optim.cu):
//! the global squared norm, AdamW over a segment table, the gather of strided 2-D blocks (with
//! Muon's momentum fused in), the scatter of Muon's orthogonalised update, and the f32 -> bf16
//! compute copy. The model's optimizer (sluice-model, `optim`) drives them; Newton-Schulz itself
//! is the `newton_schulz` family.
//!
//! Arenas are 1-D F32 tensors. A *segment* is a contiguous window of the arena (one AdamW view);
//! a *block* is a strided 2-D window (`rows` x `cols`, element (r, c) at
//! `offset + r * row_stride + c`): a head's rows or columns of a projection, one expert's
//! matrix, or a whole matrix. Segments and blocks must not overlap each other (the model's
//! layout guarantees it, and [`SegmentTable::new`] / [`BlockTable::new`] check it; each element
//! then has one writer per launch).
//!
//! Formulas (f32 on every device, in this operation order):
//! - AdamW, per element with `g' = grad_scale * g`:
//!   `m = b1 m + (1 - b1) g'`, `v = b2 v + (1 - b2) g'^2`,
//!   `p = p (1 - lr wd_segment) - lr (m / bc1) / (sqrt(v / bc2) + eps)`, with `bc1 = 1 - b1^t`,
//!   `bc2 = 1 - b2^t` computed by the caller;
//! - Muon momentum (fused into the gather): `m = mu m + g'`; the gathered value is
//!   `g' + mu m` (Nesterov) or `m`;
//! - Muon apply: `p = p (1 - lr wd) - (lr scale) x`;
//! - squared norm: device: per-chunk ([`NORM_CHUNK`] elements) fixed-order block sums in f32,
//!   then one block sums the partials in a fixed order; cpu: f64 per chunk, chunks summed in
//!   order. Both orders depend only on the length: deterministic, no atomics.
//!
//! `sluice kernel` rows (`spec`): `adamw`, `sq_norm`, `muon_gather`, `muon_apply`,
//! `cast_bf16`, over flat F32 vectors (AdamW: one segment covering the vector; Muon: the block
//! table given as `offsets[n]` and `row_strides[n]` I32 tensors).
//!
//! Files, one job each: `sq_norm` (the global squared norm), `adamw` (segments, their table,
//! AdamW), `blocks` (strided blocks, their table, the plain gather), `muon` (Muon's momentum
//! gather and apply), `cast_bf16` (the bf16 compute copy) and `spec` (the `sluice kernel`
//! rows); this file holds what they share.

mod adamw;
mod blocks;
mod cast_bf16;
mod muon;
mod spec;
mod sq_norm;

pub use adamw::{adamw, adamw_reference, check_segments, AdamWStep, Segment, SegmentTable};
pub use blocks::{
    check_blocks, check_disjoint, gather_blocks, gather_blocks_reference, BlockTable, StridedBlock,
    MAX_BLOCKS,
};
pub use cast_bf16::{cast_bf16_into, cast_bf16_reference, cast_bf16_reference_into};
pub use muon::{
    muon_apply, muon_apply_reference, muon_gather, muon_gather_reference, MuonApply, MuonMomentum,
};
pub use spec::{ADAMW_SPEC, CAST_BF16_SPEC, MUON_APPLY_SPEC, MUON_GATHER_SPEC, SQ_NORM_SPEC};
pub use sq_norm::{sq_norm, sq_norm_reference, NORM_CHUNK};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Threads per block of every optim kernel (optim.cu has the same number).
const THREADS: u32 = 256;

// ---------------------------------------------------------------------------------------------
// Validation shared by the references and the device entry points
// ---------------------------------------------------------------------------------------------

fn finite(name: &str, v: f32) -> Result<()> {
    if !v.is_finite() {
        return Err(Error::param(name, format!("{v} is not a finite number")));
    }
    Ok(())
}

fn check_arena(name: &str, t: &Tensor, len: usize) -> Result<()> {
    t.expect_dtype(name, DType::F32)?;
    if t.shape() != [len] {
        return Err(Error::shape(
            name,
            format!("[{len}] (the arena's length)"),
            t.shape(),
        ));
    }
    Ok(())
}
