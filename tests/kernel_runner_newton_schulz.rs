//! `sluice kernel newton_schulz` (DESIGN.md section 7): g[n,r,c] -> x[n,r,c] F32, parameters
//! steps=5 and precision=f32 (f32 | bf16). Runs through `run_kernel` on safetensors files in a temp dir and checks the result
//! against the iteration computed here in f64.

mod support;

use half::bf16;
use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng};
use sluice_kernels::{Backend, DType, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use support::{run_bad_input, scratch_dir, write_input};

/// The iteration on one matrix [r,c] in f64, written directly on G (no explicit transposes):
/// for r > c it runs X <- a X + X (b A + c A^2) with A = X^T X, which is the transposed form.
fn expected_one(g: &[f64], r: usize, c: usize, steps: usize) -> Vec<f64> {
    let (ca, cb, cc) = (3.4445, -4.7750, 2.0315);
    let norm = g.iter().map(|v| v * v).sum::<f64>().sqrt() + 1e-7;
    let mut x: Vec<f64> = g.iter().map(|v| v / norm).collect();
    let at = |x: &[f64], i: usize, j: usize| x[i * c + j];
    let d = r.min(c);
    for _ in 0..steps {
        // Gram matrix of the short side.
        let mut a = vec![0.0; d * d];
        for i in 0..d {
            for j in 0..d {
                a[i * d + j] = if r <= c {
                    (0..c).map(|k| at(&x, i, k) * at(&x, j, k)).sum()
                } else {
                    (0..r).map(|k| at(&x, k, i) * at(&x, k, j)).sum()
                };
            }
        }
        let mut p = vec![0.0; d * d];
        for i in 0..d {
            for j in 0..d {
                let a2: f64 = (0..d).map(|k| a[i * d + k] * a[k * d + j]).sum();
                p[i * d + j] = cb * a[i * d + j] + cc * a2;
            }
        }
        let mut nx = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                let s: f64 = if r <= c {
                    (0..d).map(|k| p[i * d + k] * at(&x, k, j)).sum()
                } else {
                    (0..d).map(|k| at(&x, i, k) * p[k * d + j]).sum()
                };
                nx[i * c + j] = ca * at(&x, i, j) + s;
            }
        }
        x = nx;
    }
    x
}

fn check_run(device: Device, dtype: DType, n: usize, r: usize, c: usize, steps: Option<usize>) {
    check_run_with(device, dtype, (n, r, c), steps, None);
}

/// Runs the row with `precision` (None: the default, f32) and checks against the f64
/// iteration: f32 within 1e-4 (the f32 path's tolerance in kernels/tests/newton_schulz.rs),
/// bf16 within 6e-2 (the bf16 path's tolerance against f64 there: rounding B = c A^2 + b A to
/// bf16 costs up to ~1% a step).
fn check_run_with(
    device: Device,
    dtype: DType,
    (n, r, c): (usize, usize, usize),
    steps: Option<usize>,
    precision: Option<&str>,
) {
    let tag = precision.unwrap_or("default");
    let dir = scratch_dir(&format!("ns-{device}-{dtype}-{n}-{r}-{c}-{tag}"));
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(7 + r as u64);
    let g = rng.normal_vec(n * r * c, 1.0);
    let gt = Tensor::from_f32_as(&cpu, &[n, r, c], dtype, &g).unwrap();
    let steps_text = steps.map(|s| s.to_string());
    let mut params: Vec<(&str, &str)> = steps_text.iter().map(|s| ("steps", s.as_str())).collect();
    if let Some(p) = precision {
        params.push(("precision", p));
    }
    let input = write_input(&dir, &[("g", gt)], &params);
    let output = dir.join("out.safetensors");
    let summary = run_kernel("newton_schulz", &input, &output, device)
        .unwrap_or_else(|e| panic!("newton_schulz on {device} {dtype} [{n},{r},{c}]: {e}"));
    assert!(summary.contains("newton_schulz"), "{summary}");
    let out = read_safetensors(&output, &cpu).unwrap();
    let x = &out.tensors["x"];
    assert_eq!(x.shape(), &[n, r, c]);
    assert_eq!(x.dtype(), DType::F32);
    let src: Vec<f64> = match dtype {
        DType::BF16 => g
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32() as f64)
            .collect(),
        _ => g.iter().map(|&v| v as f64).collect(),
    };
    let want: Vec<f64> = src
        .chunks(r * c)
        .flat_map(|m| expected_one(m, r, c, steps.unwrap_or(5)))
        .collect();
    let err = rel_norm(&x.to_vec::<f32>().unwrap(), &want);
    let tol = if precision == Some("bf16") {
        6e-2
    } else {
        1e-4
    };
    assert!(
        err <= tol,
        "{device} {dtype} [{n},{r},{c}] precision {tag}: rel err {err:e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cpu_f32_and_bf16() {
    check_run(Device::Cpu, DType::F32, 3, 8, 16, None);
    check_run(Device::Cpu, DType::BF16, 2, 17, 5, None);
    check_run(Device::Cpu, DType::F32, 2, 9, 33, Some(3));
}

#[test]
fn emu_f32_and_bf16() {
    check_run(Device::Emu, DType::F32, 3, 8, 16, None);
    check_run(Device::Emu, DType::BF16, 2, 17, 5, Some(2));
}

#[test]
fn precision_param_f32_and_bf16() {
    check_run_with(Device::Cpu, DType::F32, (3, 8, 16), None, Some("f32"));
    check_run_with(Device::Cpu, DType::F32, (2, 17, 40), None, Some("bf16"));
    check_run_with(Device::Cpu, DType::BF16, (2, 33, 7), Some(3), Some("bf16"));
    check_run_with(Device::Emu, DType::F32, (2, 8, 16), None, Some("bf16"));
    check_run_with(Device::Emu, DType::BF16, (1, 17, 5), Some(2), Some("bf16"));
}

fn run_err(name: &str, tensors: Vec<(&str, Tensor)>, params: &[(&str, &str)]) -> String {
    run_bad_input("newton_schulz", name, &tensors, params)
}

#[test]
fn bad_input_names_tensor_and_shape() {
    let cpu = Backend::Cpu;
    let g = |shape: &[usize]| {
        let n = shape.iter().product();
        Tensor::from_slice(&cpu, shape, &vec![1f32; n]).unwrap()
    };
    let m = run_err("misnamed", vec![("G", g(&[1, 4, 8]))], &[]);
    assert!(m.contains("`G`") && m.contains("g[n,r,c]"), "{m}");
    let m = run_err("rank2", vec![("g", g(&[4, 8]))], &[]);
    assert!(m.contains("`g`") && m.contains("[n,r,c]"), "{m}");
    let m = run_err("steps0", vec![("g", g(&[1, 4, 8]))], &[("steps", "0")]);
    assert!(m.contains("steps"), "{m}");
    let m = run_err("stepsx", vec![("g", g(&[1, 4, 8]))], &[("steps", "five")]);
    assert!(m.contains("steps"), "{m}");
    let m = run_err("prec", vec![("g", g(&[1, 4, 8]))], &[("precision", "fp8")]);
    assert!(m.contains("precision") && m.contains("bf16"), "{m}");
    let ints = Tensor::from_slice(&cpu, &[1, 2, 8], &[1i32; 16]).unwrap();
    let m = run_err("int", vec![("g", ints)], &[]);
    assert!(m.contains("`g`") && m.contains("F32"), "{m}");
}
