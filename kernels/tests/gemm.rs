//! gemm: the CPU reference against an f64 oracle, batch invariance and determinism, the batched
//! and grouped forms, bad input, and the kernels (emu always; cuda where a GPU exists) against
//! the CPU reference.
//!
//! Tolerances:
//! - The CPU reference against the f64 oracle: relative norm `F32_TOL` (DESIGN.md section 2), for
//!   f32 and for bf16 inputs (the oracle uses the same bf16 values widened exactly, so only f32
//!   summation error remains).
//! - Every device result against the CPU reference, output by output: within
//!   `matmul_bound_factor(K, dtype) * sum_k |a_k b_k|` (derived in kernels/src/testing.rs from K
//!   and the input dtype; it allows the tensor cores' truncating block sums), with no output an
//!   exact zero where the reference is not. f32 results must also meet `F32_TOL` in norm; emu
//!   bf16 results too (the emulator sums in f32 like the reference). CUDA bf16 results have only
//!   the element-wise bound: a relative-norm tolerance over 10^6 outputs would hide a hundred
//!   zeroed ones.

use half::bf16;
use rayon::prelude::*;
use sluice_kernels::ops::gemm::{
    gemm, gemm_batched, gemm_batched_reference, gemm_batched_with_path, gemm_grouped,
    gemm_grouped_reference, gemm_grouped_with_path, gemm_into, gemm_packed_into, gemm_reference,
    gemm_reference_bf16, gemm_strided_into, gemm_with_path, GemmPath, PackedB,
};
use sluice_kernels::testing::{
    check_matmul_elementwise, matmul_abs_sums, matmul_bound_factor, rel_norm, Rng, F32_TOL,
};
use sluice_kernels::{Backend, DType, Error, Tensor};

/// C = A . B^T in f64, written independently of the library (row-parallel, plain loops).
fn oracle(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0.0f64; m * n];
    c.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        if i >= m {
            return;
        }
        for (j, out) in row.iter_mut().enumerate() {
            let (ar, br) = (&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k]);
            *out = ar.iter().zip(br).map(|(x, y)| x * y).sum();
        }
    });
    c
}

fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Values rounded to bf16, returned both as bf16 and as their exact f32 widening.
fn bf16_pair(x: &[f32]) -> (Vec<bf16>, Vec<f32>) {
    let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let w = h.iter().map(|v| v.to_f32()).collect();
    (h, w)
}

const SIZES: [usize; 5] = [1, 17, 64, 127, 1000];

#[test]
fn reference_f32_matches_f64_oracle_on_every_ragged_shape() {
    // Every (M, N, K) in {1, 17, 64, 127, 1000}^3: 125 shapes, including 1000 in each position.
    let mut rng = Rng::new(1);
    for &m in &SIZES {
        for &n in &SIZES {
            for &k in &SIZES {
                let a = rng.normal_vec(m * k, 1.0);
                let b = rng.normal_vec(n * k, 1.0);
                let got = gemm_reference(&a, &b, m, n, k);
                let want = oracle(&to_f64(&a), &to_f64(&b), m, n, k);
                let err = rel_norm(&got, &want);
                assert!(err <= F32_TOL, "f32 M={m} N={n} K={k}: rel err {err:e}");
            }
        }
    }
}

#[test]
fn reference_bf16_matches_f64_oracle_on_every_ragged_shape() {
    let mut rng = Rng::new(2);
    for &m in &SIZES {
        for &n in &SIZES {
            for &k in &SIZES {
                let (ah, aw) = bf16_pair(&rng.normal_vec(m * k, 1.0));
                let (bh, bw) = bf16_pair(&rng.normal_vec(n * k, 1.0));
                let got = gemm_reference_bf16(&ah, &bh, m, n, k);
                let want = oracle(&to_f64(&aw), &to_f64(&bw), m, n, k);
                let err = rel_norm(&got, &want);
                assert!(err <= F32_TOL, "bf16 M={m} N={n} K={k}: rel err {err:e}");
            }
        }
    }
}

#[test]
fn device_entry_on_cpu_matches_oracle_for_f32_and_bf16() {
    let cpu = Backend::Cpu;
    let (m, n, k) = (127, 17, 1000);
    let mut rng = Rng::new(3);
    let a = rng.normal_vec(m * k, 1.0);
    let b = rng.normal_vec(n * k, 1.0);
    for dtype in [DType::F32, DType::BF16] {
        let at = Tensor::from_f32_as(&cpu, &[m, k], dtype, &a).unwrap();
        let bt = Tensor::from_f32_as(&cpu, &[n, k], dtype, &b).unwrap();
        let c = gemm(&cpu, &at, &bt).unwrap();
        assert_eq!(c.shape(), &[m, n]);
        assert_eq!(c.dtype(), DType::F32);
        let want = oracle(
            &to_f64(&at.to_f32_vec().unwrap()),
            &to_f64(&bt.to_f32_vec().unwrap()),
            m,
            n,
            k,
        );
        let err = rel_norm(&c.to_vec::<f32>().unwrap(), &want);
        assert!(err <= F32_TOL, "{dtype}: rel err {err:e}");
    }
}

