//! The CPU reference of the bf16 GEMM: C = A · B with every output one ascending chain of
//! fused multiply-adds over all of K, from +0.
//!
//! That is the order the device's bf16 path sums in under the emulator (kernels/cuda/gemm.cu's
//! `gemm_bf16_mma`: the accumulators start at 0 and each emulated mma.sync adds its 16 products
//! one `fmaf` at a time, k ascending, K step after K step; the zero padding past K adds +0,
//! which changes nothing: a chain started at +0 never holds -0). So for operands that are bf16
//! values, the cpu device and emu give the same bits for every K, where the f32 reference
//! (matrixmultiply, K cut into chunks of 256 whose sums are then added) would differ in the last
//! bits once K > 256. Products of bf16 values are exact in f32 (8 + 8 significant bits), so the
//! chain rounds once per addition, as the tensor-core emulation does.
//!
//! Used by the gemm family's device entry points for BF16 inputs on `cpu` and by the moe
//! family's CPU path for BF16 inputs. F32 inputs keep the f32 reference.
//!
//! Layout of the work: B is packed once into panels of [`NR`] columns ([K][NR], zero-padded),
//! A into blocks of [`MR`] rows ([K][MR]) per block; a block times a panel keeps MR x NR
//! accumulators in registers for the whole of K. Row blocks are split over rayon's threads; a
//! row's arithmetic does not depend on the block it is in, so the product is batch-invariant.

use crate::ops::gemm::strided_operands_checked;
use crate::par;

/// Rows of A per register block.
const MR: usize = 4;
/// Columns of B per packed panel (two 8-wide f32 vectors).
const NR: usize = 16;

/// C[m,n] = A · B (C row-major, overwritten) for operands given by strides: element (i, kk) of A
/// at `a[i * rsa + kk * csa]`, element (kk, j) of B at `b[kk * rsb + j * csb]`. Each C[i,j] is
/// `fma(A[i,K-1], B[K-1,j], ... fma(A[i,0], B[0,j], +0))`.
///
/// # Panics
/// If `c` is not m*n long or a stride reaches past the end of a slice (a caller bug).
#[allow(clippy::too_many_arguments)]
pub fn gemm_chain_strided_into(
    m: usize,
    n: usize,
    k: usize,
    (a, rsa, csa): (&[f32], usize, usize),
    (b, rsb, csb): (&[f32], usize, usize),
    c: &mut [f32],
) {
    if !strided_operands_checked("gemm_chain", m, n, k, (a, rsa, csa), (b, rsb, csb), c) {
        return;
    }
    // B^T panels: panel p holds columns p*NR.. as [K][NR], zeros past n.
    let panels = n.div_ceil(NR);
    let mut bp = vec![0.0f32; panels * k * NR];
    for (p, panel) in bp.chunks_mut(k * NR).enumerate() {
        for kk in 0..k {
            let row = &mut panel[kk * NR..(kk + 1) * NR];
            for (jj, o) in row.iter_mut().enumerate() {
                let j = p * NR + jj;
                if j < n {
                    *o = b[kk * rsb + j * csb];
                }
            }
        }
    }
    // Threads take whole row blocks (a multiple of MR rows each).
    par::chunks_mut(c, n * MR, 2 * n * k * MR, |blk0, c_rows| {
        let r0 = blk0 * MR;
        let rows = c_rows.len() / n;
        let mut ap = vec![0.0f32; k * MR];
        for b0 in (0..rows).step_by(MR) {
            let mr = MR.min(rows - b0);
            for kk in 0..k {
                for ii in 0..MR {
                    ap[kk * MR + ii] = if ii < mr {
                        a[(r0 + b0 + ii) * rsa + kk * csa]
                    } else {
                        0.0
                    };
                }
            }
            for (p, panel) in bp.chunks(k * NR).enumerate() {
                let acc = block_dispatch(&ap, panel, k);
                let j0 = p * NR;
                let nr = NR.min(n - j0);
                for (ii, acc_row) in acc.iter().enumerate().take(mr) {
                    let row = (b0 + ii) * n;
                    c_rows[row + j0..row + j0 + nr].copy_from_slice(&acc_row[..nr]);
                }
            }
        }
    });
}

/// C[m,n] = A[m,k] · B[n,k]^T (both row-major), as [`gemm_chain_strided_into`].
pub fn gemm_chain_into(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    assert_eq!(a.len(), m * k, "gemm_chain: a must hold m*k elements");
    assert_eq!(b.len(), n * k, "gemm_chain: b must hold n*k elements");
    gemm_chain_strided_into(m, n, k, (a, k, 1), (b, 1, k), c);
}

/// One MR x NR block over all of K, with FMA instructions where the CPU has them (the same
/// bits either way: `mul_add` is a correctly rounded fused multiply-add on every path).
fn block_dispatch(ap: &[f32], bp: &[f32], k: usize) -> [[f32; NR]; MR] {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn fast(ap: &[f32], bp: &[f32], k: usize) -> [[f32; NR]; MR] {
            block(ap, bp, k)
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: `fast` needs only AVX2 and FMA instructions, and the CPU has them.
            return unsafe { fast(ap, bp, k) };
        }
    }
    block(ap, bp, k)
}

#[inline(always)]
fn block(ap: &[f32], bp: &[f32], k: usize) -> [[f32; NR]; MR] {
    let mut acc = [[0.0f32; NR]; MR];
    for (av, bv) in ap.chunks_exact(MR).zip(bp.chunks_exact(NR)).take(k) {
        for ii in 0..MR {
            let x = av[ii];
            for jj in 0..NR {
                acc[ii][jj] = x.mul_add(bv[jj], acc[ii][jj]);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chain's defining order, element by element.
    fn naive(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for kk in 0..k {
                    acc = a[i * k + kk].mul_add(b[j * k + kk], acc);
                }
                c[i * n + j] = acc;
            }
        }
        c
    }

    #[test]
    fn equals_the_naive_chain_bit_for_bit() {
        let mut rng = crate::testing::Rng::new(7);
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 17, 3),
            (17, 33, 300),
            (9, 16, 1),
            (64, 5, 513),
        ] {
            let a = rng.normal_vec(m * k, 1.0);
            let b = rng.normal_vec(n * k, 1.0);
            let mut c = vec![f32::NAN; m * n];
            gemm_chain_into(&a, &b, &mut c, m, n, k);
            let want = naive(&a, &b, m, n, k);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&c), bits(&want), "{m}x{n}x{k}");
        }
    }
}
