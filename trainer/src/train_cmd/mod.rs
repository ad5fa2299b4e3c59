//! `sluice train` (DESIGN 7.1): the pipeline of stages (supervised warm-up, then RL with GRPO
//! groups and the IS-gate loss, async by default) on the built-in tasks, and the run folder:
//!
//! ```text
//! runs/NAME/config.toml      the resolved config (loading it reproduces the run)
//!           metrics.jsonl    one JSON object per learner step (DESIGN 9 keys; SFT steps too)
//!           summary.json     DESIGN 7.1's keys
//!           trace.json       Chrome trace events (Perfetto): rollout, environment, learner, sync
//!           *.svg            plots
//!           checkpoints/     SSS-NNNNNNNNN/ (stage SSS, at a barrier after learner step N) and
//!                            SSS-end/: learner.safetensors (weights + optimizer state),
//!                            rollout.safetensors (the engines' weights; barrier
//!                            checkpoints only), state.json
//!           final.safetensors
//! ```
//!
//! Every setting is validated before the run folder is touched: a bad config is an error that
//! names the key (exit code 2) and leaves no folder behind.

use crate::config::{self, ConfigError, StageKind, TaskSection, TrainConfig};
use crate::progress::Progress;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sluice_kernels::Backend;
use sluice_model::forward::loss_and_grad_on;
use sluice_model::optim::{LrSchedule, OptimConfig, Optimizer};
use sluice_model::{Model, ModelConfig, PackedBatch};
use sluice_runtime::buffer::{BufferConfig, DataBuffer};
use sluice_runtime::clock::{ClockMode, Micros};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::env::external::record::{self, Recorder, ReplayBook};
use sluice_runtime::env::{Split, Task};
use sluice_runtime::eval::{pass_rate, PassRate};
use sluice_runtime::learner::{Learner, LearnerConfig, Mismatch, Publication, StepReport};
use sluice_runtime::metrics::{insert_mismatch, LearnerTotals, LengthHistogram, Trace};
use sluice_runtime::orchestrator::{Orchestrator, OrchestratorState, RolloutPolicy, TaskSpec};
use sluice_runtime::system::{
    run_stage, BarrierView, Parts, RunError, StageConfig, StageObserver, StageStart,
};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

mod checkpoint;
mod opd;
mod stages;
mod summary;
use checkpoint::*;

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
    /// Answer external environments from this run folder's environments.jsonl instead of
    /// starting them (`--replay-env`).
    pub replay_env: Option<PathBuf>,
}

