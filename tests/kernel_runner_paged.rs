//! `sluice kernel kv_append` / `paged_prefill` through the runner: safetensors in, safetensors
//! out, on cpu and emu, compared with computations written here (an exact slot copy; a naive
//! f64 causal attention over the paged cache); misnamed and misshapen tensors and bad
//! parameters give errors that name them.

// Index loops mirror the formulas of the independent computations.
#![allow(clippy::needless_range_loop)]

mod support;

use half::bf16;
use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Device, Error, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use std::collections::BTreeMap;
use support::{scratch_dir, write_input};

/// Writes the inputs and params, runs `op` on `device`, returns the outputs by name.
fn run(
    op: &str,
    tensors: &[(&str, Tensor)],
    params: &[(&str, &str)],
    device: Device,
) -> Result<BTreeMap<String, Tensor>, Error> {
    let dir = scratch_dir(&format!("paged-{op}"));
    let input = write_input(&dir, tensors, params);
    let out = dir.join(format!("out-{device}.safetensors"));
    let result = run_kernel(op, &input, &out, device)
        .map(|_| read_safetensors(&out, &Backend::Cpu).unwrap().tensors);
    std::fs::remove_dir_all(&dir).ok();
    result
}

fn f32s(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_slice(&Backend::Cpu, shape, data).unwrap()
}

fn i32s(shape: &[usize], data: &[i32]) -> Tensor {
    Tensor::from_slice(&Backend::Cpu, shape, data).unwrap()
}

// kv_append: T new rows of Hkv x D into NB x BS slots.
const T: usize = 5;
const HKV: usize = 2;
const D: usize = 3;
const NB: usize = 3;
const BS: usize = 4;
const SLOTS: [i32; T] = [7, -1, 0, 11, 5];

fn append_inputs(
    k_new: &[f32],
    v_new: &[f32],
    kc: &[f32],
    vc: &[f32],
) -> Vec<(&'static str, Tensor)> {
    vec![
        ("k_new", f32s(&[T, HKV, D], k_new)),
        ("v_new", f32s(&[T, HKV, D], v_new)),
        ("slot_mapping", i32s(&[T], &SLOTS)),
        ("k_cache", f32s(&[NB, BS, HKV, D], kc)),
        ("v_cache", f32s(&[NB, BS, HKV, D], vc)),
    ]
}

/// The caches with row t of the new rows copied to slot SLOTS[t] (negative: skipped).
fn append_expected(new: &[f32], cache: &[f32]) -> Vec<f32> {
    let row = HKV * D;
    let mut want = cache.to_vec();
    for (t, &s) in SLOTS.iter().enumerate() {
        if s >= 0 {
            let s = s as usize;
            want[s * row..(s + 1) * row].copy_from_slice(&new[t * row..(t + 1) * row]);
        }
    }
    want
}

#[test]
fn kv_append_writes_the_slots_on_cpu_and_emu() {
    let mut rng = Rng::new(31);
    let k_new = rng.normal_vec(T * HKV * D, 1.0);
    let v_new = rng.normal_vec(T * HKV * D, 1.0);
    let kc = rng.normal_vec(NB * BS * HKV * D, 1.0);
    let vc = rng.normal_vec(NB * BS * HKV * D, 1.0);
    let want_k = append_expected(&k_new, &kc);
    let want_v = append_expected(&v_new, &vc);
    for device in [Device::Cpu, Device::Emu] {
        let out = run(
            "kv_append",
            &append_inputs(&k_new, &v_new, &kc, &vc),
            &[],
            device,
        )
        .unwrap();
        for (name, want) in [("k_cache", &want_k), ("v_cache", &want_v)] {
            let t = &out[name];
            assert_eq!(t.shape(), [NB, BS, HKV, D], "{name} on {device}");
            assert_eq!(t.dtype(), DType::F32);
            // A copy: bit for bit.
            let got: Vec<u32> = t
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{name} on {device}");
        }
    }
    // BF16 caches stay BF16, the rows copied exactly.
    let bf = |shape: &[usize], d: &[f32]| {
        let v: Vec<bf16> = d.iter().map(|&x| bf16::from_f32(x)).collect();
        Tensor::from_slice(&Backend::Cpu, shape, &v).unwrap()
    };
    let round = |d: &[f32]| -> Vec<f32> { d.iter().map(|&x| bf16::from_f32(x).to_f32()).collect() };
    let inputs = vec![
        ("k_new", bf(&[T, HKV, D], &k_new)),
        ("v_new", bf(&[T, HKV, D], &v_new)),
        ("slot_mapping", i32s(&[T], &SLOTS)),
        ("k_cache", bf(&[NB, BS, HKV, D], &kc)),
        ("v_cache", bf(&[NB, BS, HKV, D], &vc)),
    ];
    for device in [Device::Cpu, Device::Emu] {
        let out = run("kv_append", &inputs, &[], device).unwrap();
        assert_eq!(out["k_cache"].dtype(), DType::BF16);
        assert_eq!(
            out["k_cache"].to_f32_vec().unwrap(),
            append_expected(&round(&k_new), &round(&kc)),
            "bf16 k_cache on {device}"
        );
        assert_eq!(
            out["v_cache"].to_f32_vec().unwrap(),
            append_expected(&round(&v_new), &round(&vc)),
            "bf16 v_cache on {device}"
        );
    }
}

