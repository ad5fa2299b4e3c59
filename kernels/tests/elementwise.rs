//! elementwise: residual add and row softmax (with backward) vs f64 oracles and finite
//! differences, the transpose vs an index oracle, emu and cuda vs the reference, determinism,
//! batch invariance, bad input.

use sluice_kernels::ops::elementwise::{
    residual_add, residual_add_reference, softmax, softmax_backward, softmax_backward_reference,
    softmax_reference, transpose, transpose_reference,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

/// (T, n): single element, ragged rows, a row longer than the block (256 threads).
const SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (127, 17), (3, 1000)];
const EMU_SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (2, 600)];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn oracle_softmax(x: &[f64], t: usize, n: usize) -> Vec<f64> {
    let mut y = vec![0.0; t * n];
    for r in 0..t {
        let row = &x[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for j in 0..n {
            y[r * n + j] = (row[j] - m).exp() / s;
        }
    }
    y
}

/// Logits with a spread like a router's or attention's (scale 3) plus a large offset per row,
/// so a softmax that skipped the max subtraction would overflow.
fn logits(seed: u64, t: usize, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..t)
        .flat_map(|r| {
            let off = if r % 2 == 0 { 80.0 } else { -50.0 };
            rng.normal_vec(n, 3.0).into_iter().map(move |v| v + off)
        })
        .collect()
}

#[test]
fn reference_matches_f64_oracle() {
    for &(t, n) in SHAPES {
        let mut rng = Rng::new(1);
        let (a, b) = (rng.normal_vec(t * n, 1.0), rng.normal_vec(t * n, 1.0));
        let y = residual_add_reference(&a, &b).unwrap();
        let want: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| x as f64 + y as f64)
            .collect();
        assert!(rel_norm(&y, &want) <= F32_TOL);

        let x = logits(2, t, n);
        let y = softmax_reference(&x, t, n).unwrap();
        let want = oracle_softmax(&f64s(&x), t, n);
        // exp of f32 arguments (<= ~20 in magnitude after the max) and an f32 sum of n terms.
        assert!(
            rel_norm(&y, &want) <= F32_TOL,
            "softmax {t}x{n}: {}",
            rel_norm(&y, &want)
        );
        let dy = rng.normal_vec(t * n, 1.0);
        let dx = softmax_backward_reference(&y, &dy, t, n).unwrap();
        let y64 = f64s(&y);
        let mut want = vec![0.0; t * n];
        for r in 0..t {
            let dot: f64 = (0..n).map(|j| y64[r * n + j] * dy[r * n + j] as f64).sum();
            for j in 0..n {
                want[r * n + j] = y64[r * n + j] * (dy[r * n + j] as f64 - dot);
            }
        }
        assert!(rel_norm(&dx, &want) <= F32_TOL, "softmax backward {t}x{n}");
    }
}

#[test]
fn softmax_backward_matches_finite_differences() {
    // L = sum(softmax(x) * g): central differences of the f64 oracle in x; the reference
    // backward takes the forward output y.
    for &(t, n) in &[(2usize, 5usize), (1, 1), (3, 9)] {
        let x = logits(3, t, n);
        let g = Rng::new(4).normal_vec(t * n, 1.0);
        let x64 = f64s(&x);
        let loss = |x: &[f64]| -> f64 {
            oracle_softmax(x, t, n)
                .iter()
                .zip(&g)
                .map(|(a, &b)| a * b as f64)
                .sum()
        };
        let hstep = 1e-6;
        let fd: Vec<f64> = (0..t * n)
            .map(|i| {
                let (mut p, mut m) = (x64.clone(), x64.clone());
                p[i] += hstep;
                m[i] -= hstep;
                (loss(&p) - loss(&m)) / (2.0 * hstep)
            })
            .collect();
        let y = softmax_reference(&x, t, n).unwrap();
        let dx = softmax_backward_reference(&y, &g, t, n).unwrap();
        if n == 1 {
            // softmax of one element is constant 1: the gradient is exactly 0.
            assert!(dx.iter().all(|&v| v == 0.0), "{dx:?}");
            assert!(fd.iter().all(|v| v.abs() < 1e-6));
        } else {
            // f32 y and dot (~1e-7 relative) vs differences (error ~1e-10 here).
            assert!(
                rel_norm(&dx, &fd) <= F32_TOL,
                "{t}x{n}: {}",
                rel_norm(&dx, &fd)
            );
        }
    }
}