/// Why a run stopped: bad input (exit 2, nothing written) or a failure during the run.
#[derive(Debug)]
pub enum TrainError {
    /// A bad setting (exit 2). Found before the run folder is touched, except a heartbeat
    /// timeout shorter than an engine step, which only the run itself can show.
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

/// Builds the task of a config section (the model's vocabulary bounds the token ids); an
/// external task gets the section's call timeout and `io`'s record and replay; text tasks work
/// on `tok`.
pub fn make_task(
    t: &TaskSection,
    vocab: usize,
    io: &crate::tasks::external::EnvIo,
    tok: &Arc<crate::tasks::text::TextTokenizer>,
) -> Result<Arc<dyn Task>, String> {
    let io = crate::tasks::external::EnvIo {
        timeout: std::time::Duration::from_secs_f64(t.timeout_s),
        retries: t.retries,
        ..io.clone()
    };
    crate::tasks::make_with(&t.kind, &t.name, vocab, &t.options, &io, tok)
}

/// Whether a task reaches an environment outside the process.
fn is_external(t: &TaskSection) -> bool {
    matches!(t.kind.as_str(), "external" | "http")
}

/// Everything resolved before anything is written.
struct Plan {
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    tasks: BTreeMap<String, Arc<dyn Task>>,
    out: PathBuf,
    /// Where external tasks record their replies (opened with the run folder).
    recorder: Arc<Recorder>,
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
    let cfg = match &o.resume {
        Some(dir) => {
            if o.config.is_some() || !sets.is_empty() || o.out.is_some() {
                return Err(TrainError::Input(
                    "--resume continues a run with its own config.toml: --config, --set, \
                     --device, --mode, --seed and --out cannot be combined with it"
                        .into(),
                ));
            }
            let file = dir.join("config.toml");
            if !file.is_file() {
                return Err(TrainError::Input(format!(
                    "--resume {}: no config.toml there (not a run folder)",
                    dir.display()
                )));
            }
            config::load(Some(&file), &[])?
        }
        None => config::load(o.config.as_deref(), &sets)?,
    };
    let mut model_cfg = ModelConfig::from_file(&cfg.model.config).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "model.config".into(),
            message: format!("{}: {e}", cfg.model.config.display()),
        })
    })?;
    // The model's vocabulary follows the tokenizer.
    let tok = cfg.tokenizer.load()?;
    model_cfg.vocab = cfg.tokenizer.model_vocab(&tok, model_cfg.vocab);
    // The KV pool must hold at least one block of this model in this precision; found here,
    // before the run folder exists, not when the first engine is built.
    sluice_model::infer::KvCache::blocks_for_bytes(
        &model_cfg,
        cfg.model.precision.dtype(),
        cfg.rollout.block_size,
        cfg.rollout.kv_bytes,
    )
    .map_err(|e| {
        TrainError::Config(ConfigError {
            key: "rollout.kv_bytes".into(),
            message: match e {
                sluice_kernels::Error::Param { message, .. } => message,
                e => e.to_string(),
            },
        })
    })?;
    if let Some(init) = &cfg.model.init {
        if !init.is_file() {
            return Err(TrainError::Config(ConfigError {
                key: "model.init".into(),
                message: format!("{} is not a file", init.display()),
            }));
        }
        check_vocab(init, model_cfg.vocab, &tok, "model.init")?;
    }
    if let Some(opd) = &cfg.opd {
        opd::check_teachers(opd, &model_cfg)?;
    }
    if let Some(dir) = &o.resume {
        if let Some(ck) = latest_checkpoint(dir)? {
            check_vocab(
                &ck.join("learner.safetensors"),
                model_cfg.vocab,
                &tok,
                "tokenizer.path",
            )?;
        }
    }
    let replay = match &o.replay_env {
        Some(dir) => Some(Arc::new(ReplayBook::load(dir).map_err(TrainError::Input)?)),
        None => None,
    };
    let recorder = Arc::new(Recorder::default());
    let io = crate::tasks::external::EnvIo {
        recorder: Some(Arc::clone(&recorder)),
        replay,
        ..crate::tasks::external::EnvIo::default()
    };
    let mut tasks = BTreeMap::new();
    for t in &cfg.tasks {
        let task = make_task(t, model_cfg.vocab, &io, &tok).map_err(|m| {
            TrainError::Config(ConfigError {
                key: format!("tasks.{}.kind", t.name),
                message: m,
            })
        })?;
        // With a BPE, text tasks count the model turns a decode-then-encode round trip would
        // change, and with rollout.retokenize train the re-encoded ids (sluice experiment tito).
        let task =
            if crate::tasks::is_text(&t.kind) && cfg.tokenizer.kind == config::TokenizerKind::Bpe {
                crate::tasks::round_trip::RoundTrip::wrap(
                    task,
                    Arc::clone(&tok),
                    cfg.rollout.retokenize,
                )
            } else {
                task
            };
        tasks.insert(t.name.clone(), task);
    }
    let out = match (&o.resume, &o.out) {
        (Some(dir), _) => dir.clone(),
        (None, Some(out)) => out.clone(),
        (None, None) => PathBuf::from("runs").join(&cfg.run.name),
    };
    Ok(Plan {
        cfg,
        model_cfg,
        tasks,
        out,
        recorder,
    })
}

/// A checkpoint's vocabulary must be the run's (the tokenizer's, for a BPE): a mismatch is
/// bad input naming `key` and both sizes, found before anything is written.
fn check_vocab(
    file: &Path,
    vocab: usize,
    tok: &crate::tasks::text::TextTokenizer,
    key: &str,
) -> Result<(), TrainError> {
    let Ok(cfg) = sluice_model::checkpoint::read_config(file) else {
        // An unreadable checkpoint is reported where it is loaded.
        return Ok(());
    };
    if cfg.vocab != vocab {
        return Err(TrainError::Config(ConfigError {
            key: key.into(),
            message: format!(
                "{}: the checkpoint's model has a vocabulary of {} ids, the run's tokenizer {} \
                 gives {vocab}: a model and its tokenizer must match",
                file.display(),
                cfg.vocab,
                tok.version()
            ),
        }));
    }
    Ok(())
}

