//! The RL system end to end on the tiny model (DESIGN 6): crash injection never reaches the
//! loss, backpressure holds at every event, zero-lag tokens match bit for bit (cpu and emu),
//! share correction, a thousand concurrent sessions without a thread each, and the sync mode.

mod stage;

use sluice_kernels::{Backend, Device};
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig, Precision};
use sluice_runtime::buffer::{BufferConfig, DataBuffer, ReadyGroup};
use sluice_runtime::clock::{ClockMode, CostModel, Micros};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::env::faults::FaultRates;
use sluice_runtime::env::latency::LatencyModel;
use sluice_runtime::env::synthetic::{Lookup, Recall};
use sluice_runtime::env::Task;
use sluice_runtime::health::HealthConfig;
use sluice_runtime::learner::{Learner, LearnerConfig, StepReport};
use sluice_runtime::metrics::LearnerTotals;
use sluice_runtime::orchestrator::{Orchestrator, RolloutPolicy, TaskSpec};
use sluice_runtime::sync::SyncOptions;
use sluice_runtime::system::{
    run_stage, Mode, Parts, RunError, StageConfig, StageObserver, StageReport, StageStart, Tick,
};
use sluice_runtime::trajectory::{SamplingParams, TerminalReason, WeightVersion};
use std::sync::Arc;

const VOCAB: usize = 16;

fn backend(device: Device) -> Backend {
    match device {
        Device::Emu => Backend::emu_with_seed(1),
        _ => Backend::Cpu,
    }
}

fn task_spec(task: Arc<dyn Task>, latency: LatencyModel, faults: FaultRates) -> TaskSpec {
    TaskSpec {
        task,
        concurrency: 4096,
        timeout: Micros::from_secs(10.0),
        retries: 0,
        target_share: 1.0,
        latency,
        faults,
    }
}

fn recall() -> Arc<dyn Task> {
    Arc::new(Recall::new("recall", VOCAB, 3).unwrap())
}

fn lookup() -> Arc<dyn Task> {
    Arc::new(Lookup::new("lookup", VOCAB).unwrap())
}

struct Setup {
    device: Device,
    tasks: Vec<TaskSpec>,
    group_size: u32,
    groups_per_step: usize,
    eta: u64,
    tau: u64,
    steps: u64,
    mode: Mode,
    temperature: f32,
    share_correction: bool,
    max_seqs: usize,
    seed: u64,
}

impl Setup {
    fn new(tasks: Vec<TaskSpec>) -> Setup {
        Setup {
            device: Device::Cpu,
            tasks,
            group_size: 4,
            groups_per_step: 4,
            eta: 1,
            tau: 4,
            steps: 12,
            mode: Mode::Async,
            temperature: 1.0,
            share_correction: true,
            max_seqs: 64,
            seed: 11,
        }
    }

