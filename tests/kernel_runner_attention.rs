//! `sluice kernel attention_forward` / `attention_backward` through the runner: safetensors in,
//! safetensors out, compared with an independent f64 computation; misnamed and misshapen tensors.

mod support;

use sluice_kernels::testing::{rel_norm, Rng, BF16_TOL, F32_TOL};
use sluice_kernels::{Backend, DType, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::path::{Path, PathBuf};
use support::{read_f32, scratch_dir, write_tensors};

/// The file `name` in a fresh scratch dir.
fn tmp(name: &str) -> PathBuf {
    scratch_dir("attn-runner").join(name)
}

const LENS: [usize; 3] = [1, 7, 12];
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const T: usize = 20;

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    cu: Vec<i32>,
}

fn inputs() -> Inputs {
    let mut rng = Rng::new(77);
    Inputs {
        q: rng.normal_vec(T * H * D, 1.0),
        k: rng.normal_vec(T * HKV * D, 1.0),
        v: rng.normal_vec(T * HKV * D, 1.0),
        dout: rng.normal_vec(T * H * D, 1.0),
        cu: vec![0, 1, 8, 20],
    }
}

/// Naive f64 attention with scale `scale`; returns out and the gradients of sum(out*dout).
fn naive(x: &Inputs, causal: bool, scale: f64) -> [Vec<f64>; 4] {
    let mut out = vec![0.0; T * H * D];
    let mut dq = vec![0.0; T * H * D];
    let mut dk = vec![0.0; T * HKV * D];
    let mut dv = vec![0.0; T * HKV * D];
    for b in 0..LENS.len() {
        let (s0, s1) = (x.cu[b] as usize, x.cu[b + 1] as usize);
        for h in 0..H {
            let g = h / (H / HKV);
            for i in s0..s1 {
                let qi = (i * H + h) * D;
                let js: Vec<usize> = (s0..if causal { i + 1 } else { s1 }).collect();
                let dotq = |a: &[f32], ai: usize, b: &[f32], bi: usize| -> f64 {
                    (0..D).map(|d| a[ai + d] as f64 * b[bi + d] as f64).sum()
                };
                let s: Vec<f64> = js
                    .iter()
                    .map(|&j| dotq(&x.q, qi, &x.k, (j * HKV + g) * D) * scale)
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|a| (a - mx).exp()).sum();
                let p: Vec<f64> = s.iter().map(|a| (a - mx).exp() / z).collect();
                let dp: Vec<f64> = js
                    .iter()
                    .map(|&j| dotq(&x.dout, qi, &x.v, (j * HKV + g) * D))
                    .collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (n, &j) in js.iter().enumerate() {
                    let kj = (j * HKV + g) * D;
                    let ds = p[n] * (dp[n] - dsum);
                    for d in 0..D {
                        out[qi + d] += p[n] * x.v[kj + d] as f64;
                        dv[kj + d] += p[n] * x.dout[qi + d] as f64;
                        dq[qi + d] += ds * x.k[kj + d] as f64 * scale;
                        dk[kj + d] += ds * x.q[qi + d] as f64 * scale;
                    }
                }
            }
        }
    }
    [out, dq, dk, dv]
}

fn write_inputs(path: &Path, x: &Inputs, with_dout: bool, meta: &[(&str, &str)]) {
    write_inputs_as(path, x, with_dout, meta, DType::F32);
}

/// `write_inputs` with q, k, v and dout stored as `dtype`.
fn write_inputs_as(path: &Path, x: &Inputs, with_dout: bool, meta: &[(&str, &str)], dtype: DType) {
    let cpu = Backend::Cpu;
    let t = |shape: &[usize], data: &[f32]| {
        let t = Tensor::from_slice(&cpu, shape, data).unwrap();
        t.cast(&cpu, dtype).unwrap()
    };
    let q = t(&[T, H, D], &x.q);
    let k = t(&[T, HKV, D], &x.k);
    let v = t(&[T, HKV, D], &x.v);
    let cu = Tensor::from_slice(&cpu, &[4], &x.cu).unwrap();
    let dout = t(&[T, H, D], &x.dout);
    let mut named = vec![("q", &q), ("k", &k), ("v", &v), ("cu_seqlens", &cu)];
    if with_dout {
        named.push(("dout", &dout));
    }
    write_tensors(path, &named, meta);
}

