//! Rollout engine benches on CPU (docs/perf/rollout.md):
//! - decode throughput (tokens/s) against batch size 1, 4, 16, 64 for the default small model
//!   (configs/model/small.toml): B sequences already prefilled, each step decodes one token
//!   for each (contexts 17..80 tokens);
//! - prefix sharing for a GRPO group of G = 8 on a 64-token prompt: prefill tokens computed
//!   and FLOPs saved, counted from the engine's and the block manager's counters, for the
//!   group path (prefill once, fork 8 ways) and the prefix-cache path (8 separate requests
//!   with the same prompt), plus their wall time against 8 unshared prefills.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sluice_kernels::Backend;
use sluice_model::infer::token_flops;
use sluice_model::{Model, ModelConfig, Precision};
use sluice_runtime::engine::{Engine, EngineConfig, Request};
use sluice_runtime::trajectory::WeightVersion;
use std::path::Path;
use std::time::{Duration, Instant};

const PROMPT: usize = 16;
/// Decode steps timed per engine (then a fresh one, so contexts stay within 17..80).
const STEPS: u64 = 64;

fn small() -> Model {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/model/small.toml");
    let cfg = ModelConfig::from_file(&path).expect("configs/model/small.toml");
    Model::new(cfg, &Backend::Cpu).expect("model")
}

fn engine(m: &Model, max_seqs: usize, num_blocks: usize) -> Engine {
    let cfg = EngineConfig {
        kv_bytes: EngineConfig::kv_bytes_for_blocks(&m.config, Precision::F32, 16, num_blocks),
        block_size: 16,
        max_batch_tokens: 8192,
        max_seqs,
        ..EngineConfig::default()
    };
    Engine::new(Backend::Cpu, &m.config, &m.params, WeightVersion(0), cfg).expect("engine")
}

fn prompt(i: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((i * 131 + j * 17 + 3) % vocab) as u32)
        .collect()
}

/// An engine with `b` sequences prefilled (one step) and decoding.
fn warmed(m: &Model, b: usize) -> Engine {
    let blocks = b * (PROMPT + STEPS as usize + 2).div_ceil(16) + 4;
    let mut e = engine(m, b, blocks);
    for i in 0..b {
        let r = Request::new(&format!("s{i}"), prompt(i, PROMPT, m.config.vocab), 1 << 20);
        e.submit(r).expect("submit");
    }
    e.step().expect("prefill step");
    e
}

/// This process's user and system CPU seconds so far (Linux: /proc/self/stat, 100 ticks per
/// second; zeros elsewhere).
fn cpu_times() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    match f.as_slice() {
        [u, s] => (u / 100.0, s / 100.0),
        _ => (0.0, 0.0),
    }
}

/// Median time of one decode step at batch `b` (`reps` fresh engines, 64 steps each), every
/// run's time, and the user and system CPU seconds of the timed steps together.
fn decode_step_ms(m: &Model, b: usize, reps: usize) -> (f64, Vec<f64>, (f64, f64)) {
    let (mut user, mut sys) = (0.0, 0.0);
    let mut runs: Vec<f64> = (0..reps)
        .map(|_| {
            let mut e = warmed(m, b);
            let (u0, s0) = cpu_times();
            let t = Instant::now();
            for _ in 0..STEPS {
                std::hint::black_box(e.step().expect("step"));
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / STEPS as f64;
            let (u1, s1) = cpu_times();
            (user, sys) = (user + u1 - u0, sys + s1 - s0);
            ms
        })
        .collect();
    let shown = runs.clone();
    runs.sort_by(f64::total_cmp);
    (runs[runs.len() / 2], shown, (user, sys))
}

fn decode(c: &mut Criterion) {
    let m = small();
    // One JSON line per batch size from a plain timing loop (what scripts/compare-xla.py reads;
    // run the binary with a filter that matches no criterion bench to get only these).
    // SLUICE_DECODE_BATCHES=64 (a comma list) times only those batch sizes.
    let batches: Vec<usize> = std::env::var("SLUICE_DECODE_BATCHES")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 16, 64]);
    for b in batches {
        let (ms, runs, (user, sys)) = decode_step_ms(&m, b, 5);
        println!(
            "{{\"what\": \"decode\", \"form\": \"sluice\", \"batch\": {b}, \"ms\": {ms:.4}, \"runs_ms\": {runs:?}, \"user_s\": {user:.2}, \"sys_s\": {sys:.2}}}"
        );
    }
    let mut g = c.benchmark_group("rollout_decode_cpu_small");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for b in [1usize, 4, 16, 64] {
        g.throughput(Throughput::Elements(b as u64));
        g.bench_function(BenchmarkId::new("batch", b), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let mut e = warmed(&m, b);
                    let n = (iters - done).min(STEPS);
                    let t = Instant::now();
                    for _ in 0..n {
                        let ev = e.step().expect("step");
                        std::hint::black_box(ev);
                    }
                    total += t.elapsed();
                    done += n;
                }
                total
            })
        });
    }
    g.finish();
}

