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
use sluice_runtime::learner::{Learner, LearnerConfig, Mismatch, Publication, StepReport};
use sluice_runtime::metrics::{insert_mismatch, LearnerTotals, Trace};
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

/// Builds the task of a config section (the model's vocabulary bounds the token ids).
pub fn make_task(t: &TaskSection, vocab: usize) -> Result<Arc<dyn Task>, String> {
    crate::tasks::make(&t.kind, &t.name, vocab, &t.options)
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
    let model_cfg = ModelConfig::from_file(&cfg.model.config).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "model.config".into(),
            message: format!("{}: {e}", cfg.model.config.display()),
        })
    })?;
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

const STATE_FORMAT: u32 = 1;

/// Writes a checkpoint folder atomically: everything goes to a temporary folder first, which
/// is renamed into place only when complete (a run killed mid-write leaves the previous
/// checkpoints intact and the temporary folder ignored).
fn write_checkpoint(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&Path) -> Result<(), String>,
    state: &RunState,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tmp = dir.join(format!(".tmp-{name}"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    write(&tmp)?;
    let text = serde_json::to_string(state).map_err(|e| format!("state.json: {e}"))?;
    sluice_model::checkpoint::write_atomic(&tmp.join("state.json"), text.as_bytes())
        .map_err(|e| format!("state.json: {e}"))?;
    let fin = dir.join(name);
    let _ = std::fs::remove_dir_all(&fin);
    std::fs::rename(&tmp, &fin).map_err(|e| format!("{}: {e}", fin.display()))?;
    // The rename is durable once the folder's entry is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The newest complete checkpoint of a run folder (names sort in run order).
fn latest_checkpoint(out: &Path) -> Result<Option<PathBuf>, TrainError> {
    let dir = out.join("checkpoints");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(None);
    };
    let mut names: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'))
                && p.join("state.json").is_file()
        })
        .collect();
    names.sort();
    Ok(names.pop())
}

fn read_state(ck: &Path) -> Result<RunState, TrainError> {
    let p = ck.join("state.json");
    let text = std::fs::read_to_string(&p)
        .map_err(|e| TrainError::Input(format!("{}: {e}", p.display())))?;
    let st: RunState = serde_json::from_str(&text)
        .map_err(|e| TrainError::Input(format!("{}: not a run state: {e}", p.display())))?;
    if st.format != STATE_FORMAT {
        return Err(TrainError::Input(format!(
            "{}: state format {} (this build reads {STATE_FORMAT})",
            p.display(),
            st.format
        )));
    }
    Ok(st)
}

