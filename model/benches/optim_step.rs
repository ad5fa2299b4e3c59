//! The optimizer step (Muon with the per-head / per-expert split + AdamW, gradient clipping)
//! of the default small config (configs/model/small.toml) on the cpu device, next to one
//! training step (forward, loss, backward) of the model issue's batch: 32 sequences of 64
//! tokens. Prints both times and the fraction of a full step (train + optimizer) that the
//! optimizer takes, and Muon's Newton-Schulz FLOPs per step.
//! `cargo bench -p sluice-model --bench optim_step`

use criterion::{criterion_group, criterion_main, Criterion};
use sluice_model::config::ModelConfig;
use sluice_model::forward::loss_and_grad;
use sluice_model::kernels::testing::Rng;
use sluice_model::kernels::Backend;
use sluice_model::optim::{OptimConfig, Optimizer};
use sluice_model::synthetic::{random_tokens, TaskBatch};
use sluice_model::Model;
use std::hint::black_box;
use std::time::{Duration, Instant};

const SEQS: usize = 32;
const LEN: usize = 64;

/// FLOPs of `steps` Newton-Schulz steps on one [r, c] block (wide orientation rr <= cw):
/// A = X X^T (2 rr^2 cw), A A (2 rr^3), Bm X (2 rr^2 cw).
fn ns_flops(r: usize, c: usize, steps: usize) -> f64 {
    let (rr, cw) = (r.min(c) as f64, r.max(c) as f64);
    steps as f64 * (4.0 * rr * rr * cw + 2.0 * rr * rr * rr)
}

fn bench(c: &mut Criterion) {
    let be = Backend::Cpu;
    let cfg = ModelConfig::small();
    let mut m = Model::new(cfg.clone(), &be).expect("model");
    let (
        _,
        TaskBatch {
            batch,
            targets,
            mask,
        },
    ) = random_tokens(&mut Rng::new(1), cfg.vocab, SEQS, LEN).expect("batch");
    let opt = Optimizer::new(&be, m.layout().clone(), OptimConfig::default()).expect("optimizer");
    let mut state = opt.new_state(&be).expect("state");
    let flops: f64 = opt
        .muon_shapes()
        .iter()
        .map(|&(r, c, n)| n as f64 * ns_flops(r, c, opt.config().muon.ns_steps))
        .sum();

    // A few timed steps outside criterion for the summary line.
    loss_and_grad(&mut m, &batch, &targets, &mask).expect("train step");
    opt.step(&be, &mut m.params, &m.grads, &mut state, None)
        .expect("optimizer step");
    let reps = 5;
    let start = Instant::now();
    for _ in 0..reps {
        black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("train step"));
    }
    let train = start.elapsed().as_secs_f64() / reps as f64;
    let start = Instant::now();
    for _ in 0..reps {
        black_box(
            opt.step(&be, &mut m.params, &m.grads, &mut state, None)
                .expect("optimizer step"),
        );
    }
    let step = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "small config, cpu: train step ({SEQS} x {LEN} tokens) {:.1} ms, optimizer step {:.2} ms \
         = {:.1}% of train + optimizer; {} params, Muon groups {:?}, Newton-Schulz {:.2} GFLOP \
         per step ({:.1} GFLOP/s)",
        train * 1e3,
        step * 1e3,
        100.0 * step / (train + step),
        m.layout().param_count(),
        opt.muon_shapes(),
        flops / 1e9,
        flops / step / 1e9
    );

    let mut g = c.benchmark_group("optim_step");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1));
    g.bench_function("optimizer_step_small_cpu", |b| {
        b.iter(|| {
            black_box(
                opt.step(&be, &mut m.params, &m.grads, &mut state, None)
                    .expect("optimizer step"),
            )
        })
    });
    g.bench_function("train_step_small_cpu_32x64", |b| {
        b.iter(|| black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("train step")))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