type Outs = (Vec<f32>, Vec<f32>, Vec<f32>);

/// (residual add, softmax, softmax backward) on a device with inputs of `dtype`.
fn run_device(backend: &Backend, dtype: DType, t: usize, n: usize, seed: u64) -> Outs {
    let mut rng = Rng::new(seed);
    let (a, b, dy) = (
        rng.normal_vec(t * n, 1.0),
        rng.normal_vec(t * n, 1.0),
        rng.normal_vec(t * n, 1.0),
    );
    let x = logits(seed, t, n);
    let y_in = softmax_reference(&x, t, n).unwrap();
    let up = |v: &[f32]| Tensor::from_f32_as(backend, &[t, n], dtype, v).unwrap();
    let add = residual_add(backend, &up(&a), &up(&b)).unwrap();
    let y = softmax(backend, &up(&x)).unwrap();
    let dx = softmax_backward(backend, &up(&y_in), &up(&dy)).unwrap();
    (
        add.to_f32_vec().unwrap(),
        y.to_f32_vec().unwrap(),
        dx.to_f32_vec().unwrap(),
    )
}

fn reference_for(dtype: DType, t: usize, n: usize, seed: u64) -> Outs {
    let r = |v: Vec<f32>| -> Vec<f32> {
        if dtype == DType::BF16 {
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect()
        } else {
            v
        }
    };
    let mut rng = Rng::new(seed);
    let (a, b, dy) = (
        r(rng.normal_vec(t * n, 1.0)),
        r(rng.normal_vec(t * n, 1.0)),
        r(rng.normal_vec(t * n, 1.0)),
    );
    let x = logits(seed, t, n);
    let y_in = r(softmax_reference(&x, t, n).unwrap());
    (
        residual_add_reference(&a, &b).unwrap(),
        softmax_reference(&r(x), t, n).unwrap(),
        softmax_backward_reference(&y_in, &dy, t, n).unwrap(),
    )
}

fn check_device(backend: &Backend, shapes: &[(usize, usize)]) {
    for &dtype in &[DType::F32, DType::BF16] {
        for &(t, n) in shapes {
            let got = run_device(backend, dtype, t, n, 3);
            let want = reference_for(dtype, t, n, 3);
            // f32 math on exactly widened inputs: reduction order and expf ulps differ across
            // devices, both ~1e-7 relative, so the f32 tolerance applies to both dtypes.
            for (name, g, w) in [
                ("add", &got.0, &want.0),
                ("softmax", &got.1, &want.1),
                ("softmax_backward", &got.2, &want.2),
            ] {
                let err = rel_norm(g, &f64s(w));
                assert!(err <= F32_TOL, "{backend:?} {dtype} {t}x{n} {name}: {err}");
            }
            let again = run_device(backend, dtype, t, n, 3);
            assert_eq!(
                bits(&got.0),
                bits(&again.0),
                "{backend:?} add not deterministic"
            );
            assert_eq!(
                bits(&got.1),
                bits(&again.1),
                "{backend:?} softmax not deterministic"
            );
            assert_eq!(
                bits(&got.2),
                bits(&again.2),
                "{backend:?} softmax_backward not deterministic"
            );
        }
    }
}

#[test]
fn cpu_device_matches_reference_and_is_deterministic() {
    check_device(&Backend::Cpu, SHAPES);
}