#[test]
fn forward_row_defaults_and_params() {
    let x = inputs();
    let inp = tmp("fwd_in.safetensors");
    let out = tmp("fwd_out.safetensors");
    // Defaults: causal, scale 1/sqrt(D).
    write_inputs(&inp, &x, false, &[]);
    run_kernel("attention_forward", &inp, &out, Device::Cpu).unwrap();
    let want = naive(&x, true, 1.0 / (D as f64).sqrt());
    assert!(rel_norm(&read_f32(&out, "out"), &want[0]) <= F32_TOL);
    // Explicit parameters.
    write_inputs(&inp, &x, false, &[("causal", "false"), ("scale", "0.5")]);
    run_kernel("attention_forward", &inp, &out, Device::Cpu).unwrap();
    let want = naive(&x, false, 0.5);
    assert!(rel_norm(&read_f32(&out, "out"), &want[0]) <= F32_TOL);
}

#[test]
fn backward_row() {
    let x = inputs();
    let inp = tmp("bwd_in.safetensors");
    let out = tmp("bwd_out.safetensors");
    write_inputs(&inp, &x, true, &[]);
    run_kernel("attention_backward", &inp, &out, Device::Cpu).unwrap();
    let want = naive(&x, true, 1.0 / (D as f64).sqrt());
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        let err = rel_norm(&read_f32(&out, name), &want[i + 1]);
        assert!(err <= F32_TOL, "{name}: {err}");
    }
}

#[test]
fn misnamed_and_misshapen_tensors_are_named() {
    let x = inputs();
    let cpu = Backend::Cpu;
    let out = tmp("bad_out.safetensors");
    let q = Tensor::from_slice(&cpu, &[T, H, D], &x.q).unwrap();
    let k = Tensor::from_slice(&cpu, &[T, HKV, D], &x.k).unwrap();
    let v = Tensor::from_slice(&cpu, &[T, HKV, D], &x.v).unwrap();
    let cu = Tensor::from_slice(&cpu, &[4], &x.cu).unwrap();
    let bad_k = Tensor::from_slice(&cpu, &[T, HKV, D / 2], &x.k[..T * HKV * D / 2]).unwrap();

    let inp = tmp("misnamed.safetensors");
    write_tensors(
        &inp,
        &[("q", &q), ("key", &k), ("v", &v), ("cu_seqlens", &cu)],
        &[],
    );
    let e = run_kernel("attention_forward", &inp, &out, Device::Cpu).unwrap_err();
    assert!(e.is_bad_input());
    let m = e.to_string();
    assert!(m.contains("key") && m.contains("k[T,Hkv,D]"), "{m}");

    let inp = tmp("misshapen.safetensors");
    write_tensors(
        &inp,
        &[("q", &q), ("k", &bad_k), ("v", &v), ("cu_seqlens", &cu)],
        &[],
    );
    let e = run_kernel("attention_forward", &inp, &out, Device::Cpu).unwrap_err();
    assert!(e.is_bad_input());
    let m = e.to_string();
    assert!(
        m.contains("`k`") && m.contains("[T,Hkv,D] = [20,Hkv,8]"),
        "{m}"
    );

    let inp = tmp("missing_dout.safetensors");
    write_inputs(&inp, &x, false, &[]);
    let e = run_kernel("attention_backward", &inp, &out, Device::Cpu).unwrap_err();
    assert!(
        e.to_string().contains("dout") && e.to_string().contains("[T,H,D]"),
        "{e}"
    );

    let inp = tmp("bad_param.safetensors");
    write_inputs(&inp, &x, false, &[("causal", "maybe")]);
    let e = run_kernel("attention_forward", &inp, &out, Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("causal"), "{e}");
}

#[test]
fn emu_row_matches_cpu_row() {
    let x = inputs();
    let inp = tmp("emu_in.safetensors");
    let out_cpu = tmp("emu_cpu.safetensors");
    let out_emu = tmp("emu_emu.safetensors");
    write_inputs(&inp, &x, true, &[]);
    run_kernel("attention_backward", &inp, &out_cpu, Device::Cpu).unwrap();
    run_kernel("attention_backward", &inp, &out_emu, Device::Emu).unwrap();
    for name in ["dq", "dk", "dv"] {
        let want: Vec<f64> = read_f32(&out_cpu, name).iter().map(|&a| a as f64).collect();
        assert!(
            rel_norm(&read_f32(&out_emu, name), &want) <= F32_TOL,
            "{name}"
        );
    }
}

