//! topk: the CPU reference against an independent oracle, emu and CUDA against the reference,
//! determinism, the edge cases of the op's total order, and bad input.
//!
//! topk is exact (it selects and copies, it computes nothing), so every comparison here is bit
//! for bit: the same indices and the same value bits. A relative-norm tolerance would let a
//! wrong tie-break through.

use half::bf16;
use sluice_kernels::ops::topk::{
    topk, topk_into, topk_into_version, topk_reference, KernelVersion, MAX_E, MAX_K,
};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Error, Tensor};
use std::cmp::Ordering;

/// The oracle, written without the reference's order keys: sort each row's indices by value
/// with an explicit comparator (NaN lowest, -0.0 == +0.0 because f64 comparison says so),
/// stable, so equal values keep ascending index order; take the first k.
fn oracle(scores: &[f32], t: usize, e: usize, k: usize) -> (Vec<f32>, Vec<i32>) {
    let mut values = Vec::with_capacity(t * k);
    let mut indices = Vec::with_capacity(t * k);
    for r in 0..t {
        let row = &scores[r * e..(r + 1) * e];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (row[a] as f64, row[b] as f64);
            match (x.is_nan(), y.is_nan()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater, // NaN after every number
                (false, true) => Ordering::Less,
                (false, false) => y.partial_cmp(&x).unwrap(), // descending
            }
        });
        for &i in &order[..k] {
            values.push(row[i]);
            indices.push(i as i32);
        }
    }
    (values, indices)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Asserts values (bit for bit) and indices equal, naming the first difference.
fn assert_same(what: &str, got: &(Vec<f32>, Vec<i32>), want: &(Vec<f32>, Vec<i32>), k: usize) {
    assert_eq!(got.1.len(), want.1.len(), "{what}: lengths differ");
    for (n, ((gv, gi), (wv, wi))) in got
        .0
        .iter()
        .zip(&got.1)
        .zip(want.0.iter().zip(&want.1))
        .enumerate()
    {
        assert!(
            gi == wi && gv.to_bits() == wv.to_bits(),
            "{what}: row {} rank {}: got ({gv}, index {gi}), want ({wv}, index {wi})",
            n / k,
            n % k
        );
    }
}

/// Random scores with the features routers meet: mostly normal values, some exact duplicates
/// (bf16-like coarse values), and optionally NaN, ±inf and ±0.
fn scores(rng: &mut Rng, n: usize, specials: bool) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u = rng.uniform();
            if specials && u < 0.04 {
                [
                    f32::NAN,
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    0.0,
                    -0.0,
                    -f32::NAN,
                ][rng.below(6)]
            } else if u < 0.3 {
                // Coarse values: many exact ties inside a row.
                (rng.below(9) as f32 - 4.0) * 0.5
            } else {
                rng.normal() as f32
            }
        })
        .collect()
}

fn ks_for(e: usize) -> Vec<usize> {
    let mut ks = vec![1, e.min(2), e.min(8), e.min(MAX_K)];
    if e <= MAX_K {
        ks.push(e);
    }
    ks.sort();
    ks.dedup();
    ks
}

/// Runs the op on `backend` and downloads (values, indices), checking the output shapes.
fn run(
    backend: &Backend,
    data: &[f32],
    t: usize,
    e: usize,
    k: usize,
    dtype: DType,
) -> (Vec<f32>, Vec<i32>) {
    let x = Tensor::from_f32_as(backend, &[t, e], dtype, data).unwrap();
    let (v, i) = topk(backend, &x, k).unwrap_or_else(|err| panic!("topk [{t},{e}] k={k}: {err}"));
    assert_eq!(v.shape(), &[t, k]);
    assert_eq!(i.shape(), &[t, k]);
    assert_eq!(v.dtype(), DType::F32);
    assert_eq!(i.dtype(), DType::I32);
    (v.to_vec::<f32>().unwrap(), i.to_vec::<i32>().unwrap())
}

/// Both kernel versions: every device test runs each (they must give the same bits).
const VERSIONS: [KernelVersion; 2] = [KernelVersion::V1, KernelVersion::V2];

/// Like [`run`], with an explicit kernel version, into poisoned caller-owned outputs.
fn run_version(
    backend: &Backend,
    data: &[f32],
    (t, e, k): (usize, usize, usize),
    dtype: DType,
    version: KernelVersion,
) -> (Vec<f32>, Vec<i32>) {
    let x = Tensor::from_f32_as(backend, &[t, e], dtype, data).unwrap();
    let mut v = Tensor::poisoned(backend, &[t, k], DType::F32).unwrap();
    let mut i = Tensor::poisoned(backend, &[t, k], DType::I32).unwrap();
    topk_into_version(backend, &x, k, &mut v, &mut i, version)
        .unwrap_or_else(|err| panic!("topk {version:?} [{t},{e}] k={k}: {err}"));
    (v.to_vec::<f32>().unwrap(), i.to_vec::<i32>().unwrap())
}

