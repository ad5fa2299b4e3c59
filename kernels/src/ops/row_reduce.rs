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
//! The exponential is [`exp_fast`] here (a branch-free Cephes-style expf that the compiler
//! vectorises; within 2 ulp of the correctly rounded value), `expf` (not `__expf`) on CUDA and
//! the host `expf` under the emulator. Each device is consistent with itself, which is what the
//! bit-identity of sampler and loss needs; across devices results agree to f32 tolerance.
//! Products and sums are rounded separately (no fused multiply-add) on the device as here.

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

/// exp(x) for f32 without a libm call, so loops over a row vectorise: 2^n * e^r with
/// r = x - n ln2 (Cody-Waite split), |r| <= ln2 / 2, and the Cephes expf polynomial. Within 2 ulp
/// of the correctly rounded result; returns 0 below -87.3 (where exp is subnormal or 0, -inf
/// included) and +inf above 88.7.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (SSE2-friendly).
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 88.7);
    // t holds round(xc * log2 e) in its low mantissa bits; reading them back as an integer
    // (not an `as` cast, which would not vectorise) gives the exponent of 2^n.
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * (r * r) + r + 1.0;
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let v = y * scale;
    if x < -87.3 {
        0.0
    } else if x > 88.7 {
        f32::INFINITY
    } else {
        v
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

    /// Adds one value (see the module comment for the order). Branch-free: one exponential
    /// `e = exp(-|x - m|)`, then `s * e + 1` with `m = x` when `x > m`, else `s + e` (skipped
    /// while m is -inf) -- the same arithmetic as `s * exp(m - m') + exp(x - m')`.
    #[inline(always)]
    pub fn push(&mut self, x: f32) {
        let (m, s) = (self.m, self.s);
        let e = exp_fast(-(x - m).abs());
        let up = x > m;
        let s_keep = if m != f32::NEG_INFINITY { s + e } else { s };
        self.s = if up { s * e + 1.0 } else { s_keep };
        self.m = if up { x } else { m };
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
            s: self.s * exp_fast(self.m - m) + other.s * exp_fast(other.m - m),
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

/// One lane's (max `m`, sum `s` of exp(x - m), sum `t` of exp(x - m) (x - m)): [`LseState`]
/// with one more online sum, so the softmax entropy `H = ln(s) - t / s` (= lse - sum p x)
/// comes out of the same pass (is_gate_loss's entropy bonus; the device's `EntState`). `m` and
/// `s` take exactly [`LseState::push`]'s and [`LseState::combine`]'s steps, so the lse is the
/// same bits with or without `t`. `t` is kept relative to the running max: no difference of
/// two large numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EntState {
    pub m: f32,
    pub s: f32,
    pub t: f32,
}

impl EntState {
    pub const EMPTY: EntState = EntState {
        m: f32::NEG_INFINITY,
        s: 0.0,
        t: 0.0,
    };

    /// Adds one value. A new max x rescales t: sum e^(y - x)(y - x) = e^(m - x)(t + (m - x) s)
    /// (the new entry adds 0); an entry below the max adds e^(x - m)(x - m), nothing for
    /// x = -inf (weight 0; 0 * -inf would be NaN). Branch-free like [`LseState::push`].
    #[inline(always)]
    pub fn push(&mut self, x: f32) {
        let (m, s, t) = (self.m, self.s, self.t);
        let d = x - m;
        let e = exp_fast(-d.abs());
        let up = x > m;
        let live = m != f32::NEG_INFINITY;
        let s_keep = if live { s + e } else { s };
        let t_up = if live { e * (t + (m - x) * s) } else { 0.0 };
        let t_keep = if live && x != f32::NEG_INFINITY {
            t + e * d
        } else {
            t
        };
        self.s = if up { s * e + 1.0 } else { s_keep };
        self.t = if up { t_up } else { t_keep };
        self.m = if up { x } else { m };
    }

    /// Merges two lanes.
    #[inline(always)]
    pub fn combine(self, other: EntState) -> EntState {
        let m = self.m.max(other.m);
        if m == f32::NEG_INFINITY {
            return EntState::EMPTY;
        }
        let (ea, eb) = (exp_fast(self.m - m), exp_fast(other.m - m));
        let rescale = |a: EntState, e: f32| {
            if a.m == f32::NEG_INFINITY {
                0.0
            } else {
                e * (a.t + (a.m - m) * a.s)
            }
        };
        EntState {
            m,
            s: self.s * ea + other.s * eb,
            t: rescale(self, ea) + rescale(other, eb),
        }
    }

    /// The (m, s) pair: the row's lse state.
    pub fn lse_state(self) -> LseState {
        LseState {
            m: self.m,
            s: self.s,
        }
    }

    /// The softmax entropy `ln(s) - t / s` (0 for a row with no mass).
    pub fn entropy(self) -> f32 {
        if self.m == f32::NEG_INFINITY {
            0.0
        } else {
            self.s.ln() + -(self.t / self.s)
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

/// The [`ROW_LANES`] lane states of a row in progress (structure of arrays, so the per-chunk
/// update vectorises).
pub struct RowLanes {
    m: [f32; ROW_LANES],
    s: [f32; ROW_LANES],
}

impl Default for RowLanes {
    fn default() -> Self {
        RowLanes {
            m: [f32::NEG_INFINITY; ROW_LANES],
            s: [0.0; ROW_LANES],
        }
    }
}

impl RowLanes {
    /// Pushes one chunk of at most [`ROW_LANES`] consecutive entries: entry l goes to lane l.
    #[inline(always)]
    pub fn push_chunk<T: Logit>(&mut self, chunk: &[T], scale: f32) {
        for ((m, s), &x) in self.m.iter_mut().zip(self.s.iter_mut()).zip(chunk) {
            let mut st = LseState { m: *m, s: *s };
            st.push(x.to_f32() * scale);
            *m = st.m;
            *s = st.s;
        }
    }

    /// The fixed tree over the lanes.
    pub fn finish(&self) -> LseState {
        let mut lanes = [LseState::EMPTY; ROW_LANES];
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane = LseState {
                m: self.m[l],
                s: self.s[l],
            };
        }
        lane_tree(&mut lanes, LseState::combine)
    }
}

/// The row's (max, sum) state after the fixed lane order and tree, for values `x * scale`.
pub fn row_lse_state<T: Logit>(row: &[T], scale: f32) -> LseState {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of the
        // target-feature function; it does the same IEEE operations 8 lanes at a time.
        return unsafe { row_lse_state_avx2(row, scale) };
    }
    row_lse_state_portable(row, scale)
}

#[inline(always)]
fn row_lse_state_portable<T: Logit>(row: &[T], scale: f32) -> LseState {
    let mut lanes = RowLanes::default();
    for chunk in row.chunks(ROW_LANES) {
        lanes.push_chunk(chunk, scale);
    }
    lanes.finish()
}

/// The same loop compiled for AVX2: the same operations (no FMA: Rust never contracts), so the
/// same bits as the portable build, 8 lanes per instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_lse_state_avx2<T: Logit>(row: &[T], scale: f32) -> LseState {
    row_lse_state_portable(row, scale)
}

/// The row's [`EntState`] after the fixed lane order and tree, for values `x * scale`: the
/// same lanes and tree as [`row_lse_state`] (so `lse_state()` is its bits) with the entropy sum.
pub fn row_ent_state<T: Logit>(row: &[T], scale: f32) -> EntState {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement.
        return unsafe { row_ent_state_avx2(row, scale) };
    }
    row_ent_state_portable(row, scale)
}

