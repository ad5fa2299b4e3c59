//! rmsnorm: reference vs an f64 oracle, backward vs finite differences, emu and cuda vs the
//! reference, determinism, batch invariance, bad input.

use sluice_kernels::ops::rmsnorm::{
    rmsnorm, rmsnorm_backward, rmsnorm_backward_reference, rmsnorm_reference, DEFAULT_EPS,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

/// Shapes (T, d): single element, ragged sizes, and more rows than a dw chunk (64) holds.
const SHAPES: &[(usize, usize)] = &[(1, 1), (1, 17), (17, 127), (127, 17), (130, 5), (3, 300)];
/// Small shapes for the emulator (every block runs 256 fibers).
const EMU_SHAPES: &[(usize, usize)] = &[(1, 1), (17, 127), (70, 9), (3, 300)];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// Random inputs (x, w, dy) for a shape; w centred on 1 like a trained norm scale.
fn inputs(seed: u64, t: usize, d: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let x = rng.normal_vec(t * d, 1.5);
    let w = (0..d).map(|_| 1.0 + 0.3 * rng.normal() as f32).collect();
    let dy = rng.normal_vec(t * d, 1.0);
    (x, w, dy)
}

fn oracle_forward(x: &[f64], w: &[f64], t: usize, d: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; t * d];
    for r in 0..t {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..d {
            y[r * d + j] = row[j] * inv * w[j];
        }
    }
    y
}

fn oracle_backward(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    t: usize,
    d: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; t * d];
    let mut dw = vec![0.0; d];
    for r in 0..t {
        let row = &x[r * d..(r + 1) * d];
        let g = &dy[r * d..(r + 1) * d];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        let dot: f64 = (0..d).map(|j| g[j] * w[j] * row[j]).sum();
        for j in 0..d {
            dx[r * d + j] = inv * g[j] * w[j] - row[j] * dot * inv.powi(3) / d as f64;
            dw[j] += g[j] * row[j] * inv;
        }
    }
    (dx, dw)
}

/// dx against a reference. For d = 1, y = x w / sqrt(x^2 + eps) is flat (dx ~ eps / |x|^3,
/// the difference of two nearly equal f32 terms), so the error is bounded in absolute terms
/// by the f32 rounding of those terms (|dy w| / |x| each); otherwise by relative norm.
fn check_dx(dx: &[f32], want: &[f64], dy: &[f32], w: &[f32], d: usize) {
    if d == 1 {
        for (i, (&g, &wv)) in dx.iter().zip(want).enumerate() {
            let scale = (dy[i] * w[0]).abs() as f64 + 1.0;
            assert!(
                (g as f64 - wv).abs() <= 1e-5 * scale,
                "dx[{i}] = {g}, want {wv}"
            );
        }
    } else {
        assert!(rel_norm(dx, want) <= F32_TOL, "dx: {}", rel_norm(dx, want));
    }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn reference_matches_f64_oracle() {
    for &(t, d) in SHAPES {
        let (x, w, dy) = inputs(7, t, d);
        let y = rmsnorm_reference(&x, &w, t, d, DEFAULT_EPS).unwrap();
        let want = oracle_forward(&f64s(&x), &f64s(&w), t, d, DEFAULT_EPS as f64);
        // f32 sums of <= 300 squares: relative error ~ sqrt(d) * 2^-24, far below 1e-5.
        assert!(
            rel_norm(&y, &want) <= F32_TOL,
            "forward {t}x{d}: {}",
            rel_norm(&y, &want)
        );
        let (dx, dw) = rmsnorm_backward_reference(&x, &w, &dy, t, d, DEFAULT_EPS).unwrap();
        let (wdx, wdw) =
            oracle_backward(&f64s(&x), &f64s(&w), &f64s(&dy), t, d, DEFAULT_EPS as f64);
        check_dx(&dx, &wdx, &dy, &w, d);
        assert!(
            rel_norm(&dw, &wdw) <= F32_TOL,
            "dw {t}x{d}: {}",
            rel_norm(&dw, &wdw)
        );
    }
}

#[test]
fn backward_matches_finite_differences() {
    // L = sum(y * dy); dL/dx and dL/dw by central differences of the f64 oracle.
    for &(t, d, eps) in &[
        (3usize, 5usize, 1e-6f32),
        (1, 1, 1e-6),
        (1, 1, 0.5),
        (2, 7, 0.5),
    ] {
        let (x, w, dy) = inputs(11, t, d);
        let (x64, w64, dy64) = (f64s(&x), f64s(&w), f64s(&dy));
        let loss = |x: &[f64], w: &[f64]| -> f64 {
            oracle_forward(x, w, t, d, eps as f64)
                .iter()
                .zip(&dy64)
                .map(|(a, b)| a * b)
                .sum()
        };
        let h = 1e-6;
        let fd_dx: Vec<f64> = (0..t * d)
            .map(|i| {
                let (mut p, mut m) = (x64.clone(), x64.clone());
                p[i] += h;
                m[i] -= h;
                (loss(&p, &w64) - loss(&m, &w64)) / (2.0 * h)
            })
            .collect();
        let fd_dw: Vec<f64> = (0..d)
            .map(|j| {
                let (mut p, mut m) = (w64.clone(), w64.clone());
                p[j] += h;
                m[j] -= h;
                (loss(&x64, &p) - loss(&x64, &m)) / (2.0 * h)
            })
            .collect();
        let (dx, dw) = rmsnorm_backward_reference(&x, &w, &dy, t, d, eps).unwrap();
        // The f32 reference (error ~1e-7) against f64 differences (truncation ~h^2 ~1e-12,
        // cancellation ~1e-16/h = 1e-10): the f32 tolerance holds with room to spare.
        check_dx(&dx, &fd_dx, &dy, &w, d);
        assert!(
            rel_norm(&dw, &fd_dw) <= F32_TOL,
            "dw {t}x{d}: {}",
            rel_norm(&dw, &fd_dw)
        );
    }
}

/// Runs forward and backward on a device with inputs of `dtype`; returns (y, dx, dw) as f32.
fn run_device(
    backend: &Backend,
    dtype: DType,
    t: usize,
    d: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x, w, dy) = inputs(seed, t, d);
    let xt = Tensor::from_f32_as(backend, &[t, d], dtype, &x).unwrap();
    let wt = Tensor::from_f32_as(backend, &[d], dtype, &w).unwrap();
    let dyt = Tensor::from_f32_as(backend, &[t, d], dtype, &dy).unwrap();
    let y = rmsnorm(backend, &xt, &wt, DEFAULT_EPS).unwrap();
    let (dx, dw) = rmsnorm_backward(backend, &xt, &wt, &dyt, DEFAULT_EPS).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    (
        y.to_f32_vec().unwrap(),
        dx.to_f32_vec().unwrap(),
        dw.to_f32_vec().unwrap(),
    )
}

