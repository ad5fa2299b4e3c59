//! rope: reference vs f64 oracles, backward vs finite differences, emu and cuda vs the
//! reference, determinism, batch invariance, bad input.

use sluice_kernels::ops::rope::{
    rope, rope_backward, rope_backward_reference, rope_inv_freq, rope_reference, DEFAULT_THETA,
};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

/// (T, H, D): one pair, ragged head counts and dims.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 2),
    (17, 3, 8),
    (5, 2, 126),
    (127, 1, 16),
    (3, 4, 128),
];
const EMU_SHAPES: &[(usize, usize, usize)] = &[(1, 1, 2), (17, 3, 8), (5, 2, 126)];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// x and positions for a packed batch: sequences of random lengths whose positions restart
/// at 0, offset by up to `max_start` (a long context).
fn inputs(seed: u64, t: usize, h: usize, d: usize, max_start: usize) -> (Vec<f32>, Vec<i32>) {
    let mut rng = Rng::new(seed);
    let x = rng.normal_vec(t * h * d, 1.0);
    let mut positions = Vec::with_capacity(t);
    while positions.len() < t {
        let len = 1 + rng.below(9);
        let start = rng.below(max_start + 1);
        for p in 0..len {
            if positions.len() < t {
                positions.push((start + p) as i32);
            }
        }
    }
    (x, positions)
}

/// The rotation in f64 at the given per-(t, i) angles.
fn oracle(
    x: &[f64],
    angle: impl Fn(usize, usize) -> f64,
    t: usize,
    h: usize,
    d: usize,
    sign: f64,
) -> Vec<f64> {
    let half = d / 2;
    let mut y = vec![0.0; x.len()];
    for r in 0..t {
        for hh in 0..h {
            let base = (r * h + hh) * d;
            for i in 0..half {
                let a = angle(r, i);
                let (c, s) = (a.cos(), sign * a.sin());
                let (x1, x2) = (x[base + i], x[base + i + half]);
                y[base + i] = x1 * c - x2 * s;
                y[base + i + half] = x2 * c + x1 * s;
            }
        }
    }
    y
}

#[test]
fn inv_freq_is_theta_power() {
    let f = rope_inv_freq(8, 10000.0).unwrap();
    assert_eq!(f[0], 1.0);
    for (i, &v) in f.iter().enumerate() {
        let want = 10000f64.powf(-2.0 * i as f64 / 8.0);
        assert_eq!(
            v, want as f32,
            "inv_freq[{i}] is the f64 power rounded once"
        );
    }
}

#[test]
fn reference_matches_f64_oracle() {
    for &(t, h, d) in SHAPES {
        // Long positions: the documented angle is one f32 multiply (pos as f32) * inv_freq;
        // the oracle takes that angle and does the rotation in f64.
        let (x, pos) = inputs(5, t, h, d, 4096);
        let inv = rope_inv_freq(d, DEFAULT_THETA).unwrap();
        let f32_angle = |r: usize, i: usize| (pos[r] as f32 * inv[i]) as f64;
        let y = rope_reference(&x, &pos, t, h, d, DEFAULT_THETA).unwrap();
        let want = oracle(&f64s(&x), f32_angle, t, h, d, 1.0);
        // cos/sin of f32 at |angle| <= 4100 are within an ulp or two: relative error ~1e-7.
        assert!(
            rel_norm(&y, &want) <= F32_TOL,
            "{t}x{h}x{d}: {}",
            rel_norm(&y, &want)
        );
        let dx = rope_backward_reference(&x, &pos, t, h, d, DEFAULT_THETA).unwrap();
        let want = oracle(&f64s(&x), f32_angle, t, h, d, -1.0);
        assert!(rel_norm(&dx, &want) <= F32_TOL, "backward {t}x{h}x{d}");

        // Short positions: against the angle computed wholly in f64 (theta^(-2i/D) * pos).
        // The f32 angle is then off by <= 16 * 2^-24 ~ 1e-6, inside the tolerance.
        let (x, pos) = inputs(6, t, h, d, 4);
        let exact = |r: usize, i: usize| pos[r] as f64 * 10000f64.powf(-2.0 * i as f64 / d as f64);
        let y = rope_reference(&x, &pos, t, h, d, DEFAULT_THETA).unwrap();
        let want = oracle(&f64s(&x), exact, t, h, d, 1.0);
        assert!(
            rel_norm(&y, &want) <= F32_TOL,
            "f64 angles {t}x{h}x{d}: {}",
            rel_norm(&y, &want)
        );
    }
}

