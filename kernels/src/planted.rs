//! TEST-ONLY (feature `planted-faults`, never in a normal build): faults that the tests of
//! `sluice determinism` plant in a few CPU references, to show that each check and probe of the
//! tool fails when the property it guards is broken (docs/determinism.md, "Planted faults").
//!
//! A fault is inert unless the environment variable `SLUICE_PLANT` names it (a comma-separated
//! list), so a test build with the feature computes exactly what a normal build does. Each
//! fault is one realistic way to lose a promised identity:
//!
//! | name | where | what it breaks |
//! |---|---|---|
//! | `sq_norm_order` | `sq_norm` (cpu) | the chunk sums added in descending order: new bits, still deterministic (a golden check must fail) |
//! | `sq_norm_threads` | `sq_norm` (cpu) | chunks of n / threads instead of 8192: bits depend on the thread count |
//! | `gemm_batch_variant` | `gemm` (cpu, F32) | products of more than 64 rows summed over K in descending order: a row's bits depend on M |
//! | `decode_scale` | `paged_attention` (cpu) | the softmax scale one ulp up (as a fast rsqrt gives): decode no longer equals the training forward |
//! | `prefill_continuation_scale` | `paged_prefill` (cpu) | the same, only for chunks that continue a cached sequence: chunked prefill differs from one-shot |
//! | `sample_row_key` | `sample` (cpu) | the noise keyed by the batch row instead of the request id: a request's token depends on its batch |
//!
//! The trainer adds two of its own (an op whose sum follows a per-process hash order, and the
//! emulator's racy block sum); see `trainer/src/determinism/planted.rs`.

use std::sync::OnceLock;

/// Every fault this crate can plant, with what it does (the table above).
pub const FAULTS: &[(&str, &str)] = &[
    (
        "sq_norm_order",
        "sq_norm (cpu) adds its chunk sums in descending order",
    ),
    (
        "sq_norm_threads",
        "sq_norm (cpu) cuts x into one chunk per thread",
    ),
    (
        "gemm_batch_variant",
        "gemm (cpu, F32) sums K in descending order when M > 64",
    ),
    (
        "decode_scale",
        "paged_attention (cpu) scales by one ulp above 1/sqrt(D)",
    ),
    (
        "prefill_continuation_scale",
        "paged_prefill (cpu) scales continuation chunks by one ulp above 1/sqrt(D)",
    ),
    (
        "sample_row_key",
        "sample (cpu) keys its noise by the batch row, not the request id",
    ),
];

/// The names in `SLUICE_PLANT` (read once per process).
pub fn planted() -> &'static [String] {
    static NAMES: OnceLock<Vec<String>> = OnceLock::new();
    NAMES.get_or_init(|| {
        std::env::var("SLUICE_PLANT")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    })
}

/// Whether the fault `name` is planted in this process.
pub fn active(name: &str) -> bool {
    planted().iter().any(|n| n == name)
}

/// `sq_norm_order` and `sq_norm_threads`: the squared norm with the planted order, or None
/// when neither is planted.
pub fn sq_norm(x: &[f32]) -> Option<f64> {
    let chunk_sums = |chunk: usize| -> Vec<f64> {
        x.chunks(chunk.max(1))
            .map(|c| c.iter().map(|&v| v as f64 * v as f64).sum::<f64>())
            .collect()
    };
    if active("sq_norm_threads") {
        let chunk = x.len().div_ceil(crate::par::threads());
        return Some(chunk_sums(chunk).iter().sum());
    }
    if active("sq_norm_order") {
        return Some(chunk_sums(crate::ops::optim::NORM_CHUNK).iter().rev().sum());
    }
    None
}

/// `gemm_batch_variant`: C[i] = A[i] · B[i]^T (B shared when `shared_b`) with each element
/// summed over K in descending order, for products of more than `small_m` rows; false (nothing
/// done) when not planted or M is small.
pub fn gemm(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    shape: [usize; 4],
    shared_b: bool,
    small_m: usize,
) -> bool {
    let [batch, m, n, k] = shape;
    if !active("gemm_batch_variant") || m <= small_m {
        return false;
    }
    for i in 0..batch {
        let bi = if shared_b { 0 } else { i };
        for r in 0..m {
            let arow = &a[(i * m + r) * k..(i * m + r + 1) * k];
            for j in 0..n {
                let brow = &b[(bi * n + j) * k..(bi * n + j + 1) * k];
                c[(i * m + r) * n + j] = (0..k)
                    .rev()
                    .fold(0.0f32, |acc, kk| arow[kk].mul_add(brow[kk], acc));
            }
        }
    }
    true
}

/// `decode_scale`: the decode's softmax scale.
pub fn decode_scale(scale: f32) -> f32 {
    if active("decode_scale") {
        scale.next_up()
    } else {
        scale
    }
}

/// `prefill_continuation_scale`: the prefill's scale for a chunk whose sequence already has
/// `cached` keys in the cache.
pub fn prefill_scale(scale: f32, cached: usize) -> f32 {
    if cached > 0 && active("prefill_continuation_scale") {
        scale.next_up()
    } else {
        scale
    }
}

/// `sample_row_key`: the key of row `row` of a sampled batch.
pub fn sample_key(request_id: u64, row: usize) -> u64 {
    if active("sample_row_key") {
        row as u64
    } else {
        request_id
    }
}
