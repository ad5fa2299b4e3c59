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
//! | `softmax_order` | `softmax` (cpu) | each row's sum of exponentials taken one by one from the last column: new bits, still deterministic (a golden check must fail) |
//! | `sq_norm_threads` | `sq_norm` (cpu) | one chunk per thread, summed in f32: bits depend on the thread count |
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
        "softmax_order",
        "softmax (cpu) sums each row's exponentials from the last column down",
    ),
    (
        "sq_norm_threads",
        "sq_norm (cpu) cuts x into one chunk per thread, each summed in f32",
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

/// `sq_norm_threads`: the squared norm with one chunk per thread, each summed in f32 (the
/// chunking, and so the rounding, follows the pool's size); None when not planted.
pub fn sq_norm(x: &[f32]) -> Option<f64> {
    if !active("sq_norm_threads") {
        return None;
    }
    let chunk = x.len().div_ceil(crate::par::threads()).max(1);
    Some(
        x.chunks(chunk)
            .map(|c| c.iter().fold(0.0f32, |acc, &v| v.mul_add(v, acc)) as f64)
            .sum(),
    )
}

/// `softmax_order`: a row's sum of `n` terms `term(j)`, taken from j = n - 1 down to 0, in
/// place of `sum` (the reference's block order); `sum` itself when not planted.
pub fn softmax_sum(sum: f32, n: usize, term: impl Fn(usize) -> f32) -> f32 {
    if active("softmax_order") {
        (0..n).rev().fold(0.0f32, |acc, j| acc + term(j))
    } else {
        sum
    }
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