/// `data` rounded to bf16 and widened back: what a BF16 tensor of `data` holds.
fn bf16_round(data: &[f32]) -> Vec<f32> {
    data.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

#[test]
fn reference_matches_oracle_ragged() {
    let mut rng = Rng::new(11);
    for &t in &[1usize, 17, 127] {
        for &e in &[1usize, 3, 17, 256, 512] {
            for specials in [false, true] {
                let data = scores(&mut rng, t * e, specials);
                for k in ks_for(e) {
                    let what = format!("reference [{t},{e}] k={k} specials={specials}");
                    assert_same(
                        &what,
                        &topk_reference(&data, t, e, k).unwrap(),
                        &oracle(&data, t, e, k),
                        k,
                    );
                }
            }
        }
    }
}

#[test]
fn reference_allows_any_k_up_to_e() {
    // The plain-slice reference is used by other families; it has no kernel limits.
    let mut rng = Rng::new(12);
    let (t, e) = (5, 700);
    let data = scores(&mut rng, t * e, true);
    for k in [0, 1, 33, 700] {
        assert_same(
            "reference e=700",
            &topk_reference(&data, t, e, k).unwrap(),
            &oracle(&data, t, e, k),
            k.max(1),
        );
    }
}

#[test]
fn cpu_device_f32_and_bf16() {
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(13);
    for &(t, e) in &[(1usize, 1usize), (17, 3), (127, 17), (17, 256), (3, 512)] {
        let data = scores(&mut rng, t * e, true);
        for k in ks_for(e) {
            let what = format!("cpu f32 [{t},{e}] k={k}");
            assert_same(
                &what,
                &run(&cpu, &data, t, e, k, DType::F32),
                &oracle(&data, t, e, k),
                k,
            );
            let rounded = bf16_round(&data);
            let what = format!("cpu bf16 [{t},{e}] k={k}");
            assert_same(
                &what,
                &run(&cpu, &data, t, e, k, DType::BF16),
                &oracle(&rounded, t, e, k),
                k,
            );
        }
    }
}

/// Rows whose answer is known by hand: (row, k, expected indices).
fn edge_cases() -> Vec<(Vec<f32>, usize, Vec<i32>)> {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let cases: Vec<(Vec<f32>, usize, Vec<i32>)> = vec![
        // all equal: the lowest indices, in order (at E = 64 and 256 a few lanes win every
        // round, which exercises the V2 kernel's rescan path)
        (vec![0.5; 9], 4, vec![0, 1, 2, 3]),
        (vec![-2.0; 64], 16, (0..16).collect()),
        (vec![7.0; 256], 16, (0..16).collect()),
        // NaN below -inf, NaNs in index order, selected last when k = E
        (vec![nan, -inf, 1.0, nan, -inf], 5, vec![2, 1, 4, 0, 3]),
        // +inf first, ties at +inf to the lower index
        (vec![1.0, inf, -1.0, inf], 3, vec![1, 3, 0]),
        // -0.0 == +0.0: lower index first, each keeps its sign
        (vec![-0.0, 0.0, -1.0, -0.0], 3, vec![0, 1, 3]),
        (vec![0.0, -0.0, -1.0], 2, vec![0, 1]),
        // all NaN
        (vec![nan, -nan, nan], 2, vec![0, 1]),
        // E = 1
        (vec![nan], 1, vec![0]),
        (vec![-3.0], 1, vec![0]),
        // denormals and extremes
        (
            vec![1e-45, -1e-45, f32::MAX, -f32::MAX, 0.0],
            5,
            vec![2, 0, 4, 1, 3],
        ),
    ];
    cases
}

#[test]
fn edge_cases_exact_cpu() {
    for (row, k, want_idx) in edge_cases() {
        let e = row.len();
        let want_vals: Vec<u32> = want_idx
            .iter()
            .map(|&i| row[i as usize].to_bits())
            .collect();
        let (v, i) = topk_reference(&row, 1, e, k).unwrap();
        assert_eq!(i, want_idx, "reference indices of {row:?} k={k}");
        assert_eq!(bits(&v), want_vals, "reference values of {row:?} k={k}");
        let (v, i) = run(&Backend::Cpu, &row, 1, e, k, DType::F32);
        assert_eq!(i, want_idx, "cpu indices of {row:?} k={k}");
        assert_eq!(bits(&v), want_vals, "cpu values of {row:?} k={k}");
    }
}

#[test]
fn edge_cases_exact_emu() {
    let emu = Backend::emu_with_seed(1);
    for (row, k, want_idx) in edge_cases() {
        let e = row.len();
        let want_vals: Vec<u32> = want_idx
            .iter()
            .map(|&i| row[i as usize].to_bits())
            .collect();
        for version in VERSIONS {
            let (v, i) = run_version(&emu, &row, (1, e, k), DType::F32, version);
            assert_eq!(i, want_idx, "emu {version:?} indices of {row:?} k={k}");
            assert_eq!(
                bits(&v),
                want_vals,
                "emu {version:?} values of {row:?} k={k}"
            );
        }
    }
}

#[test]
fn many_ties_and_all_equal_rows() {
    let mut rng = Rng::new(14);
    let (t, e) = (127, 256);
    // Only three distinct values: every rank is decided by the index tie-break.
    let data: Vec<f32> = (0..t * e).map(|_| [-1.0, 0.0, 2.0][rng.below(3)]).collect();
    for k in [1, 8, 16] {
        assert_same(
            "3-valued rows",
            &topk_reference(&data, t, e, k).unwrap(),
            &oracle(&data, t, e, k),
            k,
        );
    }
    let flat = vec![1.25f32; t * e];
    let (_, i) = topk_reference(&flat, t, e, 16).unwrap();
    for r in 0..t {
        assert_eq!(
            &i[r * 16..(r + 1) * 16],
            (0..16).collect::<Vec<i32>>().as_slice()
        );
    }
}

#[test]
fn cpu_deterministic() {
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(15);
    let (t, e, k) = (1000, 256, 8);
    let data = scores(&mut rng, t * e, true);
    let a = run(&cpu, &data, t, e, k, DType::F32);
    let b = run(&cpu, &data, t, e, k, DType::F32);
    assert_eq!(bits(&a.0), bits(&b.0));
    assert_eq!(a.1, b.1);
}

/// Emu shapes: small T (the emulator runs each thread as a fiber), every slots-per-lane kernel
/// (E = 1, 3 -> C=1; 33 -> 2; 100 -> 4, scalar loads; 128 -> 4, vector; 256 -> 8; 512 -> 16).
const EMU_SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (17, 3),
    (9, 17),
    (5, 33),
    (4, 100),
    (3, 128),
    (17, 256),
    (2, 512),
];

