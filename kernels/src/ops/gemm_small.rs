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

/// All rows of a contiguous block of A (any count), micro-tile by micro-tile, with the widest
/// vectors the CPU has (AVX-512F, else AVX2 + FMA, else portable scalar code). Each vector lane
/// is one output element's own FMA chain (`fma(a, b, acc)`, the operand order of
/// matrixmultiply's kernels), so the choice changes no bits.
fn rows_block(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, the only feature `x86::tiles_avx512` needs.
            return unsafe { x86::tiles_avx512(a, pb, group, c, rows) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA, the features `x86::tiles_avx2` needs.
            return unsafe { x86::tiles_avx2(a, pb, group, c, rows) };
        }
    }
    tiles_portable(a, pb, group, c, rows)
}

/// Calls `tile(r0, mr, p0, np)` over the block's micro-tiles: rows in groups of up to [`MR`],
/// panels in groups of up to `np_max`. Panels outside, rows inside: a group of panels (K x 32
/// values, 16-32 KiB for the model's K) stays in the L1 cache while every row block streams
/// past it, instead of coming from L2 again for each row block.
#[inline(always)]
fn for_each_tile(
    rows: usize,
    panels: usize,
    np_max: usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let mut p = 0;
    while p < panels {
        let np = np_max.min(panels - p);
        let mut r = 0;
        while r < rows {
            let mr = MR.min(rows - r);
            tile(r, mr, p, np);
            r += mr;
        }
        p += np;
    }
}

/// Writes a tile's chunk sums `acc` (rows x np panels of NR) into C: stored for the first K
/// chunk, added (`c + acc`, one rounding) for later ones.
#[inline(always)]
fn write_tile<const R: usize, const P: usize>(
    acc: &[[[f32; NR]; P]; R],
    c: &mut [f32],
    n: usize,
    (r0, mr): (usize, usize),
    (p0, np): (usize, usize),
    first_chunk: bool,
) {
    for (i, acc_row) in acc.iter().enumerate().take(mr) {
        let crow = &mut c[(r0 + i) * n..(r0 + i + 1) * n];
        for (pi, accp) in acc_row.iter().enumerate().take(np) {
            let col0 = (p0 + pi) * NR;
            let cols = NR.min(n - col0);
            let dst = &mut crow[col0..col0 + cols];
            if first_chunk {
                dst.copy_from_slice(&accp[..cols]);
            } else {
                for (d, &v) in dst.iter_mut().zip(accp) {
                    *d += v;
                }
            }
        }
    }
}