#[inline(always)]
fn row_ent_state_portable<T: Logit>(row: &[T], scale: f32) -> EntState {
    let mut m = [f32::NEG_INFINITY; ROW_LANES];
    let mut s = [0.0f32; ROW_LANES];
    let mut t = [0.0f32; ROW_LANES];
    for chunk in row.chunks(ROW_LANES) {
        for (l, &x) in chunk.iter().enumerate() {
            let mut st = EntState {
                m: m[l],
                s: s[l],
                t: t[l],
            };
            st.push(x.to_f32() * scale);
            (m[l], s[l], t[l]) = (st.m, st.s, st.t);
        }
    }
    let mut lanes = [EntState::EMPTY; ROW_LANES];
    for (l, lane) in lanes.iter_mut().enumerate() {
        *lane = EntState {
            m: m[l],
            s: s[l],
            t: t[l],
        };
    }
    lane_tree(&mut lanes, EntState::combine)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_ent_state_avx2<T: Logit>(row: &[T], scale: f32) -> EntState {
    row_ent_state_portable(row, scale)
}

/// The gradient row of the policy loss with the entropy bonus: `out[j] = coef * (0 - p_j) +
/// (ecoef * p_j) * ((z_j - lse) + h)`, p_j = exp(z_j - lse), z_j = x[j] * scale (d(-c H)/dz_j
/// = c p_j (log p_j + H) with ecoef = c scaled as coef is). The caller fixes the token's entry.
pub fn entropy_grad_row<T: Logit>(
    src: Option<&[T]>,
    out: &mut [T],
    coef: f32,
    ecoef: f32,
    lse: f32,
    h: f32,
    scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement; the same
        // IEEE operations 8 lanes at a time (no FMA: Rust never contracts).
        return unsafe { entropy_grad_row_avx2(src, out, coef, ecoef, lse, h, scale) };
    }
    entropy_grad_row_portable(src, out, coef, ecoef, lse, h, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn entropy_grad_row_avx2<T: Logit>(
    src: Option<&[T]>,
    out: &mut [T],
    coef: f32,
    ecoef: f32,
    lse: f32,
    h: f32,
    scale: f32,
) {
    entropy_grad_row_portable(src, out, coef, ecoef, lse, h, scale)
}

#[inline(always)]
fn entropy_grad_row_portable<T: Logit>(
    src: Option<&[T]>,
    out: &mut [T],
    coef: f32,
    ecoef: f32,
    lse: f32,
    h: f32,
    scale: f32,
) {
    let entry = |x: f32| {
        let lz = x * scale - lse;
        let p = exp_fast(lz);
        T::from_f32(coef * (0.0 - p) + (ecoef * p) * (lz + h))
    };
    match src {
        Some(r) => {
            for (g, &x) in out.iter_mut().zip(r) {
                *g = entry(x.to_f32());
            }
        }
        None => {
            for g in out.iter_mut() {
                *g = entry(g.to_f32());
            }
        }
    }
}

/// The gradient row of the policy loss: `out[j] = coef * (0 - exp(x[j] * scale - lse))` for x
/// read from `src` (or from `out` itself when `src` is None: in place). The caller fixes the
/// token's entry afterwards. Dispatches to an AVX2 build where the CPU has it (same bits).
pub fn softmax_grad_row<T: Logit>(
    src: Option<&[T]>,
    out: &mut [T],
    coef: f32,
    lse: f32,
    scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { softmax_grad_row_avx2(src, out, coef, lse, scale) };
    }
    softmax_grad_row_portable(src, out, coef, lse, scale)
}

#[inline(always)]
fn softmax_grad_row_portable<T: Logit>(
    src: Option<&[T]>,
    out: &mut [T],
    coef: f32,
    lse: f32,
    scale: f32,
) {
    match src {
        Some(r) => {
            for (g, &x) in out.iter_mut().zip(r) {
                *g = T::from_f32(coef * (0.0 - exp_fast(x.to_f32() * scale - lse)));
            }
        }
        None => {
            for g in out.iter_mut() {
                *g = T::from_f32(coef * (0.0 - exp_fast(g.to_f32() * scale - lse)));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_grad_row_avx2<T: Logit>(
    src: Option<&[T]>,
    out: &mut [T],
    coef: f32,
    lse: f32,
    scale: f32,
) {
    softmax_grad_row_portable(src, out, coef, lse, scale)
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
                b.s = b.s * exp_fast(b.m - x) + 1.0;
                b.m = x;
            } else if b.m != f32::NEG_INFINITY {
                b.s += exp_fast(x - b.m);
            }
        }
        assert_eq!(a.m.to_bits(), b.m.to_bits());
        assert_eq!(a.s.to_bits(), b.s.to_bits());
    }

    #[test]
    fn exp_fast_is_within_2_ulp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_fast(x) as f64;
            let ulp = f32::EPSILON as f64 * want;
            assert!((got - want).abs() <= 2.0 * ulp, "x={x}: {got} vs {want}");
            x += 0.001_37;
        }
        assert_eq!(exp_fast(0.0), 1.0);
        assert_eq!(exp_fast(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_fast(-100.0), 0.0);
    }

    #[test]
    fn entropy_state_keeps_the_lse_bits_and_matches_f64() {
        let mut rng = crate::testing::Rng::new(9);
        for v in [1usize, 17, 255, 257, 1000] {
            let mut row: Vec<f32> = (0..v).map(|_| rng.normal() as f32 * 3.0 + 40.0).collect();
            if v > 17 {
                row[3] = f32::NEG_INFINITY;
            }
            let st = row_ent_state(&row, 1.0);
            let lse = row_lse_state(&row, 1.0);
            assert_eq!(st.lse_state().m.to_bits(), lse.m.to_bits(), "v={v}");
            assert_eq!(st.lse_state().s.to_bits(), lse.s.to_bits(), "v={v}");
            let lse64 = row_lse(&row, 1.0) as f64;
            let want: f64 = -row
                .iter()
                .map(|&x| {
                    let lp = x as f64 - lse64;
                    if lp.is_finite() {
                        lp.exp() * lp
                    } else {
                        0.0
                    }
                })
                .sum::<f64>();
            // f32 sums of v terms near 1: a few ulp of H per term at most.
            assert!(
                (st.entropy() as f64 - want).abs() <= 1e-5 * v as f64,
                "v={v}"
            );
        }
        assert_eq!(row_ent_state(&[f32::NEG_INFINITY; 3], 1.0).entropy(), 0.0);
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
