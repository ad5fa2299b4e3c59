//! `sluice train`'s configuration (DESIGN 7.1): one TOML file, every key with a default, every
//! mistake an error that names the key.
//!
//! The defaults are `defaults.toml` (embedded; `sluice config --print-defaults` prints it, and
//! configs/default.toml is the same file). A config file holds only the keys it changes: its
//! sections are merged key by key into the defaults; `[[stage]]` replaces the default pipeline
//! as a whole; `[tasks.NAME]` tables merge into the default task of that name, or define a new
//! task (which then needs `kind`; its other keys default to the first default task's). `--set
//! section.key=value` overrides one key after the file (the value is read as TOML, or as a
//! string when it is not valid TOML: `--set run.mode=sync`).
//!
//! A key the defaults do not have, a value of another type (an integer is accepted where a
//! float is expected), or a value out of range is a [`ConfigError`] naming the key.

use sluice_kernels::Device;
use sluice_runtime::clock::CostModel;
use sluice_runtime::env::faults::FaultRates;
use sluice_runtime::env::latency::LatencyModel;
use std::fmt;
use std::path::{Path, PathBuf};
use toml::{Table, Value};

mod merge;
mod opd;
mod resolve;
mod servers;

use merge::{defaults, merge_config, parse_set};
pub use opd::{OpdSection, TeacherSection};
use resolve::resolve;
pub use resolve::HEARTBEAT_FLOOR_S;

