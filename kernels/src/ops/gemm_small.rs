//! The CPU GEMM for few rows (decode, small MoE segments): C[m,n] = A[m,k] · B[n,k]^T from a
//! packed copy of B, bit-identical to [`super::gemm::gemm_reference_into`].
//!
//! Why: the general reference (matrixmultiply) packs both operands on every call and runs a
//! 16x16 micro-kernel, so a one-row product packs all of B and computes 15 padding rows; at
//! batch 1 the rollout engine's decode spent most of its time there (issue 16). Here B is
//! packed once into column panels ([`PackedB`]; the device entry point caches it on the weight
//! tensor) and each call only streams the panels past the rows of A.
//!
//! THE ORDER (the same as the reference's, so the two are interchangeable bit for bit and the
//! choice between them never breaks batch invariance): K is cut into chunks of [`KC`] = 256;
//! each output element accumulates a chunk from +0.0 by one fused multiply-add per k in
//! ascending order, `acc = fma(a[m,k], b[n,k], acc)`; the first chunk's sum is stored and each
//! later chunk's sum is added to C (`c = c + acc`, one rounding). matrixmultiply does exactly
//! this: its micro-kernels (AVX-512, AVX2+FMA) keep one FMA chain per element over a `kc = 256`
//! chunk and fold each chunk into C with `alpha = 1`, `beta = 1`. `tests/gemm.rs` checks the
//! two bit for bit on ragged shapes, K past several chunks included.

use rayon::prelude::*;

/// Columns of C per packed panel (one 512-bit vector of f32).
pub const NR: usize = 16;
/// The K chunk (matrixmultiply's `kc` for f32).
pub const KC: usize = 256;
/// Rows of A per micro-tile.
const MR: usize = 4;
/// Panels per micro-tile (2 x 16 = 32 columns).
const NP: usize = 2;

/// B `[groups, n, k]` (row-major, `groups` stacked matrices) as column panels: for each group
/// and each panel of [`NR`] rows of B (columns of C), a `[k][NR]` block, zero past `n`.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedB {
    pub groups: usize,
    pub n: usize,
    pub k: usize,
    data: Vec<f32>,
}

impl PackedB {
    /// Packs `b` (`groups * n * k` values).
    ///
    /// # Panics
    /// If `b.len() != groups * n * k` (a caller bug).
    pub fn new(b: &[f32], groups: usize, n: usize, k: usize) -> PackedB {
        assert_eq!(b.len(), groups * n * k, "PackedB: b must hold groups*n*k");
        let panels = n.div_ceil(NR);
        let per_group = panels * k * NR;
        let mut data = vec![0.0f32; groups * per_group];
        if per_group > 0 {
            data.par_chunks_mut(k * NR)
                .enumerate()
                .with_min_len(8)
                .for_each(|(i, panel)| {
                    let (g, p) = (i / panels, i % panels);
                    let rows = NR.min(n - p * NR);
                    for j in 0..rows {
                        let src = &b[(g * n + p * NR + j) * k..(g * n + p * NR + j + 1) * k];
                        for (kk, &v) in src.iter().enumerate() {
                            panel[kk * NR + j] = v;
                        }
                    }
                });
        }
        PackedB { groups, n, k, data }
    }

    fn panel(&self, group: usize, p: usize) -> &[f32] {
        let panels = self.n.div_ceil(NR);
        let start = (group * panels + p) * self.k * NR;
        &self.data[start..start + self.k * NR]
    }

    /// The packed values held (for memory accounting).
    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// C[m, n] = A[m, k] · B_group^T into `c` (overwritten), B from `pb`, in THE ORDER above; rows
/// of A in parallel when the product is large enough (see [`crate::par`]).
///
/// # Panics
/// If a slice's length disagrees with `m` and `pb`'s sizes, or `group >= pb.groups`.
pub fn gemm_packed_into(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], m: usize) {
    let (n, k) = (pb.n, pb.k);
    assert!(group < pb.groups, "gemm_packed_into: group out of range");
    assert_eq!(a.len(), m * k, "gemm_packed_into: a must hold m*k");
    assert_eq!(c.len(), m * n, "gemm_packed_into: c must hold m*n");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    // Row blocks of MR rows are independent; a block's bits do not depend on which thread runs
    // it or on the other rows.
    crate::par::chunks_mut(c, n * MR, MR * n * k, |c0, cc| {
        let r0 = c0 * MR;
        let rows = cc.len() / n;
        rows_block(&a[r0 * k..(r0 + rows) * k], pb, group, cc, rows);
    });
}