#[test]
fn emu_matches_reference_and_seeds_agree() {
    let (e1, e2) = (Backend::emu_with_seed(1), Backend::emu_with_seed(2));
    check_device(&e1, EMU_SHAPES);
    for &dtype in &[DType::F32, DType::BF16] {
        for &(t, n) in EMU_SHAPES {
            let a = run_device(&e1, dtype, t, n, 4);
            let b = run_device(&e2, dtype, t, n, 4);
            assert_eq!(
                (bits(&a.0), bits(&a.1), bits(&a.2)),
                (bits(&b.0), bits(&b.1), bits(&b.2)),
                "emu seeds disagree"
            );
            // The cpu references sum each row in the kernel's block order with the host expf, so
            // cpu and emu agree bit for bit (n = 600: lanes holding three terms).
            let c = run_device(&Backend::Cpu, dtype, t, n, 4);
            assert_eq!(
                (bits(&c.0), bits(&c.1), bits(&c.2)),
                (bits(&a.0), bits(&a.1), bits(&a.2)),
                "cpu and emu differ ({dtype} {t}x{n})"
            );
        }
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("elementwise") {
        check_device(&gpu, SHAPES);
        check_device(&gpu, &[(1024, 4096)]);
    }
}

/// A row's softmax and softmax backward are bit-identical alone or inside a batch.
fn check_batch_invariance(backend: &Backend) {
    let (t, n) = (7, 300);
    let x = logits(9, t, n);
    let dy = Rng::new(10).normal_vec(t * n, 1.0);
    let y = softmax(backend, &Tensor::from_slice(backend, &[t, n], &x).unwrap())
        .unwrap()
        .to_f32_vec()
        .unwrap();
    let dx = softmax_backward(
        backend,
        &Tensor::from_slice(backend, &[t, n], &y).unwrap(),
        &Tensor::from_slice(backend, &[t, n], &dy).unwrap(),
    )
    .unwrap()
    .to_f32_vec()
    .unwrap();
    for r in [0, 3, 6] {
        let s = r * n..(r + 1) * n;
        let yr = softmax(
            backend,
            &Tensor::from_slice(backend, &[1, n], &x[s.clone()]).unwrap(),
        )
        .unwrap();
        assert_eq!(
            bits(&yr.to_f32_vec().unwrap()),
            bits(&y[s.clone()]),
            "{backend:?} softmax row {r}"
        );
        let dxr = softmax_backward(
            backend,
            &Tensor::from_slice(backend, &[1, n], &y[s.clone()]).unwrap(),
            &Tensor::from_slice(backend, &[1, n], &dy[s.clone()]).unwrap(),
        )
        .unwrap();
        assert_eq!(
            bits(&dxr.to_f32_vec().unwrap()),
            bits(&dx[s]),
            "{backend:?} softmax_backward row {r}"
        );
    }
}

#[test]
fn batch_invariant_on_cpu() {
    check_batch_invariance(&Backend::Cpu);
}

#[test]
fn batch_invariant_on_emu() {
    check_batch_invariance(&Backend::emu_with_seed(1));
}

#[test]
fn residual_add_takes_any_shape() {
    let b = Backend::Cpu;
    let a = Tensor::from_slice(&b, &[2, 2, 3], &[1.0f32; 12]).unwrap();
    let y = residual_add(&b, &a, &a).unwrap();
    assert_eq!(y.shape(), &[2, 2, 3]);
    assert_eq!(y.to_f32_vec().unwrap(), vec![2.0; 12]);
}

#[test]
fn bad_inputs_are_errors() {
    for be in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let a = Tensor::from_slice(&be, &[2, 3], &[1.0f32; 6]).unwrap();
        let b = Tensor::from_slice(&be, &[3, 2], &[1.0f32; 6]).unwrap();
        let err = residual_add(&be, &a, &b).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "b"),
            "{err}"
        );
        let b16 = Tensor::from_f32_as(&be, &[2, 3], DType::BF16, &[1.0; 6]).unwrap();
        let err = residual_add(&be, &a, &b16).unwrap_err();
        assert!(
            matches!(&err, Error::DType { tensor, .. } if tensor == "b"),
            "{err}"
        );
        let flat = Tensor::from_slice(&be, &[6], &[1.0f32; 6]).unwrap();
        let err = softmax(&be, &flat).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "x"),
            "{err}"
        );
        assert!(err.to_string().contains("[T,n]"));
        let err = softmax_backward(&be, &a, &b).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "dy"),
            "{err}"
        );
        let ai = Tensor::from_slice(&be, &[2, 3], &[1i32; 6]).unwrap();
        assert!(matches!(softmax(&be, &ai), Err(Error::DType { tensor, .. }) if tensor == "x"));
    }
    assert!(softmax_reference(&[1.0; 5], 2, 3).is_err());
    assert!(residual_add_reference(&[1.0; 5], &[1.0; 4]).is_err());
}

// ---------------------------------------------------------------------------------------------
// transpose

/// (R, C): single element, ragged sizes across the 32-wide tile, one tall and one wide matrix.
const T_SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (127, 17), (33, 64), (1, 70), (65, 1)];
const T_EMU_SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (127, 17), (33, 64), (1, 70)];