#[test]
fn zero_k_gives_zeros_and_empty_shapes_work() {
    let cpu = Backend::Cpu;
    let a = Tensor::from_slice::<f32>(&cpu, &[3, 0], &[]).unwrap();
    let b = Tensor::from_slice::<f32>(&cpu, &[2, 0], &[]).unwrap();
    assert_eq!(
        gemm(&cpu, &a, &b).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0; 6]
    );
    let a = Tensor::from_slice::<f32>(&cpu, &[0, 4], &[]).unwrap();
    let b = Tensor::from_f32_as(&cpu, &[2, 4], DType::F32, &[1.0; 8]).unwrap();
    assert_eq!(gemm(&cpu, &a, &b).unwrap().shape(), &[0, 2]);
}

/// Row i of C must be bit-identical whether computed with M = 1, 3 or 257, at any position.
fn check_batch_invariance(n: usize, k: usize, seed: u64) {
    let big_m = 257;
    let mut rng = Rng::new(seed);
    let a = rng.normal_vec(big_m * k, 1.0);
    let b = rng.normal_vec(n * k, 1.0);
    let full = gemm_reference(&a, &b, big_m, n, k);
    for &m in &[1usize, 3, 17, 64, 257] {
        for start in [0, 1, 5, 100, 131, big_m - m] {
            if start + m > big_m {
                continue;
            }
            let part = gemm_reference(&a[start * k..(start + m) * k], &b, m, n, k);
            for i in 0..m {
                for j in 0..n {
                    assert_eq!(
                        part[i * n + j].to_bits(),
                        full[(start + i) * n + j].to_bits(),
                        "N={n} K={k}: row {} col {j} differs when computed with M={m} at {start}",
                        start + i
                    );
                }
            }
        }
    }
}

#[test]
fn reference_is_batch_invariant_bit_for_bit() {
    // K = 300 and 1000 span several of matrixmultiply's 256-wide K chunks; N = 37 and 131 leave
    // partial column panels; K = 17 is a single partial chunk.
    check_batch_invariance(37, 300, 4);
    check_batch_invariance(131, 1000, 5);
    check_batch_invariance(17, 17, 6);
}

#[test]
fn grouped_rows_equal_plain_rows_bit_for_bit() {
    // A row's result in a grouped call is the row's result in a plain call with its group's B.
    let (n, k) = (29, 300);
    let offsets = [0i32, 0, 1, 18, 18, 50];
    let rows = 50;
    let groups = offsets.len() - 1;
    let mut rng = Rng::new(7);
    let a = rng.normal_vec(rows * k, 1.0);
    let b = rng.normal_vec(groups * n * k, 1.0);
    let grouped = gemm_grouped_reference(&a, &b, &offsets, n, k);
    for g in 0..groups {
        let bg = &b[g * n * k..(g + 1) * n * k];
        for r in offsets[g] as usize..offsets[g + 1] as usize {
            let single = gemm_reference(&a[r * k..(r + 1) * k], bg, 1, n, k);
            for j in 0..n {
                assert_eq!(
                    single[j].to_bits(),
                    grouped[r * n + j].to_bits(),
                    "row {r} col {j}"
                );
            }
        }
    }
}

/// Asserts two f32 slices are equal bit for bit, naming the first difference.
fn assert_same_bits(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{label}: element {i}: {} vs {}", got[i], want[i]);
    }
}

#[test]
fn packed_small_row_path_equals_the_reference_bit_for_bit() {
    // The small-row path (packed B, issue 16) must give the reference's bits, or mixing the
    // two (decode batches vs training batches) would break batch invariance. K = 255, 256, 257
    // and 700 sit on and across matrixmultiply's 256-wide chunks; N = 15, 16, 17, 33 and 100
    // leave partial 16-column panels and partial two-panel tiles; M covers 1..4-row tails.
    let mut rng = Rng::new(21);
    for &k in &[1usize, 17, 255, 256, 257, 700] {
        for &n in &[1usize, 15, 16, 17, 33, 100] {
            let b = rng.normal_vec(n * k, 1.0);
            let pb = PackedB::new(&b, 1, n, k);
            for &m in &[1usize, 2, 3, 5, 17, 64] {
                let a = rng.normal_vec(m * k, 1.0);
                let want = gemm_reference(&a, &b, m, n, k);
                let mut got = vec![f32::NAN; m * n];
                gemm_packed_into(&a, &pb, 0, &mut got, m);
                assert_same_bits(&format!("M={m} N={n} K={k}"), &got, &want);
            }
        }
    }
}

