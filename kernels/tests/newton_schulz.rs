//! newton_schulz: the CPU reference against an f64 oracle written here, the singular-value band
//! of the result (from a Jacobi eigen solver on X X^T, in f64, written here), ill-conditioned
//! inputs, the transpose path, zero matrices, determinism, bad input, and the kernels (emu
//! always; cuda where a GPU exists) against the CPU reference.
//!
//! The bf16 path (bf16 GEMM operands, f32 accumulation and f32 X) is checked the same way: its
//! CPU reference against the f64 oracle (`NS_BF16_ORACLE_TOL`), its singular-value band, and emu
//! / cuda against the bf16 CPU reference at `BF16_TOL`, with no output an exact zero where the
//! reference is not (`lost_outputs`).
//!
//! Tolerances (relative norm): the iteration multiplies small singular values by up to
//! a = 3.4445 per step, so the f32 rounding of each step is amplified by up to a^5 ~ 480 over
//! five steps; f32 results are held to `NS_F32_TOL` = 1e-4 against the f64 oracle and against
//! the CUDA results on the larger shapes. The emu runs the same f32 arithmetic as the CPU
//! reference on tiny shapes and is held to `F32_TOL` here; where every K is at most 256 (these
//! shapes) the two agree bit for bit since issue 23 item 4, which newton_schulz_bits.rs asserts.

use half::bf16;
use sluice_kernels::ops::newton_schulz::{
    newton_schulz, newton_schulz_bf16, newton_schulz_bf16_reference, newton_schulz_reference,
    newton_schulz_with_precision, NsPrecision,
};
use sluice_kernels::testing::{lost_outputs, rel_norm, Rng, BF16_TOL, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

const NS_F32_TOL: f64 = 1e-4;
const COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// C[m,n] = A[m,k] B[k,n] in f64 (plain row-major).
fn mm(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let av = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += av * b[p * n + j];
            }
        }
    }
    c
}

fn tr(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0.0; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = x[i * cols + j];
        }
    }
    t
}

/// The iteration in f64 for one matrix g [r,c].
fn oracle_one(g: &[f64], r: usize, c: usize, steps: usize) -> Vec<f64> {
    let (a, b, cc) = COEFFS;
    let norm = g.iter().map(|v| v * v).sum::<f64>().sqrt();
    let mut x: Vec<f64> = g.iter().map(|v| v / (norm + 1e-7)).collect();
    let transposed = r > c;
    let (rr, cw) = if transposed { (c, r) } else { (r, c) };
    if transposed {
        x = tr(&x, r, c);
    }
    for _ in 0..steps {
        let am = mm(&x, &tr(&x, rr, cw), rr, rr, cw);
        let a2 = mm(&am, &am, rr, rr, rr);
        let bm: Vec<f64> = am.iter().zip(&a2).map(|(p, q)| b * p + cc * q).collect();
        let bx = mm(&bm, &x, rr, cw, rr);
        x = x.iter().zip(&bx).map(|(xv, bv)| a * xv + bv).collect();
    }
    if transposed {
        tr(&x, rr, cw)
    } else {
        x
    }
}

fn oracle(g: &[f32], n: usize, r: usize, c: usize, steps: usize) -> Vec<f64> {
    let size = r * c;
    (0..n)
        .flat_map(|i| {
            let m: Vec<f64> = g[i * size..(i + 1) * size]
                .iter()
                .map(|&v| v as f64)
                .collect();
            oracle_one(&m, r, c, steps)
        })
        .collect()
}

