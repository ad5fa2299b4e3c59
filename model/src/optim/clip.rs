//! The global gradient norm and the clipping factor.
//!
//! The norm is one reduction over the whole gradient arena (alignment padding is zero, so it
//! adds nothing): on cpu in f64 over fixed chunks summed in order; on emu/cuda two launches of
//! the optim family (per-chunk fixed-order block sums, then one block sums the partials in order)
//! and a 4-byte download. No float atomics, so the norm (and everything clipped by it) has the
//! same bits run after run.

use crate::arena::Arena;
use sluice_kernels::ops::optim::sq_norm;
use sluice_kernels::{Backend, DType, Result};

/// The L2 norm of every element of `grads` (an F32 arena).
pub fn global_norm(backend: &Backend, grads: &Arena) -> Result<f64> {
    grads.tensor().expect_dtype("grads", DType::F32)?;
    Ok(sq_norm(backend, grads.tensor())?.sqrt())
}

/// The factor that brings a gradient of norm `norm` down to `max_norm`: `max_norm / (norm +
/// 1e-6)` when `norm > max_norm`, else 1.
pub fn clip_scale(norm: f64, max_norm: Option<f32>) -> f32 {
    match max_norm {
        Some(c) if norm > c as f64 => (c as f64 / (norm + 1e-6)) as f32,
        _ => 1.0,
    }
}