/// The files a run writes (cleared when a run starts in an existing folder).
const RUN_FILES: [&str; 6] = [
    "config.toml",
    record::FILE,
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

/// What a checkpoint holds besides the weights (checkpoints/NAME/state.json): enough to
/// continue the run exactly where it stopped (see [`run_train`] on resume).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct RunState {
    /// Bumped when this layout changes.
    format: u32,
    /// The stage to run next, or to continue when `rl` is set.
    next_stage: usize,
    /// An RL stage stopped at a barrier.
    rl: Option<RlProgress>,
    /// The RL learner's version (its optimizer steps over all RL stages).
    rl_version: u64,
    /// The run clock at the start of the stage in progress (or the next one).
    clock: Micros,
    /// RL learner steps of finished stages.
    learner_steps: u64,
    stage_times: Vec<(String, f64)>,
    pass_before: BTreeMap<String, PassRate>,
    rl_totals: Option<RlTotals>,
    /// Spans of finished stages.
    trace: Trace,
    /// Lines of metrics.jsonl written so far (a resumed run cuts the file back to these).
    metrics_lines: u64,
    /// SHA-256 of each OPD teacher's file when the run started (a resume checks them).
    #[serde(default)]
    teachers: Vec<String>,
}

/// An RL stage stopped at a barrier.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct RlProgress {
    /// The run clock at the barrier.
    now: Micros,
    /// When the stage began on the run clock.
    stage_began: Micros,
    buffer: DataBuffer,
    orchestrator: OrchestratorState,
    totals: LearnerTotals,
    /// The version of the weights the engines hold (rollout.safetensors).
    engine_version: u64,
    /// The stage's spans so far.
    trace: Trace,
    /// Seconds the stage ran before the barrier.
    stage_seconds: f64,
}

