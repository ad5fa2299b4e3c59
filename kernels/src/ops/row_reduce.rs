//! THE row log-sum-exp of sluice, on the CPU. `kernels/cuda/common/row_reduce.cuh` is the same
//! routine on the device; the sampler and is_gate_loss both call it (on every device), so for
//! the same logits row the sampler's log-prob at temperature 1 and the loss's `logp` are
//! bit-identical on each device (DESIGN.md 3.3, 3.6, 6.6).
//!
//! The fixed order, shared with the device:
//! 1. [`ROW_LANES`] = 256 lanes (the device's 256 threads). Lane `l` visits the row's entries
//!    `l, l + 256, l + 512, ...` in increasing order, keeping an online (max `m`, sum `s`) pair:
//!    for each value `x`: `m' = max(m, x)`; `s = s * exp(m - m') + exp(x - m')`; `m = m'`
//!    (skipped while `m'` is -inf). The device writes the same update with one exponential
//!    (`x > m`: `s = s * exp(m - x) + 1`; else `s += exp(x - m)`), which is the same arithmetic
//!    because `exp(0) = 1` and `s * 1 = s` exactly.
//! 2. The 256 lane pairs are combined by a fixed tree: for stride 128, 64, ..., 1, lane `t <
//!    stride` takes `combine(lane t, lane t + stride)`.
//! 3. `lse = m + ln(s)`.
//!
//! -inf entries are allowed (they add nothing). A row whose entries are all -inf has no
//! probability mass: its lse is -inf, and [`row_logprob`] defines every log-prob in it as -inf
//! (never NaN). +inf and NaN logits are not supported (the results are NaN).
//! The exponential is `f32::exp` here, `expf` (not `__expf`) on CUDA and the host `expf` under
//! the emulator; products and sums are rounded separately (no fused multiply-add) on the device
//! as here.

use half::bf16;

/// Lanes of the fixed row reduction (the device's threads per row).
pub const ROW_LANES: usize = 256;

/// A logits element: f32 or bf16, read as f32.
pub trait Logit: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Logit for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Logit for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// The online (max, sum of exp(x - max)) pair of one lane.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LseState {
    pub m: f32,
    pub s: f32,
}

impl LseState {
    pub const EMPTY: LseState = LseState {
        m: f32::NEG_INFINITY,
        s: 0.0,
    };

    /// Adds one value (see the module comment for the order).
    #[inline(always)]
    pub fn push(&mut self, x: f32) {
        let m_new = self.m.max(x);
        if m_new == f32::NEG_INFINITY {
            return;
        }
        self.s = self.s * (self.m - m_new).exp() + (x - m_new).exp();
        self.m = m_new;
    }

    /// Merges two lanes (commutative).
    #[inline(always)]
    pub fn combine(self, other: LseState) -> LseState {
        let m = self.m.max(other.m);
        if m == f32::NEG_INFINITY {
            return LseState::EMPTY;
        }
        LseState {
            m,
            s: self.s * (self.m - m).exp() + other.s * (other.m - m).exp(),
        }
    }

    /// `m + ln(s)`, or -inf for an empty (all -inf) row.
    #[inline]
    pub fn lse(self) -> f32 {
        if self.m == f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            self.m + self.s.ln()
        }
    }
}

/// The fixed tree over [`ROW_LANES`] lanes: stride 128, 64, ..., 1; lane t takes
/// `f(lane t, lane t + stride)`. Returns lane 0. Shared by every fixed-order reduction of the
/// policy kernels (the device runs the same tree in shared memory).
pub fn lane_tree<T: Copy>(lanes: &mut [T; ROW_LANES], f: impl Fn(T, T) -> T) -> T {
    let mut stride = ROW_LANES / 2;
    while stride > 0 {
        for t in 0..stride {
            lanes[t] = f(lanes[t], lanes[t + stride]);
        }
        stride /= 2;
    }
    lanes[0]
}

/// The row's (max, sum) state after the fixed lane order and tree, for values `x * scale`.
pub fn row_lse_state<T: Logit>(row: &[T], scale: f32) -> LseState {
    let mut lanes = [LseState::EMPTY; ROW_LANES];
    for chunk in row.chunks(ROW_LANES) {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            lane.push(x.to_f32() * scale);
        }
    }
    lane_tree(&mut lanes, LseState::combine)
}

/// log-sum-exp of `row * scale` in the shared fixed order (-inf for an all -inf row).
pub fn row_lse<T: Logit>(row: &[T], scale: f32) -> f32 {
    row_lse_state(row, scale).lse()
}

/// The log-prob of an entry whose scaled logit is `z`, given the row's lse: `z - lse`, or -inf
/// when the row has no mass (lse = -inf). The sampler and the loss both use exactly this.
#[inline]
pub fn row_logprob(z: f32, lse: f32) -> f32 {
    if lse == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        z - lse
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branchless_push_matches_the_device_form() {
        // The device's one-exponential update, written out here, must give the same bits.
        let mut rng = crate::testing::Rng::new(3);
        let xs: Vec<f32> = (0..5000).map(|_| rng.normal() as f32 * 4.0).collect();
        let (mut a, mut b) = (LseState::EMPTY, LseState::EMPTY);
        for &x in &xs {
            a.push(x);
            if x > b.m {
                b.s = b.s * (b.m - x).exp() + 1.0;
                b.m = x;
            } else if b.m != f32::NEG_INFINITY {
                b.s += (x - b.m).exp();
            }
        }
        assert_eq!(a.m.to_bits(), b.m.to_bits());
        assert_eq!(a.s.to_bits(), b.s.to_bits());
    }

    #[test]
    fn all_neg_inf_row_is_defined() {
        let row = [f32::NEG_INFINITY; 300];
        let lse = row_lse(&row, 1.0);
        assert_eq!(lse, f32::NEG_INFINITY);
        assert_eq!(row_logprob(row[0], lse), f32::NEG_INFINITY);
    }

    #[test]
    fn matches_f64_lse() {
        let mut rng = crate::testing::Rng::new(5);
        for v in [1usize, 17, 255, 256, 257, 1000] {
            let row: Vec<f32> = (0..v).map(|_| rng.normal() as f32 * 3.0).collect();
            let m = row
                .iter()
                .cloned()
                .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let want = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            let got = row_lse(&row, 1.0) as f64;
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "v={v}");
        }
    }
}