fn prefix_sharing(c: &mut Criterion) {
    const G: usize = 8;
    const LEN: usize = 64;
    let m = small();
    let p = prompt(0, LEN, m.config.vocab);
    let flops = |positions: std::ops::Range<usize>| -> u64 {
        positions.map(|q| token_flops(&m.config, q)).sum()
    };
    let full = flops(0..LEN);
    // Group path: one request of G samples.
    let mut e = engine(&m, 64, 64);
    let mut r = Request::new("g", p.clone(), 1);
    r.group_size = G as u32;
    e.submit(r).expect("submit");
    e.run_until_idle().expect("run");
    let group = e.stats();
    // Prefix-cache path: G separate requests with the same prompt, one after another.
    let mut e = engine(&m, 64, 64);
    for i in 0..G {
        e.submit(Request::new(&format!("c{i}"), p.clone(), 1))
            .expect("submit");
        e.run_until_idle().expect("run");
    }
    let cache = e.stats();
    let hit = cache.kv.prefix_hit_tokens as usize;
    let per_req_hit = hit / (G - 1);
    eprintln!(
        "prefix sharing, G = {G}, {LEN}-token prompt, block 16, small model: unshared prefill {} tokens = {:.3} GFLOP",
        G * LEN,
        (G as u64 * full) as f64 / 1e9
    );
    eprintln!(
        "  group (prefill once, fork): {} prefill tokens computed, {} saved = {:.3} GFLOP saved ({:.1}%)",
        group.prefill_tokens,
        G * LEN - group.prefill_tokens as usize,
        ((G as u64 - 1) * full) as f64 / 1e9,
        100.0 * (G - 1) as f64 / G as f64
    );
    eprintln!(
        "  prefix cache (separate requests): {} prefix-hit tokens (block manager), {} computed, {:.3} GFLOP saved ({:.1}%)",
        hit,
        cache.prefill_tokens,
        ((G as u64 - 1) * flops(0..per_req_hit)) as f64 / 1e9,
        100.0 * ((G as u64 - 1) * flops(0..per_req_hit)) as f64 / (G as u64 * full) as f64
    );
    let mut g = c.benchmark_group("rollout_prefill_g8_cpu_small");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    g.bench_function("group_fork", |bench| {
        bench.iter(|| {
            let mut e = engine(&m, 64, 64);
            let mut r = Request::new("g", p.clone(), 1);
            r.group_size = G as u32;
            e.submit(r).expect("submit");
            e.run_until_idle().expect("run")
        })
    });
    g.bench_function("unshared", |bench| {
        bench.iter(|| {
            let mut e = engine(&m, 64, 64);
            for i in 0..G {
                e.submit(Request::new(
                    &format!("u{i}"),
                    prompt(i, LEN, m.config.vocab),
                    1,
                ))
                .expect("submit");
            }
            e.run_until_idle().expect("run")
        })
    });
    g.finish();
}

criterion_group!(benches, decode, prefix_sharing);
criterion_main!(benches);