#[test]
fn emu_matches_cpu_two_seeds() {
    let seeds = [Backend::emu_with_seed(1), Backend::emu_with_seed(2)];
    let mut rng = Rng::new(16);
    for &(t, e) in EMU_SHAPES {
        let data = scores(&mut rng, t * e, true);
        for k in [1, e.min(8), e.min(MAX_K)] {
            for dtype in [DType::F32, DType::BF16] {
                let src = if dtype == DType::BF16 {
                    bf16_round(&data)
                } else {
                    data.clone()
                };
                let want = topk_reference(&src, t, e, k).unwrap();
                for version in VERSIONS {
                    let a = run_version(&seeds[0], &data, (t, e, k), dtype, version);
                    let b = run_version(&seeds[1], &data, (t, e, k), dtype, version);
                    let what = format!("emu {version:?} {dtype} [{t},{e}] k={k}");
                    assert_same(&what, &a, &want, k);
                    assert_eq!(
                        bits(&a.0),
                        bits(&b.0),
                        "{what}: seeds 1 and 2 differ (values)"
                    );
                    assert_eq!(a.1, b.1, "{what}: seeds 1 and 2 differ (indices)");
                }
            }
        }
    }
}

#[test]
fn emu_k_equals_e() {
    let emu = Backend::emu_with_seed(3);
    let mut rng = Rng::new(17);
    for &e in &[1usize, 3, 16] {
        let data = scores(&mut rng, 3 * e, true);
        assert_same(
            "emu k=E",
            &run(&emu, &data, 3, e, e, DType::F32),
            &oracle(&data, 3, e, e),
            e,
        );
    }
}

#[test]
fn emu_batch_invariant() {
    // A row's result does not depend on the rows around it or on where it sits.
    let emu = Backend::emu_with_seed(4);
    let mut rng = Rng::new(18);
    let (t, e, k) = (9, 256, 8);
    let data = scores(&mut rng, t * e, true);
    let all = run(&emu, &data, t, e, k, DType::F32);
    for r in [0, 4, 8] {
        let one = run(&emu, &data[r * e..(r + 1) * e], 1, e, k, DType::F32);
        assert_eq!(
            bits(&one.0),
            bits(&all.0[r * k..(r + 1) * k]),
            "row {r} values"
        );
        assert_eq!(one.1, &all.1[r * k..(r + 1) * k], "row {r} indices");
    }
}

