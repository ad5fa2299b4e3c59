//! The scheduler's own cost (docs/perf/async.md): a stage on the virtual clock with thousands
//! of sessions in flight, each waiting seconds on its environment, on the tiny model so that
//! compute is small. Reports events handled, wall time outside the lanes' compute per event
//! and per session, and resident memory per session in flight.
//!
//!   cargo bench -p sluice-runtime --bench scheduler [-- 1000 10000]

use sluice_kernels::Backend;
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig, Precision};
use sluice_runtime::buffer::{BufferConfig, DataBuffer};
use sluice_runtime::clock::{ClockMode, CostModel, Micros};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::env::faults::FaultRates;
use sluice_runtime::env::latency::LatencyModel;
use sluice_runtime::env::synthetic::Lookup;
use sluice_runtime::learner::{Learner, LearnerConfig, StepReport};
use sluice_runtime::metrics::LearnerTotals;
use sluice_runtime::orchestrator::{Orchestrator, RolloutPolicy, TaskSpec};
use sluice_runtime::system::{
    run_stage, Mode, Parts, StageConfig, StageObserver, StageStart, Tick,
};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::sync::Arc;

/// Resident memory of this process, KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[derive(Default)]
struct Peak {
    in_flight: u64,
    rss_kib: u64,
}

impl StageObserver for Peak {
    fn on_step(&mut self, _: &serde_json::Value, _: &StepReport) -> Result<(), String> {
        Ok(())
    }
    fn on_tick(&mut self, t: &Tick) {
        if t.in_flight > self.in_flight {
            self.in_flight = t.in_flight;
            self.rss_kib = self.rss_kib.max(rss_kib());
        }
    }
}

fn run(sessions: u64) {
    const VOCAB: usize = 16;
    const G: u32 = 8;
    let mut cfg = ModelConfig::tiny();
    cfg.vocab = VOCAB;
    let model = Model::new(cfg.clone(), &Backend::Cpu).expect("model");
    let engine = Engine::new(
        Backend::Cpu,
        &cfg,
        &model.params,
        WeightVersion(0),
        EngineConfig {
            kv_bytes: EngineConfig::kv_bytes_for_blocks(
                &cfg,
                Precision::F32,
                EngineConfig::default().block_size,
                4 * sessions as usize + 64,
            ),
            max_seqs: 4096,
            max_batch_tokens: 1 << 16,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let learner = Learner::new(
        Backend::Cpu,
        model,
        OptimConfig::default(),
        LearnerConfig::default(),
        0,
    )
    .expect("learner");
    let task = TaskSpec {
        task: Arc::new(Lookup::new("lookup", VOCAB).expect("task")),
        concurrency: sessions * 2,
        timeout: Micros::from_secs(60.0),
        retries: 0,
        target_share: 1.0,
        // Every call waits 5 s: sessions pile up in flight, the engine has little to do.
        latency: LatencyModel::Fixed { ms: 5000.0 },
        faults: FaultRates::default(),
    };
    let groups_per_step = (sessions / G as u64 / 4).max(1) as usize;
    let per_step = groups_per_step as u64 * G as u64;
    let policy = RolloutPolicy {
        group_size: G,
        sampling: SamplingParams {
            max_new_tokens: 2,
            ..SamplingParams::default()
        },
        max_turns: 3,
        share_correction: false,
        seed: 1,
        vocab: VOCAB,
        max_observation_tokens: 8,
    };
    let orch = Orchestrator::new(vec![task], policy, 0).expect("orchestrator");
    let buffer = DataBuffer::new(BufferConfig {
        group_size: G,
        tau: 100,
        env_gate: true,
        dynamic_sampling: None,
    });
    let stage = StageConfig {
        name: "bench".into(),
        mode: Mode::Async,
        clock: ClockMode::Virtual,
        steps: 2,
        groups_per_step,
        // Room for `sessions` trajectories in flight at once.
        eta: sessions.div_ceil(per_step).saturating_sub(1),
        sync_interval: 1,
        reset_optimizer: false,
        cost: CostModel::default(),
        barrier_every: None,
        sync: Default::default(),
        health: Default::default(),
        over_sampling: None,
        servers: Vec::new(),
        pin_lanes: false,
    };
    let start = StageStart {
        clock: Micros(0),
        stage_began: Micros(0),
        totals: LearnerTotals::new(),
        engine_weights: Arc::new(learner.publish().expect("publish")),
    };
    let rss0 = rss_kib();
    let mut peak = Peak::default();
    let (_, _, _, report) = run_stage(
        &stage,
        Parts {
            learner,
            engines: vec![engine],
        },
        orch,
        buffer,
        start,
        &mut peak,
    )
    .expect("stage");
    let own = report.wall.saturating_sub(report.inline_time);
    let started = report.rollout.trajectories_started.max(1);
    println!(
        "{{\"sessions_target\":{sessions},\"peak_in_flight\":{},\"trajectories\":{started},\
         \"events\":{},\"wall_s\":{:.3},\"lanes_s\":{:.3},\"scheduler_s\":{:.3},\
         \"scheduler_us_per_event\":{:.2},\"scheduler_us_per_session\":{:.1},\
         \"rss_kib_per_session_in_flight\":{:.2}}}",
        peak.in_flight,
        report.events,
        report.wall.as_secs_f64(),
        report.inline_time.as_secs_f64(),
        own.as_secs_f64(),
        own.as_secs_f64() * 1e6 / report.events.max(1) as f64,
        own.as_secs_f64() * 1e6 / started as f64,
        peak.rss_kib.saturating_sub(rss0) as f64 / peak.in_flight.max(1) as f64,
    );
}

fn main() {
    let sizes: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 10_000]
    } else {
        sizes
    };
    for n in sizes {
        run(n);
    }
}