#[test]
fn device_gemm_small_rows_equal_large_rows_bit_for_bit() {
    // Through the cpu entry points: a product of few rows (packed path, B cached on the
    // tensor) and of many rows (matrixmultiply) give each row the same bits, plain and grouped,
    // also after the weight tensor was rewritten (the cached packing must be dropped).
    let cpu = Backend::Cpu;
    let (n, k, big) = (37, 300, 130);
    let mut rng = Rng::new(22);
    let a = rng.normal_vec(big * k, 1.0);
    let a_t = Tensor::from_slice(&cpu, &[big, k], &a).unwrap();
    for round in 0..2 {
        let b = rng.normal_vec(n * k, 1.0);
        let mut b_t = Tensor::from_slice(&cpu, &[n, k], &rng.normal_vec(n * k, 1.0)).unwrap();
        // Pack the first contents, then overwrite them: the next call must use the new ones.
        let one = Tensor::from_slice(&cpu, &[1, k], &a[..k]).unwrap();
        gemm(&cpu, &one, &b_t).unwrap();
        b_t.host_slice_mut::<f32>().unwrap().copy_from_slice(&b);
        let full = gemm(&cpu, &a_t, &b_t).unwrap().to_vec::<f32>().unwrap();
        assert_same_bits(
            "large M vs reference",
            &full,
            &gemm_reference(&a, &b, big, n, k),
        );
        for (start, m) in [(0usize, 1usize), (5, 3), (60, 17), (66, 64)] {
            let part = Tensor::from_slice(&cpu, &[m, k], &a[start * k..(start + m) * k]).unwrap();
            let got = gemm(&cpu, &part, &b_t).unwrap().to_vec::<f32>().unwrap();
            assert_same_bits(
                &format!("round {round}, M={m} at {start}"),
                &got,
                &full[start * n..(start + m) * n],
            );
        }
    }
    // Grouped: segments of 0, 1, 17 and 64 rows against three stacked matrices plus one.
    let offsets = [0i32, 1, 1, 18, 82];
    let groups = offsets.len() - 1;
    let rows = 82;
    let bs = rng.normal_vec(groups * n * k, 1.0);
    let a_t = Tensor::from_slice(&cpu, &[rows, k], &a[..rows * k]).unwrap();
    let b_t = Tensor::from_slice(&cpu, &[groups, n, k], &bs).unwrap();
    let off_t = Tensor::from_slice(&cpu, &[offsets.len()], &offsets).unwrap();
    let got = gemm_grouped(&cpu, &a_t, &b_t, &off_t)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let want = gemm_grouped_reference(&a[..rows * k], &bs, &offsets, n, k);
    assert_same_bits("grouped, packed segments", &got, &want);
}

#[test]
fn strided_views_equal_transposed_copies_bit_for_bit() {
    // gemm_strided_into reads A^T and B^T through strides (the MoE backward's dY W and P^T Q);
    // it must give the bits of the plain reference on transposed copies, which is what the
    // backward computed before it dropped the copies.
    let mut rng = Rng::new(23);
    let transpose = |x: &[f32], r: usize, c: usize| -> Vec<f32> {
        (0..c)
            .flat_map(|j| (0..r).map(move |i| x[i * c + j]))
            .collect()
    };
    for &(m, n, k) in &[
        (1usize, 1usize, 1usize),
        (17, 33, 300),
        (130, 37, 257),
        (64, 100, 17),
    ] {
        // C = A B with B [k, n] row-major: the reference takes B^T [n, k].
        let a = rng.normal_vec(m * k, 1.0);
        let b_kn = rng.normal_vec(k * n, 1.0);
        let want = gemm_reference(&a, &transpose(&b_kn, k, n), m, n, k);
        let mut got = vec![f32::NAN; m * n];
        gemm_strided_into(m, n, k, (&a, k, 1), (&b_kn, n, 1), &mut got);
        assert_same_bits(&format!("A B, M={m} N={n} K={k}"), &got, &want);
        // C = P^T Q with P [k, m], Q [k, n] row-major.
        let p = rng.normal_vec(k * m, 1.0);
        let q = rng.normal_vec(k * n, 1.0);
        let want = gemm_reference(&transpose(&p, k, m), &transpose(&q, k, n), m, n, k);
        let mut got = vec![f32::NAN; m * n];
        gemm_strided_into(m, n, k, (&p, 1, m), (&q, n, 1), &mut got);
        assert_same_bits(&format!("P^T Q, M={m} N={n} K={k}"), &got, &want);
    }
}

