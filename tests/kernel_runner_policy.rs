//! `sluice kernel is_gate_loss` and `sluice kernel sample` (DESIGN.md section 7) through the
//! kernel runner, against independent f64 computations, and their input errors.

mod support;

use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::path::Path;
use support::{scratch_dir, write_tensors};

fn log_softmax64(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let l = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - l).collect()
}

struct GateCase {
    n: usize,
    v: usize,
    logits: Vec<f32>,
    tokens: Vec<i32>,
    behavior: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<u8>,
}

fn gate_case() -> GateCase {
    let (n, v) = (9, 37);
    let mut rng = Rng::new(77);
    let logits = rng.normal_vec(n * v, 1.5);
    let tokens: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    let behavior = (0..n)
        .map(|t| {
            (log_softmax64(&logits[t * v..(t + 1) * v])[tokens[t] as usize] + 0.3 * rng.normal())
                as f32
        })
        .collect();
    let adv = (0..n).map(|_| rng.normal() as f32).collect();
    let mask = (0..n).map(|t| (t % 4 != 3) as u8).collect();
    GateCase {
        n,
        v,
        logits,
        tokens,
        behavior,
        adv,
        mask,
    }
}

fn write_gate_inputs(
    path: &Path,
    c: &GateCase,
    meta: &[(&str, &str)],
    rename: Option<(&str, &str)>,
) {
    let b = Backend::Cpu;
    let t = [
        (
            "logits",
            Tensor::from_slice(&b, &[c.n, c.v], &c.logits).unwrap(),
        ),
        ("tokens", Tensor::from_slice(&b, &[c.n], &c.tokens).unwrap()),
        (
            "behavior_logp",
            Tensor::from_slice(&b, &[c.n], &c.behavior).unwrap(),
        ),
        (
            "advantages",
            Tensor::from_slice(&b, &[c.n], &c.adv).unwrap(),
        ),
        ("mask", Tensor::from_slice(&b, &[c.n], &c.mask).unwrap()),
    ];
    let named: Vec<(&str, &Tensor)> = t
        .iter()
        .map(|(name, t)| match rename {
            Some((from, to)) if *name == from => (to, t),
            _ => (*name, t),
        })
        .collect();
    write_tensors(path, &named, meta);
}

/// pg mode in f64: loss = -(1/D) sum m A logp, dlogits = -(m A / D) (onehot - softmax).
fn check_gate_outputs(c: &GateCase, out: &Path) {
    let f = read_safetensors(out, &Backend::Cpu).unwrap();
    let get = |name: &str| {
        f.tensors
            .get(name)
            .unwrap_or_else(|| panic!("output {name}"))
    };
    let d: f64 = c.mask.iter().map(|&m| m as f64).sum();
    let mut loss = 0.0;
    let mut grad = vec![0.0; c.n * c.v];
    let mut logp = vec![];
    let mut ratio = vec![];
    for t in 0..c.n {
        let ls = log_softmax64(&c.logits[t * c.v..(t + 1) * c.v]);
        let tok = c.tokens[t] as usize;
        let k = c.mask[t] as f64 * c.adv[t] as f64;
        loss -= k * ls[tok] / d;
        for j in 0..c.v {
            grad[t * c.v + j] = -k / d * (if j == tok { 1.0 } else { 0.0 } - ls[j].exp());
        }
        logp.push(ls[tok]);
        ratio.push((ls[tok] - c.behavior[t] as f64).exp());
    }
    let l: Vec<f32> = get("loss").to_vec().unwrap();
    assert!(rel_norm(&l, &[loss]) <= F32_TOL, "loss {l:?} vs {loss}");
    assert!(rel_norm(&get("dlogits").to_f32_vec().unwrap(), &grad) <= F32_TOL);
    assert!(rel_norm(&get("logp").to_vec::<f32>().unwrap(), &logp) <= F32_TOL);
    assert!(rel_norm(&get("ratio").to_vec::<f32>().unwrap(), &ratio) <= F32_TOL);
    assert_eq!(
        get("accepted").to_vec::<u8>().unwrap(),
        c.mask,
        "pg accepts every masked token"
    );
    let counters: Vec<f32> = get("counters").to_vec().unwrap();
    assert_eq!(counters.len(), 8);
    assert_eq!(counters[0], d as f32);
    assert_eq!(counters[1], d as f32);
    assert_eq!((counters[5], counters[6]), (0.0, 0.0));
}

fn run_gate(device: Device, tag: &str) {
    let dir = scratch_dir(&format!("policy-{tag}"));
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    let c = gate_case();
    write_gate_inputs(&inp, &c, &[("mode", "pg")], None);
    let msg = run_kernel("is_gate_loss", &inp, &out, device).unwrap();
    assert!(msg.contains("dlogits"), "{msg}");
    check_gate_outputs(&c, &out);
    // Defaults (mode dis): runs and writes every output.
    write_gate_inputs(&inp, &c, &[], None);
    run_kernel("is_gate_loss", &inp, &out, device).unwrap();
    let f = read_safetensors(&out, &Backend::Cpu).unwrap();
    for name in ["loss", "dlogits", "logp", "ratio", "accepted", "counters"] {
        assert!(f.tensors.contains_key(name), "{name}");
    }
    assert_eq!(
        f.metadata.get("op").map(String::as_str),
        Some("is_gate_loss")
    );
}