/// y[c][r] = x[r][c], by index, in f64 (the oracle).
fn oracle_transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    let mut y = vec![0.0; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            y[c * rows + r] = x[r * cols + c] as f64;
        }
    }
    y
}

#[test]
fn transpose_reference_matches_index_oracle() {
    for &(r, c) in T_SHAPES {
        let x = Rng::new(5).normal_vec(r * c, 1.0);
        let y = transpose_reference(&x, r, c).unwrap();
        // A copy: exact, so compare every value, not a norm.
        let want = oracle_transpose(&x, r, c);
        assert!(y.iter().zip(&want).all(|(&a, &b)| a as f64 == b), "{r}x{c}");
        // Twice is the identity, bit for bit.
        assert_eq!(bits(&transpose_reference(&y, c, r).unwrap()), bits(&x));
    }
    assert!(transpose_reference::<f32>(&[], 0, 9).unwrap().is_empty());
    assert!(transpose_reference(&[1.0f32; 5], 2, 3).is_err());
}

/// The device transpose of random data (f32, and bf16 where the values are bf16-exact) against
/// the reference, bit for bit (a copy has no rounding to tolerate), and run twice.
fn check_transpose(backend: &Backend, shapes: &[(usize, usize)]) {
    for &(r, c) in shapes {
        let x = Rng::new(6).normal_vec(r * c, 1.0);
        let want = transpose_reference(&x, r, c).unwrap();
        let xt = Tensor::from_slice(backend, &[r, c], &x).unwrap();
        let y = transpose(backend, &xt).unwrap();
        assert_eq!(y.shape(), &[c, r]);
        assert_eq!(y.dtype(), DType::F32);
        let got = y.to_vec::<f32>().unwrap();
        assert_eq!(bits(&got), bits(&want), "{backend:?} f32 {r}x{c}");
        let again = transpose(backend, &xt).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(bits(&again), bits(&got), "{backend:?} not deterministic");

        let h: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let ht = Tensor::from_slice(backend, &[r, c], &h).unwrap();
        let hy = transpose(backend, &ht).unwrap();
        assert_eq!(hy.dtype(), DType::BF16);
        assert_eq!(
            hy.to_vec::<half::bf16>().unwrap(),
            transpose_reference(&h, r, c).unwrap(),
            "{backend:?} bf16 {r}x{c}"
        );
    }
}

#[test]
fn transpose_on_cpu_device() {
    check_transpose(&Backend::Cpu, T_SHAPES);
}

#[test]
fn transpose_emu_matches_reference_and_seeds_agree() {
    let (e1, e2) = (Backend::emu_with_seed(1), Backend::emu_with_seed(2));
    check_transpose(&e1, T_EMU_SHAPES);
    check_transpose(&e2, T_EMU_SHAPES);
    // check_transpose holds both seeds to the reference bit for bit, so they agree; check
    // directly once more on a ragged shape.
    let x = Rng::new(8).normal_vec(45 * 33, 1.0);
    let run = |b: &Backend| {
        let t = Tensor::from_slice(b, &[45, 33], &x).unwrap();
        transpose(b, &t).unwrap().to_vec::<f32>().unwrap()
    };
    assert_eq!(bits(&run(&e1)), bits(&run(&e2)));
}

#[test]
fn transpose_cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("elementwise transpose") {
        check_transpose(&gpu, T_SHAPES);
        check_transpose(&gpu, &[(2048, 4096), (4097, 33)]);
    }
}

#[test]
fn transpose_bad_inputs_are_errors() {
    for be in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let x3 = Tensor::from_slice(&be, &[2, 2, 3], &[1.0f32; 12]).unwrap();
        let err = transpose(&be, &x3).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "x"),
            "{err}"
        );
        assert!(err.to_string().contains("[R,C]"), "{err}");
        let xi = Tensor::from_slice(&be, &[2, 3], &[1i32; 6]).unwrap();
        assert!(matches!(transpose(&be, &xi), Err(Error::DType { tensor, .. }) if tensor == "x"));
        // Empty matrices are fine.
        let e = Tensor::zeros(&be, &[0, 7], DType::F32).unwrap();
        assert_eq!(transpose(&be, &e).unwrap().shape(), &[7, 0]);
    }
}
