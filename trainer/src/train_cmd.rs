//! `sluice train` (DESIGN 7.1): the pipeline of stages (supervised warm-up, then RL with GRPO
//! groups and the IS-gate loss, async by default) on the built-in tasks, and the run folder:
//!
//! ```text
//! runs/NAME/config.toml      the resolved config (loading it reproduces the run)
//!           metrics.jsonl    one JSON object per learner step (DESIGN 9 keys; SFT steps too)
//!           summary.json     DESIGN 7.1's keys
//!           trace.json       Chrome trace events (Perfetto): rollout, environment, learner, sync
//!           *.svg            plots
//!           checkpoints/     step-N/: learner.safetensors (weights + optimizer state),
//!                            rollout.safetensors (the engines' weights), state.json
//!           final.safetensors
//! ```
//!
//! Every setting is validated before the run folder is touched: a bad config is an error that
//! names the key (exit code 2) and leaves no folder behind.

use crate::config::{self, ConfigError, StageKind, TaskSection, TrainConfig};
use crate::progress::Progress;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sluice_kernels::testing::Rng;
use sluice_kernels::Backend;
use sluice_model::forward::loss_and_grad_on;
use sluice_model::optim::{LrSchedule, OptimConfig, Optimizer};
use sluice_model::{Model, ModelConfig, PackedBatch};
use sluice_runtime::buffer::{BufferConfig, DataBuffer};
use sluice_runtime::clock::{ClockMode, Micros};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::env::{Split, Task};
use sluice_runtime::eval::{pass_rate, PassRate};
use sluice_runtime::hash::{hash_str, mix64};
use sluice_runtime::learner::{Learner, LearnerConfig, StepReport};
use sluice_runtime::metrics::Trace;
use sluice_runtime::orchestrator::{Orchestrator, RolloutPolicy, TaskSpec};
use sluice_runtime::system::{
    run_stage, BarrierView, Parts, StageConfig, StageObserver, StageStart,
};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What `sluice train` was asked.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub config: Option<PathBuf>,
    pub sets: Vec<String>,
    pub device: Option<String>,
    pub mode: Option<String>,
    pub seed: Option<u64>,
    pub out: Option<PathBuf>,
    pub resume: Option<PathBuf>,
}

/// Why a run stopped: bad input (exit 2, nothing written) or a failure during the run.
#[derive(Debug)]
pub enum TrainError {
    Config(ConfigError),
    /// Bad input found outside the config file (an option, a model file).
    Input(String),
    /// The run failed.
    Run(String),
}

impl TrainError {
    pub fn is_bad_input(&self) -> bool {
        matches!(self, TrainError::Config(_) | TrainError::Input(_))
    }
}

impl fmt::Display for TrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainError::Config(e) => write!(f, "{e}"),
            TrainError::Input(m) => f.write_str(m),
            TrainError::Run(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for TrainError {}

impl From<ConfigError> for TrainError {
    fn from(e: ConfigError) -> Self {
        TrainError::Config(e)
    }
}

fn run_err(e: impl fmt::Display) -> TrainError {
    TrainError::Run(e.to_string())
}

/// The run's outcome (also written to summary.json).
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub summary: Value,
}

/// Builds the task of a config section (the model's vocabulary bounds the token ids).
pub fn make_task(t: &TaskSection, vocab: usize) -> Result<Arc<dyn Task>, String> {
    use sluice_runtime::env::synthetic::{Lookup, Recall};
    match t.kind.as_str() {
        "recall" => Ok(Arc::new(Recall::new(&t.name, vocab, 3).map_err(|e| e.0)?)),
        "lookup" => Ok(Arc::new(Lookup::new(&t.name, vocab).map_err(|e| e.0)?)),
        other => Err(format!(
            "{other:?} is not a task kind of this build (kinds: recall, lookup)"
        )),
    }
}