#[test]
fn cuda_matches_cpu() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("topk::cuda_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(19);
    let shapes = [
        (1usize, 1usize),
        (17, 3),
        (127, 17),
        (127, 256),
        (17, 512),
        (65536, 256),
    ];
    for &(t, e) in &shapes {
        let data = scores(&mut rng, t * e, true);
        for k in ks_for(e) {
            for dtype in [DType::F32, DType::BF16] {
                let src = if dtype == DType::BF16 {
                    bf16_round(&data)
                } else {
                    data.clone()
                };
                let want = topk_reference(&src, t, e, k).unwrap();
                for version in VERSIONS {
                    let a = run_version(&gpu, &data, (t, e, k), dtype, version);
                    let b = run_version(&gpu, &data, (t, e, k), dtype, version);
                    let what = format!("cuda {version:?} {dtype} [{t},{e}] k={k}");
                    assert_same(&what, &a, &want, k);
                    assert_eq!(bits(&a.0), bits(&b.0), "{what}: two runs differ (values)");
                    assert_eq!(a.1, b.1, "{what}: two runs differ (indices)");
                }
            }
        }
    }
}

fn expect_err(r: sluice_kernels::Result<(Tensor, Tensor)>, want: &str) -> Error {
    match r {
        Ok(_) => panic!("expected an error mentioning {want}"),
        Err(e) => {
            assert!(e.is_bad_input(), "{e} should be a bad-input error");
            assert!(
                e.to_string().contains(want),
                "error `{e}` should mention {want}"
            );
            e
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let b = &backend;
        let x = |shape: &[usize], dtype: DType| {
            let n: usize = shape.iter().product();
            match dtype {
                DType::I32 => Tensor::from_slice(b, shape, &vec![1i32; n]).unwrap(),
                d => Tensor::from_f32_as(b, shape, d, &vec![1.0; n]).unwrap(),
            }
        };
        // k > E, k > 16, k = 0
        let e = expect_err(topk(b, &x(&[4, 3], DType::F32), 4), "`k`");
        assert!(matches!(e, Error::Param { .. }));
        expect_err(topk(b, &x(&[4, 64], DType::F32), MAX_K + 1), "`k`");
        expect_err(topk(b, &x(&[4, 64], DType::F32), 0), "`k`");
        // E > 512, E = 0
        let e = expect_err(topk(b, &x(&[2, MAX_E + 1], DType::F32), 8), "`scores`");
        assert!(matches!(e, Error::Shape { .. }));
        expect_err(topk(b, &x(&[2, 0], DType::F32), 1), "`scores`");
        // wrong rank
        let e = expect_err(topk(b, &x(&[64], DType::F32), 8), "[T,E]");
        assert!(e.to_string().contains("`scores`"));
        expect_err(topk(b, &x(&[2, 2, 64], DType::F32), 8), "[T,E]");
        // wrong dtype
        let e = expect_err(topk(b, &x(&[2, 64], DType::I32), 8), "`scores`");
        assert!(matches!(e, Error::DType { .. }));
    }
    // A tensor on another device.
    let host = Tensor::from_slice(&Backend::Cpu, &[2, 8], &[0f32; 16]).unwrap();
    expect_err(topk(&Backend::emu_with_seed(1), &host, 2), "`scores`");
}

#[test]
fn empty_batch() {
    for backend in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let x = Tensor::from_slice(&backend, &[0, 8], &[0f32; 0]).unwrap();
        let (v, i) = topk(&backend, &x, 3).unwrap();
        assert_eq!(v.shape(), &[0, 3]);
        assert_eq!(i.shape(), &[0, 3]);
    }
}

#[test]
fn into_caller_outputs() {
    let mut rng = Rng::new(20);
    let (t, e, k) = (17, 33, 5);
    let data = scores(&mut rng, t * e, true);
    let want = oracle(&data, t, e, k);
    let cpu = Backend::Cpu;
    let x = Tensor::from_slice(&cpu, &[t, e], &data).unwrap();
    let mut v = Tensor::poisoned(&cpu, &[t, k], DType::F32).unwrap();
    let mut i = Tensor::poisoned(&cpu, &[t, k], DType::I32).unwrap();
    for _ in 0..2 {
        topk_into(&cpu, &x, k, &mut v, &mut i).unwrap();
        let got = (v.to_vec::<f32>().unwrap(), i.to_vec::<i32>().unwrap());
        assert_same("topk_into cpu", &got, &want, k);
    }
    // Wrong output shape or dtype: an error naming the output.
    let mut short = Tensor::poisoned(&cpu, &[t, k - 1], DType::F32).unwrap();
    let e1 = topk_into(&cpu, &x, k, &mut short, &mut i).unwrap_err();
    assert!(
        e1.to_string().contains("`values`") && e1.to_string().contains("[T,k]"),
        "{e1}"
    );
    let mut wrong = Tensor::poisoned(&cpu, &[t, k], DType::F32).unwrap();
    let e2 = topk_into(&cpu, &x, k, &mut v, &mut wrong).unwrap_err();
    assert!(e2.to_string().contains("`indices`"), "{e2}");
}
