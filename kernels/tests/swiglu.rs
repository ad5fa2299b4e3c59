//! swiglu: reference vs an f64 oracle, backward vs finite differences, emu and cuda vs the
//! reference, determinism, bad input.

use sluice_kernels::ops::swiglu::{
    swiglu, swiglu_backward, swiglu_backward_reference, swiglu_reference,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

const SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (127, 17), (4, 1000)];
const EMU_SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (3, 1001)];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// a spans the sigmoid's saturated tails (|a| up to ~12) as well as its middle.
fn inputs(seed: u64, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    (
        rng.normal_vec(n, 4.0),
        rng.normal_vec(n, 1.0),
        rng.normal_vec(n, 1.0),
    )
}

fn silu64(a: f64) -> f64 {
    a / (1.0 + (-a).exp())
}

#[test]
fn reference_matches_f64_oracle() {
    for &(t, f) in SHAPES {
        let (a, b, dh) = inputs(1, t * f);
        let h = swiglu_reference(&a, &b).unwrap();
        let want: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(&a, &b)| silu64(a as f64) * b as f64)
            .collect();
        // A few f32 operations per element: relative error ~1e-7.
        assert!(
            rel_norm(&h, &want) <= F32_TOL,
            "{t}x{f}: {}",
            rel_norm(&h, &want)
        );
        let (da, db) = swiglu_backward_reference(&a, &b, &dh).unwrap();
        let want_da: Vec<f64> = (0..a.len())
            .map(|i| {
                let a = a[i] as f64;
                let s = 1.0 / (1.0 + (-a).exp());
                dh[i] as f64 * b[i] as f64 * (s + a * s * (1.0 - s))
            })
            .collect();
        let want_db: Vec<f64> = (0..a.len())
            .map(|i| dh[i] as f64 * silu64(a[i] as f64))
            .collect();
        assert!(rel_norm(&da, &want_da) <= F32_TOL, "da {t}x{f}");
        assert!(rel_norm(&db, &want_db) <= F32_TOL, "db {t}x{f}");
    }
}

#[test]
fn backward_matches_finite_differences() {
    // L = sum(h * dh); central differences of the f64 oracle, per element (h is elementwise).
    let (mut a, b, dh) = inputs(2, 40);
    a.extend([0.0f32, -30.0, 30.0, 1e-3]);
    let b: Vec<f32> = b.iter().copied().chain([1.5, -2.0, 0.5, 3.0]).collect();
    let dh: Vec<f32> = dh.iter().copied().chain([1.0, 1.0, -1.0, 2.0]).collect();
    let hstep = 1e-6;
    let fd_da: Vec<f64> = (0..a.len())
        .map(|i| {
            let (av, bv, g) = (a[i] as f64, b[i] as f64, dh[i] as f64);
            g * bv * (silu64(av + hstep) - silu64(av - hstep)) / (2.0 * hstep)
        })
        .collect();
    let fd_db: Vec<f64> = (0..a.len())
        .map(|i| {
            let (av, bv, g) = (a[i] as f64, b[i] as f64, dh[i] as f64);
            g * (silu64(av) * (bv + hstep) - silu64(av) * (bv - hstep)) / (2.0 * hstep)
        })
        .collect();
    let (da, db) = swiglu_backward_reference(&a, &b, &dh).unwrap();
    // f32 reference (~1e-7) vs differences with error ~h^2 * |silu'''| + 1e-16/h ~ 1e-10.
    assert!(
        rel_norm(&da, &fd_da) <= F32_TOL,
        "da: {}",
        rel_norm(&da, &fd_da)
    );
    assert!(
        rel_norm(&db, &fd_db) <= F32_TOL,
        "db: {}",
        rel_norm(&db, &fd_db)
    );
}

type Outs = (Vec<f32>, Vec<f32>, Vec<f32>);

fn run_device(backend: &Backend, dtype: DType, t: usize, f: usize, seed: u64) -> Outs {
    let (a, b, dh) = inputs(seed, t * f);
    let up = |v: &[f32]| Tensor::from_f32_as(backend, &[t, f], dtype, v).unwrap();
    let (at, bt, dht) = (up(&a), up(&b), up(&dh));
    let h = swiglu(backend, &at, &bt).unwrap();
    let (da, db) = swiglu_backward(backend, &at, &bt, &dht).unwrap();
    (
        h.to_f32_vec().unwrap(),
        da.to_f32_vec().unwrap(),
        db.to_f32_vec().unwrap(),
    )
}