#[test]
fn position_zero_is_identity_and_backward_inverts_forward() {
    let (t, h, d) = (4, 2, 6);
    let (x, _) = inputs(1, t, h, d, 0);
    let y = rope_reference(&x, &[0; 4], t, h, d, DEFAULT_THETA).unwrap();
    assert_eq!(bits(&y), bits(&x), "angle 0 rotates nothing");
    let pos = [3, 100, 7, 2000];
    let y = rope_reference(&x, &pos, t, h, d, 500000.0).unwrap();
    let back = rope_backward_reference(&y, &pos, t, h, d, 500000.0).unwrap();
    assert!(rel_norm(&back, &f64s(&x)) <= F32_TOL);
}

#[test]
fn backward_matches_finite_differences() {
    // L = sum(y * g): dL/dx by central differences of the f64 oracle (f32 angles).
    for &(t, h, d) in &[(3usize, 2usize, 4usize), (1, 1, 2), (2, 1, 10)] {
        let (x, pos) = inputs(9, t, h, d, 50);
        let g = Rng::new(10).normal_vec(t * h * d, 1.0);
        let inv = rope_inv_freq(d, DEFAULT_THETA).unwrap();
        let angle = |r: usize, i: usize| (pos[r] as f32 * inv[i]) as f64;
        let loss = |x: &[f64]| -> f64 {
            oracle(x, angle, t, h, d, 1.0)
                .iter()
                .zip(&g)
                .map(|(a, &b)| a * b as f64)
                .sum()
        };
        let x64 = f64s(&x);
        let hstep = 1e-6;
        let fd: Vec<f64> = (0..x.len())
            .map(|i| {
                let (mut p, mut m) = (x64.clone(), x64.clone());
                p[i] += hstep;
                m[i] -= hstep;
                (loss(&p) - loss(&m)) / (2.0 * hstep)
            })
            .collect();
        let dx = rope_backward_reference(&g, &pos, t, h, d, DEFAULT_THETA).unwrap();
        // f32 reference (~1e-7) vs f64 differences of a linear function (error ~1e-10).
        assert!(
            rel_norm(&dx, &fd) <= F32_TOL,
            "{t}x{h}x{d}: {}",
            rel_norm(&dx, &fd)
        );
    }
}

fn run_device(
    backend: &Backend,
    dtype: DType,
    t: usize,
    h: usize,
    d: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>) {
    let (x, pos) = inputs(seed, t, h, d, 4096);
    let xt = Tensor::from_f32_as(backend, &[t, h, d], dtype, &x).unwrap();
    let pt = Tensor::from_slice(backend, &[t], &pos).unwrap();
    let y = rope(backend, &xt, &pt, DEFAULT_THETA).unwrap();
    let dx = rope_backward(backend, &xt, &pt, DEFAULT_THETA).unwrap();
    (y.to_f32_vec().unwrap(), dx.to_f32_vec().unwrap())
}

