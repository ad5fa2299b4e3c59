//! One supervised training step (forward, loss, backward into the gradient arena) of the
//! default small config (configs/model/small.toml: d_model 128, 4 layers, 8 experts top-2) at the
//! model issue's shape, 32 sequences of 64 tokens: on the cpu device, and on cuda when a GPU
//! exists (skipped silently otherwise). Prints tokens/s.
//! `cargo bench -p sluice-model --bench train_step`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_model::config::ModelConfig;
use sluice_model::forward::{loss_and_grad, loss_and_grad_on};
use sluice_model::kernels::testing::Rng;
use sluice_model::kernels::{Backend, Device};
use sluice_model::{Model, PackedBatch};
use std::hint::black_box;
use std::time::{Duration, Instant};

const SEQS: usize = 32;
const LEN: usize = 64;

fn bench(c: &mut Criterion) {
    let cfg = ModelConfig::small();
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).expect("model");
    let mut rng = Rng::new(1);
    let seqs: Vec<Vec<i32>> = (0..SEQS)
        .map(|_| (0..LEN).map(|_| rng.below(cfg.vocab) as i32).collect())
        .collect();
    let batch = PackedBatch::pack(&seqs, cfg.vocab).expect("batch");
    let targets: Vec<i32> = (0..batch.len())
        .map(|_| rng.below(cfg.vocab) as i32)
        .collect();
    let mask = vec![1.0f32; batch.len()];
    let tokens = batch.len() as f64;

    // A few timed steps outside criterion for the tokens/s line.
    loss_and_grad(&mut m, &batch, &targets, &mask).expect("step");
    let reps = 3;
    let start = Instant::now();
    for _ in 0..reps {
        black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("step"));
    }
    let s = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "train step, small config, {SEQS} x {LEN} tokens, cpu: {:.1} ms/step, {:.0} tokens/s",
        s * 1e3,
        tokens / s
    );

    let mut g = c.benchmark_group("train_step");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(batch.len() as u64));
    g.bench_function("small_cpu_32x64", |b| {
        b.iter(|| black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("step")))
    });
    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        let mut m = Model::new(cfg.clone(), &gpu).expect("model on cuda");
        let mut step = || {
            let l = loss_and_grad_on(&gpu, &mut m, &batch, &targets, &mask).expect("cuda step");
            gpu.synchronize().expect("sync");
            l
        };
        step();
        let start = Instant::now();
        for _ in 0..reps {
            black_box(step());
        }
        let s = start.elapsed().as_secs_f64() / reps as f64;
        println!(
            "train step, small config, {SEQS} x {LEN} tokens, cuda: {:.1} ms/step, {:.0} tokens/s",
            s * 1e3,
            tokens / s
        );
        g.bench_function("small_cuda_32x64", |b| b.iter(|| black_box(step())));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