/// The defaults, with a comment on every key.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// A bad config: the key (dotted path) or file, and what is wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "config key `{}`: {}", self.key, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.to_string(),
        message: message.into(),
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct RunSection {
    pub name: String,
    pub seed: u64,
    pub device: Device,
    pub mode: sluice_runtime::system::Mode,
    pub replay: bool,
    /// Wall clock: replica lanes on the first CPU, the learner on the last, one thread each.
    pub pin_lanes: bool,
    pub checkpoint_every: u64,
    pub log_every: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelSection {
    pub config: PathBuf,
    /// `model.precision` resolved for `run.device` (`auto`: bf16 on cuda and emu, f32 on cpu).
    pub precision: sluice_model::Precision,
    pub init: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageKind {
    Sft,
    Rl,
}

impl StageKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StageKind::Sft => "sft",
            StageKind::Rl => "rl",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct StageSection {
    pub kind: StageKind,
    pub steps: u64,
    pub tasks: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RolloutSection {
    pub replicas: usize,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    /// Bytes of each replica's KV pool (every layer's K and V); the blocks it holds depend on
    /// the model and the precision.
    pub kv_bytes: usize,
    pub block_size: usize,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub max_new_tokens: u32,
    pub max_turns: u32,
    pub swap: sluice_runtime::engine::SwapMode,
    pub preempt: sluice_runtime::engine::PreemptMode,
    pub share_correction: bool,
    pub eval_problems: usize,
    /// A replica silent this long is lost and restarted (None: no heartbeats).
    pub heartbeat_timeout_s: Option<f64>,
    /// An injected replica failure (tests and drills).
    pub fail: Option<sluice_runtime::health::ReplicaFault>,
    /// Over-sampling with abort, sync mode (None: off).
    pub over_sampling: Option<sluice_runtime::system::OverSampling>,
    /// Rollout servers (`http://host:port`) driven as the replicas; empty: in-process engines.
    pub servers: Vec<String>,
    /// Train the text tasks' model turns decoded and re-encoded instead of as sampled (the
    /// round trip of `sluice experiment tito`, crate::tasks::round_trip); needs a BPE.
    pub retokenize: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BufferSection {
    pub group_size: u32,
    pub tau: u64,
    pub eta: u64,
    pub groups_per_step: usize,
    /// Drop environment-ended trajectories (false: train them as failures).
    pub env_gate: bool,
    /// Dynamic sampling: at most this many groups without reward variance dropped per learner
    /// step (None: off).
    pub dynamic_sampling: Option<u64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LossSection {
    pub mode: sluice_kernels::ops::is_gate_loss::GateMode,
    pub eps_low: f32,
    pub eps_high: f32,
    /// The bounds of tokens with a negative advantage (`loss.four_bounds`); None: one pair.
    pub eps_neg: Option<(f32, f32)>,
    pub beta: f32,
    pub std_free: bool,
    pub aggregation: sluice_runtime::learner::Aggregation,
    /// Decoupled PPO's weight cap (`loss.decoupled`); None: off.
    pub decoupled: Option<f32>,
    pub micro_batch_tokens: usize,
    /// The entropy bonus's coefficient (0: off).
    pub entropy_coef: f32,
    /// The KL to the reference (None: no reference kept; coef 0 with `loss.kl_log`: measured).
    pub kl: Option<sluice_runtime::regularize::KlConfig>,
    /// The reference's checkpoint (None: the RL stage's initial weights).
    pub kl_reference: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct OptimSection {
    pub muon_lr: f32,
    pub adamw_lr: f32,
    pub rl_muon_lr: f32,
    pub rl_adamw_lr: f32,
    pub clip_norm: f32,
    pub weight_decay: f32,
    pub sft_batch: usize,
    pub sft_warmup: u64,
    /// SFT: the cosine schedule ends at this fraction of the peak learning rates.
    pub sft_min_lr_ratio: f32,
    /// RL: optimizer steps per pass over a learner step's groups, and passes.
    pub minibatches: usize,
    pub epochs: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SyncSection {
    pub interval: u64,
    /// inprocess | delta | disk.
    pub path: String,
    pub reset_optimizer: bool,
}

/// The baselines `sluice train` runs beside RL (crate::arms).
#[derive(Clone, Debug, PartialEq)]
pub struct BaselinesSection {
    pub ablation: bool,
    pub rft: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TaskSection {
    pub name: String,
    pub kind: String,
    pub concurrency: u64,
    pub timeout_s: f64,
    pub retries: u32,
    pub target_share: f64,
    pub latency: LatencyModel,
    pub faults: FaultRates,
    /// The kind's parameters (`digits`, `min_digits`, `tool_fraction`, `wrong_call_fraction`, `chain_fraction`, `items`).
    pub options: crate::tasks::TaskOptions,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    Char,
    Bpe,
}

/// The text tokenizer of the run (crate::tasks::text).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerSection {
    pub kind: TokenizerKind,
    /// The tokenizer.json of a BPE (required for bpe).
    pub path: Option<PathBuf>,
    /// The largest vocabulary the model may take from a BPE.
    pub max_vocab: usize,
}

impl TokenizerSection {
    /// Loads the tokenizer; a missing or bad file, a missing special token or a vocabulary
    /// over `max_vocab` is an error naming the key (and the file).
    pub fn load(&self) -> Result<std::sync::Arc<crate::tasks::text::TextTokenizer>, ConfigError> {
        use crate::tasks::text::TextTokenizer;
        let path = match (self.kind, &self.path) {
            (TokenizerKind::Char, _) => return Ok(TextTokenizer::char()),
            (TokenizerKind::Bpe, None) => {
                return Err(err("tokenizer.path", "kind bpe needs a tokenizer.json"))
            }
            (TokenizerKind::Bpe, Some(p)) => p,
        };
        let bpe = crate::tasks::bpe::Bpe::load(path).map_err(|m| err("tokenizer.path", m))?;
        if bpe.vocab_size() > self.max_vocab {
            return Err(err(
                "tokenizer.max_vocab",
                format!(
                    "{}: the vocabulary has {} ids, over the model's limit of {} (raise \
                     tokenizer.max_vocab or train a smaller one: sluice tokenizer train --vocab N)",
                    path.display(),
                    bpe.vocab_size(),
                    self.max_vocab
                ),
            ));
        }
        Ok(std::sync::Arc::new(TextTokenizer::Bpe(
            std::sync::Arc::new(bpe),
        )))
    }

    /// The model's vocabulary: a BPE's size (the model config's `vocab` is replaced), the
    /// model config's own for the character tokenizer.
    pub fn model_vocab(
        &self,
        tok: &crate::tasks::text::TextTokenizer,
        model_config_vocab: usize,
    ) -> usize {
        match self.kind {
            TokenizerKind::Char => model_config_vocab,
            TokenizerKind::Bpe => tok.vocab_size(),
        }
    }
}

/// The whole resolved configuration.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub run: RunSection,
    pub model: ModelSection,
    pub stages: Vec<StageSection>,
    pub rollout: RolloutSection,
    pub buffer: BufferSection,
    pub loss: LossSection,
    /// On-policy distillation in the RL stages (None: off).
    pub opd: Option<OpdSection>,
    pub optim: OptimSection,
    pub sync: SyncSection,
    pub baselines: BaselinesSection,
    pub tokenizer: TokenizerSection,
    pub cost: CostModel,
    /// Every task the stages use, in the order of first use.
    pub tasks: Vec<TaskSection>,
    /// The merged table (written to the run folder as config.toml).
    pub table: Table,
}

impl TrainConfig {
    /// The resolved config as TOML (the run folder's config.toml; loading it gives this config).
    pub fn to_toml(&self) -> String {
        toml::to_string(&self.table).unwrap_or_default()
    }

    pub fn task(&self, name: &str) -> Option<&TaskSection> {
        self.tasks.iter().find(|t| t.name == name)
    }

    /// The sync path of an RL stage; the disk path publishes into `run_dir`/sync.
    pub fn sync_options(&self, run_dir: &Path) -> sluice_runtime::sync::SyncOptions {
        use sluice_runtime::sync::SyncPath;
        let path = match self.sync.path.as_str() {
            "delta" => SyncPath::Delta,
            "disk" => SyncPath::Disk(run_dir.join("sync")),
            _ => SyncPath::InProcess,
        };
        sluice_runtime::sync::SyncOptions {
            path,
            ..Default::default()
        }
    }

    /// The rollout health settings of an RL stage.
    pub fn health(&self) -> sluice_runtime::health::HealthConfig {
        sluice_runtime::health::HealthConfig {
            heartbeat_timeout: self
                .rollout
                .heartbeat_timeout_s
                .map(sluice_runtime::clock::Micros::from_secs),
            fail: self.rollout.fail,
        }
    }
}

/// Loads the config: defaults, then `file` (if any), then each `--set`.
pub fn load(file: Option<&Path>, sets: &[String]) -> Result<TrainConfig, ConfigError> {
    let defaults = defaults();
    let mut merged = defaults.clone();
    if let Some(path) = file {
        let key = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(&key, format!("cannot read the config file: {e}")))?;
        let user: Table = text
            .parse()
            .map_err(|e: toml::de::Error| err(&key, format!("not valid TOML: {e}")))?;
        merge_config(&mut merged, &defaults, user)?;
    }
    for s in sets {
        let t = parse_set(s)?;
        merge_config(&mut merged, &defaults, t)?;
    }
    resolve(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_resolve() {
        let c = load(None, &[]).unwrap();
        assert_eq!(c.run.name, "default");
        // The runtime's default charges are the ones this file states.
        assert_eq!(c.cost, CostModel::default());
        assert_eq!(c.stages.len(), 2);
        assert_eq!(c.tasks.len(), 2);
        // The written config.toml loads back to the same values.
        let dir = std::env::temp_dir().join(format!("sluice-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.toml");
        std::fs::write(&p, c.to_toml()).unwrap();
        let again = load(Some(&p), &[]).unwrap();
        assert_eq!(again.table, c.table);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_group_of_one_is_refused_only_where_advantages_need_groups() {
        let e = load(None, &["buffer.group_size=1".into()]).unwrap_err();
        assert_eq!(e.key, "buffer.group_size", "{e}");
        assert!(e.message.contains("advantage"), "{e}");
        // A supervised-only pipeline has no advantages: a group of one is fine there.
        let dir = std::env::temp_dir().join(format!("sluice-cfg-g1-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("sft.toml");
        std::fs::write(
            &p,
            "[[stage]]\nkind = \"sft\"\nsteps = 3\ntasks = [\"tool\"]\n\n[buffer]\ngroup_size = 1\n",
        )
        .unwrap();
        let c = load(Some(&p), &[]).unwrap();
        assert_eq!(c.buffer.group_size, 1);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn pinned_lanes_need_the_wall_clock() {
        assert!(!load(None, &[]).unwrap().run.pin_lanes);
        let e = load(
            None,
            &["run.pin_lanes=true".into(), "run.replay=true".into()],
        )
        .unwrap_err();
        assert_eq!(e.key, "run.pin_lanes", "{e}");
        assert!(e.to_string().contains("run.replay"), "{e}");
        if sluice_runtime::system::pinnable_cpus() >= 2 {
            assert!(
                load(None, &["run.pin_lanes=true".into()])
                    .unwrap()
                    .run
                    .pin_lanes
            );
        }
    }

    #[test]
    fn over_sampling_is_a_sync_ratio_and_partial_rollout_needs_it() {
        assert_eq!(load(None, &[]).unwrap().rollout.over_sampling, None);
        let sync = "run.mode=\"sync\"".to_string();
        let c = load(
            None,
            &[
                sync.clone(),
                "rollout.over_sampling=1.5".into(),
                "rollout.partial_rollout=true".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            c.rollout.over_sampling,
            Some(sluice_runtime::system::OverSampling {
                ratio: 1.5,
                keep_partial: true
            })
        );
        for (sets, key, names) in [
            (
                vec!["rollout.over_sampling=1.5".to_string()],
                "rollout.over_sampling",
                "run.mode",
            ),
            (
                vec![sync.clone(), "rollout.over_sampling=0.5".into()],
                "rollout.over_sampling",
                "[1, 8]",
            ),
            (
                vec![sync, "rollout.partial_rollout=true".into()],
                "rollout.partial_rollout",
                "rollout.over_sampling",
            ),
        ] {
            let e = load(None, &sets).unwrap_err();
            assert_eq!(e.key, key, "{sets:?}: {e}");
            assert!(e.to_string().contains(names), "{sets:?}: {e}");
        }
    }

    #[test]
    fn heartbeat_timeout_has_a_floor() {
        for bad in ["0.001", "0.5", "0.999"] {
            let e = load(None, &[format!("rollout.heartbeat_timeout_s={bad}")]).unwrap_err();
            assert_eq!(e.key, "rollout.heartbeat_timeout_s", "{bad}: {e}");
            assert!(e.message.contains("engine step"), "{bad}: {e}");
        }
        let off = load(None, &["rollout.heartbeat_timeout_s=0".into()]).unwrap();
        assert_eq!(off.rollout.heartbeat_timeout_s, None);
        let floor = load(
            None,
            &[format!("rollout.heartbeat_timeout_s={HEARTBEAT_FLOOR_S}")],
        );
        assert_eq!(
            floor.unwrap().rollout.heartbeat_timeout_s,
            Some(HEARTBEAT_FLOOR_S)
        );
    }

    #[test]
    fn sets_override_and_are_checked() {
        let c = load(None, &["buffer.tau=4".into(), "run.mode=sync".into()]).unwrap();
        assert_eq!(c.buffer.tau, 4);
        assert_eq!(c.run.mode, sluice_runtime::system::Mode::Sync);
        let c = load(None, &["tasks.tool.faults.crash=0.2".into()]).unwrap();
        assert_eq!(c.task("tool").unwrap().faults.crash, 0.2);
        for (set, key) in [
            ("buffer.tau=-1", "buffer.tau"),
            ("buffer.group_size=0", "buffer.group_size"),
            ("buffer.eta=-2", "buffer.eta"),
            ("buffer.foo=1", "buffer.foo"),
            ("buffer.tau=\"x\"", "buffer.tau"),
            ("run.mode=fast", "run.mode"),
            ("sync.path=nfs", "sync.path"),
            // tau 4 (the default): K = 6 reaches lag 5 between publications.
            ("sync.interval=6", "sync.interval"),
            ("rollout.fail_kind=explode", "rollout.fail_kind"),
            ("rollout.fail_at_step=-1", "rollout.fail_at_step"),
            (
                "rollout.heartbeat_timeout_s=-1",
                "rollout.heartbeat_timeout_s",
            ),
            ("nosuch.key=1", "nosuch"),
            ("tasks.tool.faults.crash=2", "tasks.tool.faults.crash"),
        ] {
            let e = load(None, &[set.into()]).unwrap_err();
            assert_eq!(e.key, key, "{set}: {e}");
        }
        // An injected replica failure needs a replica that exists, a step, and heartbeats.
        let hang = |extra: &str| -> Vec<String> {
            vec![
                "rollout.fail_kind=hang".into(),
                "rollout.fail_at_step=5".into(),
                extra.into(),
            ]
        };
        for (sets, key) in [
            (hang("rollout.fail_replica=1"), "rollout.fail_replica"),
            (hang("rollout.fail_at_step=0"), "rollout.fail_at_step"),
            (
                hang("rollout.heartbeat_timeout_s=0"),
                "rollout.heartbeat_timeout_s",
            ),
        ] {
            let e = load(None, &sets).unwrap_err();
            assert_eq!(e.key, key, "{sets:?}: {e}");
        }
        let c = load(None, &hang("rollout.replicas=2")).unwrap();
        let h = c.health();
        assert_eq!(
            h.fail,
            Some(sluice_runtime::health::ReplicaFault {
                replica: 0,
                at_step: 5,
                kind: sluice_runtime::health::FailKind::Hang
            })
        );
        assert!(h.heartbeat_timeout.is_some());
        let c = load(None, &["sync.path=disk".into()]).unwrap();
        assert_eq!(
            c.sync_options(Path::new("runs/x")).path,
            sluice_runtime::sync::SyncPath::Disk(PathBuf::from("runs/x/sync"))
        );
    }
}