fn check_device(backend: &Backend, shapes: &[(usize, usize, usize)]) {
    for &dtype in &[DType::F32, DType::BF16] {
        for &(t, h, d) in shapes {
            let (mut x, pos) = inputs(3, t, h, d, 4096);
            if dtype == DType::BF16 {
                x = x
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect();
            }
            let want_y = rope_reference(&x, &pos, t, h, d, DEFAULT_THETA).unwrap();
            let want_dx = rope_backward_reference(&x, &pos, t, h, d, DEFAULT_THETA).unwrap();
            let (y, dx) = run_device(backend, dtype, t, h, d, 3);
            // Same f32 angles on every device; cos/sin differ by an ulp or two at most, and
            // bf16 inputs are widened exactly, so the f32 tolerance applies to both dtypes.
            assert!(
                rel_norm(&y, &f64s(&want_y)) <= F32_TOL,
                "{backend:?} {dtype} y {t}x{h}x{d}"
            );
            assert!(
                rel_norm(&dx, &f64s(&want_dx)) <= F32_TOL,
                "{backend:?} {dtype} dx {t}x{h}x{d}"
            );
            let (y2, dx2) = run_device(backend, dtype, t, h, d, 3);
            assert_eq!(bits(&y), bits(&y2), "{backend:?} y not deterministic");
            assert_eq!(bits(&dx), bits(&dx2), "{backend:?} dx not deterministic");
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
        for &(t, h, d) in EMU_SHAPES {
            let a = run_device(&e1, dtype, t, h, d, 4);
            let b = run_device(&e2, dtype, t, h, d, 4);
            assert_eq!(bits(&a.0), bits(&b.0), "emu seeds disagree on y");
            assert_eq!(bits(&a.1), bits(&b.1), "emu seeds disagree on dx");
        }
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("rope") {
        check_device(&gpu, SHAPES);
        check_device(&gpu, &[(2048, 8, 128)]);
    }
}

/// A sequence's rotated rows are bit-identical whether packed alone or behind others.
fn check_batch_invariance(backend: &Backend) {
    let (h, d) = (2, 10);
    let (x, pos) = inputs(8, 12, h, d, 300);
    let xt = Tensor::from_slice(backend, &[12, h, d], &x).unwrap();
    let pt = Tensor::from_slice(backend, &[12], &pos).unwrap();
    let y = rope(backend, &xt, &pt, DEFAULT_THETA)
        .unwrap()
        .to_f32_vec()
        .unwrap();
    let row = h * d;
    for (start, len) in [(0usize, 3usize), (5, 7), (11, 1)] {
        let xs = Tensor::from_slice(backend, &[len, h, d], &x[start * row..(start + len) * row])
            .unwrap();
        let ps = Tensor::from_slice(backend, &[len], &pos[start..start + len]).unwrap();
        let ys = rope(backend, &xs, &ps, DEFAULT_THETA)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        assert_eq!(
            bits(&ys),
            bits(&y[start * row..(start + len) * row]),
            "{backend:?} rows {start}.."
        );
    }
}

#[test]
fn batch_invariant_on_cpu() {
    check_batch_invariance(&Backend::Cpu);
}

#[test]
fn batch_invariant_on_emu() {
    check_batch_invariance(&Backend::emu_with_seed(2));
}

#[test]
fn bad_inputs_are_errors() {
    for b in [Backend::Cpu, Backend::emu_with_seed(1)] {
        let x = Tensor::from_slice(&b, &[2, 1, 4], &[1.0f32; 8]).unwrap();
        let pos = Tensor::from_slice(&b, &[2], &[0i32, 1]).unwrap();
        let odd = Tensor::from_slice(&b, &[2, 1, 3], &[1.0f32; 6]).unwrap();
        let err = rope(&b, &odd, &pos, DEFAULT_THETA).unwrap_err();
        assert!(
            err.to_string().contains("`x`") && err.to_string().contains("even"),
            "{err}"
        );
        let flat = Tensor::from_slice(&b, &[8], &[1.0f32; 8]).unwrap();
        let err = rope(&b, &flat, &pos, DEFAULT_THETA).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "x"),
            "{err}"
        );
        assert!(err.to_string().contains("[T,H,D]"));
        let pos3 = Tensor::from_slice(&b, &[3], &[0i32, 1, 2]).unwrap();
        let err = rope(&b, &x, &pos3, DEFAULT_THETA).unwrap_err();
        assert!(
            matches!(&err, Error::Shape { tensor, .. } if tensor == "positions"),
            "{err}"
        );
        assert!(err.to_string().contains("[2]"), "{err}");
        let posf = Tensor::from_slice(&b, &[2], &[0.0f32, 1.0]).unwrap();
        assert!(
            matches!(rope(&b, &x, &posf, DEFAULT_THETA), Err(Error::DType { tensor, .. }) if tensor == "positions")
        );
        assert!(
            matches!(rope(&b, &x, &pos, 0.0), Err(Error::Param { name, .. }) if name == "theta")
        );
        assert!(matches!(
            rope(&b, &x, &pos, f32::INFINITY),
            Err(Error::Param { .. })
        ));
        let err = rope_backward(&b, &odd, &pos, DEFAULT_THETA).unwrap_err();
        assert!(err.to_string().contains("`dy`"), "{err}");
    }
    assert!(rope_reference(&[1.0; 8], &[0], 2, 1, 4, DEFAULT_THETA).is_err());
}
