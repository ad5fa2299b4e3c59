//! Helpers for tests and benches: a seeded generator, relative-norm comparison.

/// SplitMix64: small, fast, and the same numbers on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// `n` standard normal f32 values scaled by `scale`.
    pub fn normal_vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() as f32 * scale).collect()
    }
}

/// ||got - want|| / ||want||, computed in f64. NaN or infinite entries in `got` give infinity,
/// so NaN never passes a tolerance.
pub fn rel_norm(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_norm: lengths differ");
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w).powi(2);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Relative-norm tolerance of f32 results (DESIGN.md section 2).
pub const F32_TOL: f64 = 1e-5;
/// Relative-norm tolerance of bf16 results (DESIGN.md section 2).
pub const BF16_TOL: f64 = 1e-2;
