//! A small RL stage on the tiny model for the weight-sync, health and environment-fault tests,
//! and an observer that records everything those tests check.
#![allow(dead_code)]

use sluice_kernels::Backend;
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig};
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
use sluice_runtime::sync::lane::arena_bytes;
use sluice_runtime::sync::{ContentHash, SyncOptions};
use sluice_runtime::system::{
    run_stage, BarrierView, Mode, OverSampling, Parts, ReplicaLoss, RunError, StageConfig,
    StageObserver, StageReport, StageStart, SyncEvent,
};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::sync::Arc;

pub const VOCAB: usize = 16;

pub fn recall() -> Arc<dyn Task> {
    Arc::new(Recall::new("recall", VOCAB, 3).unwrap())
}

pub fn lookup() -> Arc<dyn Task> {
    Arc::new(Lookup::new("lookup", VOCAB).unwrap())
}

pub fn task_spec(task: Arc<dyn Task>, latency: LatencyModel, faults: FaultRates) -> TaskSpec {
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

/// Both synthetic tasks, half and half: recall (single turn) and lookup (multi-turn).
pub fn both_tasks(median_ms: f64) -> Vec<TaskSpec> {
    let mut r = task_spec(
        recall(),
        LatencyModel::Fixed { ms: median_ms },
        FaultRates::default(),
    );
    let mut l = task_spec(
        lookup(),
        LatencyModel::LogNormal {
            median_ms,
            p99_ms: 10.0 * median_ms,
        },
        FaultRates::default(),
    );
    r.target_share = 0.5;
    l.target_share = 0.5;
    vec![r, l]
}

pub struct Setup {
    pub tasks: Vec<TaskSpec>,
    pub replicas: usize,
    pub group_size: u32,
    pub groups_per_step: usize,
    pub eta: u64,
    pub tau: u64,
    pub steps: u64,
    pub mode: Mode,
    pub clock: ClockMode,
    pub sync: SyncOptions,
    pub health: HealthConfig,
    pub over_sampling: Option<OverSampling>,
    pub pin_lanes: bool,
    pub cost: CostModel,
    pub barrier_every: Option<u64>,
    pub temperature: f32,
    pub seed: u64,
    pub engine: EngineConfig,
}

impl Setup {
    pub fn new(tasks: Vec<TaskSpec>) -> Setup {
        Setup {
            tasks,
            replicas: 2,
            group_size: 4,
            groups_per_step: 4,
            eta: 1,
            tau: 4,
            steps: 8,
            mode: Mode::Async,
            clock: ClockMode::Virtual,
            sync: SyncOptions::default(),
            health: HealthConfig::default(),
            over_sampling: None,
            pin_lanes: false,
            cost: CostModel::default(),
            barrier_every: None,
            temperature: 1.0,
            seed: 5,
            engine: EngineConfig {
                kv_bytes: EngineConfig::kv_bytes_for_blocks(
                    &Self::model_config(),
                    sluice_model::Precision::F32,
                    16,
                    2048,
                ),
                max_seqs: 64,
                ..EngineConfig::default()
            },
        }
    }

    pub fn model_config() -> ModelConfig {
        let mut cfg = ModelConfig::tiny();
        cfg.vocab = VOCAB;
        cfg.init_std = 0.15;
        cfg
    }

    /// Runs the stage; returns the report and the learner's final weights (their bytes).
    pub fn try_run(
        &self,
        observer: &mut dyn StageObserver,
    ) -> Result<(StageReport, Vec<u8>), RunError> {
        let cfg = Self::model_config();
        let model = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
        let engines = (0..self.replicas)
            .map(|_| {
                Engine::new(
                    Backend::Cpu,
                    &cfg,
                    &model.params,
                    WeightVersion(0),
                    self.engine.clone(),
                )
                .unwrap()
            })
            .collect();
        let mut oc = OptimConfig::default();
        oc.muon.lr = 0.01;
        oc.adamw.lr = 0.01;
        let learner = Learner::new(Backend::Cpu, model, oc, LearnerConfig::default(), 0).unwrap();
        let policy = RolloutPolicy {
            group_size: self.group_size,
            sampling: SamplingParams {
                temperature: self.temperature,
                max_new_tokens: 4,
                seed: self.seed,
                ..SamplingParams::default()
            },
            max_turns: 3,
            share_correction: true,
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
            clock: self.clock,
            steps: self.steps,
            groups_per_step: self.groups_per_step,
            eta: self.eta,
            sync_interval: 1,
            reset_optimizer: false,
            cost: self.cost,
            barrier_every: self.barrier_every,
            sync: self.sync.clone(),
            health: self.health,
            over_sampling: self.over_sampling,
            servers: Vec::new(),
            pin_lanes: self.pin_lanes,
        };
        let start = StageStart {
            clock: Micros(0),
            stage_began: Micros(0),
            totals: LearnerTotals::new(),
            engine_weights: Arc::new(learner.publish().unwrap()),
        };
        let (parts, _orch, _buffer, report) = run_stage(
            &stage,
            Parts { learner, engines },
            orch,
            buffer,
            start,
            observer,
        )?;
        assert_eq!(parts.engines.len(), self.replicas);
        let weights = arena_bytes(&parts.learner.model().params).unwrap();
        Ok((report, weights))
    }

    pub fn run(&self, observer: &mut dyn StageObserver) -> (StageReport, Vec<u8>) {
        self.try_run(observer)
            .unwrap_or_else(|e| panic!("the stage failed: {e}"))
    }
}

/// One barrier as the test saw it.
#[derive(Clone, Debug)]
pub struct BarrierCheck {
    pub learner_version: WeightVersion,
    /// blake3 of the learner's parameters, computed by the test.
    pub learner_hash: ContentHash,
    /// Per replica: (version, hash) it reports, and its engine's version.
    pub replicas: Vec<(Option<WeightVersion>, Option<ContentHash>, WeightVersion)>,
}

/// Records what the stage reported.
#[derive(Default)]
pub struct Recorder {
    pub batches: Vec<Vec<ReadyGroup>>,
    pub lines: Vec<serde_json::Value>,
    pub syncs: Vec<SyncEvent>,
    pub losses: Vec<ReplicaLoss>,
    pub barriers: Vec<BarrierCheck>,
    /// (learner step when the batch was taken) for each batch.
    pub batch_after_losses: Vec<usize>,
}

impl StageObserver for Recorder {
    fn on_step(&mut self, line: &serde_json::Value, _r: &StepReport) -> Result<(), String> {
        self.lines.push(line.clone());
        Ok(())
    }
    fn on_learner_batch(&mut self, groups: &[ReadyGroup]) {
        self.batches.push(groups.to_vec());
        self.batch_after_losses.push(self.losses.len());
    }
    fn on_sync(&mut self, e: &SyncEvent) {
        self.syncs.push(e.clone());
    }
    fn on_replica_lost(&mut self, loss: &ReplicaLoss) {
        self.losses.push(loss.clone());
    }
    fn on_barrier(&mut self, view: &BarrierView<'_>) -> Result<(), String> {
        let bytes = arena_bytes(&view.learner.model().params)?;
        self.barriers.push(BarrierCheck {
            learner_version: view.learner.version(),
            learner_hash: ContentHash::of(&bytes),
            replicas: view
                .replica_weights
                .iter()
                .zip(&view.engines)
                .map(|(&(v, h), e)| (v, h, e.version()))
                .collect(),
        });
        Ok(())
    }
}

impl Recorder {
    /// Every install reported the hash the learner published for its version.
    pub fn assert_every_install_is_the_learners(&self) {
        assert!(!self.syncs.is_empty(), "no install was reported");
        for e in &self.syncs {
            assert_eq!(
                Some(e.hash),
                e.published,
                "replica {} installed {} with blake3 {} ({}), not what the learner published",
                e.replica,
                e.version,
                e.hash,
                e.encoding
            );
        }
    }
}

/// The session id of a trajectory span's name (`{session}#{index}` or `{session} lost`).
pub fn session_of(span_name: &str) -> &str {
    span_name
        .split_once('#')
        .map(|(s, _)| s)
        .or_else(|| span_name.strip_suffix(" lost"))
        .unwrap_or(span_name)
}
