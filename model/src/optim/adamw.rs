//! AdamW over the AdamW views (embedding, LM head, router, norm scales): one fused launch over
//! every AdamW element of the arena.
//!
//! The launch covers the views through a segment table built once from the layout: per view its
//! arena offset, the prefix sum of the view lengths (so a thread maps its index in the compact
//! range of all AdamW elements to a view by binary search) and the view's weight decay (the
//! config's for matrices; 0 for 1-D views unless `decay_vectors`). Bias correction uses the
//! step count t: bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, computed in f64 on the host.

use super::{AdamWConfig, OptimState};
use crate::arena::Arena;
use crate::layout::{Layout, OptimKind};
use sluice_kernels::ops::optim::{adamw, AdamWStep, Segment, SegmentTable};
use sluice_kernels::{Backend, Result};

/// The segment table of `layout`'s AdamW views, on `backend`.
pub fn segment_table(
    backend: &Backend,
    layout: &Layout,
    config: &AdamWConfig,
) -> Result<SegmentTable> {
    let segments = layout
        .views_of(OptimKind::AdamW)
        .map(|v| Segment {
            start: v.offset,
            len: v.numel(),
            weight_decay: if v.shape.len() >= 2 || config.decay_vectors {
                config.weight_decay
            } else {
                0.0
            },
        })
        .collect();
    SegmentTable::new(backend, segments, layout.len())
}

/// The scalars of step `t` (1-based) at learning-rate factor `lr_factor`.
pub fn step_scalars(config: &AdamWConfig, t: u64, lr_factor: f32, grad_scale: f32) -> AdamWStep {
    let t = t.min(i32::MAX as u64) as i32;
    AdamWStep {
        lr: config.lr * lr_factor,
        beta1: config.beta1,
        beta2: config.beta2,
        eps: config.eps,
        bc1: (1.0 - (config.beta1 as f64).powi(t)) as f32,
        bc2: (1.0 - (config.beta2 as f64).powi(t)) as f32,
        grad_scale,
    }
}

/// One AdamW step over the table's views (in place in `params`, `state.m`, `state.v`).
#[allow(clippy::too_many_arguments)]
pub fn step(
    backend: &Backend,
    table: &SegmentTable,
    config: &AdamWConfig,
    params: &mut Arena,
    grads: &Arena,
    state: &mut OptimState,
    t: u64,
    lr_factor: f32,
    grad_scale: f32,
) -> Result<()> {
    let hp = step_scalars(config, t, lr_factor, grad_scale);
    adamw(
        backend,
        params.tensor_mut(),
        grads.tensor(),
        state.m.tensor_mut(),
        state.v.tensor_mut(),
        table,
        &hp,
    )
}