    fn run(&self, observer: &mut dyn StageObserver) -> StageReport {
        let mut cfg = ModelConfig::tiny();
        cfg.vocab = VOCAB;
        cfg.init_std = 0.15;
        let be = backend(self.device);
        let model = Model::new(cfg.clone(), &be).unwrap();
        let engine_cfg = EngineConfig {
            kv_bytes: EngineConfig::kv_bytes_for_blocks(&cfg, Precision::F32, 16, 4096),
            max_seqs: self.max_seqs,
            ..EngineConfig::default()
        };
        let engine = Engine::new(
            backend(self.device),
            &cfg,
            &model.params,
            WeightVersion(0),
            engine_cfg,
        )
        .unwrap();
        let mut oc = OptimConfig::default();
        oc.muon.lr = 0.01;
        oc.adamw.lr = 0.01;
        let learner = Learner::new(be, model, oc, LearnerConfig::default(), 0).unwrap();
        let policy = RolloutPolicy {
            group_size: self.group_size,
            sampling: SamplingParams {
                temperature: self.temperature,
                max_new_tokens: 4,
                seed: self.seed,
                ..SamplingParams::default()
            },
            max_turns: 3,
            share_correction: self.share_correction,
            seed: self.seed,
            vocab: VOCAB,
            max_observation_tokens: 32,
        };
        let orch = Orchestrator::new(self.tasks.clone(), policy, 0).unwrap();
        let buffer = DataBuffer::new(BufferConfig {
            group_size: self.group_size,
            tau: self.tau,
            env_gate: true,
            dynamic_sampling: None,
        });
        let stage = StageConfig {
            name: "rl".into(),
            mode: self.mode,
            clock: ClockMode::Virtual,
            steps: self.steps,
            groups_per_step: self.groups_per_step,
            eta: self.eta,
            sync_interval: 1,
            reset_optimizer: false,
            cost: CostModel::default(),
            barrier_every: None,
            sync: SyncOptions::default(),
            health: HealthConfig::default(),
            over_sampling: None,
            servers: Vec::new(),
            pin_lanes: false,
        };
        let start = StageStart {
            clock: Micros(0),
            stage_began: Micros(0),
            totals: LearnerTotals::new(),
            engine_weights: Arc::new(learner.publish().unwrap()),
        };
        let (_parts, _orch, _buffer, report) = run_stage(
            &stage,
            Parts {
                learner,
                engines: vec![engine],
            },
            orch,
            buffer,
            start,
            observer,
        )
        .unwrap();
        report
    }
}

/// Records what the learner was given and every tick.
#[derive(Default)]
struct Recorder {
    batches: Vec<Vec<ReadyGroup>>,
    ticks: Vec<Tick>,
    lines: Vec<serde_json::Value>,
    threads_max: usize,
}

fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Threads:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

impl StageObserver for Recorder {
    fn on_step(&mut self, line: &serde_json::Value, _r: &StepReport) -> Result<(), String> {
        self.lines.push(line.clone());
        Ok(())
    }
    fn on_learner_batch(&mut self, groups: &[ReadyGroup]) {
        self.batches.push(groups.to_vec());
    }
    fn on_tick(&mut self, tick: &Tick) {
        self.ticks.push(*tick);
        if self.ticks.len().is_multiple_of(64) {
            self.threads_max = self.threads_max.max(threads());
        }
    }
}

#[test]
fn crashing_environments_never_reach_the_loss() {
    let crash = 0.2;
    let mut s = Setup::new(vec![task_spec(
        recall(),
        LatencyModel::LogNormal {
            median_ms: 30.0,
            p99_ms: 600.0,
        },
        FaultRates {
            crash,
            ..FaultRates::default()
        },
    )]);
    s.steps = 40;
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    // Training proceeded.
    assert_eq!(report.learner.steps, 40);
    assert_eq!(rec.batches.len(), 40);
    // Checked on the loss inputs: no `environment` trajectory was ever given to the learner.
    let trained: usize = rec.batches.iter().flatten().map(|g| g.samples.len()).sum();
    assert_eq!(trained, 40 * 4 * 4);
    for g in rec.batches.iter().flatten() {
        for smp in &g.samples {
            assert_ne!(smp.terminal_reason, TerminalReason::Environment);
        }
    }
    // The environment gate's drop rate matches the injected per-trajectory rate (one call per
    // single-turn trajectory, no retries): within 4 standard errors.
    let b = report.buffer;
    assert!(b.env_dropped > 0);
    let n = b.trajectories_in as f64;
    let rate = b.env_dropped as f64 / n;
    let se = (crash * (1.0 - crash) / n).sqrt();
    assert!(
        (rate - crash).abs() < 4.0 * se,
        "env drop rate {rate:.3} over {n} trajectories vs injected {crash}"
    );
    // Accounting: with no retries every crash ended one trajectory as `environment`, and the
    // gate dropped each of those that reached a gated group.
    let crashes = report.rollout.env_faults.get("crash").copied().unwrap_or(0);
    let env_ended = report
        .rollout
        .by_terminal
        .get("environment")
        .copied()
        .unwrap_or(0);
    assert_eq!(crashes, env_ended);
    assert!(b.env_dropped <= env_ended && env_ended - b.env_dropped <= 4 * 4);
}

