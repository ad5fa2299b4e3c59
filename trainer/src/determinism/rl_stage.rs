//! The `rl_stage` workload: a short asynchronous GRPO stage replayed on the virtual clock
//! (DESIGN 6.7: with a seed, bit for bit), through the same `run_stage` as `sluice train`:
//! the rollout engine, two synthetic tasks behind environments with heavy-tailed latency and
//! injected crashes, the data buffer with its gates, the learner with the IS-gate loss, and
//! weight publication after every step.
//!
//! Digested: every batch the learner trained on (its tokens, behavior log-probs, loss masks and
//! rewards, in the order given to the loss), each step's loss and gradient norm as reported,
//! and the learner's final parameters and optimizer moments.

use super::workloads::{Output, Preset};
use super::DetError;
use sluice_kernels::Backend;
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, Precision};
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
use sluice_runtime::system::{run_stage, Mode, Parts, StageConfig, StageObserver, StageStart};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::sync::Arc;

/// What the stage gave the learner, and what each step reported.
#[derive(Default)]
struct Recorder {
    tokens: Vec<i32>,
    behavior_logp: Vec<f32>,
    loss_mask: Vec<u8>,
    rewards: Vec<f32>,
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
}

impl StageObserver for Recorder {
    fn on_step(&mut self, line: &serde_json::Value, _r: &StepReport) -> Result<(), String> {
        let num = |k: &str| line.get(k).and_then(serde_json::Value::as_f64);
        self.losses.push(num("loss").unwrap_or(f64::NAN));
        self.grad_norms.push(num("grad_norm").unwrap_or(f64::NAN));
        Ok(())
    }

    fn on_learner_batch(&mut self, groups: &[ReadyGroup]) {
        for s in groups.iter().flat_map(|g| &g.samples) {
            self.tokens.extend(s.tokens.iter().map(|&t| t as i32));
            self.behavior_logp.extend_from_slice(&s.behavior_logp);
            self.loss_mask
                .extend(s.loss_mask.iter().map(|&m| u8::from(m)));
            self.rewards.push(s.reward);
        }
    }
}

fn task(task: Arc<dyn Task>, latency: LatencyModel, crash: f64) -> TaskSpec {
    TaskSpec {
        task,
        concurrency: 64,
        timeout: Micros::from_secs(10.0),
        retries: 0,
        target_share: 0.5,
        latency,
        faults: FaultRates {
            crash,
            ..FaultRates::default()
        },
    }
}

/// Runs the stage on `backend` (f32 on cpu, bf16 on emu and cuda: each device's default).
pub fn run(backend: &Backend, preset: Preset) -> Result<Vec<Output>, DetError> {
    let err = |what: &str, e: String| DetError::Run(format!("rl_stage: {what}: {e}"));
    let cfg = preset.model()?;
    let precision = Precision::default_for(backend.device());
    let open = || -> Result<Backend, DetError> {
        match backend {
            Backend::Cpu => Ok(Backend::Cpu),
            Backend::Emu(e) => Ok(Backend::emu_with_seed(e.seed)),
            Backend::Cuda(_) => {
                Backend::open(backend.device()).map_err(|e| err("device", e.to_string()))
            }
        }
    };
    let be = open()?;
    let mut model = Model::new(cfg.clone(), &be).map_err(|e| err("model", e.to_string()))?;
    model
        .set_precision(&be, precision)
        .map_err(|e| err("model", e.to_string()))?;
    let engine_cfg = EngineConfig {
        kv_bytes: EngineConfig::kv_bytes_for_blocks(&cfg, precision, 16, 256),
        max_seqs: 16,
        precision,
        ..EngineConfig::default()
    };
    let engine = Engine::new(
        open()?,
        &cfg,
        model.compute_weights(),
        WeightVersion(0),
        engine_cfg,
    )
    .map_err(|e| err("engine", e.to_string()))?;
    let mut oc = OptimConfig::default();
    oc.muon.lr = 0.01;
    oc.adamw.lr = 0.01;
    let learner = Learner::new(be, model, oc, LearnerConfig::default(), 0)
        .map_err(|e| err("learner", e.to_string()))?;
    let recall = Recall::new("recall", cfg.vocab, 3).map_err(|e| err("task", e.to_string()))?;
    let lookup = Lookup::new("lookup", cfg.vocab).map_err(|e| err("task", e.to_string()))?;
    let tasks = vec![
        task(
            Arc::new(recall),
            LatencyModel::LogNormal {
                median_ms: 20.0,
                p99_ms: 400.0,
            },
            0.1,
        ),
        task(
            Arc::new(lookup),
            LatencyModel::Pareto {
                median_ms: 30.0,
                p99_ms: 900.0,
            },
            0.0,
        ),
    ];
    let seed = 11;
    let policy = RolloutPolicy {
        group_size: 4,
        sampling: SamplingParams {
            temperature: 1.0,
            max_new_tokens: 4,
            seed,
            ..SamplingParams::default()
        },
        max_turns: 2,
        share_correction: true,
        seed,
        vocab: cfg.vocab,
        max_observation_tokens: 16,
    };
    let orch =
        Orchestrator::new(tasks, policy, 0).map_err(|e| err("orchestrator", e.to_string()))?;
    let buffer = DataBuffer::new(BufferConfig {
        group_size: 4,
        tau: 4,
        env_gate: true,
        dynamic_sampling: None,
    });
    let stage = StageConfig {
        name: "rl".into(),
        mode: Mode::Async,
        clock: ClockMode::Virtual,
        steps: preset.learner_steps(),
        groups_per_step: 2,
        eta: 1,
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
        engine_weights: Arc::new(
            learner
                .publish()
                .map_err(|e| err("publish", e.to_string()))?,
        ),
    };
    let mut rec = Recorder::default();
    let (parts, _orch, _buffer, _report) = run_stage(
        &stage,
        Parts {
            learner,
            engines: vec![engine],
        },
        orch,
        buffer,
        start,
        &mut rec,
    )
    .map_err(|e| err("stage", e.to_string()))?;
    let case = format!("{precision} {} learner steps", preset.learner_steps());
    let op = "rl_stage";
    let learner = &parts.learner;
    let state = learner.optimizer_state();
    let tensor = |name: &str, t: &sluice_kernels::Tensor| {
        Output::of_tensor(op, &case, name, t).map_err(|e| err("download", e.to_string()))
    };
    Ok(vec![
        Output::of_slice(op, &case, "trained_tokens", &rec.tokens),
        Output::of_slice(op, &case, "behavior_logp", &rec.behavior_logp),
        Output::of_slice(op, &case, "loss_mask", &rec.loss_mask),
        Output::of_slice(op, &case, "rewards", &rec.rewards),
        Output::of_slice(
            op,
            &case,
            "losses",
            &rec.losses.iter().map(|l| l.to_bits()).collect::<Vec<u64>>(),
        ),
        Output::of_slice(
            op,
            &case,
            "grad_norms",
            &rec.grad_norms
                .iter()
                .map(|l| l.to_bits())
                .collect::<Vec<u64>>(),
        ),
        tensor("params", learner.model().params.tensor())?,
        tensor("moment1", state.m.tensor())?,
        tensor("moment2", state.v.tensor())?,
    ])
}