/// Cuts metrics.jsonl back to its first `lines` lines (a resumed run rewrites the rest).
fn truncate_lines(path: &Path, lines: u64) -> Result<std::fs::File, TrainError> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kept: String = text
        .lines()
        .take(lines as usize)
        .map(|l| format!("{l}\n"))
        .collect();
    if (kept.lines().count() as u64) < lines {
        return Err(TrainError::Input(format!(
            "{}: has fewer lines than its checkpoint recorded ({lines}); the run folder was \
             changed by hand",
            path.display()
        )));
    }
    std::fs::write(path, kept).map_err(|e| run_err(format!("{}: {e}", path.display())))?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| run_err(format!("{}: {e}", path.display())))
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
            let file = truncate_lines(&metrics_path, st.metrics_lines)?;
            (st, Some(ck), file)
        }
        None => {
            prepare_folder(&p.out)?;
            std::fs::write(p.out.join("config.toml"), cfg.to_toml())
                .map_err(|e| run_err(format!("config.toml: {e}")))?;
            let file = std::fs::File::create(&metrics_path)
                .map_err(|e| run_err(format!("{}: {e}", metrics_path.display())))?;
            (
                RunState {
                    format: STATE_FORMAT,
                    ..RunState::default()
                },
                None,
                file,
            )
        }
    };
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
            self.optim_config(
                StageKind::Sft,
                LrSchedule::WarmupCosine {
                    warmup,
                    total: steps,
                    min_ratio: 0.1,
                },
            ),
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
                .step(
                    backend,
                    &mut model.params,
                    &model.grads,
                    &mut state,
                    model.compute.as_mut(),
                )
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
            model.compute_weights(),
            WeightVersion(self.state.rl_version),
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
            kv_bytes: r.kv_bytes,
            block_size: r.block_size,
            max_batch_tokens: r.max_batch_tokens,
            max_seqs: r.max_seqs,
            preempt: r.preempt,
            swap: r.swap,
            precision: self.cfg.model.precision,
        }
    }

    /// One RL stage: held-out pass rates first (on the first RL stage), then the system; or
    /// its continuation from the checkpoint this process resumed from.
    fn rl_stage(&mut self, index: usize, model: Model) -> Result<Model, TrainError> {
        let cfg = self.cfg;
        let stage = &cfg.stages[index];
        let resume = self.state.rl.clone();
        if self.state.pass_before.is_empty() && resume.is_none() {
            self.state.pass_before = self.evaluate(&model, &stage.tasks)?;
            for (name, r) in &self.state.pass_before {
                let _ = writeln!(
                    self.progress,
                    "  held-out pass rate before RL: {name} {:.1}% ({})",
                    100.0 * r.rate(),
                    r.counts()
                );
            }
        }
        // The engines' weights: the model's compute weights (a new stage), or what they held
        // at the barrier (saved as f32; a bf16 copy's values come back exactly).
        let learner_backend = Backend::open(cfg.run.device).map_err(run_err)?;
        let dtype = cfg.model.precision.dtype();
        let (engine_params, engine_version) = match (&resume, &self.resume_from) {
            (Some(r), Some(ck)) => {
                let (_, arena) = sluice_model::checkpoint::load_new(
                    &ck.join("rollout.safetensors"),
                    &learner_backend,
                )
                .map_err(|e| TrainError::Input(format!("resume: {e}")))?;
                (
                    arena.cast_copy(&learner_backend, dtype).map_err(run_err)?,
                    r.engine_version,
                )
            }
            _ => (
                model
                    .compute_weights()
                    .cast_copy(&learner_backend, dtype)
                    .map_err(run_err)?,
                self.state.rl_version,
            ),
        };
        let mut engines = Vec::with_capacity(cfg.rollout.replicas);
        for _ in 0..cfg.rollout.replicas {
            let b = Backend::open(cfg.run.device).map_err(run_err)?;
            engines.push(
                Engine::new(
                    b,
                    &model.config,
                    &engine_params,
                    WeightVersion(engine_version),
                    self.engine_config(),
                )
                .map_err(run_err)?,
            );
        }
        let mut learner = Learner::new(
            learner_backend,
            model,
            self.optim_config(StageKind::Rl, LrSchedule::Constant),
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
            self.state.rl_version,
        )
        .map_err(run_err)?;
        if let (Some(_), Some(ck)) = (&resume, &self.resume_from) {
            // Weights and optimizer state at the barrier.
            learner
                .load(&ck.join("learner.safetensors"), self.state.rl_version)
                .map_err(|e| TrainError::Input(format!("resume: {e}")))?;
        }
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
            vocab: learner.model().config.vocab,
            max_observation_tokens: 256,
        };
        let mut orch = Orchestrator::new(specs, policy, 0).map_err(run_err)?;
        let mut buffer = DataBuffer::new(BufferConfig {
            group_size: cfg.buffer.group_size,
            tau: cfg.buffer.tau,
            env_gate: cfg.buffer.env_gate,
        });
        let mut totals = LearnerTotals::new();
        let mut stage_trace = Trace::default();
        let mut clock = self.state.clock;
        if let Some(r) = &resume {
            orch.restore(r.orchestrator.clone()).map_err(run_err)?;
            buffer = r.buffer.clone();
            totals = r.totals.clone();
            stage_trace = r.trace.clone();
            clock = r.now;
        }
        let sc = StageConfig {
            name: format!("rl#{index}"),
            mode: cfg.run.mode,
            clock: self.clock(),
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
        let engine_weights = Arc::new(Publication {
            version: WeightVersion(engine_version),
            params: Arc::new(engine_params),
        });
        let start = StageStart {
            clock,
            stage_began: resume.as_ref().map_or(clock, |r| r.stage_began),
            totals,
            engine_weights,
        };
        let mut base = self.state.clone();
        base.next_stage = index;
        let mut obs = RlObserver {
            metrics: &mut *self.metrics,
            progress: Progress::new(&format!("rl #{index}"), stage.steps, cfg.run.log_every),
            out: &mut *self.progress,
            tasks: stage.tasks.clone(),
            checkpoints: self.out_dir.join("checkpoints"),
            base,
            stage_index: index,
            stage_trace: stage_trace.clone(),
            started: Instant::now(),
            seconds_before: resume.as_ref().map_or(0.0, |r| r.stage_seconds),
        };
        let (parts, _orch, _buffer, report) = run_stage(
            &sc,
            Parts { learner, engines },
            orch,
            buffer,
            start,
            &mut obs,
        )
        .map_err(|e| match e {
            // A setting only a run can show wrong: a bad config all the same (exit 2).
            RunError::HeartbeatTooShort { .. } => TrainError::Config(ConfigError {
                key: "rollout.heartbeat_timeout_s".into(),
                message: e.to_string(),
            }),
            e => run_err(e),
        })?;
        obs.progress.finish(
            obs.out,
            &format!(
                "{:.1}s; zero-lag mismatch {} of {} tokens",
                report.wall.as_secs_f64(),
                report.learner.zero_lag_mismatch_tokens,
                report.learner.zero_lag_tokens
            ),
        );
        self.state.metrics_lines = obs.base.metrics_lines;
        if report.learner.zero_lag_mismatch_tokens > 0 {
            let _ = writeln!(
                self.progress,
                "WARNING: {} zero-lag tokens had a learner log-prob that differs from the \
                 rollout's in some bit (the design promises 0)",
                report.learner.zero_lag_mismatch_tokens
            );
        }
        // report.elapsed runs from the stage's beginning (before any resume).
        self.state.clock = resume
            .as_ref()
            .map_or(clock, |r| r.stage_began)
            .plus(report.elapsed);
        self.state.rl_version = parts.learner.version().0;
        self.state.learner_steps += report.learner.steps;
        self.state.trace.spans.extend(stage_trace.spans);
        self.state
            .trace
            .spans
            .extend(report.trace.spans.iter().cloned());
        let t = self.state.rl_totals.get_or_insert_with(RlTotals::default);
        let l = &report.learner;
        t.samples += l.samples;
        t.accepted_tokens += l.accepted_tokens;
        t.gradient_tokens += l.gradient_tokens;
        t.sampled_tokens += report.rollout.sampled_tokens;
        t.finished_generated += report.rollout.finished_generated_tokens;
        t.zero_lag += l.zero_lag_tokens;
        t.zero_lag_mismatch += l.zero_lag_mismatch_tokens;
        t.mismatch_lag0.merge(&l.mismatch_lag0);
        t.mismatch_lagpos.merge(&l.mismatch_lagpos);
        t.masked_tokens += l.masked_tokens;
        t.gated_low += l.gated_low;
        t.gated_high += l.gated_high;
        t.buffer_in += report.buffer.trajectories_in;
        t.stale += report.buffer.stale_dropped;
        t.env += report.buffer.env_dropped;
        t.env_trained += report.buffer.env_trained;
        t.dup += report.buffer.duplicated;
        t.released += report.buffer.trajectories_released;
        t.elapsed_s = self.state.clock.secs();
        t.engine_busy_s += report.rollout.engine_busy.secs();
        t.learner_busy_s += report.rollout.learner_busy.secs();
        for (name, target, st) in &report.tasks {
            let groups = l.per_task.get(name).map_or(0, |x| x.groups);
            let e = t.shares.entry(name.clone()).or_insert((*target, 0));
            e.0 = *target;
            e.1 += groups;
            let f = t.flow.entry(name.clone()).or_insert((0, 0, 0.0));
            f.0 += st.trajectories_finished;
            f.1 += st.groups_consumed * cfg.buffer.group_size as u64;
            f.2 += st.completion_sum.secs();
        }
        let (_, model, _) = parts.learner.into_parts();
        Ok(model)
    }

    /// The baselines of `[baselines]` and every arm's held-out pass rates (crate::arms), when
    /// the run has an RL stage; summary.json's `arms`.
    fn arms(
        &mut self,
        p: &Plan,
        rl_model: &Model,
        names: &[String],
    ) -> Result<Option<Value>, TrainError> {
        let cfg = self.cfg;
        let Some(first_rl) = cfg.stages.iter().position(|s| s.kind == StageKind::Rl) else {
            return Ok(None);
        };
        if names.is_empty() || cfg.rollout.eval_problems == 0 {
            return Ok(None);
        }
        let warm_file = match first_rl {
            0 => cfg.model.init.clone(),
            i => Some(
                p.out
                    .join("checkpoints")
                    .join(format!("{:03}-end", i - 1))
                    .join("learner.safetensors"),
            ),
        };
        let start = match &warm_file {
            Some(f) => crate::arms::Start::File(f),
            None => crate::arms::Start::Fresh(&p.model_cfg),
        };
        let t = self.state.rl_totals.clone().unwrap_or_default();
        let budget = crate::arms::RlBudget {
            steps: self.state.learner_steps,
            trained_tokens: t.accepted_tokens,
            groups: t.shares.iter().map(|(k, v)| (k.clone(), v.1)).collect(),
        };
        let rate = |m: &BTreeMap<String, PassRate>| -> BTreeMap<String, f64> {
            m.iter().map(|(k, v)| (k.clone(), v.rate())).collect()
        };
        let (warm, rl) = (rate(&self.state.pass_before), rate(&self.pass_after));
        let mut arms = crate::arms::Arms {
            cfg,
            tasks: self.tasks,
            progress: &mut *self.progress,
            metrics: &mut *self.metrics,
        };
        let (v, times) = arms
            .run_all(start, rl_model, names, &budget, &warm, &rl)
            .map_err(run_err)?;
        self.state.stage_times.extend(times);
        Ok(Some(v))
    }

    /// The RL stages' run clock.
    fn clock(&self) -> ClockMode {
        if self.cfg.run.replay {
            ClockMode::Virtual
        } else {
            ClockMode::Wall
        }
    }

    fn summary(&self, sha: &str, wall_s: f64) -> Value {
        let t = self.state.rl_totals.as_ref();
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let total_groups: u64 = t.map_or(0, |t| t.shares.values().map(|s| s.1).sum());
        let mut tasks = serde_json::Map::new();
        let names: Vec<String> = self
            .state
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
            let (finished, consumed, completion) = t
                .and_then(|t| t.flow.get(&name).copied())
                .unwrap_or((0, 0, 0.0));
            tasks.insert(
                name.clone(),
                json!({
                    "target_share": target,
                    "learner_share": ratio(groups, total_groups),
                    // q: the share of the task's finished trajectories the learner trained on.
                    "acceptance_rate": ratio(consumed, finished),
                    "mean_completion_s": if finished > 0 { completion / finished as f64 } else { 0.0 },
                    "pass_rate_before": self.state.pass_before.get(&name).map(PassRate::rate),
                    "pass_rate_after": self.pass_after.get(&name).map(PassRate::rate),
                    // Distinct held-out problems each pass rate is over (drawn without
                    // replacement).
                    "held_out_problems": self.pass_after.get(&name).or(self.state.pass_before.get(&name)).map(|r| r.problems),
                }),
            );
        }
        let elapsed = t.map_or(0.0, |t| t.elapsed_s).max(1e-9);
        // Over the whole run: token-weighted means and the max (the metrics lines' keys).
        let mut mismatch = serde_json::Map::new();
        let none = RlTotals::default();
        let tt = t.unwrap_or(&none);
        insert_mismatch(&mut mismatch, "mismatch.lag0", &tt.mismatch_lag0);
        insert_mismatch(&mut mismatch, "mismatch.lagpos", &tt.mismatch_lagpos);
        let gated = tt.gated_low + tt.gated_high;
        for (key, n) in [
            ("is_clip_fraction", gated),
            ("is_gated_low_fraction", tt.gated_low),
            ("is_gated_high_fraction", tt.gated_high),
            (
                "is_accepted_fraction",
                tt.masked_tokens.saturating_sub(gated),
            ),
        ] {
            mismatch.insert(key.into(), json!(ratio(n, tt.masked_tokens)));
        }
        let mut s = json!({
            // Every rate per second below is per second of this clock.
            "clock": self.clock().as_str(),
            "final_weights_sha256": sha,
            "learner_steps": self.state.learner_steps,
            "samples_trained": t.map_or(0, |t| t.samples),
            "wall_s": wall_s,
            "rl_time_s": t.map_or(0.0, |t| t.elapsed_s),
            "effective_tokens_per_s": t.map_or(0.0, |t| t.accepted_tokens as f64 / elapsed),
            "gradient_tokens_per_s": t.map_or(0.0, |t| t.gradient_tokens as f64 / elapsed),
            "raw_tokens_per_s": t.map_or(0.0, |t| t.sampled_tokens as f64 / elapsed),
            "token_accept_rate": t.map_or(0.0, |t| ratio(t.accepted_tokens, t.finished_generated)),
            "stale_drop_rate": t.map_or(0.0, |t| ratio(t.stale, t.buffer_in)),
            "env_drop_rate": t.map_or(0.0, |t| ratio(t.env, t.buffer_in)),
            // Environment-ended trajectories trained as failures (buffer.env_gate = false).
            "env_trained_rate": t.map_or(0.0, |t| ratio(t.env_trained, t.buffer_in)),
            "group_dup_rate": t.map_or(0.0, |t| ratio(t.dup, t.released)),
            "zero_lag_tokens": t.map_or(0, |t| t.zero_lag),
            "zero_lag_mismatch_tokens": t.map_or(0, |t| t.zero_lag_mismatch),
            "engine_busy": t.map_or(0.0, |t| t.engine_busy_s / elapsed / self.cfg.rollout.replicas as f64),
            "learner_busy": t.map_or(0.0, |t| t.learner_busy_s / elapsed),
            "stage_seconds": self.state.stage_times.iter().map(|(n, s)| (n.clone(), json!(s))).collect::<serde_json::Map<_, _>>(),
            "tasks": tasks,
        });
        if let Some(m) = s.as_object_mut() {
            m.extend(mismatch);
        }
        s
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
            "\n| task | pass rate before RL | after RL | target share | learner share | \
             trajectories trained | mean completion |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|---|---|");
        if let Some(tasks) = s["tasks"].as_object() {
            for (name, v) in tasks {
                let _ = writeln!(
                    t,
                    "| {name} | {} | {} | {} | {} | {} | {:.2}s |",
                    pct(&v["pass_rate_before"]),
                    pct(&v["pass_rate_after"]),
                    pct(&v["target_share"]),
                    pct(&v["learner_share"]),
                    pct(&v["acceptance_rate"]),
                    v["mean_completion_s"].as_f64().unwrap_or(0.0)
                );
            }
        }
        let _ = writeln!(
            t,
            "\n| accepted tokens | stale drops | env drops | group repeats | effective tok/s | gradient tok/s | raw tok/s | zero-lag mismatch |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} of {} |",
            pct(&s["token_accept_rate"]),
            pct(&s["stale_drop_rate"]),
            pct(&s["env_drop_rate"]),
            pct(&s["group_dup_rate"]),
            s["effective_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["gradient_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["raw_tokens_per_s"].as_f64().unwrap_or(0.0),
            s["zero_lag_mismatch_tokens"],
            s["zero_lag_tokens"],
        );
        let _ = write!(
            t,
            "{}",
            match s["clock"].as_str() {
                Some("virtual") => {
                    "tok/s: per second of the virtual clock (run.replay = true), not of wall time\n"
                }
                _ => "tok/s: per second of the wall clock\n",
            }
        );
        t.push_str(&crate::arms::table(&s["arms"]));
        let _ = write!(t, "\ntime per stage:");
        for (n, secs) in &self.state.stage_times {
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
    /// The run state at the stage's start (a barrier's checkpoint adds the stage's progress).
    base: RunState,
    stage_index: usize,
    /// Spans of this stage from before a resume.
    stage_trace: Trace,
    started: Instant,
    seconds_before: f64,
}

impl StageObserver for RlObserver<'_> {
    fn on_step(&mut self, line: &Value, _report: &StepReport) -> Result<(), String> {
        writeln!(self.metrics, "{line}").map_err(|e| format!("metrics.jsonl: {e}"))?;
        self.base.metrics_lines += 1;
        let step = line["step"].as_u64().unwrap_or(0);
        let mut msg = String::new();
        for t in &self.tasks {
            let r = line[format!("reward_mean_window.{t}")]
                .as_f64()
                .unwrap_or(0.0);
            msg.push_str(&format!("{t} {r:.2}  "));
        }
        msg.push_str(&format!(
            "eff {:.0} tok/s  grad {:.0} tok/s  raw {:.0} tok/s ({} clock)",
            line["effective_tokens_per_s"].as_f64().unwrap_or(0.0),
            line["gradient_tokens_per_s"].as_f64().unwrap_or(0.0),
            line["raw_tokens_per_s"].as_f64().unwrap_or(0.0),
            line["clock"].as_str().unwrap_or("wall")
        ));
        self.progress.update(self.out, step, &msg);
        Ok(())
    }

    fn on_barrier(&mut self, view: &BarrierView<'_>) -> Result<(), String> {
        let _ = self.metrics.sync_data();
        let mut trace = self.stage_trace.clone();
        trace.spans.extend(view.trace.spans.iter().cloned());
        let mut state = self.base.clone();
        state.rl_version = view.learner.version().0;
        state.rl = Some(RlProgress {
            now: view.now,
            stage_began: view.stage_began,
            buffer: view.buffer.clone(),
            orchestrator: view.orchestrator.state().map_err(|e| e.to_string())?,
            totals: view.totals.clone(),
            engine_version: view.engine_weights.version.0,
            trace,
            stage_seconds: self.seconds_before + self.started.elapsed().as_secs_f64(),
        });
        let name = format!("{:03}-{:09}", self.stage_index, view.totals.steps);
        let learner = view.learner;
        let config = learner.model().config.clone();
        let engine = view.engine_weights;
        write_checkpoint(
            &self.checkpoints,
            &name,
            |dir| {
                learner
                    .save(&dir.join("learner.safetensors"))
                    .map_err(|e| format!("checkpoint: {e}"))?;
                sluice_model::checkpoint::save_with_meta(
                    &dir.join("rollout.safetensors"),
                    &config,
                    &engine.params,
                    &[],
                    &[("version", engine.version.0.to_string())],
                )
                .map_err(|e| format!("checkpoint: {e}"))
            },
            &state,
        )
    }
}
