//! Finite-difference checks of the gradient arena, view by view.
//!
//! For each named view, a few elements (chosen by a seeded generator, always including the first
//! and the last) are perturbed by +-eps and +-eps/2; the two central differences
//! D(h) = (L(p + h) - L(p - h)) / 2h are combined by Richardson extrapolation,
//! (4 D(eps/2) - D(eps)) / 3, which cancels the O(h^2) truncation error (large where an RMSNorm
//! normalises a short row) while keeping the step big enough that f32 rounding of the loss stays
//! small. The result is compared with the gradient arena's entry. The comparison is per view by relative norm over
//! the sampled elements, so one view with a wrong gradient cannot hide among correct ones. Every
//! perturbed element is restored to its exact original bits.

use crate::arena::Arena;
use crate::init::{fnv1a64, mix};
use sluice_kernels::{Error, Result};

/// The result of checking one view.
#[derive(Clone, Debug)]
pub struct ViewCheck {
    pub name: String,
    /// Element indices within the view that were checked.
    pub indices: Vec<usize>,
    /// The gradient arena's values at those elements.
    pub analytic: Vec<f64>,
    /// The central differences.
    pub numeric: Vec<f64>,
    /// ||analytic - numeric|| / max(||numeric||, floor).
    pub rel_err: f64,
}

/// Checks every view's gradient in `grads` against central differences of `loss` around
/// `params`. `samples` elements per view (fewer if the view is smaller), step `eps`.
/// `floor` keeps the relative error finite when a view's true gradient is ~0.
pub fn check_views(
    params: &mut Arena,
    grads: &Arena,
    mut loss: impl FnMut(&Arena) -> Result<f64>,
    samples: usize,
    eps: f32,
    floor: f64,
    seed: u64,
) -> Result<Vec<ViewCheck>> {
    if params.layout() != grads.layout() {
        return Err(Error::Invalid(
            "gradcheck: params and grads have different layouts".into(),
        ));
    }
    let layout = params.layout().clone();
    let g = grads.to_vec()?;
    let mut out = Vec::with_capacity(layout.views().len());
    for spec in layout.views() {
        let n = spec.numel();
        let mut indices = vec![0, n - 1];
        let mut state = mix(seed ^ fnv1a64(spec.name.as_bytes()));
        while indices.len() < samples.min(n) {
            state = mix(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
            let i = (state % n as u64) as usize;
            if !indices.contains(&i) {
                indices.push(i);
            }
        }
        indices.truncate(samples.min(n).max(1));
        indices.sort_unstable();
        indices.dedup();
        let mut analytic = Vec::with_capacity(indices.len());
        let mut numeric = Vec::with_capacity(indices.len());
        for &i in &indices {
            let at = spec.offset + i;
            let orig = params.as_slice()?[at];
            let mut central = |step: f32| -> Result<f64> {
                params.as_mut_slice()?[at] = orig + step;
                let up = loss(params)?;
                params.as_mut_slice()?[at] = orig - step;
                let down = loss(params)?;
                params.as_mut_slice()?[at] = orig;
                // The step actually taken in f32 (orig + step is rounded).
                let h = ((orig + step) as f64 - (orig - step) as f64) / 2.0;
                Ok((up - down) / (2.0 * h))
            };
            let (full, half) = (central(eps)?, central(eps / 2.0)?);
            numeric.push((4.0 * half - full) / 3.0);
            analytic.push(g[at] as f64);
        }
        let diff: f64 = analytic
            .iter()
            .zip(&numeric)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = numeric.iter().map(|b| b * b).sum::<f64>().sqrt();
        let rel_err = if diff.is_finite() {
            diff / norm.max(floor)
        } else {
            f64::INFINITY
        };
        out.push(ViewCheck {
            name: spec.name.clone(),
            indices,
            analytic,
            numeric,
            rel_err,
        });
    }
    Ok(out)
}