/// Everything resolved before anything is written.
struct Plan {
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    tasks: BTreeMap<String, Arc<dyn Task>>,
    out: PathBuf,
}

fn plan(o: &TrainOptions) -> Result<Plan, TrainError> {
    let mut sets = o.sets.clone();
    if let Some(d) = &o.device {
        sets.push(format!("run.device=\"{d}\""));
    }
    if let Some(m) = &o.mode {
        sets.push(format!("run.mode=\"{m}\""));
    }
    if let Some(s) = o.seed {
        sets.push(format!("run.seed={s}"));
    }
    if o.resume.is_some() {
        return Err(TrainError::Input(
            "--resume: resuming a run is not available in this build".into(),
        ));
    }
    let cfg = config::load(o.config.as_deref(), &sets)?;
    let model_cfg = ModelConfig::from_file(&cfg.model.config).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "model.config".into(),
            message: format!("{}: {e}", cfg.model.config.display()),
        })
    })?;
    if let Some(init) = &cfg.model.init {
        if !init.is_file() {
            return Err(TrainError::Config(ConfigError {
                key: "model.init".into(),
                message: format!("{} is not a file", init.display()),
            }));
        }
    }
    let mut tasks = BTreeMap::new();
    for t in &cfg.tasks {
        let task = make_task(t, model_cfg.vocab).map_err(|m| {
            TrainError::Config(ConfigError {
                key: format!("tasks.{}.kind", t.name),
                message: m,
            })
        })?;
        tasks.insert(t.name.clone(), task);
    }
    let out = o
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs").join(&cfg.run.name));
    Ok(Plan {
        cfg,
        model_cfg,
        tasks,
        out,
    })
}

/// The files a run writes (cleared when a run starts in an existing folder).
const RUN_FILES: [&str; 5] = [
    "config.toml",
    "metrics.jsonl",
    "summary.json",
    "trace.json",
    "final.safetensors",
];

fn prepare_folder(out: &Path) -> Result<(), TrainError> {
    std::fs::create_dir_all(out)
        .map_err(|e| TrainError::Input(format!("--out {}: {e}", out.display())))?;
    for f in RUN_FILES {
        let p = out.join(f);
        if p.exists() {
            std::fs::remove_file(&p).map_err(|e| run_err(format!("{}: {e}", p.display())))?;
        }
    }
    let ck = out.join("checkpoints");
    if ck.exists() {
        std::fs::remove_dir_all(&ck).map_err(|e| run_err(format!("{}: {e}", ck.display())))?;
    }
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "svg") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

