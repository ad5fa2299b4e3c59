//! Deterministic, seeded parameter initialisation (docs/model.md, "Initialisation").
//!
//! Each view follows its [`InitRule`]: RMSNorm scales are ones; every matrix is drawn from
//! normal(0, init_std), except the output projections (W_o, and W2 of every FFN), which use
//! init_std / sqrt(2 n_layers). Padding between views is zero.
//!
//! The generator: a view is cut into chunks of [`CHUNK`] elements; chunk `c` of view `name`
//! draws from its own SplitMix64 stream whose starting state is
//! `mix(mix(seed ^ fnv1a64(name)) + c)` (`mix` = the SplitMix64 finaliser). Consecutive pairs of
//! 64-bit outputs become two normals by Box-Muller in f64 (u1 = (x1 >> 11 + 1) / 2^53 in (0, 1],
//! u2 = (x2 >> 11) / 2^53: z0 = r cos(2 pi u2), z1 = r sin(2 pi u2), r = sqrt(-2 ln u1)), scaled by
//! the std and rounded to f32. So a view's values depend only on the seed, its name and its
//! shape: adding a view or a layer leaves every other view's values unchanged, and chunks can
//! be drawn in parallel with the same result.

use crate::layout::{InitRule, Layout};
use rayon::prelude::*;

/// Elements per independent generator stream.
pub const CHUNK: usize = 4096;

/// The SplitMix64 finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a, 64-bit (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
}

/// Fills `out` (chunk `chunk` of a view whose name hashes to `name_hash`) with normal draws.
fn fill_normal(out: &mut [f32], seed: u64, name_hash: u64, chunk: usize, std: f64) {
    let mut g = SplitMix64(mix(mix(seed ^ name_hash).wrapping_add(chunk as u64)));
    let two_pi = 2.0 * std::f64::consts::PI;
    for pair in out.chunks_mut(2) {
        let u1 = ((g.next() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let u2 = (g.next() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (two_pi * u2).sin_cos();
        pair[0] = (r * c * std) as f32;
        if let Some(second) = pair.get_mut(1) {
            *second = (r * s * std) as f32;
        }
    }
}

/// The initial values of the whole arena (padding zero) for `seed` and `init_std`.
pub fn initial_values(layout: &Layout, seed: u64, init_std: f64) -> Vec<f32> {
    let mut out = vec![0.0f32; layout.len()];
    // Split the arena into (view, chunk) jobs over disjoint windows, then fill them in parallel.
    let mut jobs: Vec<(&mut [f32], InitRule, u64, usize)> = Vec::new();
    let mut rest: &mut [f32] = &mut out;
    let mut consumed = 0;
    for spec in layout.views() {
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(spec.offset - consumed);
        let (view, tail) = tail.split_at_mut(spec.numel());
        consumed = spec.offset + spec.numel();
        rest = tail;
        let name_hash = fnv1a64(spec.name.as_bytes());
        for (c, chunk) in view.chunks_mut(CHUNK).enumerate() {
            jobs.push((chunk, spec.init, name_hash, c));
        }
    }
    jobs.into_par_iter()
        .for_each(|(chunk, rule, name_hash, c)| match rule {
            InitRule::Ones => chunk.fill(1.0),
            InitRule::Normal { scale } => fill_normal(chunk, seed, name_hash, c, scale * init_std),
        });
    out
}
