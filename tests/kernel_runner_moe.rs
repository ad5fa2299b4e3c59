//! `sluice kernel moe_forward` / `moe_backward` (DESIGN.md section 7): x[T,d], w_router[E,d],
//! w1[E,f,d], w3[E,f,d], w2[E,d,f] (and dy[T,d]) with parameters k, score_fn=softmax,
//! renorm=true -> y[T,d], topk_idx[T,k] I32, topk_gate[T,k] / dx, dw_router, dw1, dw3, dw2.
//! Runs through `run_kernel` on safetensors files in a temp dir and checks the outputs against
//! a naive f64 per-token MoE written here (forward) and its central finite differences
//! (backward).

mod support;

use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng};
use sluice_kernels::{Backend, DType, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::collections::BTreeMap;
use support::{run_bad_input, scratch_dir, write_input};

const T: usize = 3;
const D: usize = 4;
const F: usize = 3;
const E: usize = 4;
const K: usize = 2;

/// The inputs x, w_router, w1, w3, w2, dy as f32 vectors.
fn inputs(seed: u64) -> [Vec<f32>; 6] {
    let mut r = Rng::new(seed);
    [
        r.normal_vec(T * D, 1.0),
        r.normal_vec(E * D, 1.0),
        r.normal_vec(E * F * D, 0.5),
        r.normal_vec(E * F * D, 0.5),
        r.normal_vec(E * D * F, 0.5),
        r.normal_vec(T * D, 1.0),
    ]
}

/// Naive f64 MoE: (y, idx, gate, smallest top-k margin) with softmax scores and renorm.
fn naive(v: &[Vec<f64>]) -> (Vec<f64>, Vec<i32>, Vec<f64>, f64) {
    let (x, wr, w1, w3, w2) = (&v[0], &v[1], &v[2], &v[3], &v[4]);
    let (mut y, mut idx, mut gate) = (vec![0.0; T * D], vec![], vec![]);
    let mut margin = f64::INFINITY;
    for t in 0..T {
        let xr = &x[t * D..(t + 1) * D];
        let z: Vec<f64> = (0..E)
            .map(|e| (0..D).map(|c| xr[c] * wr[e * D + c]).sum())
            .collect();
        let s: f64 = z.iter().map(|v| v.exp()).sum();
        let p: Vec<f64> = z.iter().map(|v| v.exp() / s).collect();
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap());
        margin = margin.min(p[order[K - 1]] - p[order[K]]);
        let sum: f64 = order[..K].iter().map(|&e| p[e]).sum();
        for &e in &order[..K] {
            let g = p[e] / sum;
            idx.push(e as i32);
            gate.push(g);
            let h: Vec<f64> = (0..F)
                .map(|i| {
                    let a: f64 = (0..D).map(|c| w1[(e * F + i) * D + c] * xr[c]).sum();
                    let b: f64 = (0..D).map(|c| w3[(e * F + i) * D + c] * xr[c]).sum();
                    a / (1.0 + (-a).exp()) * b
                })
                .collect();
            for c in 0..D {
                y[t * D + c] += g * (0..F).map(|i| w2[(e * D + c) * F + i] * h[i]).sum::<f64>();
            }
        }
    }
    (y, idx, gate, margin)
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// A seed whose routing margins are far above the finite-difference step.
fn smooth_inputs() -> [Vec<f32>; 6] {
    (0..200)
        .map(inputs)
        .find(|v| naive(&v.iter().map(|x| widen(x)).collect::<Vec<_>>()).3 > 1e-3)
        .expect("a smooth seed")
}

fn tensors(v: &[Vec<f32>; 6], with_dy: bool) -> Vec<(&'static str, Tensor)> {
    let cpu = Backend::Cpu;
    let shapes: [(&str, Vec<usize>); 6] = [
        ("x", vec![T, D]),
        ("w_router", vec![E, D]),
        ("w1", vec![E, F, D]),
        ("w3", vec![E, F, D]),
        ("w2", vec![E, D, F]),
        ("dy", vec![T, D]),
    ];
    shapes
        .iter()
        .zip(v)
        .take(if with_dy { 6 } else { 5 })
        .map(|((n, s), data)| (*n, Tensor::from_slice(&cpu, s, data).unwrap()))
        .collect()
}

fn run(
    op: &str,
    device: Device,
    ts: Vec<(&str, Tensor)>,
    params: &[(&str, &str)],
) -> BTreeMap<String, Tensor> {
    let dir = scratch_dir(&format!("moe-{op}-{device}"));
    let input = write_input(&dir, &ts, params);
    let output = dir.join("out.safetensors");
    run_kernel(op, &input, &output, device).unwrap_or_else(|e| panic!("{op} on {device}: {e}"));
    let out = read_safetensors(&output, &Backend::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    out.tensors.into_iter().collect()
}

fn check_forward(device: Device) {
    let v = smooth_inputs();
    let out = run("moe_forward", device, tensors(&v, false), &[("k", "2")]);
    let (y, idx, gate, _) = naive(&v.iter().map(|x| widen(x)).collect::<Vec<_>>());
    assert_eq!(out["y"].shape(), &[T, D]);
    assert_eq!(out["topk_idx"].dtype(), DType::I32);
    assert_eq!(out["topk_idx"].to_vec::<i32>().unwrap(), idx, "{device}");
    // f32 op against the f64 loop: tolerance F32 (1e-5) with 4-long dot products.
    assert!(
        rel_norm(&out["y"].to_vec::<f32>().unwrap(), &y) <= 1e-5,
        "{device}: y"
    );
    assert!(
        rel_norm(&out["topk_gate"].to_vec::<f32>().unwrap(), &gate) <= 1e-5,
        "{device}: gate"
    );
}

fn check_backward(device: Device) {
    let v = smooth_inputs();
    let out = run(
        "moe_backward",
        device,
        tensors(&v, true),
        &[("k", "2"), ("renorm", "true")],
    );
    let base: Vec<Vec<f64>> = v.iter().map(|x| widen(x)).collect();
    let dy = &base[5];
    let loss = |p: &[Vec<f64>]| -> f64 { naive(p).0.iter().zip(dy).map(|(a, b)| a * b).sum() };
    for (which, name) in ["dx", "dw_router", "dw1", "dw3", "dw2"].iter().enumerate() {
        let h = 1e-5;
        let fd: Vec<f64> = (0..base[which].len())
            .map(|i| {
                let mut p = base.clone();
                p[which][i] += h;
                let lp = loss(&p);
                p[which][i] -= 2.0 * h;
                (lp - loss(&p)) / (2.0 * h)
            })
            .collect();
        let got = out[*name].to_vec::<f32>().unwrap();
        // f32 gradients against f64 central differences (truncation ~1e-10): 1e-5.
        let err = rel_norm(&got, &fd);
        assert!(err <= 1e-5, "{device}: {name} rel err {err:e}");
    }
}

#[test]
fn forward_and_backward_on_cpu() {
    check_forward(Device::Cpu);
    check_backward(Device::Cpu);
}

#[test]
fn forward_and_backward_on_emu() {
    check_forward(Device::Emu);
    check_backward(Device::Emu);
}

fn run_err(name: &str, ts: Vec<(&str, Tensor)>, params: &[(&str, &str)]) -> String {
    run_bad_input("moe_forward", name, &ts, params)
}

#[test]
fn misnamed_misshapen_and_missing_tensors_are_errors() {
    let v = inputs(1);
    let cpu = Backend::Cpu;
    let mut ts = tensors(&v, false);
    ts[2].0 = "w_1";
    let m = run_err("misnamed", ts, &[("k", "2")]);
    assert!(m.contains("w_1") && m.contains("w1[E,f,d]"), "{m}");

    let mut ts = tensors(&v, false);
    ts[4].1 = Tensor::zeros(&cpu, &[E, F, D], DType::F32).unwrap();
    let m = run_err("misshapen", ts, &[("k", "2")]);
    assert!(
        m.contains("w2") && m.contains(&format!("[{E},{D},{F}]")),
        "{m}"
    );

    let mut ts = tensors(&v, false);
    ts.remove(1);
    let m = run_err("missing", ts, &[("k", "2")]);
    assert!(m.contains("w_router") && m.contains("[E,d]"), "{m}");

    let m = run_err("nok", tensors(&v, false), &[]);
    assert!(m.contains('k'), "{m}");
    let m = run_err(
        "badscore",
        tensors(&v, false),
        &[("k", "2"), ("score_fn", "tanh")],
    );
    assert!(m.contains("score_fn"), "{m}");
}
