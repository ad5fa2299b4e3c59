//! bf16 against f32 on the cpu device, side by side in one run (docs/perf/precision.md):
//! - the train step of the small config (configs/model/small.toml) at 32 sequences x 64 tokens:
//!   forward, loss and backward, and the same plus the optimizer step (in bf16 the step also
//!   refreshes the bf16 compute copy);
//! - the rollout engine's decode step at batch 16 (contexts 17..80 tokens): f32 weights and KV
//!   cache against the bf16 compute copy and a bf16 KV cache.
//!
//! The two precisions are timed alternately, run after run (median of 7 each), so load on a
//! shared machine hits both alike. One JSON line per form; no criterion statistics (a step is
//! 0.1-1 s, and the alternation is the point).
//! `cargo bench -p sluice-runtime --bench precision`

use sluice_kernels::testing::Rng;
use sluice_kernels::Backend;
use sluice_model::forward::loss_and_grad;
use sluice_model::optim::{OptimConfig, Optimizer};
use sluice_model::synthetic::{random_tokens, TaskBatch};
use sluice_model::{Model, ModelConfig, Precision};
use sluice_runtime::engine::{Engine, EngineConfig, Request};
use sluice_runtime::trajectory::WeightVersion;
use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

const SEQS: usize = 32;
const LEN: usize = 64;
const REPS: usize = 7;
const DECODE_BATCH: usize = 16;
const PROMPT: usize = 16;
const DECODE_STEPS: usize = 64;

fn small(precision: Precision) -> Model {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/model/small.toml");
    let cfg = ModelConfig::from_file(&path).expect("configs/model/small.toml");
    let mut m = Model::new(cfg, &Backend::Cpu).expect("model");
    m.set_precision(&Backend::Cpu, precision)
        .expect("precision");
    m
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(what: &str, runs: &[(Precision, Vec<f64>)]) {
    let mut medians = Vec::new();
    for (p, r) in runs {
        let ms = median(r.clone());
        medians.push(ms);
        println!("{{\"what\": \"{what}\", \"precision\": \"{p}\", \"ms\": {ms:.3}, \"runs_ms\": {r:.2?}}}");
    }
    eprintln!(
        "{what}: f32 {:.2} ms, bf16 {:.2} ms (bf16 / f32 = {:.2})",
        medians[0],
        medians[1],
        medians[1] / medians[0]
    );
}

fn train() {
    let precisions = [Precision::F32, Precision::Bf16];
    let mut models: Vec<Model> = precisions.iter().map(|&p| small(p)).collect();
    let cfg = models[0].config.clone();
    let (
        _,
        TaskBatch {
            batch,
            targets,
            mask,
        },
    ) = random_tokens(&mut Rng::new(1), cfg.vocab, SEQS, LEN).expect("batch");
    let cpu = Backend::Cpu;
    let opt = Optimizer::new(&cpu, models[0].layout().clone(), OptimConfig::default())
        .expect("optimizer");
    let mut states: Vec<_> = precisions
        .iter()
        .map(|_| opt.new_state(&cpu).expect("state"))
        .collect();
    let mut fwd_bwd: Vec<Vec<f64>> = vec![Vec::new(); 2];
    let mut full: Vec<Vec<f64>> = vec![Vec::new(); 2];
    for rep in 0..=REPS {
        for (i, m) in models.iter_mut().enumerate() {
            let t = Instant::now();
            black_box(loss_and_grad(m, &batch, &targets, &mask).expect("step"));
            let a = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            black_box(loss_and_grad(m, &batch, &targets, &mask).expect("step"));
            let Model {
                params,
                grads,
                compute,
                ..
            } = m;
            black_box(
                opt.step(&cpu, params, grads, &mut states[i], compute.as_mut())
                    .expect("optimizer step"),
            );
            let b = t.elapsed().as_secs_f64() * 1e3;
            if rep > 0 {
                fwd_bwd[i].push(a);
                full[i].push(b);
            }
        }
    }
    let zip = |v: Vec<Vec<f64>>| -> Vec<(Precision, Vec<f64>)> {
        precisions.iter().copied().zip(v).collect()
    };
    report(&format!("train_fwd_bwd {SEQS}x{LEN}"), &zip(fwd_bwd));
    report(&format!("train_step {SEQS}x{LEN}"), &zip(full));
}

fn prompt(i: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((i * 131 + j * 17 + 3) % vocab) as u32)
        .collect()
}

/// An engine in `m`'s precision with `DECODE_BATCH` sequences prefilled and decoding.
fn warmed(m: &Model) -> Engine {
    let p = m.precision();
    let blocks = DECODE_BATCH * (PROMPT + DECODE_STEPS + 2).div_ceil(16) + 4;
    let cfg = EngineConfig {
        kv_bytes: EngineConfig::kv_bytes_for_blocks(&m.config, p, 16, blocks),
        block_size: 16,
        max_batch_tokens: 8192,
        max_seqs: DECODE_BATCH,
        precision: p,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(
        Backend::Cpu,
        &m.config,
        m.compute_weights(),
        WeightVersion(0),
        cfg,
    )
    .expect("engine");
    for i in 0..DECODE_BATCH {
        let r = Request::new(&format!("s{i}"), prompt(i, PROMPT, m.config.vocab), 1 << 20);
        e.submit(r).expect("submit");
    }
    e.step().expect("prefill step");
    e
}

fn decode() {
    let precisions = [Precision::F32, Precision::Bf16];
    let models: Vec<Model> = precisions.iter().map(|&p| small(p)).collect();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); 2];
    for rep in 0..=REPS {
        for (i, m) in models.iter().enumerate() {
            let mut e = warmed(m);
            let t = Instant::now();
            for _ in 0..DECODE_STEPS {
                black_box(e.step().expect("decode step"));
            }
            if rep > 0 {
                runs[i].push(t.elapsed().as_secs_f64() * 1e3 / DECODE_STEPS as f64);
            }
        }
    }
    let runs: Vec<(Precision, Vec<f64>)> = precisions.iter().copied().zip(runs).collect();
    report(&format!("decode_step batch {DECODE_BATCH}"), &runs);
}

fn main() {
    // `cargo bench --bench precision -- train` (or `decode`) runs one half; anything else both.
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    if filter != "decode" {
        train();
    }
    if filter != "train" {
        decode();
    }
}
