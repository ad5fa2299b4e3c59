//! One supervised training step of the default small config (configs/model/small.toml: d_model
//! 128, 4 layers, 8 experts top-2) at the model issue's shape, 32 sequences of 64 tokens, on the
//! cpu device (and on cuda when a GPU exists; skipped silently otherwise):
//! - `small_cpu_32x64`: forward, loss and backward into the gradient arena;
//! - `small_cpu_32x64_full`: the same plus the optimizer step (Muon with the per-head /
//!   per-expert split + AdamW, clipping): what one step of `sluice sft` costs, and what
//!   scripts/compare-xla.py sets against the XLA peer's one compiled step.
//!
//! Before criterion it prints one JSON line per form from a plain timing loop (median of 7
//! steps). With `SLUICE_PEER_DIR=DIR` it also writes what the peer's numerics check reads
//! (scripts/peer-xla.py check): DIR/model.safetensors (the weights), DIR/batch.safetensors
//! (tokens, targets, mask as [32, 64]) and DIR/sluice.json (the loss of that batch and the
//! global norm of its gradient).
//! `cargo bench -p sluice-model --bench train_step`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_model::config::ModelConfig;
use sluice_model::forward::{loss_and_grad, loss_and_grad_on};
use sluice_model::kernels::io::write_safetensors;
use sluice_model::kernels::testing::Rng;
use sluice_model::kernels::{Backend, Device, Tensor};
use sluice_model::optim::{clip::global_norm, OptimConfig, Optimizer};
use sluice_model::synthetic::{random_tokens, TaskBatch};
use sluice_model::{Model, PackedBatch};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

const SEQS: usize = 32;
const LEN: usize = 64;

/// Median milliseconds of `reps` calls of `f` (after one warm-up call).
fn median_ms(reps: usize, mut f: impl FnMut()) -> (f64, Vec<f64>) {
    f();
    let mut runs: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let shown = runs.clone();
    runs.sort_by(f64::total_cmp);
    (runs[reps / 2], shown)
}

/// Writes the peer's check inputs (see the module documentation) into `dir`.
fn export_for_peer(
    dir: &Path,
    m: &mut Model,
    tokens: &[i32],
    targets: &[i32],
    mask: &[f32],
    batch: &PackedBatch,
) {
    std::fs::create_dir_all(dir).expect("SLUICE_PEER_DIR: create");
    m.save(&dir.join("model.safetensors")).expect("save model");
    let cpu = Backend::Cpu;
    let shape = [SEQS, LEN];
    let t = Tensor::from_slice(&cpu, &shape, tokens).expect("tokens");
    let y = Tensor::from_slice(&cpu, &shape, targets).expect("targets");
    let k = Tensor::from_slice(&cpu, &shape, mask).expect("mask");
    let tensors = [("tokens", &t), ("targets", &y), ("mask", &k)];
    write_safetensors(&dir.join("batch.safetensors"), &tensors, &BTreeMap::new())
        .expect("write batch");
    let loss = loss_and_grad(m, batch, targets, mask).expect("step");
    let norm = global_norm(&cpu, &m.grads).expect("norm");
    let json = format!("{{\"loss\": {loss:.9e}, \"grad_norm\": {norm:.9e}}}\n");
    std::fs::write(dir.join("sluice.json"), json).expect("write sluice.json");
    eprintln!("peer check inputs written to {}", dir.display());
}

fn bench(c: &mut Criterion) {
    let cfg = ModelConfig::small();
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).expect("model");
    let (
        seqs,
        TaskBatch {
            batch,
            targets,
            mask,
        },
    ) = random_tokens(&mut Rng::new(1), cfg.vocab, SEQS, LEN).expect("batch");
    let tokens = batch.len() as f64;
    if let Ok(dir) = std::env::var("SLUICE_PEER_DIR") {
        let flat: Vec<i32> = seqs.concat();
        export_for_peer(Path::new(&dir), &mut m, &flat, &targets, &mask, &batch);
    }

    let cpu = Backend::Cpu;
    let opt = Optimizer::new(&cpu, m.layout().clone(), OptimConfig::default()).expect("optim");
    let mut state = opt.new_state(&cpu).expect("state");
    let (fwd_bwd, runs) = median_ms(7, || {
        black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("step"));
    });
    println!(
        "{{\"what\": \"train_fwd_bwd\", \"form\": \"sluice\", \"batch\": \"{SEQS}x{LEN}\", \"ms\": {fwd_bwd:.3}, \"runs_ms\": {runs:?}}}"
    );
    let (full, runs) = median_ms(7, || {
        black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("step"));
        let Model { params, grads, .. } = &mut m;
        black_box(
            opt.step(&cpu, params, grads, &mut state, None)
                .expect("optim"),
        );
    });
    println!(
        "{{\"what\": \"train\", \"form\": \"sluice\", \"batch\": \"{SEQS}x{LEN}\", \"ms\": {full:.3}, \"runs_ms\": {runs:?}}}"
    );
    eprintln!(
        "train step, small config, {SEQS} x {LEN} tokens, cpu: forward+backward {fwd_bwd:.1} ms \
         ({:.0} tokens/s), with the optimizer {full:.1} ms",
        tokens / fwd_bwd * 1e3
    );

    let mut g = c.benchmark_group("train_step");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(batch.len() as u64));
    g.bench_function("small_cpu_32x64", |b| {
        b.iter(|| black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("step")))
    });
    g.bench_function("small_cpu_32x64_full", |b| {
        b.iter(|| {
            black_box(loss_and_grad(&mut m, &batch, &targets, &mask).expect("step"));
            let Model { params, grads, .. } = &mut m;
            black_box(
                opt.step(&cpu, params, grads, &mut state, None)
                    .expect("optim"),
            )
        })
    });
    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        let mut m = Model::new(cfg.clone(), &gpu).expect("model on cuda");
        let mut step = || {
            let l = loss_and_grad_on(&gpu, &mut m, &batch, &targets, &mask).expect("cuda step");
            gpu.synchronize().expect("sync");
            l
        };
        let (s, _) = median_ms(3, || {
            black_box(step());
        });
        println!(
            "train step, small config, {SEQS} x {LEN} tokens, cuda: {s:.1} ms/step, {:.0} tokens/s",
            tokens / s * 1e3
        );
        g.bench_function("small_cuda_32x64", |b| b.iter(|| black_box(step())));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