fn check_device(backend: &Backend, shapes: &[(usize, usize)]) {
    for &dtype in &[DType::F32, DType::BF16] {
        for &(t, f) in shapes {
            let (mut a, mut b, mut dh) = inputs(3, t * f);
            if dtype == DType::BF16 {
                let r = |v: &[f32]| {
                    v.iter()
                        .map(|&x| half::bf16::from_f32(x).to_f32())
                        .collect::<Vec<_>>()
                };
                (a, b, dh) = (r(&a), r(&b), r(&dh));
            }
            let h = swiglu_reference(&a, &b).unwrap();
            let (da, db) = swiglu_backward_reference(&a, &b, &dh).unwrap();
            let got = run_device(backend, dtype, t, f, 3);
            // expf differs across devices by an ulp or two; inputs of both dtypes are widened
            // exactly and the math is f32, so the f32 tolerance applies.
            for (name, g, w) in [("h", &got.0, &h), ("da", &got.1, &da), ("db", &got.2, &db)] {
                let err = rel_norm(g, &f64s(w));
                assert!(err <= F32_TOL, "{backend:?} {dtype} {t}x{f} {name}: {err}");
            }
            let again = run_device(backend, dtype, t, f, 3);
            assert_eq!(
                bits(&got.0),
                bits(&again.0),
                "{backend:?} h not deterministic"
            );
            assert_eq!(
                bits(&got.1),
                bits(&again.1),
                "{backend:?} da not deterministic"
            );
            assert_eq!(
                bits(&got.2),
                bits(&again.2),
                "{backend:?} db not deterministic"
            );
        }
    }
}

/// The backward's mixed form: BF16 a and b (saved activations) with an F32 dh, against the
/// reference on the rounded a, b and the unrounded dh; deterministic; the count of shapes run.
fn check_mixed(backend: &Backend, shapes: &[(usize, usize)]) -> usize {
    let mut checked = 0;
    for &(t, f) in shapes {
        let (a, b, dh) = inputs(5, t * f);
        let r = |v: &[f32]| -> Vec<f32> {
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect()
        };
        let (ar, br) = (r(&a), r(&b));
        let (want_da, want_db) = swiglu_backward_reference(&ar, &br, &dh).unwrap();
        let run = || {
            let at = Tensor::from_f32_as(backend, &[t, f], DType::BF16, &a).unwrap();
            let bt = Tensor::from_f32_as(backend, &[t, f], DType::BF16, &b).unwrap();
            let dht = Tensor::from_slice(backend, &[t, f], &dh).unwrap();
            let (da, db) = swiglu_backward(backend, &at, &bt, &dht).unwrap();
            (da.to_f32_vec().unwrap(), db.to_f32_vec().unwrap())
        };
        let (da, db) = run();
        for (name, g, w) in [("da", &da, &want_da), ("db", &db, &want_db)] {
            let err = rel_norm(g, &f64s(w));
            assert!(err <= F32_TOL, "{backend:?} mixed {t}x{f} {name}: {err}");
        }
        let again = run();
        assert_eq!((bits(&da), bits(&db)), (bits(&again.0), bits(&again.1)));
        checked += 1;
    }
    checked
}

#[test]
fn cpu_device_matches_reference_and_is_deterministic() {
    check_device(&Backend::Cpu, SHAPES);
    assert_eq!(check_mixed(&Backend::Cpu, SHAPES), SHAPES.len());
}

#[test]
fn emu_matches_reference_and_seeds_agree() {
    let (e1, e2) = (Backend::emu_with_seed(1), Backend::emu_with_seed(2));
    check_device(&e1, EMU_SHAPES);
    assert_eq!(check_mixed(&e1, EMU_SHAPES), EMU_SHAPES.len());
    for &dtype in &[DType::F32, DType::BF16] {
        for &(t, f) in EMU_SHAPES {
            let a = run_device(&e1, dtype, t, f, 4);
            let b = run_device(&e2, dtype, t, f, 4);
            assert_eq!(
                (bits(&a.0), bits(&a.1), bits(&a.2)),
                (bits(&b.0), bits(&b.1), bits(&b.2)),
                "emu seeds disagree"
            );
        }
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("swiglu") {
        check_device(&gpu, SHAPES);
        check_device(&gpu, &[(4096, 1024)]);
        assert_eq!(check_mixed(&gpu, SHAPES), SHAPES.len());
    }
}

#[test]
fn bad_inputs_are_errors() {
    for be in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let a = Tensor::from_slice(&be, &[2, 3], &[1.0f32; 6]).unwrap();
        let b_bad = Tensor::from_slice(&be, &[3, 2], &[1.0f32; 6]).unwrap();
        let err = swiglu(&be, &a, &b_bad).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "b"),
            "{err}"
        );
        assert!(err.to_string().contains("[2, 3]"), "{err}");
        let b16 = Tensor::from_f32_as(&be, &[2, 3], DType::BF16, &[1.0; 6]).unwrap();
        assert!(matches!(swiglu(&be, &a, &b16), Err(Error::DType { tensor, .. }) if tensor == "b"));
        let dh_bad = Tensor::from_slice(&be, &[2, 4], &[1.0f32; 8]).unwrap();
        assert!(
            matches!(swiglu_backward(&be, &a, &a, &dh_bad), Err(Error::Shape { tensor, .. }) if tensor == "dh")
        );
        let ai = Tensor::from_slice(&be, &[2, 3], &[1i32; 6]).unwrap();
        assert!(matches!(swiglu(&be, &ai, &a), Err(Error::DType { tensor, .. }) if tensor == "a"));
    }
    assert!(swiglu_reference(&[1.0; 3], &[1.0; 2]).is_err());
}