#[test]
fn reference_is_deterministic() {
    let (m, n, k) = (300, 200, 700);
    let mut rng = Rng::new(8);
    let a = rng.normal_vec(m * k, 1.0);
    let b = rng.normal_vec(n * k, 1.0);
    let first = gemm_reference(&a, &b, m, n, k);
    for _ in 0..3 {
        let again = gemm_reference(&a, &b, m, n, k);
        assert!(first
            .iter()
            .zip(&again)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}

#[test]
fn batched_matches_oracle_with_own_and_shared_b() {
    let cpu = Backend::Cpu;
    let (batch, m, n, k) = (3, 17, 33, 40);
    let mut rng = Rng::new(9);
    let a = rng.normal_vec(batch * m * k, 1.0);
    let b = rng.normal_vec(batch * n * k, 1.0);
    let at = Tensor::from_slice(&cpu, &[batch, m, k], &a).unwrap();
    let bt = Tensor::from_slice(&cpu, &[batch, n, k], &b).unwrap();
    let c = gemm_batched(&cpu, &at, &bt)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(c, gemm_batched_reference(&a, &b, batch, m, n, k));
    for i in 0..batch {
        let want = oracle(
            &to_f64(&a[i * m * k..(i + 1) * m * k]),
            &to_f64(&b[i * n * k..(i + 1) * n * k]),
            m,
            n,
            k,
        );
        let err = rel_norm(&c[i * m * n..(i + 1) * m * n], &want);
        assert!(err <= F32_TOL, "batch {i}: {err:e}");
    }
    // One B [N,K] shared by every batch entry.
    let b0 = Tensor::from_slice(&cpu, &[n, k], &b[..n * k]).unwrap();
    let c = gemm_batched(&cpu, &at, &b0)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for i in 0..batch {
        let want = gemm_reference(&a[i * m * k..(i + 1) * m * k], &b[..n * k], m, n, k);
        assert_eq!(&c[i * m * n..(i + 1) * m * n], &want[..]);
    }
}

/// offsets with empty segments (first, middle and last) and a one-row segment.
const GROUP_OFFSETS: [i32; 7] = [0, 0, 1, 18, 18, 40, 40];

#[test]
fn grouped_matches_oracle_with_empty_and_one_row_segments() {
    let cpu = Backend::Cpu;
    let (n, k) = (33, 40);
    let rows = *GROUP_OFFSETS.last().unwrap() as usize;
    let groups = GROUP_OFFSETS.len() - 1;
    let mut rng = Rng::new(10);
    let a = rng.normal_vec(rows * k, 1.0);
    let b = rng.normal_vec(groups * n * k, 1.0);
    for dtype in [DType::F32, DType::BF16] {
        let at = Tensor::from_f32_as(&cpu, &[rows, k], dtype, &a).unwrap();
        let bt = Tensor::from_f32_as(&cpu, &[groups, n, k], dtype, &b).unwrap();
        let ot = Tensor::from_slice(&cpu, &[groups + 1], &GROUP_OFFSETS).unwrap();
        let c = gemm_grouped(&cpu, &at, &bt, &ot).unwrap();
        assert_eq!(c.shape(), &[rows, n]);
        let c = c.to_vec::<f32>().unwrap();
        let (aw, bw) = (at.to_f32_vec().unwrap(), bt.to_f32_vec().unwrap());
        for g in 0..groups {
            let (r0, r1) = (GROUP_OFFSETS[g] as usize, GROUP_OFFSETS[g + 1] as usize);
            if r0 == r1 {
                continue;
            }
            let want = oracle(
                &to_f64(&aw[r0 * k..r1 * k]),
                &to_f64(&bw[g * n * k..(g + 1) * n * k]),
                r1 - r0,
                n,
                k,
            );
            let err = rel_norm(&c[r0 * n..r1 * n], &want);
            assert!(err <= F32_TOL, "{dtype} group {g}: {err:e}");
        }
    }
}

fn expect_shape_err(r: sluice_kernels::Result<Tensor>, tensor: &str, expected: &str) {
    match r {
        Err(e @ Error::Shape { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{tensor}`")), "{msg}");
            assert!(msg.contains(expected), "`{msg}` should name {expected}");
        }
        other => panic!("expected a shape error naming `{tensor}`, got {other:?}"),
    }
}

#[test]
fn bad_input_is_an_error_naming_the_tensor() {
    let cpu = Backend::Cpu;
    let t = |shape: &[usize], dtype| {
        let nel: usize = shape.iter().product();
        Tensor::from_f32_as(&cpu, shape, dtype, &vec![1.0; nel]).unwrap()
    };
    let a = t(&[17, 40], DType::F32);
    expect_shape_err(gemm(&cpu, &a, &t(&[33, 41], DType::F32)), "b", "[N,40]");
    expect_shape_err(gemm(&cpu, &a, &t(&[33], DType::F32)), "b", "[N,40]");
    expect_shape_err(gemm(&cpu, &t(&[17], DType::F32), &a), "a", "[M,K]");
    match gemm(&cpu, &a, &t(&[33, 40], DType::BF16)) {
        Err(Error::DType { tensor, .. }) => assert_eq!(tensor, "b"),
        other => panic!("expected a dtype error for `b`, got {other:?}"),
    }
    let ints = Tensor::from_slice::<i32>(&cpu, &[2, 2], &[1, 2, 3, 4]).unwrap();
    match gemm(&cpu, &ints, &ints) {
        Err(Error::DType { tensor, .. }) => assert_eq!(tensor, "a"),
        other => panic!("expected a dtype error for `a`, got {other:?}"),
    }
    // Batched: batch or K mismatch.
    let a3 = t(&[2, 17, 40], DType::F32);
    expect_shape_err(
        gemm_batched(&cpu, &a3, &t(&[3, 5, 40], DType::F32)),
        "b",
        "[2,N,40]",
    );
    expect_shape_err(
        gemm_batched(&cpu, &a3, &t(&[2, 5, 8], DType::F32)),
        "b",
        "[2,N,40]",
    );
    // Grouped: b_stack's G or K, offsets' dtype, values and coverage.
    let offs = |v: &[i32]| Tensor::from_slice(&cpu, &[v.len()], v).unwrap();
    let a = t(&[10, 8], DType::F32);
    let bs = t(&[2, 5, 8], DType::F32);
    expect_shape_err(
        gemm_grouped(&cpu, &a, &t(&[3, 5, 8], DType::F32), &offs(&[0, 4, 10])),
        "b_stack",
        "[2,N,8]",
    );
    expect_shape_err(
        gemm_grouped(&cpu, &a, &t(&[2, 5, 9], DType::F32), &offs(&[0, 4, 10])),
        "b_stack",
        "[2,N,8]",
    );
    for bad in [
        &[0, 4, 9][..],
        &[0, 6, 4, 10][..],
        &[1, 4, 10][..],
        &[0, 4, 11][..],
    ] {
        let b_g = t(&[bad.len() - 1, 5, 8], DType::F32);
        match gemm_grouped(&cpu, &a, &b_g, &offs(bad)) {
            Err(e @ Error::Invalid(_)) => assert!(e.to_string().contains("`offsets`"), "{e}"),
            other => panic!("offsets {bad:?}: expected an error naming `offsets`, got {other:?}"),
        }
    }
    let f_offs = Tensor::from_f32_as(&cpu, &[3], DType::F32, &[0.0, 4.0, 10.0]).unwrap();
    match gemm_grouped(&cpu, &a, &bs, &f_offs) {
        Err(Error::DType { tensor, .. }) => assert_eq!(tensor, "offsets"),
        other => panic!("expected a dtype error for `offsets`, got {other:?}"),
    }
    assert!(gemm_grouped(&cpu, &a, &bs, &offs(&[0, 4, 10])).is_ok());
    // gemm_into: the output must be F32 [M,N].
    let (a, b) = (t(&[4, 8], DType::F32), t(&[5, 8], DType::F32));
    let mut c = t(&[5, 4], DType::F32);
    match gemm_into(&cpu, &a, &b, &mut c) {
        Err(e @ Error::Shape { .. }) => assert!(e.to_string().contains("`c`"), "{e}"),
        other => panic!("expected a shape error naming `c`, got {other:?}"),
    }
    let mut c = t(&[4, 5], DType::BF16);
    assert!(matches!(
        gemm_into(&cpu, &a, &b, &mut c),
        Err(Error::DType { .. })
    ));
    let mut c = t(&[4, 5], DType::F32);
    gemm_into(&cpu, &a, &b, &mut c).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![8.0; 20]);
}

// ---------------------------------------------------------------------------------------------
// Kernels: emu (always) and cuda (where a GPU exists) against the CPU reference.
// ---------------------------------------------------------------------------------------------

/// The kernel variants: (label, dtype, bf16 path).
fn variants(include_wgmma: bool) -> Vec<(&'static str, DType, GemmPath)> {
    let mut v = vec![
        ("f32", DType::F32, GemmPath::Mma),
        ("bf16 mma", DType::BF16, GemmPath::Mma),
    ];
    if include_wgmma {
        v.push(("bf16 wgmma", DType::BF16, GemmPath::Wgmma));
    }
    v
}

/// One device result with what it is checked against: the CPU reference of the same
/// dtype-rounded inputs and, per output, sum_k |a_k b_k| (the scale of its rounding error).
struct DeviceRun {
    got: Vec<f32>,
    want: Vec<f32>,
    abs_sums: Vec<f64>,
    k: usize,
    dtype: DType,
}

impl DeviceRun {
    /// Element-wise bound and no lost outputs, always; with `norm_tol`, the relative norm too.
    fn check(&self, label: &str, norm_tol: Option<f64>) {
        let r = check_matmul_elementwise(&self.got, &self.want, &self.abs_sums, self.k, self.dtype);
        println!(
            "{label}: worst error {:.3e} of its element-wise bound",
            r.worst_ratio
        );
        r.assert_ok(label);
        if let Some(tol) = norm_tol {
            assert_close(label, &self.got, &self.want, tol);
        }
    }
}

/// Runs one GEMM on `backend` against the CPU reference of the same dtype-rounded inputs.
/// `gemm` poisons its output (NaN) before launching, so an unwritten element fails.
#[allow(clippy::too_many_arguments)]
fn device_vs_cpu(
    backend: &Backend,
    dtype: DType,
    path: GemmPath,
    m: usize,
    n: usize,
    k: usize,
    seed: u64,
) -> DeviceRun {
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(seed);
    let a = Tensor::from_f32_as(&cpu, &[m, k], dtype, &rng.normal_vec(m * k, 1.0)).unwrap();
    let b = Tensor::from_f32_as(&cpu, &[n, k], dtype, &rng.normal_vec(n * k, 1.0)).unwrap();
    let want = gemm_with_path(&cpu, &a, &b, path)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let c = gemm_with_path(
        backend,
        &a.to_backend(backend).unwrap(),
        &b.to_backend(backend).unwrap(),
        path,
    )
    .unwrap();
    assert_eq!(c.shape(), &[m, n]);
    let abs_sums = matmul_abs_sums(&a.to_f32_vec().unwrap(), &b.to_f32_vec().unwrap(), m, n, k);
    DeviceRun {
        got: c.to_vec::<f32>().unwrap(),
        want,
        abs_sums,
        k,
        dtype,
    }
}

fn assert_close(label: &str, got: &[f32], want: &[f32], tol: f64) {
    let err = rel_norm(got, &to_f64(want));
    assert!(err <= tol, "{label}: rel err {err:e} > {tol:e}");
}

fn assert_bits_eq(label: &str, x: &[f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "{label}: lengths");
    for (i, (p, q)) in x.iter().zip(y).enumerate() {
        assert_eq!(
            p.to_bits(),
            q.to_bits(),
            "{label}: element {i} differs: {p} vs {q}"
        );
    }
}

/// The element-wise check fails on what a relative norm over many outputs lets through: one
/// output zeroed, one output missing a 16-wide k-step. And the CPU reference itself stays inside
/// the bound against the f64 oracle (the reference's half of the bound holds on its own).
#[test]
fn elementwise_bound_catches_a_lost_output_and_a_dropped_k_step() {
    let (m, n, k) = (64, 300, 1000);
    let mut rng = Rng::new(16);
    let (ah, a) = bf16_pair(&rng.normal_vec(m * k, 1.0));
    let (bh, b) = bf16_pair(&rng.normal_vec(n * k, 1.0));
    let want = gemm_reference_bf16(&ah, &bh, m, n, k);
    let sums = matmul_abs_sums(&a, &b, m, n, k);
    let exact = oracle(&to_f64(&a), &to_f64(&b), m, n, k);
    let mut worst = 0.0f64;
    for i in 0..m * n {
        worst = worst.max((want[i] as f64 - exact[i]).abs() / sums[i]);
    }
    assert!(
        worst <= matmul_bound_factor(k, DType::BF16),
        "reference error {worst:e} of sum |ab| is over the bound"
    );
    let ok = check_matmul_elementwise(&want, &want, &sums, k, DType::BF16);
    assert_eq!((ok.over_bound, ok.lost, ok.non_finite), (0, 0, 0));

    // One output zeroed: its relative-norm error over 19200 outputs is about 0.7%, under 1e-2.
    let mut zeroed = want.clone();
    zeroed[777] = 0.0;
    assert!(rel_norm(&zeroed, &to_f64(&want)) < 1e-2);
    let r = check_matmul_elementwise(&zeroed, &want, &sums, k, DType::BF16);
    assert_eq!(r.lost, 1, "{r:?}");
    assert_eq!(r.worst_index, 777, "{r:?}");

    // One output computed without its k-step 480..496.
    let (i, j) = (5, 123);
    let mut dropped = want.clone();
    dropped[i * n + j] = (0..k)
        .filter(|p| !(480..496).contains(p))
        .map(|p| a[i * k + p] * b[j * k + p])
        .sum();
    let r = check_matmul_elementwise(&dropped, &want, &sums, k, DType::BF16);
    assert_eq!((r.over_bound, r.worst_index), (1, i * n + j), "{r:?}");
}

/// Small ragged shapes for the emulator. (3, 140, 264): two column tiles and five K steps of 64,
/// one more than the wgmma kernel's four stages, so its ring wraps and the barrier parity flips.
const EMU_SHAPES: [(usize, usize, usize); 5] = [
    (17, 33, 40),
    (1, 1, 1),
    (127, 17, 64),
    (5, 130, 70),
    (3, 140, 264),
];

#[test]
fn emu_matches_cpu_with_two_seeds_bit_identical() {
    let emu1 = Backend::emu_with_seed(1);
    let emu2 = Backend::emu_with_seed(2);
    for (label, dtype, path) in variants(true) {
        for &(m, n, k) in &EMU_SHAPES {
            let tag = format!("emu {label} {m}x{n}x{k}");
            let one = device_vs_cpu(&emu1, dtype, path, m, n, k, 11);
            let two = device_vs_cpu(&emu2, dtype, path, m, n, k, 11);
            one.check(&tag, Some(F32_TOL));
            assert_bits_eq(&format!("{tag}, seeds 1 and 2"), &one.got, &two.got);
        }
    }
}

#[test]
fn emu_is_batch_invariant() {
    // Row r of an M = 17 product equals the same row computed alone (M = 1), bit for bit.
    let emu = Backend::emu_with_seed(3);
    let (m, n, k) = (17, 9, 40);
    let mut rng = Rng::new(12);
    let a = rng.normal_vec(m * k, 1.0);
    let b = rng.normal_vec(n * k, 1.0);
    for (label, dtype, path) in variants(true) {
        let bt = Tensor::from_f32_as(&emu, &[n, k], dtype, &b).unwrap();
        let at = Tensor::from_f32_as(&emu, &[m, k], dtype, &a).unwrap();
        let full = gemm_with_path(&emu, &at, &bt, path)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for r in [0, 7, 16] {
            let ar = Tensor::from_f32_as(&emu, &[1, k], dtype, &a[r * k..(r + 1) * k]).unwrap();
            let row = gemm_with_path(&emu, &ar, &bt, path)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            assert_bits_eq(
                &format!("emu {label} row {r}"),
                &row,
                &full[r * n..(r + 1) * n],
            );
        }
    }
}

/// Batched and grouped forms on a device against the CPU, run twice and bit-compared; every
/// output within its element-wise bound, none lost. `norm_tol_bf16`: the relative-norm tolerance
/// bf16 results must meet as well (`None` on CUDA: element-wise only).
fn batched_and_grouped_on(
    backend: &Backend,
    name: &str,
    include_wgmma: bool,
    norm_tol_bf16: Option<f64>,
) {
    let cpu = Backend::Cpu;
    let (batch, m, n, k) = (2, 17, 20, 24);
    let mut rng = Rng::new(13);
    let a = rng.normal_vec(batch * m * k, 1.0);
    let b = rng.normal_vec(batch * n * k, 1.0);
    let rows = *GROUP_OFFSETS.last().unwrap() as usize;
    let groups = GROUP_OFFSETS.len() - 1;
    let ga = rng.normal_vec(rows * k, 1.0);
    let gb = rng.normal_vec(groups * n * k, 1.0);
    for (label, dtype, path) in variants(include_wgmma) {
        let norm_tol = if dtype == DType::F32 {
            Some(F32_TOL)
        } else {
            norm_tol_bf16
        };
        let at = Tensor::from_f32_as(&cpu, &[batch, m, k], dtype, &a).unwrap();
        let bt = Tensor::from_f32_as(&cpu, &[batch, n, k], dtype, &b).unwrap();
        let want = gemm_batched(&cpu, &at, &bt)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (ar, br) = (at.to_f32_vec().unwrap(), bt.to_f32_vec().unwrap());
        let abs_sums: Vec<f64> = (0..batch)
            .flat_map(|i| {
                matmul_abs_sums(
                    &ar[i * m * k..(i + 1) * m * k],
                    &br[i * n * k..(i + 1) * n * k],
                    m,
                    n,
                    k,
                )
            })
            .collect();
        let (ad, bd) = (
            at.to_backend(backend).unwrap(),
            bt.to_backend(backend).unwrap(),
        );
        let run = || {
            sluice_kernels::ops::gemm::gemm_batched_with_path(backend, &ad, &bd, path)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        let (x, y) = (run(), run());
        let tag = format!("{name} batched {label}");
        DeviceRun {
            got: x.clone(),
            want,
            abs_sums,
            k,
            dtype,
        }
        .check(&tag, norm_tol);
        assert_bits_eq(&format!("{tag}, two runs"), &x, &y);

        let at = Tensor::from_f32_as(&cpu, &[rows, k], dtype, &ga).unwrap();
        let bt = Tensor::from_f32_as(&cpu, &[groups, n, k], dtype, &gb).unwrap();
        let ot = Tensor::from_slice(&cpu, &[groups + 1], &GROUP_OFFSETS).unwrap();
        let want = gemm_grouped(&cpu, &at, &bt, &ot)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (ar, br) = (at.to_f32_vec().unwrap(), bt.to_f32_vec().unwrap());
        let abs_sums: Vec<f64> = (0..groups)
            .flat_map(|g| {
                let (r0, r1) = (GROUP_OFFSETS[g] as usize, GROUP_OFFSETS[g + 1] as usize);
                matmul_abs_sums(
                    &ar[r0 * k..r1 * k],
                    &br[g * n * k..(g + 1) * n * k],
                    r1 - r0,
                    n,
                    k,
                )
            })
            .collect();
        let (ad, bd, od) = (
            at.to_backend(backend).unwrap(),
            bt.to_backend(backend).unwrap(),
            ot.to_backend(backend).unwrap(),
        );
        let run = || {
            gemm_grouped_with_path(backend, &ad, &bd, &od, path)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        let (x, y) = (run(), run());
        let tag = format!("{name} grouped {label}");
        DeviceRun {
            got: x.clone(),
            want,
            abs_sums,
            k,
            dtype,
        }
        .check(&tag, norm_tol);
        assert_bits_eq(&format!("{tag}, two runs"), &x, &y);
    }
}

#[test]
fn emu_batched_and_grouped_match_cpu() {
    batched_and_grouped_on(&Backend::emu_with_seed(4), "emu", true, Some(F32_TOL));
}

#[test]
fn emu_bad_offsets_are_an_error_not_a_launch() {
    let emu = Backend::emu_with_seed(1);
    let a = Tensor::from_f32_as(&emu, &[10, 8], DType::F32, &[1.0; 80]).unwrap();
    let b = Tensor::from_f32_as(&emu, &[2, 5, 8], DType::F32, &[1.0; 80]).unwrap();
    let o = Tensor::from_slice::<i32>(&emu, &[3], &[0, 12, 10]).unwrap();
    assert!(matches!(
        gemm_grouped(&emu, &a, &b, &o),
        Err(Error::Invalid(_))
    ));
}

#[test]
fn cuda_matches_cpu_and_is_deterministic() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("gemm cuda") else {
        return;
    };
    let hopper = gpu
        .cuda()
        .is_some_and(|c| c.arch() == sluice_kernels::cuda::PtxArch::Sm90a);
    let shapes = [
        (17, 33, 40),
        (1, 1, 1),
        (127, 17, 64),
        (1000, 127, 1000),
        (64, 1000, 17),
        (1000, 1000, 1000),
    ];
    for (label, dtype, path) in variants(hopper) {
        // bf16 on tensor cores: the element-wise bound alone (see the module comment).
        let norm_tol = (dtype == DType::F32).then_some(F32_TOL);
        for &(m, n, k) in &shapes {
            let tag = format!("cuda {label} {m}x{n}x{k}");
            let x = device_vs_cpu(&gpu, dtype, path, m, n, k, 14);
            let y = device_vs_cpu(&gpu, dtype, path, m, n, k, 14);
            x.check(&tag, norm_tol);
            assert_bits_eq(&format!("{tag}, two runs"), &x.got, &y.got);
        }
    }
    batched_and_grouped_on(&gpu, "cuda", hopper, None);
}

#[test]
fn cuda_is_batch_invariant() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("gemm cuda batch invariance") else {
        return;
    };
    let hopper = gpu
        .cuda()
        .is_some_and(|c| c.arch() == sluice_kernels::cuda::PtxArch::Sm90a);
    let (n, k) = (300, 1000);
    let mut rng = Rng::new(15);
    let a = rng.normal_vec(257 * k, 1.0);
    let b = rng.normal_vec(n * k, 1.0);
    for (label, dtype, path) in variants(hopper) {
        let bt = Tensor::from_f32_as(&gpu, &[n, k], dtype, &b).unwrap();
        let full = {
            let at = Tensor::from_f32_as(&gpu, &[257, k], dtype, &a).unwrap();
            gemm_with_path(&gpu, &at, &bt, path)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        for (m, start) in [(1usize, 0usize), (1, 200), (3, 128), (3, 254)] {
            let at =
                Tensor::from_f32_as(&gpu, &[m, k], dtype, &a[start * k..(start + m) * k]).unwrap();
            let part = gemm_with_path(&gpu, &at, &bt, path)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            assert_bits_eq(
                &format!("cuda {label} M={m} at {start}"),
                &part,
                &full[start * n..(start + m) * n],
            );
        }
    }
}

/// BF16 inputs on `cpu` (kernels/src/ops/gemm_chain.rs: one ascending FMA chain per output over
/// all of K) and on emu (`gemm_bf16_mma`, whose emulated mma.sync adds its products one `fmaf` at
/// a time, k ascending): the same bits, for ragged M and N (1, 17, 127) and for K past the f32
/// reference's 256-long chunks (300, 513), in the plain, batched and grouped forms. This is what
/// makes the cpu bf16 model bit-identical to the emulated kernels (model/tests/bf16.rs). Only
/// the mma path: the wgmma emulation is checked against the reference by norm above.
#[test]
fn emu_mma_bf16_equals_cpu_bf16_bit_for_bit() {
    let emu = Backend::emu_with_seed(5);
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(21);
    for &(m, n, k) in &[(1, 1, 1), (17, 33, 40), (127, 17, 300), (5, 130, 513)] {
        let a =
            Tensor::from_f32_as(&cpu, &[m, k], DType::BF16, &rng.normal_vec(m * k, 1.0)).unwrap();
        let b =
            Tensor::from_f32_as(&cpu, &[n, k], DType::BF16, &rng.normal_vec(n * k, 1.0)).unwrap();
        let want = gemm_with_path(&cpu, &a, &b, GemmPath::Mma).unwrap();
        let got = gemm_with_path(
            &emu,
            &a.to_backend(&emu).unwrap(),
            &b.to_backend(&emu).unwrap(),
            GemmPath::Mma,
        )
        .unwrap();
        assert_bits_eq(
            &format!("bf16 {m}x{n}x{k}"),
            &got.to_vec::<f32>().unwrap(),
            &want.to_vec::<f32>().unwrap(),
        );
    }
    // Batched (own B per entry) and grouped (empty and one-row segments), K = 300.
    let (batch, m, n, k) = (2, 17, 20, 300);
    let a = Tensor::from_f32_as(
        &cpu,
        &[batch, m, k],
        DType::BF16,
        &rng.normal_vec(batch * m * k, 1.0),
    )
    .unwrap();
    let b = Tensor::from_f32_as(
        &cpu,
        &[batch, n, k],
        DType::BF16,
        &rng.normal_vec(batch * n * k, 1.0),
    )
    .unwrap();
    let want = gemm_batched_with_path(&cpu, &a, &b, GemmPath::Mma).unwrap();
    let got = gemm_batched_with_path(
        &emu,
        &a.to_backend(&emu).unwrap(),
        &b.to_backend(&emu).unwrap(),
        GemmPath::Mma,
    )
    .unwrap();
    assert_bits_eq(
        "bf16 batched",
        &got.to_vec::<f32>().unwrap(),
        &want.to_vec::<f32>().unwrap(),
    );
    let rows = *GROUP_OFFSETS.last().unwrap() as usize;
    let groups = GROUP_OFFSETS.len() - 1;
    let ga = Tensor::from_f32_as(
        &cpu,
        &[rows, k],
        DType::BF16,
        &rng.normal_vec(rows * k, 1.0),
    )
    .unwrap();
    let gb = Tensor::from_f32_as(
        &cpu,
        &[groups, n, k],
        DType::BF16,
        &rng.normal_vec(groups * n * k, 1.0),
    )
    .unwrap();
    let off = Tensor::from_slice(&cpu, &[groups + 1], &GROUP_OFFSETS).unwrap();
    let want = gemm_grouped_with_path(&cpu, &ga, &gb, &off, GemmPath::Mma).unwrap();
    let got = gemm_grouped_with_path(
        &emu,
        &ga.to_backend(&emu).unwrap(),
        &gb.to_backend(&emu).unwrap(),
        &off.to_backend(&emu).unwrap(),
        GemmPath::Mma,
    )
    .unwrap();
    assert_bits_eq(
        "bf16 grouped",
        &got.to_vec::<f32>().unwrap(),
        &want.to_vec::<f32>().unwrap(),
    );
}
