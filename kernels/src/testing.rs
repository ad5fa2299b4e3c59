//! Helpers for tests and benches: a seeded generator, relative-norm comparison, and the
//! element-wise bound of a matrix product against its reference.

use crate::dtype::DType;

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
/// Relative-norm tolerance of bf16 results (DESIGN.md section 2), for composite ops whose error
/// has no simple per-output bound (MoE, attention, Newton-Schulz, a bf16-stored gradient). A norm
/// over many outputs hides a few wrong ones, so tests that use it also require [`lost_outputs`]
/// to be 0. A plain matrix product has its element-wise bound instead
/// ([`check_matmul_elementwise`]).
pub const BF16_TOL: f64 = 1e-2;

/// Outputs that are exactly 0 (either sign) where the reference is not: an output never written
/// or zeroed, which a relative norm over many outputs lets through (one in 10^4 costs 1e-2).
pub fn lost_outputs(got: &[f32], want: &[f32]) -> usize {
    assert_eq!(got.len(), want.len(), "lost_outputs: lengths differ");
    got.iter()
        .zip(want)
        .filter(|(&g, &w)| g == 0.0 && w != 0.0)
        .count()
}

// ---------------------------------------------------------------------------------------------
// Element-wise bound of a matrix product (C = A . B^T) against its CPU reference
// ---------------------------------------------------------------------------------------------

/// Unit roundoff of f32 under round-to-nearest: the CPU reference's additions and products.
pub const F32_UNIT_ROUNDOFF: f64 = 1.0 / (1u64 << 24) as f64;
/// The error of one f32 accumulation step on a device, relative to the magnitudes it adds:
/// one unit in the last place (2^-23). It covers round-to-nearest FFMA, and tensor cores, whose
/// block additions align every addend to the largest exponent and truncate it (Fasi, Higham,
/// Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021: products of
/// bf16/fp16 inputs exact, at least 24 significant bits kept, truncation rather than rounding).
/// If a GPU ever fails [`matmul_bound_factor`] on many elements at once, not on a few, this is the
/// assumption to revisit.
pub const DEVICE_ACCUMULATION_ULP: f64 = 1.0 / (1u64 << 23) as f64;

/// gamma_n(u) = n u / (1 - n u): the relative bound after n operations of relative error u
/// (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., lemma 3.1).
fn gamma(n: usize, u: f64) -> f64 {
    let nu = n as f64 * u;
    assert!(nu < 0.5, "gamma({n}, {u:e}): the bound needs n u < 1/2");
    nu / (1.0 - nu)
}

/// `c(K, dtype)` such that, for every output of a K-long product of inputs stored in `dtype`,
/// `|device - reference| <= c * sum_k |a_k b_k|` (plus an underflow term, see
/// [`check_matmul_elementwise`]).
///
/// Derivation. Each result is sum_k a_k b_k summed in f32 in some order. If every operation on
/// the way errs by at most u times the sum of the magnitudes of its inputs, and every product
/// passes through at most L such operations, the computed sum differs from the exact one by at
/// most gamma_L(u) sum_k |a_k b_k| (Higham, section 3.1). L, whatever the order: a chain of
/// FMAs or additions costs K; partial sums combined in a tree or across k-blocks of a tile, at
/// most K more; a tensor core's block addition of b products into the accumulator truncates each
/// of its b + 1 addends by less than one ulp of the largest, so it counts as b + 1 operations and
/// the K/b blocks of a chain as K + K/b <= 2K; the rounding of the product itself, one more when
/// the inputs are f32 (bf16 products have at most 16 significant bits: exact in f32). So:
///   device:    L = 2K (+1 for f32 inputs), u = [`DEVICE_ACCUMULATION_ULP`] = 2^-23;
///   reference: L = 2K (+1 for f32 inputs), u = [`F32_UNIT_ROUNDOFF`] = 2^-24 (round to nearest);
///   c = gamma_L(2^-23) + gamma_L(2^-24), by the triangle inequality through the exact sum.
/// For K = 1000 that is 3.6e-4: an output whose |a|.|b| is 640 (standard normal inputs) may differ
/// by 0.23, while a dropped 16-wide k-step or a zeroed output (|c| about 32) is off by far more.
pub fn matmul_bound_factor(k: usize, dtype: DType) -> f64 {
    let l = 2 * k
        + match dtype {
            DType::BF16 => 0,
            _ => 1,
        };
    gamma(l, DEVICE_ACCUMULATION_ULP) + gamma(l, F32_UNIT_ROUNDOFF)
}