#[test]
fn is_gate_loss_runs_on_cpu() {
    run_gate(Device::Cpu, "gate-cpu");
}

#[test]
fn is_gate_loss_runs_on_emu() {
    run_gate(Device::Emu, "gate-emu");
}

#[test]
fn is_gate_loss_input_errors_name_the_tensor() {
    let dir = scratch_dir("policy-gate-err");
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    let c = gate_case();
    write_gate_inputs(&inp, &c, &[], Some(("advantages", "advantage")));
    let e = run_kernel("is_gate_loss", &inp, &out, Device::Cpu).unwrap_err();
    assert!(
        e.is_bad_input() && e.to_string().contains("advantage"),
        "{e}"
    );
    assert!(
        e.to_string().contains("advantages[N]"),
        "lists the inputs: {e}"
    );
    let mut short = gate_case();
    short.behavior.pop();
    let b = Backend::Cpu;
    let t = [
        (
            "logits",
            Tensor::from_slice(&b, &[c.n, c.v], &c.logits).unwrap(),
        ),
        ("tokens", Tensor::from_slice(&b, &[c.n], &c.tokens).unwrap()),
        (
            "behavior_logp",
            Tensor::from_slice(&b, &[c.n - 1], &short.behavior).unwrap(),
        ),
        (
            "advantages",
            Tensor::from_slice(&b, &[c.n], &c.adv).unwrap(),
        ),
        ("mask", Tensor::from_slice(&b, &[c.n], &c.mask).unwrap()),
    ];
    write_tensors(&inp, &t, &[]);
    let e = run_kernel("is_gate_loss", &inp, &out, Device::Cpu).unwrap_err();
    let s = e.to_string();
    assert!(
        e.is_bad_input() && s.contains("behavior_logp") && s.contains("[N] with N = 9"),
        "{s}"
    );
    write_gate_inputs(&inp, &c, &[("mode", "grpo")], None);
    let e = run_kernel("is_gate_loss", &inp, &out, Device::Cpu).unwrap_err();
    assert!(e.is_bad_input() && e.to_string().contains("mode"), "{e}");
}

fn write_sample_inputs(
    path: &Path,
    logits: &[f32],
    b: usize,
    v: usize,
    meta: &[(&str, &str)],
    ids_shape: usize,
) {
    let be = Backend::Cpu;
    let ids: Vec<u64> = (0..ids_shape as u64).map(|i| 1000 + i).collect();
    let t = [
        ("logits", Tensor::from_slice(&be, &[b, v], logits).unwrap()),
        (
            "request_ids",
            Tensor::from_slice(&be, &[ids_shape], &ids).unwrap(),
        ),
        (
            "positions",
            Tensor::from_slice(&be, &[b], &(0..b as i32).collect::<Vec<_>>()).unwrap(),
        ),
    ];
    write_tensors(path, &t, meta);
}

fn run_sample(device: Device, tag: &str) {
    let dir = scratch_dir(&format!("policy-{tag}"));
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    let (b, v) = (6, 29);
    let logits = Rng::new(5).normal_vec(b * v, 2.0);
    for meta in [
        vec![("seed", "7"), ("temperature", "0")],
        vec![("seed", "7")],
        vec![("seed", "8"), ("top_k", "3"), ("top_p", "0.9")],
    ] {
        write_sample_inputs(&inp, &logits, b, v, &meta, b);
        run_kernel("sample", &inp, &out, device).unwrap();
        let f = read_safetensors(&out, &Backend::Cpu).unwrap();
        let tok: Vec<i32> = f.tensors["tokens"].to_vec().unwrap();
        let lp: Vec<f32> = f.tensors["logprobs"].to_vec().unwrap();
        let mut want = vec![];
        for r in 0..b {
            let row = &logits[r * v..(r + 1) * v];
            let t = tok[r] as usize;
            assert!(t < v);
            if meta.contains(&("temperature", "0")) {
                let am = (0..v).fold(0, |a, j| if row[j] > row[a] { j } else { a });
                assert_eq!(t, am, "greedy is the argmax");
            }
            want.push(log_softmax64(row)[t]);
        }
        assert!(rel_norm(&lp, &want) <= F32_TOL, "{meta:?}");
    }
}

#[test]
fn sample_runs_on_cpu() {
    run_sample(Device::Cpu, "sample-cpu");
}

#[test]
fn sample_runs_on_emu() {
    run_sample(Device::Emu, "sample-emu");
}

#[test]
fn sample_input_errors_name_the_tensor() {
    let dir = scratch_dir("policy-sample-err");
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    let logits = vec![0.5f32; 12];
    write_sample_inputs(&inp, &logits, 3, 4, &[], 2);
    let e = run_kernel("sample", &inp, &out, Device::Cpu).unwrap_err();
    let s = e.to_string();
    assert!(
        e.is_bad_input() && s.contains("request_ids") && s.contains("[B] with B = 3"),
        "{s}"
    );
    write_sample_inputs(&inp, &logits, 3, 4, &[("top_p", "2")], 3);
    let e = run_kernel("sample", &inp, &out, Device::Cpu).unwrap_err();
    assert!(e.is_bad_input() && e.to_string().contains("top_p"), "{e}");
    write_sample_inputs(&inp, &logits, 3, 4, &[("temprature", "1")], 3);
    assert!(run_kernel("sample", &inp, &out, Device::Cpu)
        .unwrap_err()
        .is_bad_input());
}