/// Runs `sluice train`; progress goes to `out` (stdout in the CLI).
///
/// With `--resume runs/NAME` the run continues from its newest checkpoint: the config is the
/// folder's config.toml; weights, optimizer state, the engines' weights, the data buffer, the
/// orchestrator's counters, the learner's totals and the run clock are restored, and
/// metrics.jsonl is cut back to the checkpoint. Checkpoints are taken at barriers (no
/// trajectory in flight) and every random choice is keyed, so on the virtual clock (replay) a
/// resumed run ends with exactly the weights an uninterrupted one does.
pub fn run_train(o: &TrainOptions, out: &mut dyn Write) -> Result<TrainSummary, TrainError> {
    let p = plan(o)?;
    let cfg = &p.cfg;
    // Servers that do not answer now fail the run before the warm-up, not after it.
    for (i, url) in cfg.rollout.servers.iter().enumerate() {
        sluice_runtime::remote::ServerClient::new(url, std::time::Duration::from_secs(10))
            .health()
            .map_err(|e| TrainError::Input(format!("rollout.servers[{i}]: {e}")))?;
    }
    let backend = Backend::open(cfg.run.device).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "run.device".into(),
            message: e.to_string(),
        })
    })?;
    let metrics_path = p.out.join("metrics.jsonl");
    let (state, resume_from, mut metrics) = match &o.resume {
        Some(_) => {
            let Some(ck) = latest_checkpoint(&p.out)? else {
                return Err(TrainError::Input(format!(
                    "--resume {}: the run has no checkpoint yet (run.checkpoint_every)",
                    p.out.display()
                )));
            };
            let st = read_state(&ck)?;
            opd::check_unchanged(cfg.opd.as_ref(), &st.teachers)?;
            let file = truncate_lines(&metrics_path, st.metrics_lines)?;
            (st, Some(ck), file)
        }
        None => {
            let teachers = opd::digests(cfg.opd.as_ref())?;
            prepare_folder(&p.out)?;
            std::fs::write(p.out.join("config.toml"), cfg.to_toml())
                .map_err(|e| run_err(format!("config.toml: {e}")))?;
            let file = std::fs::File::create(&metrics_path)
                .map_err(|e| run_err(format!("{}: {e}", metrics_path.display())))?;
            (
                RunState {
                    format: STATE_FORMAT,
                    teachers,
                    ..RunState::default()
                },
                None,
                file,
            )
        }
    };
    if cfg.tasks.iter().any(is_external) {
        // A resumed run continues its record; a new one starts it.
        p.recorder
            .open(&p.out.join(record::FILE), o.resume.is_some())
            .map_err(run_err)?;
    }
    let start = Instant::now();
    let mut model = match (&resume_from, &cfg.model.init) {
        (Some(ck), _) => Model::from_checkpoint(&ck.join("learner.safetensors"), &backend)
            .map_err(|e| TrainError::Input(format!("resume: {e}")))?,
        (None, Some(init)) => Model::from_checkpoint(init, &backend).map_err(run_err)?,
        (None, None) => Model::new(p.model_cfg.clone(), &backend).map_err(run_err)?,
    };
    model
        .set_precision(&backend, cfg.model.precision)
        .map_err(run_err)?;
    let _ = writeln!(
        out,
        "sluice train: {} ({} parameters) on {} in {}, {} mode{}, {} stage(s); run folder {}{}",
        cfg.model.config.display(),
        model.layout().param_count(),
        cfg.run.device,
        cfg.model.precision,
        cfg.run.mode.as_str(),
        if cfg.run.replay {
            ", replay (virtual clock)"
        } else {
            ""
        },
        cfg.stages.len(),
        p.out.display(),
        match &resume_from {
            Some(ck) => format!(", resumed from {}", ck.display()),
            None => String::new(),
        }
    );
    let mut ctx = RunContext {
        cfg,
        tasks: &p.tasks,
        out_dir: &p.out,
        metrics: &mut metrics,
        progress: out,
        state,
        resume_from,
        pass_after: BTreeMap::new(),
    };
    for i in ctx.state.next_stage..cfg.stages.len() {
        let stage = &cfg.stages[i];
        let t0 = Instant::now();
        let before = ctx.state.rl.as_ref().map_or(0.0, |r| r.stage_seconds);
        model = match stage.kind {
            StageKind::Sft => ctx.sft_stage(i, model, &backend)?,
            StageKind::Rl => ctx.rl_stage(i, model)?,
        };
        ctx.state.stage_times.push((
            format!("{}#{i}", stage.kind.as_str()),
            before + t0.elapsed().as_secs_f64(),
        ));
        ctx.state.next_stage = i + 1;
        ctx.state.rl = None;
        ctx.resume_from = None;
        // A checkpoint at every stage end (the next stage starts from it on resume).
        let st = ctx.state.clone();
        let m = &model;
        write_checkpoint(
            &p.out.join("checkpoints"),
            &format!("{i:03}-end"),
            |dir| {
                m.save(&dir.join("learner.safetensors"))
                    .map_err(|e| format!("checkpoint: {e}"))
            },
            &st,
        )
        .map_err(run_err)?;
    }
    // Held-out pass rates at the end of the run.
    let final_tasks: Vec<String> = cfg
        .stages
        .iter()
        .filter(|s| s.kind == StageKind::Rl)
        .flat_map(|s| s.tasks.iter().cloned())
        .collect();
    if !final_tasks.is_empty() {
        ctx.pass_after = ctx.evaluate(&model, &final_tasks)?;
    }
    let arms = ctx.arms(&p, &model, &final_tasks)?;
    let final_path = p.out.join("final.safetensors");
    model.save(&final_path).map_err(run_err)?;
    let sha = weights_sha256(&model)?;
    let mut summary = ctx.summary(&sha, start.elapsed().as_secs_f64());
    if let (Some(a), Some(m)) = (&arms, summary.as_object_mut()) {
        m.insert("arms".into(), a.clone());
    }
    let write = |name: &str, text: &str| -> Result<(), TrainError> {
        let path = p.out.join(name);
        sluice_model::checkpoint::write_atomic(&path, text.as_bytes())
            .map_err(|e| run_err(format!("{}: {e}", path.display())))
    };
    write(
        "summary.json",
        &serde_json::to_string_pretty(&summary).map_err(run_err)?,
    )?;
    write(
        "trace.json",
        &serde_json::to_string(&ctx.state.trace.to_chrome_json()).map_err(run_err)?,
    )?;
    // Plots from the metrics, with the held-out pass rates at the first RL stage's start and
    // at the end of the last one.
    // The charts are of the RL stages (supervised lines carry only a loss).
    let lines: Vec<Value> = crate::report::plots::read_metrics(&metrics_path)
        .map_err(run_err)?
        .into_iter()
        .filter(|l| l["stage"].as_str().is_some_and(|s| s.starts_with("rl#")))
        .collect();
    let rl_stages: Vec<usize> = cfg
        .stages
        .iter()
        .enumerate()
        .filter(|(_, s)| s.kind == StageKind::Rl)
        .map(|(i, _)| i)
        .collect();
    let mut pass = Vec::new();
    if let (Some(&first), Some(&last)) = (rl_stages.first(), rl_stages.last()) {
        for (name, r) in &ctx.state.pass_before {
            pass.push(crate::report::plots::PassPoint {
                task: name.clone(),
                stage: format!("rl#{first}"),
                step: 0,
                pass_rate: r.rate(),
            });
        }
        for (name, r) in &ctx.pass_after {
            pass.push(crate::report::plots::PassPoint {
                task: name.clone(),
                stage: format!("rl#{last}"),
                step: cfg.stages[last].steps,
                pass_rate: r.rate(),
            });
        }
    }
    let targets: BTreeMap<String, f64> = cfg
        .tasks
        .iter()
        .map(|t| (t.name.clone(), t.target_share))
        .collect();
    let total_target: f64 = targets.values().sum::<f64>().max(1e-12);
    let targets = targets
        .into_iter()
        .map(|(k, v)| (k, v / total_target))
        .collect();
    let plots =
        crate::report::plots::write_all(&p.out, &lines, &targets, &pass).map_err(run_err)?;
    let table = ctx.summary_table(&summary);
    let _ = writeln!(ctx.progress, "{table}");
    let names: Vec<String> = plots
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        .collect();
    if !names.is_empty() {
        let _ = writeln!(ctx.progress, "plots: {}", names.join(", "));
    }
    let _ = writeln!(
        ctx.progress,
        "trace: open {} in https://ui.perfetto.dev (or chrome://tracing)",
        p.out.join("trace.json").display()
    );
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
    state: RunState,
    /// The checkpoint this process resumed from, until its stage is done.
    resume_from: Option<PathBuf>,
    pass_after: BTreeMap<String, PassRate>,
}