/// bf16 inputs take the tensor-core tile kernels on emu and their cpu twin on cpu: the runner's
/// rows agree bit for bit, and both are within bf16 tolerance of the f64 computation on the
/// rounded inputs (forward and backward).
#[test]
fn bf16_rows_take_the_tile_path_with_the_same_bits_on_cpu_and_emu() {
    let mut x = inputs();
    for data in [&mut x.q, &mut x.k, &mut x.v, &mut x.dout] {
        for a in data.iter_mut() {
            *a = half::bf16::from_f32(*a).to_f32();
        }
    }
    let want = naive(&x, true, 1.0 / (D as f64).sqrt());
    for (op, names) in [
        ("attention_forward", &["out"][..]),
        ("attention_backward", &["dq", "dk", "dv"][..]),
    ] {
        let inp = tmp(&format!("{op}_bf16_in.safetensors"));
        write_inputs_as(&inp, &x, op == "attention_backward", &[], DType::BF16);
        let out_cpu = tmp(&format!("{op}_bf16_cpu.safetensors"));
        let out_emu = tmp(&format!("{op}_bf16_emu.safetensors"));
        run_kernel(op, &inp, &out_cpu, Device::Cpu).unwrap();
        run_kernel(op, &inp, &out_emu, Device::Emu).unwrap();
        for name in names {
            let (cpu, emu) = (read_f32(&out_cpu, name), read_f32(&out_emu, name));
            assert_eq!(
                cpu.len(),
                T * if *name == "dk" || *name == "dv" {
                    HKV
                } else {
                    H
                } * D
            );
            let same = cpu
                .iter()
                .zip(&emu)
                .filter(|(a, b)| a.to_bits() == b.to_bits());
            assert_eq!(
                same.count(),
                cpu.len(),
                "{op} {name}: cpu and emu bits differ"
            );
            let i = ["out", "dq", "dk", "dv"]
                .iter()
                .position(|n| n == name)
                .unwrap();
            let err = rel_norm(&cpu, &want[i]);
            assert!(err <= BF16_TOL, "{op} {name}: {err}");
        }
    }
}

#[test]
fn paged_attention_row() {
    // Two sequences of 5 and 20 tokens in a cache of 4 blocks of 16 slots, GQA 2.
    let mut rng = Rng::new(91);
    let (b, nb, bs, mb) = (2usize, 4usize, 16usize, 2usize);
    let q = rng.normal_vec(b * H * D, 1.0);
    let kc = rng.normal_vec(nb * bs * HKV * D, 1.0);
    let vc = rng.normal_vec(nb * bs * HKV * D, 1.0);
    let table = [3i32, -1, 0, 2];
    let ctx = [5i32, 20];
    let cpu = Backend::Cpu;
    let t = |shape: &[usize], x: &[f32]| Tensor::from_slice(&cpu, shape, x).unwrap();
    let (tq, tk, tv) = (
        t(&[b, H, D], &q),
        t(&[nb, bs, HKV, D], &kc),
        t(&[nb, bs, HKV, D], &vc),
    );
    let tb = Tensor::from_slice(&cpu, &[b, mb], &table).unwrap();
    let tc = Tensor::from_slice(&cpu, &[b], &ctx).unwrap();
    let inp = tmp("paged_in.safetensors");
    let out = tmp("paged_out.safetensors");
    let named = [
        ("q", &tq),
        ("k_cache", &tk),
        ("v_cache", &tv),
        ("block_table", &tb),
        ("context_lens", &tc),
    ];
    write_tensors(&inp, &named, &[]);
    run_kernel("paged_attention", &inp, &out, Device::Cpu).unwrap();
    let got = read_f32(&out, "out");
    // Independent: naive f64 softmax over each sequence's slots.
    let scale = 1.0 / (D as f64).sqrt();
    let mut want = vec![0.0f64; b * H * D];
    for s in 0..b {
        for h in 0..H {
            let g = h / (H / HKV);
            let qi = (s * H + h) * D;
            let rows: Vec<usize> = (0..ctx[s] as usize)
                .map(|j| ((table[s * mb + j / bs] as usize * bs + j % bs) * HKV + g) * D)
                .collect();
            let sc: Vec<f64> = rows
                .iter()
                .map(|&r| {
                    (0..D)
                        .map(|d| q[qi + d] as f64 * kc[r + d] as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|a| (a - mx).exp()).sum();
            for (n, &r) in rows.iter().enumerate() {
                for d in 0..D {
                    want[qi + d] += (sc[n] - mx).exp() / z * vc[r + d] as f64;
                }
            }
        }
    }
    assert!(rel_norm(&got, &want) <= F32_TOL);

    // A misshapen cache names the tensor and the shape expected.
    let bad = t(&[nb, bs, HKV, D / 2], &kc[..nb * bs * HKV * D / 2]);
    let named = [
        ("q", &tq),
        ("k_cache", &bad),
        ("v_cache", &tv),
        ("block_table", &tb),
        ("context_lens", &tc),
    ];
    write_tensors(&inp, &named, &[]);
    let e = run_kernel("paged_attention", &inp, &out, Device::Cpu).unwrap_err();
    assert!(e.is_bad_input());
    assert!(
        e.to_string().contains("`k_cache`") && e.to_string().contains("[NB,BS,Hkv,D]"),
        "{e}"
    );
}