/// SHA-256 of the parameters' f32 little-endian bytes.
pub fn weights_sha256(model: &Model) -> Result<String, TrainError> {
    let v = model.params.to_vec().map_err(run_err)?;
    let mut h = Sha256::new();
    for x in v {
        h.update(x.to_le_bytes());
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Runs `sluice train`; progress goes to `out` (stdout in the CLI).
pub fn run_train(o: &TrainOptions, out: &mut dyn Write) -> Result<TrainSummary, TrainError> {
    let p = plan(o)?;
    let cfg = &p.cfg;
    let backend = Backend::open(cfg.run.device).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "run.device".into(),
            message: e.to_string(),
        })
    })?;
    prepare_folder(&p.out)?;
    let write = |name: &str, text: &str| -> Result<(), TrainError> {
        let path = p.out.join(name);
        std::fs::write(&path, text).map_err(|e| run_err(format!("{}: {e}", path.display())))
    };
    write("config.toml", &cfg.to_toml())?;
    let metrics_path = p.out.join("metrics.jsonl");
    let mut metrics = std::fs::File::create(&metrics_path)
        .map_err(|e| run_err(format!("{}: {e}", metrics_path.display())))?;
    let start = Instant::now();
    let mut model = match &cfg.model.init {
        Some(init) => Model::from_checkpoint(init, &backend).map_err(run_err)?,
        None => Model::new(p.model_cfg.clone(), &backend).map_err(run_err)?,
    };
    let _ = writeln!(
        out,
        "sluice train: {} ({} parameters) on {}, {} mode{}, {} stage(s); run folder {}",
        cfg.model.config.display(),
        model.layout().param_count(),
        cfg.run.device,
        cfg.run.mode.as_str(),
        if cfg.run.replay {
            ", replay (virtual clock)"
        } else {
            ""
        },
        cfg.stages.len(),
        p.out.display()
    );
    let mut ctx = RunContext {
        cfg,
        tasks: &p.tasks,
        out_dir: &p.out,
        metrics: &mut metrics,
        progress: out,
        trace: Trace::default(),
        clock: Micros(0),
        rl_version: 0,
        stage_times: Vec::new(),
        pass_before: BTreeMap::new(),
        pass_after: BTreeMap::new(),
        rl_totals: None,
        learner_steps: 0,
    };
    for (i, stage) in cfg.stages.iter().enumerate() {
        let t0 = Instant::now();
        model = match stage.kind {
            StageKind::Sft => ctx.sft_stage(i, model, &backend)?,
            StageKind::Rl => ctx.rl_stage(i, model, &backend)?,
        };
        ctx.stage_times.push((
            format!("{}#{i}", stage.kind.as_str()),
            t0.elapsed().as_secs_f64(),
        ));
    }
    // Held-out pass rates at the end of the run.
    let final_tasks: Vec<String> = cfg
        .stages
        .iter()
        .filter(|s| s.kind == StageKind::Rl)
        .flat_map(|s| s.tasks.iter().cloned())
        .collect();
    if !final_tasks.is_empty() {
        let rates = ctx.evaluate(&model, &final_tasks)?;
        ctx.pass_after = rates;
    }
    let final_path = p.out.join("final.safetensors");
    model.save(&final_path).map_err(run_err)?;
    let sha = weights_sha256(&model)?;
    let summary = ctx.summary(&sha, start.elapsed().as_secs_f64());
    write(
        "summary.json",
        &serde_json::to_string_pretty(&summary).map_err(run_err)?,
    )?;
    write(
        "trace.json",
        &serde_json::to_string(&ctx.trace.to_chrome_json()).map_err(run_err)?,
    )?;
    let table = ctx.summary_table(&summary);
    let _ = writeln!(ctx.progress, "{table}");
    Ok(TrainSummary {
        out_dir: p.out.clone(),
        summary,
    })
}

struct RunContext<'a> {
    cfg: &'a TrainConfig,
    tasks: &'a BTreeMap<String, Arc<dyn Task>>,
    out_dir: &'a Path,
    metrics: &'a mut std::fs::File,
    progress: &'a mut dyn Write,
    trace: Trace,
    /// The run clock at the end of the last RL stage.
    clock: Micros,
    /// The RL learner's version (optimizer steps over RL stages).
    rl_version: u64,
    stage_times: Vec<(String, f64)>,
    pass_before: BTreeMap<String, PassRate>,
    pass_after: BTreeMap<String, PassRate>,
    rl_totals: Option<RlTotals>,
    learner_steps: u64,
}

/// What the RL stages added up to (for summary.json).
#[derive(Default)]
struct RlTotals {
    samples: u64,
    accepted_tokens: u64,
    sampled_tokens: u64,
    finished_generated: u64,
    zero_lag: u64,
    zero_lag_mismatch: u64,
    buffer_in: u64,
    stale: u64,
    env: u64,
    dup: u64,
    released: u64,
    elapsed_s: f64,
    engine_busy_s: f64,
    learner_busy_s: f64,
    shares: BTreeMap<String, (f64, u64)>,
}