/// Over-sampling's counts over the RL stages (`rollout.over_sampling`; summary.json's
/// `over_sampling`).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct AbortTotals {
    groups_aborted: u64,
    aborted_tokens: u64,
    groups_resumed: u64,
    resumed_tokens: u64,
    trajectories_discarded: u64,
    discarded_tokens: u64,
    started_lengths: LengthHistogram,
    trained_lengths: LengthHistogram,
}

impl AbortTotals {
    fn add(&mut self, c: &sluice_runtime::metrics::RolloutCounters) {
        self.groups_aborted += c.groups_aborted;
        self.aborted_tokens += c.aborted_tokens;
        self.groups_resumed += c.groups_resumed;
        self.resumed_tokens += c.resumed_tokens;
        self.trajectories_discarded += c.trajectories_discarded;
        self.discarded_tokens += c.discarded_tokens;
        self.started_lengths.merge(&c.started_lengths);
        self.trained_lengths.merge(&c.trained_lengths);
    }

    fn summary(&self) -> Value {
        let (started, trained) = (&self.started_lengths, &self.trained_lengths);
        json!({
            "groups_aborted": self.groups_aborted,
            "aborted_tokens": self.aborted_tokens,
            "groups_resumed": self.groups_resumed,
            "resumed_tokens": self.resumed_tokens,
            "trajectories_discarded": self.trajectories_discarded,
            "discarded_tokens": self.discarded_tokens,
            // Generated tokens per trajectory: of every trajectory that started (at its end or
            // its discard) and of every trajectory trained. Aborts cut long trajectories
            // first; length_bias = trained mean / started mean.
            "started_mean_length": started.mean(),
            "trained_mean_length": trained.mean(),
            "length_bias": if started.mean() > 0.0 { trained.mean() / started.mean() } else { 0.0 },
            "started_p90_length_below": started.quantile_bound(0.9),
            "trained_p90_length_below": trained.quantile_bound(0.9),
            // Counts by length: bucket 0 is length 0, bucket k lengths in [2^(k-1), 2^k).
            "started_length_buckets": started.buckets,
            "trained_length_buckets": trained.buckets,
        })
    }
}

