//! Benches of the policy kernels: is_gate_loss and sample. CPU always; CUDA at the target
//! shapes when a GPU is present (skipped silently otherwise). Prints effective GB/s for the
//! bytes each op must move (docs/perf/is_gate_loss.md, docs/perf/sample.md).

use criterion::{criterion_group, criterion_main, Criterion};
use sluice_kernels::ops::is_gate_loss::{
    is_gate_loss, is_gate_loss_in_place, GateParams, TokenBatch,
};
use sluice_kernels::ops::sample::{sample, SampleParams};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::time::{Duration, Instant};

struct GateInputs {
    logits: Tensor,
    rest: Vec<Tensor>,
}

fn gate_inputs(b: &Backend, n: usize, v: usize, dtype: DType) -> GateInputs {
    let mut rng = Rng::new(1);
    let logits = cheap_logits(n * v);
    let tokens: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
    let behavior: Vec<f32> = (0..n).map(|_| -(rng.uniform() as f32) * 12.0).collect();
    let adv: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    let mask = vec![1.0f32; n];
    GateInputs {
        logits: Tensor::from_f32_as(b, &[n, v], dtype, &logits).unwrap(),
        rest: vec![
            Tensor::from_slice(b, &[n], &tokens).unwrap(),
            Tensor::from_slice(b, &[n], &behavior).unwrap(),
            Tensor::from_slice(b, &[n], &adv).unwrap(),
            Tensor::from_slice(b, &[n], &mask).unwrap(),
        ],
    }
}

fn token_batch(rest: &[Tensor]) -> TokenBatch<'_> {
    TokenBatch {
        tokens: &rest[0],
        behavior_logp: &rest[1],
        advantages: &rest[2],
        mask: &rest[3],
        weight: None,
        ref_logp: None,
    }
}

/// Logits in [-4, 4) from a multiplicative hash: the GPU shapes hold 1.25e9 entries, too many
/// to draw normals for in a bench's setup.
fn cheap_logits(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 * (8.0 / 16_777_216.0) - 4.0)
        .collect()
}

fn run_gate(b: &Backend, g: &GateInputs, p: &GateParams) {
    let out = is_gate_loss(b, &g.logits, &token_batch(&g.rest), p).unwrap();
    b.synchronize().unwrap();
    std::hint::black_box(out);
}

/// In place: the gradient overwrites the logits (values stay finite, so repeated calls do the
/// same work).
fn run_gate_in_place(b: &Backend, g: &mut GateInputs) {
    let out = is_gate_loss_in_place(
        b,
        &mut g.logits,
        &token_batch(&g.rest),
        &GateParams::default(),
    )
    .unwrap();
    b.synchronize().unwrap();
    std::hint::black_box(out);
}

/// Mean seconds per call over `iters` calls after one warm-up.
fn seconds(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() / iters as f64
}

fn bench_gate(c: &mut Criterion, b: &Backend, name: &str, n: usize, v: usize, dtype: DType) {
    let mut g = gate_inputs(b, n, v, dtype);
    // Bytes it must move: read the logits twice (lse pass, gradient pass), write dlogits once.
    let bytes = 3.0 * (n * v * dtype.size_bytes()) as f64;
    // The plain kernel, the entropy measured (what the learner runs), and the entropy bonus
    // (docs/perf/is_gate_loss.md: the same bytes, a few more flops per element).
    for (variant, entropy) in [("", None), ("entropy/", Some(0.0)), ("bonus/", Some(0.01))] {
        let p = GateParams {
            entropy,
            ..GateParams::default()
        };
        let s = seconds(3, || run_gate(b, &g, &p));
        println!(
            "is_gate_loss {name} {variant}N={n} V={v} {dtype}: {:.2} ms, {:.1} GB/s effective (2 reads + 1 write)",
            s * 1e3,
            bytes / s / 1e9
        );
        c.bench_function(
            &format!("is_gate_loss/{name}/{variant}N{n}xV{v}/{dtype}"),
            |bench| bench.iter(|| run_gate(b, &g, &p)),
        );
    }
    let s = seconds(3, || run_gate_in_place(b, &mut g));
    println!(
        "is_gate_loss {name} in place N={n} V={v} {dtype}: {:.2} ms, {:.1} GB/s effective",
        s * 1e3,
        bytes / s / 1e9
    );
    c.bench_function(
        &format!("is_gate_loss/{name}/in_place/N{n}xV{v}/{dtype}"),
        |bench| bench.iter(|| run_gate_in_place(b, &mut g)),
    );
}

fn bench_sample(c: &mut Criterion, b: &Backend, name: &str, rows: usize, v: usize, dtype: DType) {
    let logits = Tensor::from_f32_as(b, &[rows, v], dtype, &cheap_logits(rows * v)).unwrap();
    let ids: Vec<u64> = (0..rows as u64).collect();
    let ids = Tensor::from_slice(b, &[rows], &ids).unwrap();
    let pos = Tensor::from_slice(b, &[rows], &vec![17i32; rows]).unwrap();
    let p = SampleParams {
        seed: 3,
        ..SampleParams::default()
    };
    let mut run = || {
        let out = sample(b, &logits, &ids, &pos, &p).unwrap();
        b.synchronize().unwrap();
        std::hint::black_box(out);
    };
    // Bytes it must move: one read of the logits (the default path is one fused pass).
    let bytes = (rows * v * dtype.size_bytes()) as f64;
    let s = seconds(3, &mut run);
    println!(
        "sample {name} B={rows} V={v} {dtype} (top_k=0, top_p=1): {:.2} ms, {:.1} GB/s effective (1 read)",
        s * 1e3,
        bytes / s / 1e9
    );
    c.bench_function(&format!("sample/{name}/B{rows}xV{v}/{dtype}"), |bench| {
        bench.iter(&mut run)
    });
}

fn policy(c: &mut Criterion) {
    let cpu = Backend::Cpu;
    bench_gate(c, &cpu, "cpu", 256, 32768, DType::F32);
    bench_sample(c, &cpu, "cpu", 64, 32768, DType::F32);
    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        bench_gate(c, &gpu, "cuda", 8192, 152064, DType::BF16);
        bench_sample(c, &gpu, "cuda", 256, 152064, DType::BF16);
        bench_sample(c, &gpu, "cuda", 256, 152064, DType::F32);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(2));
    targets = policy
}
criterion_main!(benches);