impl RunContext<'_> {
    fn line(&mut self, v: &Value) -> Result<(), TrainError> {
        writeln!(self.metrics, "{v}").map_err(|e| run_err(format!("metrics.jsonl: {e}")))
    }

    fn optim_config(&self, schedule: LrSchedule) -> OptimConfig {
        let mut c =
            OptimConfig::with_lrs(self.cfg.optim.muon_lr, self.cfg.optim.adamw_lr, schedule);
        c.clip_norm = (self.cfg.optim.clip_norm > 0.0).then_some(self.cfg.optim.clip_norm);
        c.muon.weight_decay = self.cfg.optim.weight_decay;
        c.adamw.weight_decay = self.cfg.optim.weight_decay;
        c
    }

    /// Supervised warm-up on the tasks' demonstrations, mixed by target share.
    fn sft_stage(
        &mut self,
        index: usize,
        mut model: Model,
        backend: &Backend,
    ) -> Result<Model, TrainError> {
        let stage = &self.cfg.stages[index];
        let steps = stage.steps;
        let warmup = self.cfg.optim.sft_warmup.min(steps.saturating_sub(1));
        let opt = Optimizer::new(
            backend,
            model.layout().clone(),
            self.optim_config(LrSchedule::WarmupCosine {
                warmup,
                total: steps,
                min_ratio: 0.1,
            }),
        )
        .map_err(run_err)?;
        let mut state = opt.new_state(backend).map_err(run_err)?;
        let tasks: Vec<(&TaskSection, &Arc<dyn Task>)> = stage
            .tasks
            .iter()
            .filter_map(|n| Some((self.cfg.task(n)?, self.tasks.get(n)?)))
            .collect();
        let shares: f64 = tasks.iter().map(|(t, _)| t.target_share.max(0.0)).sum();
        let mut progress = Progress::new(&format!("sft #{index}"), steps, self.cfg.run.log_every);
        let start = Instant::now();
        let mut tokens = 0u64;
        let seed = self.cfg.run.seed;
        let vocab = model.config.vocab;
        for step in 1..=steps {
            let mut seqs: Vec<Vec<i32>> = Vec::with_capacity(self.cfg.optim.sft_batch);
            let mut masks: Vec<Vec<bool>> = Vec::with_capacity(self.cfg.optim.sft_batch);
            for i in 0..self.cfg.optim.sft_batch {
                let mut rng = Rng::new(mix64(
                    hash_str(seed, &format!("sft{index}")) ^ mix64(step << 20 | i as u64),
                ));
                // The task by target share (uniform when every share is 0).
                let u = rng.uniform()
                    * if shares > 0.0 {
                        shares
                    } else {
                        tasks.len() as f64
                    };
                let mut acc = 0.0;
                let mut pick = tasks.len() - 1;
                for (k, (t, _)) in tasks.iter().enumerate() {
                    acc += if shares > 0.0 {
                        t.target_share.max(0.0)
                    } else {
                        1.0
                    };
                    if u < acc {
                        pick = k;
                        break;
                    }
                }
                let task = tasks[pick].1;
                let problem = task.problem(&mut rng, Split::Train);
                let demo = task.demonstration(&problem, &mut rng).ok_or_else(|| {
                    TrainError::Config(ConfigError {
                        key: format!("stage[{index}].tasks"),
                        message: format!(
                            "task {} has no demonstrations for supervised training",
                            task.name()
                        ),
                    })
                })?;
                seqs.push(demo.tokens.iter().map(|&t| t as i32).collect());
                masks.push(demo.loss_mask);
            }
            let batch = PackedBatch::pack(&seqs, vocab).map_err(run_err)?;
            let n = batch.len();
            let mut targets = vec![0i32; n];
            let mut mask = vec![0.0f32; n];
            for (b, (s, m)) in seqs.iter().zip(&masks).enumerate() {
                let r = batch.seq_range(b);
                for j in 0..s.len() - 1 {
                    targets[r.start + j] = s[j + 1];
                    mask[r.start + j] = if m[j + 1] { 1.0 } else { 0.0 };
                }
            }
            let loss =
                loss_and_grad_on(backend, &mut model, &batch, &targets, &mask).map_err(run_err)?;
            if !loss.is_finite() {
                return Err(TrainError::Run(format!(
                    "sft step {step}: the loss is {loss}; lower optim.muon_lr / optim.adamw_lr"
                )));
            }
            let stats = opt
                .step(backend, &mut model.params, &model.grads, &mut state, None)
                .map_err(run_err)?;
            tokens += n as u64;
            let secs = start.elapsed().as_secs_f64();
            let line = json!({
                "stage": format!("sft#{index}"),
                "step": step,
                "loss": loss,
                "grad_norm": stats.grad_norm,
                "lr_factor": stats.lr_factor,
                "wall_tokens_per_s": tokens as f64 / secs.max(1e-9),
                "wall_s": secs,
            });
            self.line(&line)?;
            progress.update(
                self.progress,
                step,
                &format!(
                    "loss {loss:.4}  {:.0} tokens/s",
                    tokens as f64 / secs.max(1e-9)
                ),
            );
        }
        progress.finish(
            self.progress,
            &format!("{:.1}s", start.elapsed().as_secs_f64()),
        );
        Ok(model)
    }

    /// Held-out greedy pass rates of `names` for `model`, on a fresh engine.
    fn evaluate(
        &mut self,
        model: &Model,
        names: &[String],
    ) -> Result<BTreeMap<String, PassRate>, TrainError> {
        let mut out = BTreeMap::new();
        let n = self.cfg.rollout.eval_problems;
        if n == 0 {
            return Ok(out);
        }
        let backend = Backend::open(self.cfg.run.device).map_err(run_err)?;
        let mut engine = Engine::new(
            backend,
            &model.config,
            &model.params,
            WeightVersion(self.rl_version),
            self.engine_config(),
        )
        .map_err(run_err)?;
        let sampling = SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: self.cfg.rollout.max_new_tokens,
            seed: self.cfg.run.seed,
        };
        for name in names {
            if out.contains_key(name) {
                continue;
            }
            let task = self
                .tasks
                .get(name)
                .ok_or_else(|| run_err(format!("no task {name}")))?;
            let r = pass_rate(
                &mut engine,
                task.as_ref(),
                n,
                self.cfg.run.seed,
                sampling,
                self.cfg.rollout.max_turns,
            )
            .map_err(run_err)?;
            out.insert(name.clone(), r);
        }
        Ok(out)
    }

    fn engine_config(&self) -> EngineConfig {
        let r = &self.cfg.rollout;
        EngineConfig {
            num_blocks: r.num_blocks,
            block_size: r.block_size,
            max_batch_tokens: r.max_batch_tokens,
            max_seqs: r.max_seqs,
            preempt: r.preempt,
            swap: r.swap,
        }
    }

    /// One RL stage: held-out pass rates first (on the first RL stage), then the system.
    fn rl_stage(
        &mut self,
        index: usize,
        model: Model,
        backend: &Backend,
    ) -> Result<Model, TrainError> {
        let cfg = self.cfg;
        let stage = &cfg.stages[index];
        if self.pass_before.is_empty() {
            self.pass_before = self.evaluate(&model, &stage.tasks)?;
            for (name, r) in &self.pass_before {
                let _ = writeln!(
                    self.progress,
                    "  held-out pass rate before RL: {name} {:.1}% ({}/{})",
                    100.0 * r.rate(),
                    r.passed,
                    r.problems
                );
            }
        }
        let mut engines = Vec::with_capacity(cfg.rollout.replicas);
        for _ in 0..cfg.rollout.replicas {
            let b = Backend::open(cfg.run.device).map_err(run_err)?;
            engines.push(
                Engine::new(
                    b,
                    &model.config,
                    &model.params,
                    WeightVersion(self.rl_version),
                    self.engine_config(),
                )
                .map_err(run_err)?,
            );
        }
        let learner_backend = Backend::open(cfg.run.device).map_err(run_err)?;
        let _ = backend;
        let learner = Learner::new(
            learner_backend,
            model,
            self.optim_config(LrSchedule::Constant),
            LearnerConfig {
                loss: sluice_kernels::ops::is_gate_loss::GateParams {
                    mode: cfg.loss.mode,
                    eps_low: cfg.loss.eps_low,
                    eps_high: cfg.loss.eps_high,
                    beta: cfg.loss.beta,
                    temperature: 1.0,
                },
                std_free: cfg.loss.std_free,
                adv_eps: 1e-6,
                micro_batch_tokens: cfg.loss.micro_batch_tokens,
            },
            self.rl_version,
        )
        .map_err(run_err)?;
        let total_share: f64 = stage
            .tasks
            .iter()
            .filter_map(|n| cfg.task(n))
            .map(|t| t.target_share)
            .sum();
        let specs: Vec<TaskSpec> = stage
            .tasks
            .iter()
            .filter_map(|n| Some((cfg.task(n)?, self.tasks.get(n)?.clone())))
            .map(|(t, task)| TaskSpec {
                task,
                concurrency: t.concurrency,
                timeout: Micros::from_secs(t.timeout_s),
                retries: t.retries,
                target_share: t.target_share / total_share,
                latency: t.latency,
                faults: t.faults,
            })
            .collect();
        let policy = RolloutPolicy {
            group_size: cfg.buffer.group_size,
            sampling: SamplingParams {
                temperature: cfg.rollout.temperature,
                top_k: cfg.rollout.top_k,
                top_p: cfg.rollout.top_p,
                max_new_tokens: cfg.rollout.max_new_tokens,
                seed: cfg.run.seed,
            },
            max_turns: cfg.rollout.max_turns,
            share_correction: cfg.rollout.share_correction,
            seed: cfg.run.seed,
            vocab: self.cfg_vocab(&engines),
            max_observation_tokens: 256,
        };
        let orch = Orchestrator::new(specs, policy, 0).map_err(run_err)?;
        let buffer = DataBuffer::new(BufferConfig {
            group_size: cfg.buffer.group_size,
            tau: cfg.buffer.tau,
        });
        let sc = StageConfig {
            name: format!("rl#{index}"),
            mode: cfg.run.mode,
            clock: if cfg.run.replay {
                ClockMode::Virtual
            } else {
                ClockMode::Wall
            },
            steps: stage.steps,
            groups_per_step: cfg.buffer.groups_per_step,
            eta: cfg.buffer.eta,
            sync_interval: cfg.sync.interval,
            reset_optimizer: cfg.sync.reset_optimizer,
            cost: cfg.cost,
            barrier_every: (cfg.run.checkpoint_every > 0).then_some(cfg.run.checkpoint_every),
            sync: cfg.sync_options(self.out_dir),
            health: cfg.health(),
        };
        let task_names: Vec<String> = stage.tasks.clone();
        let mut obs = RlObserver {
            metrics: &mut *self.metrics,
            progress: Progress::new(&format!("rl #{index}"), stage.steps, cfg.run.log_every),
            out: &mut *self.progress,
            tasks: task_names,
            checkpoints: self.out_dir.join("checkpoints"),
            error: None,
        };
        let start = StageStart {
            clock: self.clock,
            totals: sluice_runtime::metrics::LearnerTotals::new(),
            engine_weights: Arc::new(learner.publish().map_err(run_err)?),
        };
        let (parts, _orch, _buffer, report) = run_stage(
            &sc,
            Parts { learner, engines },
            orch,
            buffer,
            start,
            &mut obs,
        )
        .map_err(run_err)?;
        obs.progress.finish(
            obs.out,
            &format!(
                "{:.1}s; zero-lag mismatch {} of {} tokens",
                report.wall.as_secs_f64(),
                report.learner.zero_lag_mismatch_tokens,
                report.learner.zero_lag_tokens
            ),
        );
        if report.learner.zero_lag_mismatch_tokens > 0 {
            let _ = writeln!(
                self.progress,
                "WARNING: {} zero-lag tokens had a learner log-prob that differs from the \
                 rollout's in some bit (the design promises 0)",
                report.learner.zero_lag_mismatch_tokens
            );
        }
        self.clock = self.clock.plus(report.elapsed);
        self.rl_version = parts.learner.version().0;
        self.learner_steps += report.learner.steps;
        self.trace.spans.extend(report.trace.spans.iter().cloned());
        let t = self.rl_totals.get_or_insert_with(RlTotals::default);
        t.samples += report.learner.samples;
        t.accepted_tokens += report.learner.accepted_tokens;
        t.sampled_tokens += report.rollout.sampled_tokens;
        t.finished_generated += report.rollout.finished_generated_tokens;
        t.zero_lag += report.learner.zero_lag_tokens;
        t.zero_lag_mismatch += report.learner.zero_lag_mismatch_tokens;
        t.buffer_in += report.buffer.trajectories_in;
        t.stale += report.buffer.stale_dropped;
        t.env += report.buffer.env_dropped;
        t.dup += report.buffer.duplicated;
        t.released += report.buffer.trajectories_released;
        t.elapsed_s += report.elapsed.secs();
        t.engine_busy_s += report.rollout.engine_busy.secs();
        t.learner_busy_s += report.rollout.learner_busy.secs();
        for (name, target, _) in &report.tasks {
            let groups = report.learner.per_task.get(name).map_or(0, |x| x.groups);
            let e = t.shares.entry(name.clone()).or_insert((*target, 0));
            e.0 = *target;
            e.1 += groups;
        }
        let (_, model, _) = parts.learner.into_parts();
        Ok(model)
    }

    fn cfg_vocab(&self, engines: &[Engine]) -> usize {
        engines.first().map_or(0, |e| e.model_config().vocab)
    }

    fn summary(&self, sha: &str, wall_s: f64) -> Value {
        let t = self.rl_totals.as_ref();
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let total_groups: u64 = t.map_or(0, |t| t.shares.values().map(|s| s.1).sum());
        let mut tasks = serde_json::Map::new();
        let names: Vec<String> = self
            .pass_before
            .keys()
            .chain(t.map(|t| t.shares.keys()).into_iter().flatten())
            .cloned()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for name in names {
            let (target, groups) = t
                .and_then(|t| t.shares.get(&name).copied())
                .unwrap_or((0.0, 0));
            tasks.insert(
                name.clone(),
                json!({
                    "target_share": target,
                    "learner_share": ratio(groups, total_groups),
                    "pass_rate_before": self.pass_before.get(&name).map(PassRate::rate),
                    "pass_rate_after": self.pass_after.get(&name).map(PassRate::rate),
                }),
            );
        }
        let elapsed = t.map_or(0.0, |t| t.elapsed_s).max(1e-9);
        json!({
            "final_weights_sha256": sha,
            "learner_steps": self.learner_steps,
            "samples_trained": t.map_or(0, |t| t.samples),
            "wall_s": wall_s,
            "rl_time_s": t.map_or(0.0, |t| t.elapsed_s),
            "effective_tokens_per_s": t.map_or(0.0, |t| t.accepted_tokens as f64 / elapsed),
            "raw_tokens_per_s": t.map_or(0.0, |t| t.sampled_tokens as f64 / elapsed),
            "token_accept_rate": t.map_or(0.0, |t| ratio(t.accepted_tokens, t.finished_generated)),
            "stale_drop_rate": t.map_or(0.0, |t| ratio(t.stale, t.buffer_in)),
            "env_drop_rate": t.map_or(0.0, |t| ratio(t.env, t.buffer_in)),
            "group_dup_rate": t.map_or(0.0, |t| ratio(t.dup, t.released)),
            "zero_lag_tokens": t.map_or(0, |t| t.zero_lag),
            "zero_lag_mismatch_tokens": t.map_or(0, |t| t.zero_lag_mismatch),
            "engine_busy": t.map_or(0.0, |t| t.engine_busy_s / elapsed / self.cfg.rollout.replicas as f64),
            "learner_busy": t.map_or(0.0, |t| t.learner_busy_s / elapsed),
            "stage_seconds": self.stage_times.iter().map(|(n, s)| (n.clone(), json!(s))).collect::<serde_json::Map<_, _>>(),
            "tasks": tasks,
        })
    }

    fn summary_table(&self, s: &Value) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let pct = |v: &Value| {
            v.as_f64()
                .map_or("-".to_string(), |x| format!("{:.1}%", 100.0 * x))
        };
        let _ = writeln!(
            t,
            "\n| task | pass rate before RL | after RL | target share | learner share |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|");
        if let Some(tasks) = s["tasks"].as_object() {
            for (name, v) in tasks {
                let _ = writeln!(
                    t,
                    "| {name} | {} | {} | {} | {} |",
                    pct(&v["pass_rate_before"]),
                    pct(&v["pass_rate_after"]),
                    pct(&v["target_share"]),
                    pct(&v["learner_share"])
                );
            }
        }
        let _ = writeln!(
            t,
            "\n| accepted tokens | stale drops | env drops | group repeats | effective tok/s | raw tok/s | zero-lag mismatch |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|---|---|");
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {} of {} |",
            pct(&s["token_accept_rate"]),
            pct(&s["stale_drop_rate"]),
            pct(&s["env_drop_rate"]),
            pct(&s["group_dup_rate"]),
            s["effective_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["raw_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["zero_lag_mismatch_tokens"],
            s["zero_lag_tokens"],
        );
        let _ = write!(t, "\ntime per stage:");
        for (n, secs) in &self.stage_times {
            let _ = write!(t, "  {n} {secs:.1}s");
        }
        let _ = write!(
            t,
            "\nrun folder: {} (metrics.jsonl, summary.json, trace.json, final.safetensors)",
            self.out_dir.display()
        );
        t
    }
}