/// What the RL stages added up to (for summary.json).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct RlTotals {
    samples: u64,
    accepted_tokens: u64,
    /// Accepted tokens with a non-zero advantage.
    #[serde(default)]
    gradient_tokens: u64,
    sampled_tokens: u64,
    finished_generated: u64,
    zero_lag: u64,
    zero_lag_mismatch: u64,
    /// Learner-vs-behavior log-prob mismatch at lag 0 and above (see
    /// [`sluice_runtime::learner::StepReport::mismatch_lag0`]).
    #[serde(default)]
    mismatch_lag0: Mismatch,
    #[serde(default)]
    mismatch_lagpos: Mismatch,
    /// Trained tokens (repeats included) and those the IS gate rejected below / above.
    #[serde(default)]
    masked_tokens: u64,
    #[serde(default)]
    gated_low: u64,
    #[serde(default)]
    gated_high: u64,
    buffer_in: u64,
    stale: u64,
    env: u64,
    /// Environment-ended trajectories trained (buffer.env_gate = false).
    #[serde(default)]
    env_trained: u64,
    /// Optimizer steps of the RL stages (learner steps x minibatches x epochs).
    #[serde(default)]
    optimizer_steps: u64,
    /// Tokens whose PPO surrogate took its clipped branch.
    #[serde(default)]
    clipped: u64,
    /// Entropy and KL-to-reference sums over trained tokens (sluice_runtime's LearnerTotals).
    #[serde(default)]
    entropy_sum: f64,
    #[serde(default)]
    entropy_tokens: u64,
    #[serde(default)]
    kl_sum: f64,
    #[serde(default)]
    kl_tokens: u64,
    /// On-policy distillation: behavior - teacher log-prob summed over the scored tokens, and
    /// their count (sluice_runtime's LearnerTotals).
    #[serde(default)]
    opd_gap_sum: f64,
    #[serde(default)]
    opd_tokens: u64,
    /// Groups without reward variance: dropped by dynamic sampling, and trained (all of them
    /// with dynamic sampling off; past its cap with it on).
    #[serde(default)]
    zero_signal_dropped: u64,
    #[serde(default)]
    zero_signal_trained: u64,
    /// Over-sampling's aborts, and the generated lengths of started and trained trajectories.
    #[serde(default)]
    aborts: AbortTotals,
    /// Per task and number of model turns: trajectories in, stale drops, environment drops.
    #[serde(default)]
    by_turns: BTreeMap<String, BTreeMap<u32, (u64, u64, u64)>>,
    dup: u64,
    released: u64,
    elapsed_s: f64,
    engine_busy_s: f64,
    learner_busy_s: f64,
    shares: BTreeMap<String, (f64, u64)>,
    /// Per task: trajectories finished, trajectories the learner consumed (G per consumed
    /// group), and the sum of their completion times (seconds).
    #[serde(default)]
    flow: BTreeMap<String, (u64, u64, f64)>,
    /// Environment calls, and the failed ones by kind (crash, timeout, garbage, malformed,
    /// error, submit, refused_observation).
    #[serde(default)]
    env_calls: u64,
    #[serde(default)]
    env_faults: BTreeMap<String, u64>,
    /// Finished trajectories by terminal reason.
    #[serde(default)]
    by_terminal: BTreeMap<String, u64>,
    /// Text tasks' round trips (a BPE run; `rollout.retokenize`).
    #[serde(default)]
    round_trip: sluice_runtime::env::RoundTripCounts,
}

impl RunContext<'_> {
    fn line(&mut self, v: &Value) -> Result<(), TrainError> {
        self.state.metrics_lines += 1;
        writeln!(self.metrics, "{v}").map_err(|e| run_err(format!("metrics.jsonl: {e}")))
    }

    /// The optimizer of a stage: the supervised or the RL learning rates.
    fn optim_config(&self, kind: StageKind, schedule: LrSchedule) -> OptimConfig {
        let o = &self.cfg.optim;
        let (muon, adamw) = match kind {
            StageKind::Sft => (o.muon_lr, o.adamw_lr),
            StageKind::Rl => (o.rl_muon_lr, o.rl_adamw_lr),
        };
        let mut c = OptimConfig::with_lrs(muon, adamw, schedule);
        c.clip_norm = (o.clip_norm > 0.0).then_some(o.clip_norm);
        c.muon.weight_decay = o.weight_decay;
        c.adamw.weight_decay = o.weight_decay;
        c
    }
}
