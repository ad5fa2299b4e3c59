//! `sluice kernel topk` (DESIGN.md section 7): scores[T,E] -> values[T,k], indices[T,k] I32,
//! parameter k (required). Runs through `run_kernel` on safetensors files in a temp dir and
//! checks the result against a top-k computed here by sorting.

mod support;

use half::bf16;
use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use support::{run_bad_input, scratch_dir, write_input};

/// Top-k by a stable sort on (value descending, NaN last): ties keep the lower index first.
fn expected(data: &[f32], t: usize, e: usize, k: usize) -> (Vec<u32>, Vec<i32>) {
    let (mut v, mut ix) = (Vec::new(), Vec::new());
    for r in 0..t {
        let row = &data[r * e..(r + 1) * e];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| match (row[a].is_nan(), row[b].is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            (false, false) => row[b].partial_cmp(&row[a]).unwrap(),
        });
        for &i in &order[..k] {
            v.push(row[i].to_bits());
            ix.push(i as i32);
        }
    }
    (v, ix)
}

fn data(t: usize, e: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..t * e)
        .map(|_| match rng.below(20) {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            2..=6 => rng.below(4) as f32, // ties
            _ => rng.normal() as f32,
        })
        .collect()
}

fn check_run(device: Device, dtype: DType, t: usize, e: usize, k: usize) {
    let dir = scratch_dir(&format!("topk-{device}-{dtype}-{t}-{e}-{k}"));
    let cpu = Backend::Cpu;
    let x = data(t, e, 7 + t as u64);
    let scores = Tensor::from_f32_as(&cpu, &[t, e], dtype, &x).unwrap();
    let k_text = k.to_string();
    let input = write_input(&dir, &[("scores", scores)], &[("k", &k_text)]);
    let output = dir.join("out.safetensors");
    let summary = run_kernel("topk", &input, &output, device)
        .unwrap_or_else(|e| panic!("topk on {device} {dtype} [{t},{e}] k={k}: {e}"));
    assert!(summary.contains("topk"), "{summary}");
    let out = read_safetensors(&output, &cpu).unwrap();
    let values = &out.tensors["values"];
    let indices = &out.tensors["indices"];
    assert_eq!(values.shape(), &[t, k]);
    assert_eq!(values.dtype(), DType::F32);
    assert_eq!(indices.shape(), &[t, k]);
    assert_eq!(indices.dtype(), DType::I32);
    let src: Vec<f32> = match dtype {
        DType::BF16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        _ => x,
    };
    let (want_v, want_i) = expected(&src, t, e, k);
    let got_v: Vec<u32> = values
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(
        indices.to_vec::<i32>().unwrap(),
        want_i,
        "indices on {device}"
    );
    assert_eq!(got_v, want_v, "values on {device}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cpu_f32_and_bf16() {
    check_run(Device::Cpu, DType::F32, 17, 256, 8);
    check_run(Device::Cpu, DType::BF16, 17, 33, 16);
    check_run(Device::Cpu, DType::F32, 1, 1, 1);
}

#[test]
fn emu_f32_and_bf16() {
    check_run(Device::Emu, DType::F32, 9, 64, 8);
    check_run(Device::Emu, DType::BF16, 3, 17, 16);
}

fn run_err(name: &str, tensors: Vec<(&str, Tensor)>, params: &[(&str, &str)]) -> String {
    run_bad_input("topk", name, &tensors, params)
}

#[test]
fn bad_input_names_tensor_and_shape() {
    let cpu = Backend::Cpu;
    let scores = |shape: &[usize]| {
        let n = shape.iter().product();
        Tensor::from_slice(&cpu, shape, &vec![1f32; n]).unwrap()
    };
    // Misnamed tensor: names it and the expected input.
    let m = run_err("misnamed", vec![("score", scores(&[4, 8]))], &[("k", "2")]);
    assert!(m.contains("`score`") && m.contains("scores[T,E]"), "{m}");
    // Misshapen: rank 1.
    let m = run_err("rank1", vec![("scores", scores(&[8]))], &[("k", "2")]);
    assert!(m.contains("`scores`") && m.contains("[T,E]"), "{m}");
    // E > 512.
    let m = run_err("wide", vec![("scores", scores(&[2, 513]))], &[("k", "2")]);
    assert!(m.contains("`scores`") && m.contains("E <= 512"), "{m}");
    // k is required (no default in DESIGN 7).
    let m = run_err("nok", vec![("scores", scores(&[4, 8]))], &[]);
    assert!(m.contains("`k`") && m.contains("required"), "{m}");
    // k out of range, k not a number.
    let m = run_err("bigk", vec![("scores", scores(&[4, 8]))], &[("k", "9")]);
    assert!(m.contains("`k`"), "{m}");
    let m = run_err("nank", vec![("scores", scores(&[4, 8]))], &[("k", "eight")]);
    assert!(m.contains("`k`"), "{m}");
    // Integer scores.
    let ints = Tensor::from_slice(&cpu, &[2, 8], &[1i32; 16]).unwrap();
    let m = run_err("int", vec![("scores", ints)], &[("k", "2")]);
    assert!(m.contains("`scores`") && m.contains("F32"), "{m}");
}
