//! The CPU side of `gemm` (split from mod.rs, which keeps the device entry points): the f32
//! reference and its strided and batched/grouped forms, the small-row packed path's thresholds,
//! and the check of grouped offsets shared with the devices.

use super::super::gemm_small::PackedB;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use half::bf16;

// ---------------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------------

/// C[m,n] = A[m,k] · B[n,k]^T in f32, written into `c` (overwritten, not accumulated).
///
/// Runs on the `matrixmultiply` crate (AVX2/FMA micro-kernels), row panels over rayon. It is
/// batch-invariant, which `kernels/tests/gemm.rs` checks bit for bit: each element of C is the
/// sum of K products taken in a fixed order that depends on K alone: K is cut into chunks of 256
/// (matrixmultiply's `kc`), each chunk accumulated from zero by one FMA per k in ascending order,
/// and the chunk sums added to C in ascending order. M only decides how rows are packed into
/// 8-row micro-panels; a partial panel is zero-padded and run through the same micro-kernel into
/// a scratch tile, so neither the number of rows nor a row's position changes its arithmetic.
/// Threads split rows and columns, never K.
///
/// # Panics
/// If a slice's length is not the one `m`, `n`, `k` give (a caller bug: the device entry points
/// validate user input before calling this).
pub fn gemm_reference_into(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    assert_eq!(a.len(), m * k, "gemm_reference: a must hold m*k elements");
    assert_eq!(b.len(), n * k, "gemm_reference: b must hold n*k elements");
    assert_eq!(c.len(), m * n, "gemm_reference: c must hold m*n elements");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    // Rows split into panels over the pool's threads, each panel one single-threaded sgemm: a
    // row's arithmetic does not depend on which panel it is in (see above), so this keeps batch
    // invariance, and it scales better than matrixmultiply's own pool (measured in
    // docs/perf/gemm.md). Panels are multiples of 8 rows (the micro-kernel's height) and small
    // products stay on the calling thread. B^T is the k x n view of row-major B[n,k] (row
    // stride 1, column stride k).
    gemm_strided_into(m, n, k, (a, k, 1), (b, 1, k), c);
}

/// The shared preamble of the strided CPU products: asserts that `c` holds m*n elements and
/// that every stride stays inside its slice, and settles the empty cases (nothing to do when
/// m or n is 0; C = 0 when k is 0). Returns whether a product remains to be computed.
///
/// # Panics
/// If `c` is not m*n long or a stride reaches past the end of a slice (a caller bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn strided_operands_checked(
    name: &str,
    m: usize,
    n: usize,
    k: usize,
    (a, rsa, csa): (&[f32], usize, usize),
    (b, rsb, csb): (&[f32], usize, usize),
    c: &mut [f32],
) -> bool {
    assert_eq!(c.len(), m * n, "{name}: c must hold m*n elements");
    if m == 0 || n == 0 {
        return false;
    }
    if k == 0 {
        c.fill(0.0);
        return false;
    }
    let last = |r: usize, rs: usize, cols: usize, cs: usize| (r - 1) * rs + (cols - 1) * cs;
    assert!(last(m, rsa, k, csa) < a.len(), "{name}: A out of bounds");
    assert!(last(k, rsb, n, csb) < b.len(), "{name}: B out of bounds");
    true
}