/// The reference on the dtype-rounded inputs (what every device computes from).
fn reference_for(dtype: DType, t: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut x, mut w, mut dy) = inputs(seed, t, d);
    if dtype == DType::BF16 {
        (x, w, dy) = (bf16_round(&x), bf16_round(&w), bf16_round(&dy));
    }
    let y = rmsnorm_reference(&x, &w, t, d, DEFAULT_EPS).unwrap();
    let (dx, dw) = rmsnorm_backward_reference(&x, &w, &dy, t, d, DEFAULT_EPS).unwrap();
    (y, dx, dw)
}

fn check_device(backend: &Backend, shapes: &[(usize, usize)]) {
    for &dtype in &[DType::F32, DType::BF16] {
        // Math is f32 for both input dtypes, so the f32 tolerance applies against the reference
        // on the same (rounded) inputs.
        let tol = F32_TOL;
        for &(t, d) in shapes {
            let got = run_device(backend, dtype, t, d, 3);
            let want = reference_for(dtype, t, d, 3);
            for (name, g, w) in [("y", &got.0, &want.0), ("dw", &got.2, &want.2)] {
                let err = rel_norm(g, &f64s(w));
                assert!(err <= tol, "{backend:?} {dtype} {t}x{d} {name}: {err}");
            }
            let (_, w, dy) = inputs(3, t, d);
            check_dx(&got.1, &f64s(&want.1), &dy, &w, d);
            let again = run_device(backend, dtype, t, d, 3);
            assert_eq!(
                bits(&got.0),
                bits(&again.0),
                "{backend:?} y not deterministic"
            );
            assert_eq!(
                bits(&got.1),
                bits(&again.1),
                "{backend:?} dx not deterministic"
            );
            assert_eq!(
                bits(&got.2),
                bits(&again.2),
                "{backend:?} dw not deterministic"
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
        for &(t, d) in EMU_SHAPES {
            let a = run_device(&e1, dtype, t, d, 5);
            let b = run_device(&e2, dtype, t, d, 5);
            assert_eq!(
                bits(&a.0),
                bits(&b.0),
                "emu seeds disagree on y ({dtype} {t}x{d})"
            );
            assert_eq!(bits(&a.1), bits(&b.1), "emu seeds disagree on dx");
            assert_eq!(bits(&a.2), bits(&b.2), "emu seeds disagree on dw");
            // The cpu reference sums each row in the kernel's block order (ops::block_reduce),
            // so cpu and emu agree bit for bit, d > 256 (lanes holding two terms) included.
            let c = run_device(&Backend::Cpu, dtype, t, d, 5);
            for (name, x, y) in [("y", &c.0, &a.0), ("dx", &c.1, &a.1), ("dw", &c.2, &a.2)] {
                assert_eq!(
                    bits(x),
                    bits(y),
                    "cpu and emu differ on {name} ({dtype} {t}x{d})"
                );
            }
        }
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("rmsnorm") {
        check_device(&gpu, SHAPES);
        check_device(&gpu, &[(4096, 2048)]);
    }
}

/// A row's y and dx are bit-identical whether it runs alone or inside a batch at any offset.
fn check_batch_invariance(backend: &Backend) {
    let (t, d) = (9, 37);
    let (x, w, dy) = inputs(21, t, d);
    let full_x = Tensor::from_slice(backend, &[t, d], &x).unwrap();
    let full_dy = Tensor::from_slice(backend, &[t, d], &dy).unwrap();
    let wt = Tensor::from_slice(backend, &[d], &w).unwrap();
    let y = rmsnorm(backend, &full_x, &wt, DEFAULT_EPS)
        .unwrap()
        .to_f32_vec()
        .unwrap();
    let (dx, _) = rmsnorm_backward(backend, &full_x, &wt, &full_dy, DEFAULT_EPS).unwrap();
    let dx = dx.to_f32_vec().unwrap();
    for r in [0, 4, 8] {
        let xr = Tensor::from_slice(backend, &[1, d], &x[r * d..(r + 1) * d]).unwrap();
        let dyr = Tensor::from_slice(backend, &[1, d], &dy[r * d..(r + 1) * d]).unwrap();
        let yr = rmsnorm(backend, &xr, &wt, DEFAULT_EPS)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        let (dxr, _) = rmsnorm_backward(backend, &xr, &wt, &dyr, DEFAULT_EPS).unwrap();
        assert_eq!(
            bits(&yr),
            bits(&y[r * d..(r + 1) * d]),
            "{backend:?} y row {r}"
        );
        assert_eq!(
            bits(&dxr.to_f32_vec().unwrap()),
            bits(&dx[r * d..(r + 1) * d]),
            "{backend:?} dx row {r}"
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
fn outputs_poisoned_before_launch_are_fully_written() {
    // Poison is NaN; rel_norm turns any NaN left behind into infinity, which the device checks
    // above would reject. Here: a zero-row input gives an empty y and a zero dw.
    let b = Backend::Cpu;
    let x = Tensor::from_slice(&b, &[0, 4], &[] as &[f32]).unwrap();
    let w = Tensor::from_slice(&b, &[4], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let (dx, dw) = rmsnorm_backward(&b, &x, &w, &x, DEFAULT_EPS).unwrap();
    assert_eq!(dx.shape(), &[0, 4]);
    assert_eq!(dw.to_f32_vec().unwrap(), vec![0.0; 4]);
}

#[test]
fn bad_inputs_are_errors() {
    let b = Backend::Cpu;
    let x = Tensor::from_slice(&b, &[2, 3], &[1.0f32; 6]).unwrap();
    let w_bad = Tensor::from_slice(&b, &[4], &[1.0f32; 4]).unwrap();
    let err = rmsnorm(&b, &x, &w_bad, DEFAULT_EPS).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "w"),
        "{err}"
    );
    assert!(err.to_string().contains("[3]"), "{err}");
    let w = Tensor::from_slice(&b, &[3], &[1.0f32; 3]).unwrap();
    let x1 = Tensor::from_slice(&b, &[6], &[1.0f32; 6]).unwrap();
    assert!(
        matches!(rmsnorm(&b, &x1, &w, DEFAULT_EPS), Err(Error::Shape { tensor, .. }) if tensor == "x")
    );
    let wb = Tensor::from_f32_as(&b, &[3], DType::BF16, &[1.0; 3]).unwrap();
    assert!(
        matches!(rmsnorm(&b, &x, &wb, DEFAULT_EPS), Err(Error::DType { tensor, .. }) if tensor == "w")
    );
    let xi = Tensor::from_slice(&b, &[2, 3], &[1i32; 6]).unwrap();
    assert!(
        matches!(rmsnorm(&b, &xi, &w, DEFAULT_EPS), Err(Error::DType { tensor, .. }) if tensor == "x")
    );
    assert!(matches!(rmsnorm(&b, &x, &w, -1.0), Err(Error::Param { name, .. }) if name == "eps"));
    assert!(matches!(
        rmsnorm(&b, &x, &w, f32::NAN),
        Err(Error::Param { .. })
    ));
    let dy_bad = Tensor::from_slice(&b, &[3, 3], &[1.0f32; 9]).unwrap();
    assert!(
        matches!(rmsnorm_backward(&b, &x, &w, &dy_bad, DEFAULT_EPS), Err(Error::Shape { tensor, .. }) if tensor == "dy")
    );
    assert!(rmsnorm_reference(&[1.0; 5], &[1.0; 3], 2, 3, DEFAULT_EPS).is_err());
    // The same checks run before any launch on the emulator.
    let e = Backend::emu_with_seed(1);
    let xe = Tensor::from_slice(&e, &[2, 3], &[1.0f32; 6]).unwrap();
    let we = Tensor::from_slice(&e, &[4], &[1.0f32; 4]).unwrap();
    assert!(
        matches!(rmsnorm(&e, &xe, &we, DEFAULT_EPS), Err(Error::Shape { tensor, .. }) if tensor == "w")
    );
}