/// The portable version (scalar `mul_add`: a software fused multiply-add where the CPU has
/// none, so the bits stay those of the FMA chains; slow, used only off x86 FMA machines).
fn tiles_portable(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
    let (n, k) = (pb.n, pb.k);
    for_each_tile(rows, n.div_ceil(NR), 1, |r0, mr, p0, _| {
        let panel = pb.panel(group, p0);
        let mut k0 = 0;
        while k0 < k {
            let k1 = (k0 + KC).min(k);
            let mut acc = [[[0.0f32; NR]; 1]; MR];
            for (i, acc_row) in acc.iter_mut().enumerate().take(mr) {
                let arow = &a[(r0 + i) * k..(r0 + i + 1) * k];
                for kk in k0..k1 {
                    let b = &panel[kk * NR..(kk + 1) * NR];
                    for (x, &bv) in acc_row[0].iter_mut().zip(b) {
                        *x = arow[kk].mul_add(bv, *x);
                    }
                }
            }
            write_tile(&acc, c, n, (r0, mr), (p0, 1), k0 == 0);
            k0 = k1;
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The vector micro-kernels: a tile of up to MR rows x P panels of accumulators kept in
    //! registers over one K chunk; one broadcast of a[r, k] and P panel loads per k.

    use super::{for_each_tile, write_tile, PackedB, KC, MR, NR};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tiles_avx512(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
        let (n, k) = (pb.n, pb.k);
        for_each_tile(rows, n.div_ceil(NR), 2, |r0, mr, p0, np| {
            let mut k0 = 0;
            while k0 < k {
                let k1 = (k0 + KC).min(k);
                // SAFETY (both calls): AVX-512F is present (this function's contract); the
                // tile's rows r0..r0+mr of `a` and panels p0..p0+np exist (for_each_tile).
                let acc = match np {
                    2 => chunk512::<2>(a, pb, group, (r0, mr), p0, (k0, k1)),
                    _ => widen(chunk512::<1>(a, pb, group, (r0, mr), p0, (k0, k1))),
                };
                write_tile(&acc, c, n, (r0, mr), (p0, np), k0 == 0);
                k0 = k1;
            }
        });
    }

    fn widen(x: [[[f32; NR]; 1]; MR]) -> [[[f32; NR]; 2]; MR] {
        let mut o = [[[0.0f32; NR]; 2]; MR];
        for (oi, xi) in o.iter_mut().zip(&x) {
            oi[0] = xi[0];
        }
        o
    }

    /// One K chunk of a tile of `mr` rows (the rest of the MR rows are left zero) and P panels.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn chunk512<const P: usize>(
        a: &[f32],
        pb: &PackedB,
        group: usize,
        (r0, mr): (usize, usize),
        p0: usize,
        (k0, k1): (usize, usize),
    ) -> [[[f32; NR]; P]; MR] {
        let k = pb.k;
        let panels: [&[f32]; P] = std::array::from_fn(|i| pb.panel(group, p0 + i));
        let mut out = [[[0.0f32; NR]; P]; MR];
        macro_rules! rows {
            ($r:literal) => {{
                let arows: [&[f32]; $r] =
                    std::array::from_fn(|i| &a[(r0 + i) * k + k0..(r0 + i) * k + k1]);
                let mut acc = [[_mm512_setzero_ps(); P]; $r];
                for kk in 0..k1 - k0 {
                    let b: [__m512; P] = std::array::from_fn(|j| {
                        let row = &panels[j][(k0 + kk) * NR..(k0 + kk + 1) * NR];
                        // SAFETY: `row` holds NR = 16 f32 values; unaligned load.
                        unsafe { _mm512_loadu_ps(row.as_ptr()) }
                    });
                    for i in 0..$r {
                        let av = _mm512_set1_ps(arows[i][kk]);
                        for j in 0..P {
                            acc[i][j] = _mm512_fmadd_ps(av, b[j], acc[i][j]);
                        }
                    }
                }
                for i in 0..$r {
                    for j in 0..P {
                        // SAFETY: out[i][j] holds NR = 16 f32 values; unaligned store.
                        unsafe { _mm512_storeu_ps(out[i][j].as_mut_ptr(), acc[i][j]) };
                    }
                }
            }};
        }
        match mr {
            4 => rows!(4),
            3 => rows!(3),
            2 => rows!(2),
            _ => rows!(1),
        }
        out
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tiles_avx2(a: &[f32], pb: &PackedB, group: usize, c: &mut [f32], rows: usize) {
        let (n, k) = (pb.n, pb.k);
        for_each_tile(rows, n.div_ceil(NR), 1, |r0, mr, p0, _| {
            let mut k0 = 0;
            while k0 < k {
                let k1 = (k0 + KC).min(k);
                let acc = chunk256(a, pb, group, (r0, mr), p0, (k0, k1));
                write_tile(&acc, c, n, (r0, mr), (p0, 1), k0 == 0);
                k0 = k1;
            }
        });
    }

    /// One K chunk of a tile of `mr` rows and one panel (two 8-lane halves).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn chunk256(
        a: &[f32],
        pb: &PackedB,
        group: usize,
        (r0, mr): (usize, usize),
        p0: usize,
        (k0, k1): (usize, usize),
    ) -> [[[f32; NR]; 1]; MR] {
        let k = pb.k;
        let panel = pb.panel(group, p0);
        let mut out = [[[0.0f32; NR]; 1]; MR];
        macro_rules! rows {
            ($r:literal) => {{
                let arows: [&[f32]; $r] =
                    std::array::from_fn(|i| &a[(r0 + i) * k + k0..(r0 + i) * k + k1]);
                let mut acc = [[_mm256_setzero_ps(); 2]; $r];
                for kk in 0..k1 - k0 {
                    let row = &panel[(k0 + kk) * NR..(k0 + kk + 1) * NR];
                    // SAFETY: `row` holds 16 f32 values: two unaligned 8-lane loads.
                    let b = unsafe {
                        [
                            _mm256_loadu_ps(row.as_ptr()),
                            _mm256_loadu_ps(row.as_ptr().add(8)),
                        ]
                    };
                    for i in 0..$r {
                        let av = _mm256_set1_ps(arows[i][kk]);
                        for h in 0..2 {
                            acc[i][h] = _mm256_fmadd_ps(av, b[h], acc[i][h]);
                        }
                    }
                }
                for i in 0..$r {
                    for h in 0..2 {
                        // SAFETY: out[i][0][8h..8h+8] is in bounds; unaligned store.
                        unsafe { _mm256_storeu_ps(out[i][0].as_mut_ptr().add(8 * h), acc[i][h]) };
                    }
                }
            }};
        }
        match mr {
            4 => rows!(4),
            3 => rows!(3),
            2 => rows!(2),
            _ => rows!(1),
        }
        out
    }
}