#[test]
fn rollout_never_runs_more_than_eta_steps_ahead() {
    for eta in [0u64, 2] {
        let mut s = Setup::new(vec![task_spec(
            lookup(),
            LatencyModel::LogNormal {
                median_ms: 50.0,
                p99_ms: 2000.0,
            },
            FaultRates::default(),
        )]);
        s.eta = eta;
        s.tau = 100;
        s.steps = 15;
        let mut rec = Recorder::default();
        let report = s.run(&mut rec);
        assert_eq!(report.learner.steps, 15);
        assert!(rec.ticks.len() > 100, "{} ticks", rec.ticks.len());
        // No group was dropped here, so AReaL's rule holds exactly, at every event.
        assert_eq!(report.buffer.groups_dropped, 0);
        let mut reached = false;
        for t in &rec.ticks {
            let limit = (t.learner_steps + eta + 1) * t.per_step;
            assert!(
                t.started <= limit,
                "eta {eta}: {} started with {} learner steps done (limit {limit})",
                t.started,
                t.learner_steps
            );
            reached |= t.started == limit;
        }
        assert!(
            reached,
            "eta {eta}: the bound was never reached (the test saw no pressure)"
        );
    }
}

#[test]
fn backpressure_counts_dropped_groups_back() {
    // With crashes, groups get dropped; the admission rule gives their room back (else the
    // run would deadlock) and still never exceeds the bound net of them.
    let mut s = Setup::new(vec![task_spec(
        recall(),
        LatencyModel::Fixed { ms: 20.0 },
        FaultRates {
            crash: 0.45,
            ..FaultRates::default()
        },
    )]);
    s.steps = 10;
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    assert_eq!(report.learner.steps, 10);
    assert!(report.buffer.groups_dropped > 0);
    for t in &rec.ticks {
        assert!(t.started - t.discarded <= (t.learner_steps + t.eta + 1) * t.per_step);
    }
}