/// Eigenvalues of the symmetric matrix s [d,d] by cyclic Jacobi rotations (f64).
fn jacobi_eigenvalues(mut s: Vec<f64>, d: usize) -> Vec<f64> {
    for _sweep in 0..100 {
        let off: f64 = (0..d)
            .flat_map(|i| (0..d).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| s[i * d + j] * s[i * d + j])
            .sum();
        let diag: f64 = (0..d).map(|i| s[i * d + i] * s[i * d + i]).sum();
        if off <= 1e-30 * diag.max(1e-300) {
            break;
        }
        for p in 0..d {
            for q in p + 1..d {
                let apq = s[p * d + q];
                if apq == 0.0 {
                    continue;
                }
                let (app, aqq) = (s[p * d + p], s[q * d + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let cs = 1.0 / (t * t + 1.0).sqrt();
                let sn = t * cs;
                for k in 0..d {
                    let (skp, skq) = (s[k * d + p], s[k * d + q]);
                    s[k * d + p] = cs * skp - sn * skq;
                    s[k * d + q] = sn * skp + cs * skq;
                }
                for k in 0..d {
                    let (spk, sqk) = (s[p * d + k], s[q * d + k]);
                    s[p * d + k] = cs * spk - sn * sqk;
                    s[q * d + k] = sn * spk + cs * sqk;
                }
            }
        }
    }
    (0..d).map(|i| s[i * d + i]).collect()
}

/// Singular values of x [r,c] (f32) from the eigenvalues of the smaller Gram matrix.
fn singular_values(x: &[f32], r: usize, c: usize) -> Vec<f64> {
    let mut x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let (rr, cw) = if r > c { (c, r) } else { (r, c) };
    if r > c {
        x = tr(&x, r, c);
    }
    let gram = mm(&x, &tr(&x, rr, cw), rr, rr, cw);
    jacobi_eigenvalues(gram, rr)
        .into_iter()
        .map(|e| e.max(0.0).sqrt())
        .collect()
}

/// Orthonormal columns: Gram-Schmidt (twice) on a random [rows, cols] Gaussian, cols <= rows;
/// returned row-major [rows, cols].
fn random_orthonormal(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f64> {
    let mut q: Vec<Vec<f64>> = Vec::new();
    for _ in 0..cols {
        let mut v: Vec<f64> = (0..rows).map(|_| rng.normal()).collect();
        for _pass in 0..2 {
            for u in &q {
                let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
                for (vi, ui) in v.iter_mut().zip(u) {
                    *vi -= d * ui;
                }
            }
        }
        let nrm = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        v.iter_mut().for_each(|a| *a /= nrm);
        q.push(v);
    }
    let mut out = vec![0.0; rows * cols];
    for (j, col) in q.iter().enumerate() {
        for i in 0..rows {
            out[i * cols + j] = col[i];
        }
    }
    out
}

#[test]
fn reference_matches_f64_oracle_on_ragged_shapes() {
    let mut rng = Rng::new(1);
    for &(n, r, c) in &[
        (1, 1, 1),
        (2, 1, 17),
        (3, 17, 5),
        (2, 8, 16),
        (1, 17, 127),
        (2, 127, 17),
        (1, 64, 64),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        for steps in [1, 5] {
            let got = newton_schulz_reference(&g, n, r, c, steps);
            let want = oracle(&g, n, r, c, steps);
            let err = rel_norm(&got, &want);
            assert!(
                err <= NS_F32_TOL,
                "n={n} [{r},{c}] steps={steps}: rel err {err:e}"
            );
        }
    }
}

/// The quintic applied `steps` times to one singular value.
fn quintic(mut x: f64, steps: usize) -> f64 {
    let (a, b, c) = COEFFS;
    for _ in 0..steps {
        x = a * x + b * x * x * x + c * x * x * x * x * x;
    }
    x
}

/// The band of the issue is "about [0.68, 1.13]". The exact image of (0.02, 1] under five steps
/// of the scalar quintic is [0.6818, 1.2024] (a fine grid; the iterates oscillate around 1, and
/// inputs near 0.56 after four steps peak at 1.2024), and Gaussian matrices do reach 1.137
/// (seen at [40,40]). So the test asserts the exact band, and that each output singular value
/// is the quintic of the matching input singular value (the iteration is a polynomial in G's
/// SVD: X = U p^5(S / (||G||_F + 1e-7)) V^T).
const BAND_LO: f64 = 0.68;
const BAND_HI: f64 = 1.21;

#[test]
fn singular_values_land_in_the_quintic_band_for_gaussian_inputs() {
    let mut rng = Rng::new(2);
    let mut seen = (f64::MAX, 0.0f64);
    for &(n, r, c) in &[
        (3, 16, 64),
        (2, 64, 16),
        (2, 17, 127),
        (1, 32, 96),
        (2, 40, 40),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        let x = newton_schulz_reference(&g, n, r, c, 5);
        for i in 0..n {
            let gm = &g[i * r * c..(i + 1) * r * c];
            let norm = gm.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
            let s0: Vec<f64> = singular_values(gm, r, c)
                .into_iter()
                .map(|s| s / (norm + 1e-7))
                .collect();
            let mut want: Vec<f64> = s0.iter().map(|&s| quintic(s, 5)).collect();
            let mut sv = singular_values(&x[i * r * c..(i + 1) * r * c], r, c);
            want.sort_by(f64::total_cmp);
            sv.sort_by(f64::total_cmp);
            for (k, (&got, &w)) in sv.iter().zip(&want).enumerate() {
                assert!(
                    (got - w).abs() <= 1e-3,
                    "[{r},{c}] matrix {i}: singular value {k} is {got}, the quintic gives {w}"
                );
            }
            // Every input singular value above 0.02 (after normalising) lands in the band; a
            // square Gaussian matrix can have smaller ones, which are not expected to reach it.
            for &s in s0.iter().filter(|&&s| s > 0.02) {
                let out = quintic(s, 5);
                seen = (seen.0.min(out), seen.1.max(out));
                assert!(
                    (BAND_LO..=BAND_HI).contains(&out),
                    "[{r},{c}] matrix {i}: input singular value {s} -> {out}, outside the band"
                );
            }
            if r != c {
                assert!(
                    sv[0] >= BAND_LO && sv[sv.len() - 1] <= BAND_HI,
                    "[{r},{c}] matrix {i}: singular values in [{}, {}], want [{BAND_LO}, {BAND_HI}]",
                    sv[0],
                    sv[sv.len() - 1]
                );
            }
        }
    }
    println!("singular values seen: [{}, {}]", seen.0, seen.1);
}

#[test]
fn ill_conditioned_input_never_exceeds_1_25() {
    let mut rng = Rng::new(3);
    for &(r, c) in &[(16, 32), (32, 16), (24, 24)] {
        let d = r.min(c);
        let u = random_orthonormal(&mut rng, r, d); // [r,d]
        let v = random_orthonormal(&mut rng, c, d); // [c,d]
                                                    // s from 1 down to 1e-6, log-spaced: condition number 1e6.
        let s: Vec<f64> = (0..d)
            .map(|i| 10f64.powf(-6.0 * i as f64 / (d - 1) as f64))
            .collect();
        let us: Vec<f64> = (0..r * d).map(|idx| u[idx] * s[idx % d]).collect();
        let g64 = mm(&us, &tr(&v, c, d), r, c, d);
        let g: Vec<f32> = g64.iter().map(|&v| v as f32).collect();
        let x = newton_schulz_reference(&g, 1, r, c, 5);
        let sv = singular_values(&x, r, c);
        let hi = sv.iter().cloned().fold(0.0, f64::max);
        assert!(
            hi <= 1.25,
            "[{r},{c}] cond 1e6: largest singular value {hi}"
        );
        assert!(x.iter().all(|v| v.is_finite()), "[{r},{c}]: non-finite");
    }
}

#[test]
fn transpose_path_matches_oracle_and_the_wide_form() {
    let mut rng = Rng::new(4);
    let (n, r, c) = (2, 37, 9);
    let g = rng.normal_vec(n * r * c, 1.0);
    let got = newton_schulz_reference(&g, n, r, c, 5);
    let err = rel_norm(&got, &oracle(&g, n, r, c, 5));
    assert!(err <= NS_F32_TOL, "tall: rel err {err:e}");
    // Running G^T (wide) and transposing back gives the same bits.
    let gt: Vec<f32> = (0..n)
        .flat_map(|i| {
            let m = &g[i * r * c..(i + 1) * r * c];
            (0..c).flat_map(move |j| (0..r).map(move |k| m[k * c + j]))
        })
        .collect();
    let wide = newton_schulz_reference(&gt, n, c, r, 5);
    for i in 0..n {
        for k in 0..r {
            for j in 0..c {
                assert_eq!(
                    got[i * r * c + k * c + j].to_bits(),
                    wide[i * r * c + j * r + k].to_bits()
                );
            }
        }
    }
}

#[test]
fn zero_matrix_gives_zeros_on_cpu_and_emu() {
    let mut rng = Rng::new(5);
    let (r, c) = (8, 16);
    let mut g = rng.normal_vec(2 * r * c, 1.0);
    g[..r * c].fill(0.0);
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let t = Tensor::from_slice(&backend, &[2, r, c], &g).unwrap();
        let x = newton_schulz(&backend, &t, 5)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert!(
            x[..r * c].iter().all(|&v| v == 0.0),
            "zero matrix: not zeros"
        );
        assert!(x[r * c..].iter().all(|v| v.is_finite()));
        assert!(x[r * c..].iter().any(|&v| v != 0.0));
    }
}

#[test]
fn cpu_is_deterministic_and_matches_its_reference() {
    let mut rng = Rng::new(6);
    let g = rng.normal_vec(4 * 17 * 40, 1.0);
    let t = Tensor::from_slice(&Backend::Cpu, &[4, 17, 40], &g).unwrap();
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let x1 = bits(
        newton_schulz(&Backend::Cpu, &t, 5)
            .unwrap()
            .to_vec()
            .unwrap(),
    );
    let x2 = bits(
        newton_schulz(&Backend::Cpu, &t, 5)
            .unwrap()
            .to_vec()
            .unwrap(),
    );
    assert_eq!(x1, x2);
    let r: Vec<u32> = newton_schulz_reference(&g, 4, 17, 40, 5)
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(x1, r);
}

fn emu_case(n: usize, r: usize, c: usize, dtype: DType, steps: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let g = rng.normal_vec(n * r * c, 1.0);
    let gw: Vec<f32> = match dtype {
        DType::BF16 => g.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        _ => g.clone(),
    };
    let want = newton_schulz_reference(&gw, n, r, c, steps);
    let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    let mut bits = Vec::new();
    for s in [1, 2] {
        let emu = Backend::emu_with_seed(s);
        let t = Tensor::from_f32_as(&emu, &[n, r, c], dtype, &g).unwrap();
        let x = newton_schulz(&emu, &t, steps).unwrap();
        assert_eq!(x.shape(), &[n, r, c]);
        assert_eq!(x.dtype(), DType::F32);
        let got = x.to_vec::<f32>().unwrap();
        let err = rel_norm(&got, &want64);
        println!("emu seed {s} {dtype} n={n} [{r},{c}] steps={steps}: rel err {err:e}");
        assert!(
            err <= F32_TOL,
            "emu seed {s} {dtype} n={n} [{r},{c}] steps={steps}: rel err {err:e}"
        );
        bits.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
    assert_eq!(bits[0], bits[1], "emu seeds 1 and 2 differ");
}

#[test]
fn emu_matches_cpu_and_is_seed_invariant() {
    emu_case(3, 8, 16, DType::F32, 5, 11);
    emu_case(3, 17, 5, DType::F32, 5, 12);
    emu_case(2, 1, 7, DType::F32, 2, 13);
    emu_case(3, 8, 16, DType::BF16, 5, 14);
    emu_case(2, 17, 5, DType::BF16, 5, 15);
}

#[test]
fn bad_input_is_an_error() {
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let g2 = Tensor::from_slice(&backend, &[4, 4], &[1.0f32; 16]).unwrap();
        let e = newton_schulz(&backend, &g2, 5).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        assert!(e.to_string().contains('g'), "{e}");
        let gi = Tensor::from_slice(&backend, &[1, 2, 2], &[1i32; 4]).unwrap();
        let e = newton_schulz(&backend, &gi, 5).unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{e}");
        let g = Tensor::from_slice(&backend, &[1, 2, 2], &[1.0f32; 4]).unwrap();
        for steps in [0, 101] {
            let e = newton_schulz(&backend, &g, steps).unwrap_err();
            assert!(
                matches!(&e, Error::Param { name, .. } if name == "steps"),
                "{e}"
            );
        }
    }
}

#[test]
fn cuda_matches_cpu() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("newton_schulz::cuda_matches_cpu")
    else {
        return;
    };
    let mut rng = Rng::new(21);
    for &(n, r, c, dtype) in &[
        (3, 8, 16, DType::F32),
        (4, 17, 5, DType::F32),
        (2, 128, 512, DType::F32),
        (2, 128, 512, DType::BF16),
        (2, 300, 77, DType::BF16),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        let gw: Vec<f32> = match dtype {
            DType::BF16 => g.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
            _ => g.clone(),
        };
        let want: Vec<f64> = newton_schulz_reference(&gw, n, r, c, 5)
            .iter()
            .map(|&v| v as f64)
            .collect();
        let t = Tensor::from_f32_as(&gpu, &[n, r, c], dtype, &g).unwrap();
        let x1 = newton_schulz(&gpu, &t, 5).unwrap().to_vec::<f32>().unwrap();
        let x2 = newton_schulz(&gpu, &t, 5).unwrap().to_vec::<f32>().unwrap();
        let err = rel_norm(&x1, &want);
        assert!(err <= NS_F32_TOL, "cuda {dtype} [{r},{c}]: rel err {err:e}");
        let b1: Vec<u32> = x1.iter().map(|v| v.to_bits()).collect();
        let b2: Vec<u32> = x2.iter().map(|v| v.to_bits()).collect();
        assert_eq!(b1, b2, "cuda {dtype} [{r},{c}]: two runs differ");
    }
}

// ---------------------------------------------------------------------------------------------
// The bf16 path
// ---------------------------------------------------------------------------------------------

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// bf16 result vs the f64 oracle. The dominant error is B = c A^2 + b A rounded to bf16: near
/// convergence A ~ I, so B's diagonal is ~ -2.74 (half an ulp: 2^-7 ~ 7.8e-3) while B + a I ~
/// 0.70, a relative error of up to ~1.1% in X' per step; over five steps measured up to 4.3e-2
/// (ragged shapes, 1x1 included). Held to 6e-2.
const NS_BF16_ORACLE_TOL: f64 = 6e-2;
/// The band of the bf16 result's singular values: the f32 band [0.68, 1.21] widened by the
/// ~5% the bf16 rounding moves a singular value over five steps (measured: within
/// [0.679, 1.138] on the shapes below).
const BF16_BAND_LO: f64 = 0.64;
const BF16_BAND_HI: f64 = 1.25;

#[test]
fn bf16_reference_matches_f64_oracle_on_ragged_shapes() {
    let mut rng = Rng::new(31);
    for &(n, r, c) in &[
        (1, 1, 1),
        (2, 1, 17),
        (3, 17, 5),
        (2, 8, 16),
        (1, 17, 127),
        (2, 127, 17),
        (1, 64, 64),
        (2, 64, 256),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        for steps in [1, 5] {
            let got = newton_schulz_bf16_reference(&g, n, r, c, steps);
            let want = oracle(&g, n, r, c, steps);
            let err = rel_norm(&got, &want);
            println!("n={n} [{r},{c}] steps={steps}: bf16 vs f64 rel err {err:e}");
            assert!(
                err <= NS_BF16_ORACLE_TOL,
                "n={n} [{r},{c}] steps={steps}: rel err {err:e}"
            );
            assert!(got.iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn bf16_singular_values_land_in_the_widened_band() {
    let mut rng = Rng::new(32);
    let mut seen = (f64::MAX, 0.0f64);
    for &(n, r, c) in &[(3, 16, 64), (2, 64, 16), (2, 17, 127), (1, 32, 96)] {
        let g = rng.normal_vec(n * r * c, 1.0);
        let x = newton_schulz_bf16_reference(&g, n, r, c, 5);
        for i in 0..n {
            let sv = singular_values(&x[i * r * c..(i + 1) * r * c], r, c);
            let lo = sv.iter().cloned().fold(f64::MAX, f64::min);
            let hi = sv.iter().cloned().fold(0.0, f64::max);
            seen = (seen.0.min(lo), seen.1.max(hi));
            assert!(
                lo >= BF16_BAND_LO && hi <= BF16_BAND_HI,
                "[{r},{c}] matrix {i}: singular values in [{lo}, {hi}], want \
                 [{BF16_BAND_LO}, {BF16_BAND_HI}]"
            );
        }
    }
    println!("bf16 singular values seen: [{}, {}]", seen.0, seen.1);
}

/// Condition number 1e6: X0's small singular values are far below bf16's resolution of X, so
/// the rounding injects O(2^-9 |X|) components the quintic then grows; they still land in the
/// quintic's range (measured largest singular values 1.187-1.193), held to the same 1.25 as f32.
#[test]
fn bf16_ill_conditioned_input_never_exceeds_1_25() {
    let mut rng = Rng::new(36);
    for &(r, c) in &[(16, 32), (32, 16), (24, 24)] {
        let d = r.min(c);
        let u = random_orthonormal(&mut rng, r, d);
        let v = random_orthonormal(&mut rng, c, d);
        let s: Vec<f64> = (0..d)
            .map(|i| 10f64.powf(-6.0 * i as f64 / (d - 1) as f64))
            .collect();
        let us: Vec<f64> = (0..r * d).map(|idx| u[idx] * s[idx % d]).collect();
        let g: Vec<f32> = mm(&us, &tr(&v, c, d), r, c, d)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let x = newton_schulz_bf16_reference(&g, 1, r, c, 5);
        assert!(x.iter().all(|v| v.is_finite()), "[{r},{c}]: non-finite");
        let hi = singular_values(&x, r, c).into_iter().fold(0.0, f64::max);
        println!("bf16 [{r},{c}] cond 1e6: largest singular value {hi}");
        assert!(
            hi <= 1.25,
            "bf16 [{r},{c}] cond 1e6: largest singular value {hi}"
        );
    }
}

#[test]
fn bf16_transpose_path_is_the_wide_form_transposed() {
    let mut rng = Rng::new(33);
    let (n, r, c) = (2, 37, 9);
    let g = rng.normal_vec(n * r * c, 1.0);
    let got = newton_schulz_bf16_reference(&g, n, r, c, 5);
    let gt: Vec<f32> = (0..n)
        .flat_map(|i| {
            let m = &g[i * r * c..(i + 1) * r * c];
            (0..c).flat_map(move |j| (0..r).map(move |k| m[k * c + j]))
        })
        .collect();
    let wide = newton_schulz_bf16_reference(&gt, n, c, r, 5);
    for i in 0..n {
        for k in 0..r {
            for j in 0..c {
                assert_eq!(
                    got[i * r * c + k * c + j].to_bits(),
                    wide[i * r * c + j * r + k].to_bits()
                );
            }
        }
    }
    let err = rel_norm(&got, &oracle(&g, n, r, c, 5));
    assert!(err <= NS_BF16_ORACLE_TOL, "tall bf16: rel err {err:e}");
}

#[test]
fn bf16_cpu_entry_is_its_reference_and_deterministic() {
    let mut rng = Rng::new(34);
    let g = rng.normal_vec(3 * 17 * 40, 1.0);
    let t = Tensor::from_slice(&Backend::Cpu, &[3, 17, 40], &g).unwrap();
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let x1 = bits(
        newton_schulz_bf16(&Backend::Cpu, &t, 5)
            .unwrap()
            .to_vec()
            .unwrap(),
    );
    let x2 = bits(
        newton_schulz_with_precision(&Backend::Cpu, &t, 5, NsPrecision::Bf16)
            .unwrap()
            .to_vec()
            .unwrap(),
    );
    assert_eq!(x1, x2);
    assert_eq!(x1, bits(newton_schulz_bf16_reference(&g, 3, 17, 40, 5)));
    // The f32 precision is `newton_schulz`.
    let f = bits(
        newton_schulz_with_precision(&Backend::Cpu, &t, 5, NsPrecision::F32)
            .unwrap()
            .to_vec()
            .unwrap(),
    );
    assert_eq!(f, bits(newton_schulz_reference(&g, 3, 17, 40, 5)));
}

#[test]
fn bf16_zero_matrix_gives_zeros_on_cpu_and_emu() {
    let mut rng = Rng::new(35);
    let (r, c) = (5, 17);
    let mut g = rng.normal_vec(2 * r * c, 1.0);
    g[r * c..].fill(0.0);
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let t = Tensor::from_slice(&backend, &[2, r, c], &g).unwrap();
        let x = newton_schulz_bf16(&backend, &t, 5)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert!(
            x[r * c..].iter().all(|&v| v == 0.0),
            "{}: zero matrix: not zeros",
            backend.device()
        );
        assert!(x[..r * c].iter().all(|v| v.is_finite()));
        assert!(x[..r * c].iter().any(|&v| v != 0.0));
    }
}

/// The bf16 path on emu against the bf16 CPU reference, two seeds bit-identical. The outputs
/// (and every scratch tensor) are allocated poisoned (NaN) inside the call, so an element a
/// kernel misses shows up as a NaN and fails the comparison.
fn emu_bf16_case(n: usize, r: usize, c: usize, dtype: DType, steps: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let g = rng.normal_vec(n * r * c, 1.0);
    let gw: Vec<f32> = match dtype {
        DType::BF16 => g.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        _ => g.clone(),
    };
    let want32 = newton_schulz_bf16_reference(&gw, n, r, c, steps);
    let want = to64(&want32);
    let mut bits = Vec::new();
    for s in [1, 2] {
        let emu = Backend::emu_with_seed(s);
        let t = Tensor::from_f32_as(&emu, &[n, r, c], dtype, &g).unwrap();
        let x = newton_schulz_bf16(&emu, &t, steps).unwrap();
        assert_eq!(x.shape(), &[n, r, c]);
        assert_eq!(x.dtype(), DType::F32);
        let got = x.to_vec::<f32>().unwrap();
        assert!(got.iter().all(|v| v.is_finite()), "emu bf16: non-finite");
        let err = rel_norm(&got, &want);
        println!("emu bf16 seed {s} {dtype} n={n} [{r},{c}] steps={steps}: rel err {err:e}");
        assert!(
            err <= BF16_TOL,
            "emu bf16 seed {s} {dtype} n={n} [{r},{c}] steps={steps}: rel err {err:e}"
        );
        assert_eq!(
            lost_outputs(&got, &want32),
            0,
            "emu bf16 seed {s}: lost outputs"
        );
        bits.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
    assert_eq!(bits[0], bits[1], "emu bf16: seeds 1 and 2 differ");
}

#[test]
fn emu_bf16_matches_bf16_reference_and_is_seed_invariant() {
    emu_bf16_case(3, 8, 16, DType::F32, 5, 41); // batch of several
    emu_bf16_case(2, 17, 5, DType::F32, 5, 42); // transpose path
    emu_bf16_case(2, 1, 17, DType::BF16, 5, 43); // one row, bf16 input
    emu_bf16_case(1, 17, 1, DType::F32, 3, 44); // one column (transposed to 1 x 17)
    emu_bf16_case(1, 1, 1, DType::F32, 1, 45);
    emu_bf16_case(1, 33, 40, DType::BF16, 2, 46); // two 32-tiles each way in the combine
}

#[test]
fn bf16_bad_input_is_an_error() {
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let g2 = Tensor::from_slice(&backend, &[4, 4], &[1.0f32; 16]).unwrap();
        let e = newton_schulz_bf16(&backend, &g2, 5).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        assert!(e.to_string().contains('g'), "{e}");
        let gi = Tensor::from_slice(&backend, &[1, 2, 2], &[1i32; 4]).unwrap();
        let e = newton_schulz_bf16(&backend, &gi, 5).unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{e}");
        let g = Tensor::from_slice(&backend, &[1, 2, 2], &[1.0f32; 4]).unwrap();
        for steps in [0, 101] {
            let e = newton_schulz_bf16(&backend, &g, steps).unwrap_err();
            assert!(
                matches!(&e, Error::Param { name, .. } if name == "steps"),
                "{e}"
            );
        }
    }
    let e = NsPrecision::parse("precision", "fp8").unwrap_err();
    assert!(
        matches!(&e, Error::Param { name, .. } if name == "precision"),
        "{e}"
    );
    assert_eq!(NsPrecision::parse("p", "bf16").unwrap(), NsPrecision::Bf16);
    assert_eq!(NsPrecision::parse("p", "f32").unwrap(), NsPrecision::F32);
    assert_eq!(
        NsPrecision::default_for(&Backend::Cpu),
        NsPrecision::F32,
        "cpu defaults to f32"
    );
    assert_eq!(
        NsPrecision::default_for(&Backend::emu_with_seed(1)),
        NsPrecision::F32,
        "emu defaults to f32"
    );
}

#[test]
fn cuda_bf16_matches_bf16_reference() {
    let Some(gpu) =
        sluice_kernels::device::cuda_for_tests("newton_schulz::cuda_bf16_matches_bf16_reference")
    else {
        return;
    };
    assert_eq!(NsPrecision::default_for(&gpu), NsPrecision::Bf16);
    let mut rng = Rng::new(51);
    for &(n, r, c, dtype) in &[
        (3, 8, 16, DType::F32),
        (4, 17, 5, DType::F32),
        (2, 1, 17, DType::BF16),
        (2, 128, 512, DType::BF16),
        (2, 300, 77, DType::BF16),
        (1, 130, 260, DType::F32),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        let gw: Vec<f32> = match dtype {
            DType::BF16 => g.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
            _ => g.clone(),
        };
        let want32 = newton_schulz_bf16_reference(&gw, n, r, c, 5);
        let want = to64(&want32);
        let t = Tensor::from_f32_as(&gpu, &[n, r, c], dtype, &g).unwrap();
        let x1 = newton_schulz_bf16(&gpu, &t, 5)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let x2 = newton_schulz_bf16(&gpu, &t, 5)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let err = rel_norm(&x1, &want);
        println!("cuda bf16 {dtype} n={n} [{r},{c}]: rel err {err:e}");
        assert!(
            err <= BF16_TOL,
            "cuda bf16 {dtype} [{r},{c}]: rel err {err:e}"
        );
        assert_eq!(
            lost_outputs(&x1, &want32),
            0,
            "cuda bf16 {dtype} [{r},{c}]: lost outputs"
        );
        let err64 = rel_norm(&x1, &oracle(&gw, n, r, c, 5));
        assert!(
            err64 <= NS_BF16_ORACLE_TOL,
            "cuda bf16 {dtype} [{r},{c}]: vs f64 rel err {err64:e}"
        );
        let b1: Vec<u32> = x1.iter().map(|v| v.to_bits()).collect();
        let b2: Vec<u32> = x2.iter().map(|v| v.to_bits()).collect();
        assert_eq!(b1, b2, "cuda bf16 {dtype} [{r},{c}]: two runs differ");
    }
}