/// Writes metrics lines and progress during an RL stage; saves checkpoints at barriers.
struct RlObserver<'a> {
    metrics: &'a mut std::fs::File,
    progress: Progress,
    out: &'a mut dyn Write,
    tasks: Vec<String>,
    checkpoints: PathBuf,
    error: Option<String>,
}

impl StageObserver for RlObserver<'_> {
    fn on_step(&mut self, line: &Value, _report: &StepReport) -> Result<(), String> {
        writeln!(self.metrics, "{line}").map_err(|e| format!("metrics.jsonl: {e}"))?;
        let step = line["step"].as_u64().unwrap_or(0);
        let mut msg = String::new();
        for t in &self.tasks {
            let r = line[format!("reward_mean_window.{t}")]
                .as_f64()
                .unwrap_or(0.0);
            msg.push_str(&format!("{t} {r:.2}  "));
        }
        msg.push_str(&format!(
            "eff {:.0} tok/s  raw {:.0} tok/s",
            line["effective_tokens_per_s"].as_f64().unwrap_or(0.0),
            line["raw_tokens_per_s"].as_f64().unwrap_or(0.0)
        ));
        self.progress.update(self.out, step, &msg);
        Ok(())
    }

    fn on_barrier(&mut self, view: &BarrierView<'_>) -> Result<(), String> {
        let dir = self
            .checkpoints
            .join(format!("step-{:06}", view.learner.version().0));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        view.learner
            .save(&dir.join("learner.safetensors"))
            .map_err(|e| format!("checkpoint: {e}"))?;
        let _ = &self.error;
        Ok(())
    }
}