fn zero_lag_run(device: Device) {
    // Groups, multi-turn episodes (lookup), several publications (K = 1, 8 steps), temperature
    // != 1, several sequences per learner micro-batch, lag 0 and lag 1 tokens mixed.
    let mut s = Setup::new(vec![
        task_spec(
            recall(),
            LatencyModel::Fixed { ms: 10.0 },
            FaultRates::default(),
        ),
        task_spec(
            lookup(),
            LatencyModel::LogNormal {
                median_ms: 20.0,
                p99_ms: 400.0,
            },
            FaultRates::default(),
        ),
    ]);
    s.device = device;
    s.temperature = 0.7;
    s.steps = 8;
    s.eta = 1;
    s.tasks[0].target_share = 0.5;
    s.tasks[1].target_share = 0.5;
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    let l = &report.learner;
    assert_eq!(l.steps, 8);
    assert!(report.publications >= 8);
    assert!(
        l.zero_lag_tokens >= 100,
        "{device}: {} zero-lag tokens",
        l.zero_lag_tokens
    );
    assert_eq!(
        l.zero_lag_mismatch_tokens, 0,
        "{device}: bit mismatch at lag 0"
    );
    // Stale tokens were trained too (async): the ratio measures staleness only.
    assert!(
        l.lag_hist.len() >= 2 && l.lag_hist[1] > 0,
        "{:?}",
        l.lag_hist
    );
    // Multi-turn episodes reached the learner.
    let multi = rec
        .batches
        .iter()
        .flatten()
        .flat_map(|g| &g.samples)
        .filter(|s| !s.turns.is_empty())
        .count();
    assert!(multi > 0);
    let last = rec.lines.last().unwrap();
    assert_eq!(last["zero_lag_mismatch_tokens"], 0);

    // Mismatch telemetry split by lag: every trained token in one of the two sets, lag 0
    // exactly 0, lag > 0 a real, finite, non-negative drift.
    let (z, p) = (&l.mismatch_lag0, &l.mismatch_lagpos);
    assert_eq!(
        z.tokens + p.tokens,
        l.masked_tokens,
        "{device}: {z:?} {p:?}"
    );
    assert!(z.tokens >= 100, "{device}: {} lag-0 tokens", z.tokens);
    assert_eq!(z.abs_diff_max, 0.0, "{device}: lag-0 logp differs: {z:?}");
    assert_eq!(z.abs_diff_sum, 0.0, "{device}: {z:?}");
    assert_eq!(z.k3_sum, 0.0, "{device}: {z:?}");
    assert!(p.tokens > 0, "{device}: no lag > 0 tokens");
    for x in [p.abs_diff_sum, p.abs_diff_max, p.k3_sum] {
        assert!(x.is_finite() && x >= 0.0, "{device}: lag > 0: {p:?}");
    }
    // The weights moved between versions: stale tokens' logps differ.
    assert!(p.abs_diff_max > 0.0 && p.k3_sum > 0.0, "{device}: {p:?}");
    assert!(p.abs_diff_mean() <= p.abs_diff_max);
    // The metrics lines carry each step's share; their sums are the stage's totals.
    let sum = |key: &str| -> u64 { rec.lines.iter().map(|v| v[key].as_u64().unwrap()).sum() };
    assert_eq!(sum("mismatch.lag0.tokens"), z.tokens);
    assert_eq!(sum("mismatch.lagpos.tokens"), p.tokens);
    let mut lagpos_max = 0.0f64;
    for v in &rec.lines {
        let f = |key: &str| v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"));
        assert_eq!(f("mismatch.lag0.abs_diff_max"), 0.0);
        assert_eq!(f("mismatch.lag0.k3_kl"), 0.0);
        assert!(f("mismatch.lagpos.k3_kl") >= 0.0);
        assert!(f("mismatch.lagpos.abs_diff_mean") <= f("mismatch.lagpos.abs_diff_max"));
        lagpos_max = lagpos_max.max(f("mismatch.lagpos.abs_diff_max"));
        let (clip, low, high, acc) = (
            f("is_clip_fraction"),
            f("is_gated_low_fraction"),
            f("is_gated_high_fraction"),
            f("is_accepted_fraction"),
        );
        assert!((0.0..=1.0).contains(&clip), "{v}");
        assert!((low + high - clip).abs() < 1e-12, "{v}");
        assert!((clip + acc - 1.0).abs() < 1e-12, "{v}");
    }
    assert_eq!(lagpos_max, p.abs_diff_max);
    assert!(l.gated_low + l.gated_high <= l.masked_tokens);
}

#[test]
fn zero_lag_tokens_match_bit_for_bit_on_cpu() {
    zero_lag_run(Device::Cpu);
}

#[test]
fn zero_lag_tokens_match_bit_for_bit_on_emu() {
    zero_lag_run(Device::Emu);
}

fn share_run(correction: bool) -> (f64, StageReport) {
    let mut fast = task_spec(
        recall(),
        LatencyModel::Fixed { ms: 5.0 },
        FaultRates::default(),
    );
    let mut slow = task_spec(
        lookup(),
        LatencyModel::Fixed { ms: 600.0 },
        FaultRates::default(),
    );
    fast.target_share = 0.5;
    slow.target_share = 0.5;
    fast.concurrency = 32;
    slow.concurrency = 32;
    let mut s = Setup::new(vec![fast, slow]);
    s.share_correction = correction;
    s.steps = 40;
    s.eta = 3;
    s.tau = 100;
    let report = s.run(&mut Recorder::default());
    let fast_share = report.learner.share("recall");
    (fast_share, report)
}