#[test]
fn kv_append_bad_input_is_named() {
    let mut rng = Rng::new(32);
    let k_new = rng.normal_vec(T * HKV * D, 1.0);
    let kc = rng.normal_vec(NB * BS * HKV * D, 1.0);
    // Misnamed: names the tensor and the op's inputs with their shapes.
    let mut inputs = append_inputs(&k_new, &k_new, &kc, &kc);
    inputs[0].0 = "k";
    let err = run("kv_append", &inputs, &[], Device::Cpu).unwrap_err();
    let msg = err.to_string();
    assert!(
        err.is_bad_input() && msg.contains("`k`") && msg.contains("k_new[T,Hkv,D]"),
        "{msg}"
    );
    // Missing.
    let mut inputs = append_inputs(&k_new, &k_new, &kc, &kc);
    inputs.remove(2);
    let err = run("kv_append", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "slot_mapping")
            && err.to_string().contains("[T]"),
        "{err}"
    );
    // Misshapen v_new: names it and the shape expected.
    let mut inputs = append_inputs(&k_new, &k_new, &kc, &kc);
    inputs[1].1 = f32s(&[T, HKV * D], &k_new);
    let err = run("kv_append", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "v_new")
            && err.to_string().contains(&format!("[{T}, {HKV}, {D}]")),
        "{err}"
    );
    // Misshapen k_new (wrong D): names it and [T,Hkv,D] with the cache's sizes.
    let mut inputs = append_inputs(&k_new, &k_new, &kc, &kc);
    inputs[0].1 = f32s(&[T, D, HKV], &k_new);
    let err = run("kv_append", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "k_new")
            && err.to_string().contains(&format!("[T,{HKV},{D}]")),
        "{err}"
    );
    // A slot past the cache, and a slot named twice, name slot_mapping.
    for slots in [[0, 1, 2, 3, (NB * BS) as i32], [0, 1, 2, 1, -1]] {
        let mut inputs = append_inputs(&k_new, &k_new, &kc, &kc);
        inputs[2].1 = i32s(&[T], &slots);
        let err = run("kv_append", &inputs, &[], Device::Cpu).unwrap_err();
        assert!(
            err.is_bad_input() && err.to_string().contains("`slot_mapping`"),
            "{err}"
        );
    }
}

// paged_prefill: B sequences with new tokens over a cache that already holds them.
const H: usize = 4;
const PD: usize = 8;
const PNB: usize = 5;
const PBS: usize = 4;
const MB: usize = 2;
const CU: [i32; 3] = [0, 2, 5];
const CTX: [i32; 2] = [6, 3];
const TABLE: [i32; 4] = [3, 0, 4, -1];
const PT: usize = 5;

fn prefill_inputs(q: &[f32], kc: &[f32], vc: &[f32]) -> Vec<(&'static str, Tensor)> {
    vec![
        ("q", f32s(&[PT, H, PD], q)),
        ("k_cache", f32s(&[PNB, PBS, HKV, PD], kc)),
        ("v_cache", f32s(&[PNB, PBS, HKV, PD], vc)),
        ("block_table", i32s(&[2, MB], &TABLE)),
        ("cu_seqlens", i32s(&[3], &CU)),
        ("context_lens", i32s(&[2], &CTX)),
    ]
}