/// All rows of a contiguous block of A (any count), micro-tile by micro-tile.
fn rows_block(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, the only feature `rows_block_avx512` enables.
            return unsafe { rows_block_avx512(a, pb, group, c, rows) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA, the features `rows_block_avx2` enables.
            return unsafe { rows_block_avx2(a, pb, group, c, rows) };
        }
    }
    rows_block_body(a, pb, group, c, rows)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn rows_block_avx512(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
    rows_block_body(a, pb, group, c, rows)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_block_avx2(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
    rows_block_body(a, pb, group, c, rows)
}

/// The portable body, inlined into each feature wrapper (the fixed-size loops below vectorise
/// over the NR columns of a panel; each lane is one output element's own FMA chain, so
/// vectorising changes no rounding).
#[inline(always)]
fn rows_block_body(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
    let (n, k) = (pb.n, pb.k);
    let panels = n.div_ceil(NR);
    let mut r = 0;
    while r < rows {
        let mr = MR.min(rows - r);
        let mut p = 0;
        while p < panels {
            let np = NP.min(panels - p);
            match (mr, np) {
                (4, 2) => tile::<4, 2>(a, pb, group, c, r, p),
                (4, _) => tile::<4, 1>(a, pb, group, c, r, p),
                (3, 2) => tile::<3, 2>(a, pb, group, c, r, p),
                (3, _) => tile::<3, 1>(a, pb, group, c, r, p),
                (2, 2) => tile::<2, 2>(a, pb, group, c, r, p),
                (2, _) => tile::<2, 1>(a, pb, group, c, r, p),
                (_, 2) => tile::<1, 2>(a, pb, group, c, r, p),
                _ => tile::<1, 1>(a, pb, group, c, r, p),
            }
            p += np;
        }
        r += mr;
    }
    debug_assert!(k > 0 && n > 0);
}

/// One micro-tile: rows `r0..r0+R` of C, panels `p0..p0+P`, over every K chunk.
#[inline(always)]
fn tile<const R: usize, const P: usize>(
    a: &[f32],
    pb: &PackedB,
    group: usize,
    c: &mut [f32],
    r0: usize,
    p0: usize,
) {
    let (n, k) = (pb.n, pb.k);
    let panel: [&[f32]; P] = std::array::from_fn(|i| pb.panel(group, p0 + i));
    let arow: [&[f32]; R] = std::array::from_fn(|i| &a[(r0 + i) * k..(r0 + i + 1) * k]);
    let mut k0 = 0;
    while k0 < k {
        let k1 = (k0 + KC).min(k);
        let mut acc = [[[0.0f32; NR]; P]; R];
        for kk in k0..k1 {
            let bv: [&[f32; NR]; P] = std::array::from_fn(|i| {
                panel[i][kk * NR..(kk + 1) * NR]
                    .try_into()
                    .expect("a panel row holds NR values")
            });
            for i in 0..R {
                let av = arow[i][kk];
                for (accp, b) in acc[i].iter_mut().zip(&bv) {
                    for j in 0..NR {
                        accp[j] = av.mul_add(b[j], accp[j]);
                    }
                }
            }
        }
        for (i, acc_row) in acc.iter().enumerate() {
            let crow = &mut c[(r0 + i) * n..(r0 + i + 1) * n];
            for (pi, accp) in acc_row.iter().enumerate() {
                let col0 = (p0 + pi) * NR;
                let cols = NR.min(n - col0);
                let dst = &mut crow[col0..col0 + cols];
                if k0 == 0 {
                    dst.copy_from_slice(&accp[..cols]);
                } else {
                    for (d, &s) in dst.iter_mut().zip(accp) {
                        *d += s;
                    }
                }
            }
        }
        k0 = k1;
    }
}