/// sum_k |a[i,k] b[j,k]| for C[m,n] = A[m,k] . B[n,k]^T, in f64 (exact to far below the bound's
/// own size): the scale of each output's rounding error.
pub fn matmul_abs_sums(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    use rayon::prelude::*;
    assert_eq!(a.len(), m * k, "matmul_abs_sums: a must hold m*k");
    assert_eq!(b.len(), n * k, "matmul_abs_sums: b must hold n*k");
    let mut s = vec![0.0f64; m * n];
    if n == 0 {
        return s;
    }
    s.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        let ar = &a[i * k..(i + 1) * k];
        for (j, out) in row.iter_mut().enumerate() {
            let br = &b[j * k..(j + 1) * k];
            *out = ar
                .iter()
                .zip(br)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
        }
    });
    s
}

/// What [`check_matmul_elementwise`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct MatmulCheck {
    /// Outputs compared.
    pub outputs: usize,
    /// Outputs further from the reference than their bound.
    pub over_bound: usize,
    /// Outputs exactly 0 (either sign) where the reference is not: an output never written, or
    /// zeroed, that a norm over many outputs would hide. Must be 0.
    pub lost: usize,
    /// NaN or infinite outputs.
    pub non_finite: usize,
    /// The largest |got - want| / bound, and the output where it occurs.
    pub worst_ratio: f64,
    pub worst_index: usize,
}

impl MatmulCheck {
    /// Panics with a message naming the first kind of failure, unless every output is finite,
    /// within its bound and not lost.
    pub fn assert_ok(&self, label: &str) {
        assert!(
            self.non_finite == 0 && self.over_bound == 0 && self.lost == 0,
            "{label}: {} of {} outputs over the element-wise bound (worst {:.3}x at {}), {} exact \
             zeros where the reference is not, {} NaN or infinite",
            self.over_bound,
            self.outputs,
            self.worst_ratio,
            self.worst_index,
            self.lost,
            self.non_finite
        );
    }
}

/// Compares a device's matrix product with the CPU reference output by output:
/// `|got - want| <= matmul_bound_factor(k, dtype) * abs_sums + 2K * 2^-149` (the last term
/// covers underflow: an operation whose result is subnormal errs by up to 2^-150 absolutely), and
/// counts the outputs lost to an exact zero. `abs_sums` from [`matmul_abs_sums`] on the same
/// (dtype-rounded) inputs the reference used.
pub fn check_matmul_elementwise(
    got: &[f32],
    want: &[f32],
    abs_sums: &[f64],
    k: usize,
    dtype: DType,
) -> MatmulCheck {
    assert_eq!(
        got.len(),
        want.len(),
        "check_matmul_elementwise: lengths differ"
    );
    assert_eq!(
        got.len(),
        abs_sums.len(),
        "check_matmul_elementwise: abs_sums length"
    );
    let c = matmul_bound_factor(k, dtype);
    let floor = 2.0 * k as f64 * f64::from(f32::from_bits(1));
    let mut r = MatmulCheck {
        outputs: got.len(),
        over_bound: 0,
        lost: 0,
        non_finite: 0,
        worst_ratio: 0.0,
        worst_index: 0,
    };
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(abs_sums).enumerate() {
        if !g.is_finite() {
            r.non_finite += 1;
            continue;
        }
        if g == 0.0 && w != 0.0 {
            r.lost += 1;
        }
        let bound = c * s + floor;
        let ratio = (g as f64 - w as f64).abs() / bound;
        if ratio > 1.0 {
            r.over_bound += 1;
        }
        if ratio > r.worst_ratio {
            r.worst_ratio = ratio;
            r.worst_index = i;
        }
    }
    r
}