/// Naive f64 causal attention of each new token over its sequence's cached keys.
fn prefill_naive(q: &[f32], kc: &[f32], vc: &[f32], scale: f64) -> Vec<f64> {
    let mut out = vec![0.0; PT * H * PD];
    for b in 0..2 {
        let (s0, s1) = (CU[b] as usize, CU[b + 1] as usize);
        let n_new = s1 - s0;
        for tok in s0..s1 {
            let n_keys = CTX[b] as usize - n_new + (tok - s0) + 1;
            for h in 0..H {
                let g = h / (H / HKV);
                let qi = (tok * H + h) * PD;
                let rows: Vec<usize> = (0..n_keys)
                    .map(|j| {
                        let slot = TABLE[b * MB + j / PBS] as usize * PBS + j % PBS;
                        (slot * HKV + g) * PD
                    })
                    .collect();
                let s: Vec<f64> = rows
                    .iter()
                    .map(|&r| {
                        (0..PD)
                            .map(|d| q[qi + d] as f64 * kc[r + d] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|a| (a - mx).exp()).sum();
                for (n, &r) in rows.iter().enumerate() {
                    let p = (s[n] - mx).exp() / z;
                    for d in 0..PD {
                        out[qi + d] += p * vc[r + d] as f64;
                    }
                }
            }
        }
    }
    out
}

#[test]
fn paged_prefill_matches_naive_attention_on_cpu_and_emu() {
    let mut rng = Rng::new(41);
    let q = rng.normal_vec(PT * H * PD, 1.0);
    let kc = rng.normal_vec(PNB * PBS * HKV * PD, 1.0);
    let vc = rng.normal_vec(PNB * PBS * HKV * PD, 1.0);
    let want = prefill_naive(&q, &kc, &vc, 1.0 / (PD as f64).sqrt());
    let mut cpu = Vec::new();
    for device in [Device::Cpu, Device::Emu] {
        let out = run("paged_prefill", &prefill_inputs(&q, &kc, &vc), &[], device).unwrap();
        let o = &out["out"];
        assert_eq!(o.shape(), [PT, H, PD]);
        assert_eq!(o.dtype(), DType::F32);
        let got = o.to_vec::<f32>().unwrap();
        let err = rel_norm(&got, &want);
        assert!(err <= F32_TOL, "paged_prefill on {device}: rel err {err}");
        if device == Device::Cpu {
            cpu = got;
        } else {
            let c: Vec<f64> = cpu.iter().map(|&v| v as f64).collect();
            assert!(rel_norm(&got, &c) <= F32_TOL, "emu vs cpu");
        }
    }
    // An explicit scale.
    let out = run(
        "paged_prefill",
        &prefill_inputs(&q, &kc, &vc),
        &[("scale", "0.5")],
        Device::Cpu,
    )
    .unwrap();
    let err = rel_norm(
        &out["out"].to_vec::<f32>().unwrap(),
        &prefill_naive(&q, &kc, &vc, 0.5),
    );
    assert!(err <= F32_TOL, "scale 0.5: rel err {err}");
}

#[test]
fn paged_prefill_bad_input_is_named() {
    let mut rng = Rng::new(42);
    let q = rng.normal_vec(PT * H * PD, 1.0);
    let kc = rng.normal_vec(PNB * PBS * HKV * PD, 1.0);
    // Misnamed.
    let mut inputs = prefill_inputs(&q, &kc, &kc);
    inputs[4].0 = "cu_seqlen";
    let err = run("paged_prefill", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        err.is_bad_input()
            && err.to_string().contains("`cu_seqlen`")
            && err.to_string().contains("cu_seqlens[B+1]"),
        "{err}"
    );
    // Misshapen q (rank 2).
    let mut inputs = prefill_inputs(&q, &kc, &kc);
    inputs[0].1 = f32s(&[PT, H * PD], &q);
    let err = run("paged_prefill", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "q")
            && err.to_string().contains("[T,H,D]"),
        "{err}"
    );
    // Misshapen block_table (B rows of q's cu_seqlens).
    let mut inputs = prefill_inputs(&q, &kc, &kc);
    inputs[3].1 = i32s(&[1, 4], &TABLE);
    let err = run("paged_prefill", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "block_table")
            && err.to_string().contains("[B,MB]"),
        "{err}"
    );
    // Misshapen v_cache.
    let mut inputs = prefill_inputs(&q, &kc, &kc);
    inputs[2].1 = f32s(&[PNB, PBS, HKV * PD], &kc);
    let err = run("paged_prefill", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == "v_cache")
            && err.to_string().contains("[NB,BS,Hkv,D]"),
        "{err}"
    );
    // A context shorter than its new tokens names context_lens.
    let mut inputs = prefill_inputs(&q, &kc, &kc);
    inputs[5].1 = i32s(&[2], &[6, 2]);
    let err = run("paged_prefill", &inputs, &[], Device::Cpu).unwrap_err();
    assert!(
        err.is_bad_input() && err.to_string().contains("`context_lens`"),
        "{err}"
    );
    // A bad scale names the parameter.
    let err = run(
        "paged_prefill",
        &prefill_inputs(&q, &kc, &kc),
        &[("scale", "half")],
        Device::Cpu,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Param { name, .. } if name == "scale"),
        "{err}"
    );
}

#[test]
fn list_shows_the_paged_rows() {
    let list = sluice_kernels::runner::list();
    assert!(list.contains("kv_append  "), "{list}");
    assert!(list.contains("paged_prefill  "), "{list}");
    assert!(list.contains("slot_mapping[T] I32"), "{list}");
}