#[test]
fn share_correction_brings_a_slow_task_to_its_target() {
    let (uncorrected, r0) = share_run(false);
    let (corrected, r1) = share_run(true);
    println!("fast-task learner share: uncorrected {uncorrected:.3}, corrected {corrected:.3}");
    // The skew is visible without correction, and reported per task...
    assert!(
        uncorrected > 0.6,
        "uncorrected fast-task share {uncorrected:.3}: expected the fast task to crowd out"
    );
    assert_eq!(r0.tasks.len(), 2);
    // ...and corrected to within 5 points of the 1:1 target.
    assert!(
        (corrected - 0.5).abs() <= 0.05,
        "corrected fast-task share {corrected:.3}"
    );
    let slow = &r1.tasks.iter().find(|t| t.0 == "lookup").unwrap().2;
    let fast = &r1.tasks.iter().find(|t| t.0 == "recall").unwrap().2;
    assert!(slow.mean_completion_s() > 10.0 * fast.mean_completion_s());
}

#[test]
fn a_thousand_sessions_without_a_thread_each() {
    let mut t = task_spec(
        lookup(),
        LatencyModel::Fixed { ms: 3000.0 },
        FaultRates::default(),
    );
    t.concurrency = 4096;
    let mut s = Setup::new(vec![t]);
    s.group_size = 8;
    s.groups_per_step = 8;
    s.eta = 20;
    s.tau = 100;
    s.steps = 3;
    s.max_seqs = 512;
    let before = threads();
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    assert_eq!(report.learner.steps, 3);
    let peak = rec.ticks.iter().map(|t| t.in_flight).max().unwrap_or(0);
    assert!(peak >= 1000, "peak concurrent sessions {peak}");
    // Sessions are records and timers, not threads (the rayon pool may start its workers).
    assert!(
        rec.threads_max <= before + 4,
        "threads: {before} before, {} during the run",
        rec.threads_max
    );
}

#[test]
fn sync_mode_trains_on_whole_batches_at_lag_zero() {
    let mut s = Setup::new(vec![task_spec(
        lookup(),
        LatencyModel::LogNormal {
            median_ms: 50.0,
            p99_ms: 2000.0,
        },
        FaultRates::default(),
    )]);
    s.mode = Mode::Sync;
    s.steps = 5;
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    assert_eq!(report.learner.steps, 5);
    // Every token trained at lag 0: rollout of a batch, train, publish, repeat.
    assert_eq!(report.learner.lag_hist.len(), 1);
    assert!(report.learner.zero_lag_tokens > 0);
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
    for b in &rec.batches {
        assert_eq!(b.len(), 4, "a sync batch is groups_per_step groups");
    }
    // A replay's rates are per virtual second, and say so.
    assert!(rec.lines.iter().all(|l| l["clock"] == "virtual"));
}

/// Sync mode with a batch bigger than the tasks' concurrency: admission tops the batch up as
/// groups finish, so every step still trains groups_per_step groups (not just the first
/// concurrency's worth), all of them at lag 0.
#[test]
fn sync_mode_tops_up_a_batch_larger_than_the_concurrency() {
    let mut recall = task_spec(
        recall(),
        LatencyModel::Fixed { ms: 5.0 },
        FaultRates::default(),
    );
    let mut lookup = task_spec(
        lookup(),
        LatencyModel::Fixed { ms: 20.0 },
        FaultRates::default(),
    );
    // One group of G = 4 in flight per task at a time; the batch is 8 groups.
    recall.concurrency = 4;
    lookup.concurrency = 4;
    recall.target_share = 0.5;
    lookup.target_share = 0.5;
    let mut s = Setup::new(vec![recall, lookup]);
    s.mode = Mode::Sync;
    s.groups_per_step = 8;
    s.steps = 3;
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    assert_eq!(report.learner.steps, 3);
    assert_eq!(rec.batches.len(), 3);
    for b in &rec.batches {
        assert_eq!(
            b.len(),
            8,
            "a sync batch is groups_per_step groups, whatever the concurrency"
        );
        assert!(b.iter().all(|g| g.samples.len() == 4));
    }
    assert_eq!(report.learner.samples, 3 * 8 * 4);
    // Never more than the concurrency in flight.
    assert!(rec.ticks.iter().all(|t| t.in_flight <= 8));
    assert_eq!(report.learner.lag_hist.len(), 1, "every token at lag 0");
    assert!(report.learner.zero_lag_tokens >= 3 * 8 * 4);
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
}