/// C[m,n] = A · B in f32 for operands given by strides: element (i, kk) of A at
/// `a[i * rsa + kk * csa]`, element (kk, j) of B at `b[kk * rsb + j * csb]`; C row-major,
/// overwritten. The same arithmetic as [`gemm_reference_into`] (matrixmultiply packs either
/// layout into the same panels, so a product computed from a transposed view has the bits of
/// the product of the transposed copy): what lets the MoE backward skip its transposes.
///
/// # Panics
/// If a stride reaches past the end of a slice (a caller bug).
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided_into(
    m: usize,
    n: usize,
    k: usize,
    (a, rsa, csa): (&[f32], usize, usize),
    (b, rsb, csb): (&[f32], usize, usize),
    c: &mut [f32],
) {
    if !strided_operands_checked(
        "gemm_strided_into",
        m,
        n,
        k,
        (a, rsa, csa),
        (b, rsb, csb),
        c,
    ) {
        return;
    }
    // Row panels over the pool as in gemm_reference_into (a row's bits do not depend on its
    // panel).
    let rows_per_panel = panel_rows(m, n, k);
    crate::par::chunks_mut(c, n * rows_per_panel, 1 << 30, |r0_panel, c_panel| {
        let r0 = r0_panel * rows_per_panel;
        let rows = c_panel.len() / n;
        // SAFETY: the asserts above bound every index matrixmultiply forms: A's rows r0..r0+rows
        // (< m) and columns < k through (rsa, csa), B's k x n window through (rsb, csb), and C's
        // panel (rows x n, row-major, a &mut slice aliasing neither input). beta = 0: C is not
        // read.
        unsafe {
            matrixmultiply::sgemm(
                rows,
                k,
                n,
                1.0,
                a.as_ptr().add(r0 * rsa),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                0.0,
                c_panel.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    });
}

/// Rows per thread panel of a product (multiples of 8; the whole of M when small).
fn panel_rows(m: usize, n: usize, k: usize) -> usize {
    let threads = crate::par::threads();
    let panels = if m * n * k < (1 << 21) {
        1
    } else {
        threads.min(m.div_ceil(8))
    };
    m.div_ceil(panels).div_ceil(8) * 8
}

/// Products with at most this many rows of A use the packed small-row GEMM
/// ([`gemm_packed_into`]; same bits as [`gemm_reference_into`]) when B is a host F32 tensor.
pub const SMALL_M: usize = 64;
/// ... and K at most this (longer K streams the packed panels from further out in the cache
/// than matrixmultiply's blocking does).
const SMALL_MAX_K: usize = 1024;

/// The longest K for which a BF16 product on `cpu` may take the small-row packed kernel
/// instead of [`gemm_chain_into`]: with K within one of its chunks
/// ([`super::super::gemm_small::KC`]), each output is one FMA chain from +0 over all of K, which is
/// exactly the chain's order, so the two give the same bits (and the packed copy of a weight is
/// kept on it, which matters at decode's few rows).
pub const BF16_PACKED_MAX_K: usize = super::super::gemm_small::KC;

/// The packed form of `b` (`groups` stacked [n, k] matrices) when a product with `m` rows of A
/// should take the small-row path: `b` a host F32 (or BF16) tensor, `m <= SMALL_M`,
/// `k <= SMALL_MAX_K`.
pub fn small_rows_rhs(
    b: &Tensor,
    groups: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Option<std::sync::Arc<PackedB>> {
    if m == 0 || m > SMALL_M || n == 0 || k == 0 || k > SMALL_MAX_K {
        return None;
    }
    b.packed_rhs(groups, n, k)
}

/// C[m,n] = A[m,k] · B[n,k]^T in f32. See [`gemm_reference_into`].
pub fn gemm_reference(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0.0; m * n];
    gemm_reference_into(a, b, &mut c, m, n, k);
    c
}

/// bf16 inputs widened to f32 exactly, then [`gemm_reference`] (f32 accumulation).
pub fn gemm_reference_bf16(a: &[bf16], b: &[bf16], m: usize, n: usize, k: usize) -> Vec<f32> {
    gemm_reference(&widen(a), &widen(b), m, n, k)
}

/// Batched: C[i] = A[i] · B[i]^T for i in 0..batch, with A [batch,m,k], B [batch,n,k] and C
/// [batch,m,n] contiguous.
pub fn gemm_batched_reference(
    a: &[f32],
    b: &[f32],
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    assert_eq!(
        b.len(),
        batch * n * k,
        "gemm_batched_reference: b must hold batch*n*k"
    );
    assert_eq!(
        a.len(),
        batch * m * k,
        "gemm_batched_reference: a must hold batch*m*k"
    );
    let mut c = vec![0.0; batch * m * n];
    if m * n == 0 {
        return c;
    }
    for i in 0..batch {
        gemm_reference_into(
            &a[i * m * k..(i + 1) * m * k],
            &b[i * n * k..(i + 1) * n * k],
            &mut c[i * m * n..(i + 1) * m * n],
            m,
            n,
            k,
        );
    }
    c
}

/// Grouped (the MoE form): rows `offsets[g]..offsets[g+1]` of A [T,k] are multiplied by
/// `b_stack[g]` [n,k]; C is [T,n] with T = offsets[G]. Segments may be empty.
///
/// # Panics
/// If `offsets` is not a non-decreasing list starting at 0, or a slice length disagrees with it
/// (the device entry point [`gemm_grouped`] validates user input first).
pub fn gemm_grouped_reference(
    a: &[f32],
    b_stack: &[f32],
    offsets: &[i32],
    n: usize,
    k: usize,
) -> Vec<f32> {
    let bounds =
        check_offsets(offsets, None).unwrap_or_else(|e| panic!("gemm_grouped_reference: {e}"));
    let groups = offsets.len() - 1;
    let rows = bounds.last().copied().unwrap_or(0);
    assert_eq!(a.len(), rows * k, "gemm_grouped_reference: a must hold T*k");
    assert_eq!(
        b_stack.len(),
        groups * n * k,
        "gemm_grouped_reference: b_stack must hold G*n*k"
    );
    let mut c = vec![0.0; rows * n];
    for g in 0..groups {
        let (r0, r1) = (bounds[g], bounds[g + 1]);
        if r1 == r0 {
            continue;
        }
        gemm_reference_into(
            &a[r0 * k..r1 * k],
            &b_stack[g * n * k..(g + 1) * n * k],
            &mut c[r0 * n..r1 * n],
            r1 - r0,
            n,
            k,
        );
    }
    c
}

/// The row bounds of each segment, after checking `offsets` (G+1 entries, 0 first, T last,
/// non-decreasing).
pub(super) fn check_offsets(offsets: &[i32], rows: Option<usize>) -> Result<Vec<usize>> {
    let bad = |m: String| Error::Invalid(format!("tensor `offsets`: {m}"));
    if offsets.is_empty() {
        return Err(bad(
            "needs G+1 >= 1 entries (the start of each group, then T)".into(),
        ));
    }
    if offsets[0] != 0 {
        return Err(bad(format!("offsets[0] is {}; it must be 0", offsets[0])));
    }
    for (g, w) in offsets.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(bad(format!(
                "offsets[{}] = {} < offsets[{g}] = {}; offsets must be non-decreasing",
                g + 1,
                w[1],
                w[0]
            )));
        }
    }
    let last = *offsets.last().unwrap_or(&0) as usize;
    if rows.is_some_and(|rows| rows != last) {
        let rows = rows.unwrap_or(0);
        return Err(bad(format!(
            "offsets[G] is {last}, but `a` has {rows} rows; the segments must cover a exactly"
        )));
    }
    Ok(offsets.iter().map(|&o| o as usize).collect())
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}