/// GRPO advantages are normalised within a group: with G = 1 every advantage is 0 and nothing
/// would be trained while the throughput looked fine. The stage refuses to start.
#[test]
fn a_group_of_one_is_refused_before_the_stage_starts() {
    let mut s = stage::Setup::new(stage::both_tasks(5.0));
    s.group_size = 1;
    let mut rec = stage::Recorder::default();
    match s.try_run(&mut rec) {
        Err(RunError::Config(m)) => assert!(m.contains("buffer.group_size"), "{m}"),
        Err(e) => panic!("expected a config error, got {e}"),
        Ok((report, _)) => panic!(
            "the stage ran {} steps on zero advantages",
            report.learner.steps
        ),
    }
    assert!(rec.lines.is_empty(), "no learner step");
}

/// Gradient-carrying throughput counts exactly the accepted tokens of trajectories whose
/// advantage is not 0. In sync mode every token is trained at lag 0 with ratio 1, so the gate
/// accepts every masked token: the count is the masked tokens of unique trajectories with a
/// non-zero advantage, recomputed here from the batches the learner was given.
#[test]
fn gradient_tokens_count_only_tokens_with_a_nonzero_advantage() {
    let mut s = Setup::new(vec![task_spec(
        lookup(),
        LatencyModel::Fixed { ms: 10.0 },
        FaultRates::default(),
    )]);
    s.mode = Mode::Sync;
    s.steps = 6;
    let mut rec = Recorder::default();
    let report = s.run(&mut rec);
    assert_eq!(report.learner.steps, 6);
    assert_eq!(report.learner.lag_hist.len(), 1, "sync mode: lag 0 only");
    let (mut masked, mut with_gradient, mut flat_groups) = (0u64, 0u64, 0);
    for g in rec.batches.iter().flatten() {
        let adv = sluice_runtime::learner::advantages(&g.samples, false, 1e-6);
        if adv.iter().all(|&a| a == 0.0) {
            flat_groups += 1;
        }
        let unique = g.samples.len() - g.duplicated;
        for (smp, a) in g.samples.iter().zip(adv).take(unique) {
            let n = smp.loss_mask[1..].iter().filter(|&&m| m).count() as u64;
            masked += n;
            if a != 0.0 {
                with_gradient += n;
            }
        }
    }
    let l = &report.learner;
    assert_eq!(
        l.accepted_tokens, masked,
        "ratio 1: the gate keeps every token"
    );
    assert_eq!(l.gradient_tokens, with_gradient);
    // The run has groups with equal rewards (their tokens carry nothing) and groups without.
    assert!(
        flat_groups > 0,
        "no group with equal rewards: the test shows nothing"
    );
    assert!(0 < l.gradient_tokens && l.gradient_tokens < l.accepted_tokens);
    let last = rec.lines.last().unwrap();
    let t = last["time_s"].as_f64().unwrap();
    let rate = last["gradient_tokens_per_s"].as_f64().unwrap();
    assert!((rate - with_gradient as f64 / t).abs() < 1e-3, "{rate}");
    assert!(rate < last["effective_tokens_per_s"].as_f64().unwrap());
    assert_eq!(last["gradient_tokens"], with_gradient);
}
