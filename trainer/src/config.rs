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

/// The defaults, with a comment on every key.
pub const DEFAULTS: &str = include_str!("defaults.toml");

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
}

#[derive(Clone, Debug, PartialEq)]
pub struct BufferSection {
    pub group_size: u32,
    pub tau: u64,
    pub eta: u64,
    pub groups_per_step: usize,
    /// Drop environment-ended trajectories (false: train them as failures).
    pub env_gate: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LossSection {
    pub mode: sluice_kernels::ops::is_gate_loss::GateMode,
    pub eps_low: f32,
    pub eps_high: f32,
    pub beta: f32,
    pub std_free: bool,
    pub micro_batch_tokens: usize,
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
    /// The kind's parameters (`digits`, `min_digits`, `tool_fraction`, `wrong_call_fraction`, `items`).
    pub options: crate::tasks::TaskOptions,
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
    pub optim: OptimSection,
    pub sync: SyncSection,
    pub baselines: BaselinesSection,
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

fn defaults() -> Table {
    // The embedded defaults are part of the program; a syntax error there is a build bug that
    // every test catches.
    DEFAULTS
        .parse::<Table>()
        .unwrap_or_else(|e| panic!("trainer/src/defaults.toml does not parse: {e}"))
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a number",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// `got` takes the place of `default` at `key`: same type (an integer for a float is
/// converted); tables and arrays are checked by the caller.
fn conform(key: &str, default: &Value, got: Value) -> Result<Value, ConfigError> {
    match (default, got) {
        (Value::Float(_), Value::Integer(i)) => Ok(Value::Float(i as f64)),
        (d, g) if std::mem::discriminant(d) == std::mem::discriminant(&g) => Ok(g),
        (d, g) => Err(err(
            key,
            format!("expected {}, got {} ({g})", type_name(d), type_name(&g)),
        )),
    }
}

fn join(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_string()
    } else {
        format!("{prefix}.{k}")
    }
}

/// Merges `user` into `base` key by key; every key of `user` must exist in `schema`.
fn merge_table(
    prefix: &str,
    base: &mut Table,
    schema: &Table,
    user: Table,
) -> Result<(), ConfigError> {
    for (k, v) in user {
        let key = join(prefix, &k);
        let Some(def) = schema.get(&k) else {
            if key == "rollout.num_blocks" {
                return Err(err(
                    &key,
                    "was replaced by rollout.kv_bytes: the KV pool is sized in bytes (per \
                     replica, every layer's K and V), and holds as many blocks as fit in the \
                     run's precision (a bf16 cache twice as many as an f32 one)",
                ));
            }
            let known: Vec<&str> = schema.keys().map(String::as_str).collect();
            return Err(err(
                &key,
                format!(
                    "unknown key (known keys here: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
        };
        match (def, v) {
            (Value::Table(dt), Value::Table(ut)) => {
                let mut b = match base.remove(&k) {
                    Some(Value::Table(t)) => t,
                    _ => dt.clone(),
                };
                merge_table(&key, &mut b, dt, ut)?;
                base.insert(k, Value::Table(b));
            }
            (Value::Array(da), Value::Array(ua)) => {
                // Arrays of scalars: element type of the default's first element.
                let mut out = Vec::with_capacity(ua.len());
                for (i, x) in ua.into_iter().enumerate() {
                    match da.first() {
                        Some(d) => out.push(conform(&format!("{key}[{i}]"), d, x)?),
                        None => out.push(x),
                    }
                }
                base.insert(k, Value::Array(out));
            }
            (d, v) => {
                let v = conform(&key, d, v)?;
                base.insert(k, v);
            }
        }
    }
    Ok(())
}

/// The task template: the first `[tasks.NAME]` table of the defaults.
fn task_template(defaults: &Table) -> Table {
    match defaults.get("tasks") {
        Some(Value::Table(tasks)) => match tasks.values().next() {
            Some(Value::Table(t)) => {
                let mut t = t.clone();
                // A kind's parameters are not inherited by a new task of another kind.
                for k in [
                    "digits",
                    "min_digits",
                    "tool_fraction",
                    "wrong_call_fraction",
                    "items",
                ] {
                    t.remove(k);
                }
                t
            }
            _ => Table::new(),
        },
        _ => Table::new(),
    }
}

/// A task's optional keys: its kind's parameters (crate::tasks::TaskOptions), absent unless
/// set; each kind rejects the ones it does not take.
fn task_schema(template: &Table) -> Table {
    let mut schema = template.clone();
    for (k, v) in [
        ("digits", Value::Integer(0)),
        ("min_digits", Value::Integer(0)),
        ("tool_fraction", Value::Float(0.0)),
        ("wrong_call_fraction", Value::Float(0.0)),
        ("items", Value::Integer(0)),
    ] {
        schema.entry(k).or_insert(v);
    }
    schema
}

/// Merges a user (or `--set`) table into the merged config.
fn merge_config(merged: &mut Table, defaults: &Table, user: Table) -> Result<(), ConfigError> {
    let template = task_template(defaults);
    for (section, v) in user {
        match section.as_str() {
            "stage" => {
                let Value::Array(stages) = v else {
                    return Err(err(
                        "stage",
                        "expected [[stage]] tables (an array of tables)",
                    ));
                };
                let schema = match defaults.get("stage") {
                    Some(Value::Array(a)) => match a.first() {
                        Some(Value::Table(t)) => t.clone(),
                        _ => Table::new(),
                    },
                    _ => Table::new(),
                };
                let mut out = Vec::with_capacity(stages.len());
                for (i, s) in stages.into_iter().enumerate() {
                    let key = format!("stage[{i}]");
                    let Value::Table(t) = s else {
                        return Err(err(&key, "expected a table"));
                    };
                    for required in ["kind", "steps"] {
                        if !t.contains_key(required) {
                            return Err(err(&format!("{key}.{required}"), "missing"));
                        }
                    }
                    let mut base = schema.clone();
                    merge_table(&key, &mut base, &schema, t)?;
                    out.push(Value::Table(base));
                }
                merged.insert("stage".into(), Value::Array(out));
            }
            "tasks" => {
                let Value::Table(tasks) = v else {
                    return Err(err("tasks", "expected [tasks.NAME] tables"));
                };
                let mut all = match merged.remove("tasks") {
                    Some(Value::Table(t)) => t,
                    _ => Table::new(),
                };
                for (name, t) in tasks {
                    let key = format!("tasks.{name}");
                    let Value::Table(t) = t else {
                        return Err(err(&key, "expected a table"));
                    };
                    let mut base = match all.remove(&name) {
                        Some(Value::Table(b)) => b,
                        None => {
                            if !t.contains_key("kind") {
                                return Err(err(
                                    &format!("{key}.kind"),
                                    "missing: a new task needs a kind",
                                ));
                            }
                            template.clone()
                        }
                        Some(_) => template.clone(),
                    };
                    merge_table(&key, &mut base, &task_schema(&template), t)?;
                    all.insert(name, Value::Table(base));
                }
                merged.insert("tasks".into(), Value::Table(all));
            }
            _ => {
                let Some(Value::Table(schema)) = defaults.get(&section) else {
                    let known: Vec<&str> = defaults.keys().map(String::as_str).collect();
                    return Err(err(
                        &section,
                        format!("unknown section (known: {})", known.join(", ")),
                    ));
                };
                let Value::Table(t) = v else {
                    return Err(err(&section, "expected a table"));
                };
                let mut base = match merged.remove(&section) {
                    Some(Value::Table(b)) => b,
                    _ => schema.clone(),
                };
                merge_table(&section, &mut base, schema, t)?;
                merged.insert(section, Value::Table(base));
            }
        }
    }
    Ok(())
}

/// Parses `--set a.b.c=value` into a nested table `{a = {b = {c = value}}}`.
fn parse_set(s: &str) -> Result<Table, ConfigError> {
    let Some((path, value)) = s.split_once('=') else {
        return Err(err(
            s,
            "--set takes section.key=value (e.g. --set buffer.tau=4)",
        ));
    };
    let path = path.trim();
    if path.is_empty() || path.split('.').any(str::is_empty) {
        return Err(err(path, "--set needs a dotted key such as buffer.tau"));
    }
    if path.starts_with("stage") {
        return Err(err(
            path,
            "stages cannot be set one key at a time; write [[stage]] tables in a config file",
        ));
    }
    let value = value.trim();
    let parsed: Value = match format!("v = {value}").parse::<Table>() {
        Ok(mut t) => t.remove("v").unwrap_or(Value::String(value.to_string())),
        Err(_) => Value::String(value.to_string()),
    };
    let mut keys: Vec<&str> = path.split('.').collect();
    let last = keys.pop().unwrap_or_default();
    let mut table = Table::new();
    table.insert(last.to_string(), parsed);
    for k in keys.into_iter().rev() {
        let mut outer = Table::new();
        outer.insert(k.to_string(), Value::Table(table));
        table = outer;
    }
    Ok(table)
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

/// Typed access to the merged table with range checks.
struct Get<'a> {
    t: &'a Table,
    prefix: String,
}

impl<'a> Get<'a> {
    fn section(root: &'a Table, name: &str) -> Result<Get<'a>, ConfigError> {
        match root.get(name) {
            Some(Value::Table(t)) => Ok(Get {
                t,
                prefix: name.to_string(),
            }),
            _ => Err(err(name, "missing section")),
        }
    }

    fn key(&self, k: &str) -> String {
        join(&self.prefix, k)
    }

    fn value(&self, k: &str) -> Result<&'a Value, ConfigError> {
        self.t.get(k).ok_or_else(|| err(&self.key(k), "missing"))
    }

    fn str(&self, k: &str) -> Result<&'a str, ConfigError> {
        self.value(k)?
            .as_str()
            .ok_or_else(|| err(&self.key(k), "expected a string"))
    }

    fn bool(&self, k: &str) -> Result<bool, ConfigError> {
        self.value(k)?
            .as_bool()
            .ok_or_else(|| err(&self.key(k), "expected true or false"))
    }

    fn int(&self, k: &str, min: i64, max: i64) -> Result<i64, ConfigError> {
        let v = self
            .value(k)?
            .as_integer()
            .ok_or_else(|| err(&self.key(k), "expected an integer"))?;
        if v < min || v > max {
            return Err(err(&self.key(k), format!("{v} is outside {min}..={max}")));
        }
        Ok(v)
    }

    fn float(&self, k: &str, ok: impl Fn(f64) -> bool, what: &str) -> Result<f64, ConfigError> {
        let v = match self.value(k)? {
            Value::Float(f) => *f,
            Value::Integer(i) => *i as f64,
            _ => return Err(err(&self.key(k), "expected a number")),
        };
        if !v.is_finite() || !ok(v) {
            return Err(err(&self.key(k), format!("{v}: must be {what}")));
        }
        Ok(v)
    }

    fn sub(&self, k: &str) -> Result<Get<'a>, ConfigError> {
        match self.value(k)? {
            Value::Table(t) => Ok(Get {
                t,
                prefix: self.key(k),
            }),
            _ => Err(err(&self.key(k), "expected a table")),
        }
    }
}

const MAX: i64 = i64::MAX;

/// The shortest heartbeat timeout accepted (seconds; 0 turns heartbeats off).
pub const HEARTBEAT_FLOOR_S: f64 = 1.0;

/// The optional task parameters that are set (ranges are the task's to check).
fn task_options(g: &Get<'_>) -> Result<crate::tasks::TaskOptions, ConfigError> {
    let int = |k: &str| -> Result<Option<u32>, ConfigError> {
        match g.t.get(k) {
            None => Ok(None),
            Some(_) => Ok(Some(g.int(k, 0, u32::MAX as i64)? as u32)),
        }
    };
    let frac = |k: &str| -> Result<Option<f64>, ConfigError> {
        match g.t.get(k) {
            None => Ok(None),
            Some(_) => Ok(Some(g.float(
                k,
                |x| (0.0..=1.0).contains(&x),
                "in [0, 1]",
            )?)),
        }
    };
    Ok(crate::tasks::TaskOptions {
        digits: int("digits")?,
        min_digits: int("min_digits")?,
        tool_fraction: frac("tool_fraction")?,
        wrong_call_fraction: frac("wrong_call_fraction")?,
        items: int("items")?,
    })
}

fn resolve(table: Table) -> Result<TrainConfig, ConfigError> {
    let run = Get::section(&table, "run")?;
    let name = run.str("name")?.to_string();
    if name.is_empty() || name.contains(['/', '\\']) || name == "." || name == ".." {
        return Err(err(
            "run.name",
            format!("{name:?} must be a non-empty folder name without slashes"),
        ));
    }
    let device: Device = run
        .str("device")?
        .parse()
        .map_err(|e| err("run.device", format!("{e}")))?;
    let mode = match run.str("mode")? {
        "async" => sluice_runtime::system::Mode::Async,
        "sync" => sluice_runtime::system::Mode::Sync,
        other => return Err(err("run.mode", format!("{other:?} is not async or sync"))),
    };
    let run_s = RunSection {
        name,
        seed: run.int("seed", 0, MAX)? as u64,
        device,
        mode,
        replay: run.bool("replay")?,
        checkpoint_every: run.int("checkpoint_every", 0, MAX)? as u64,
        log_every: run.int("log_every", 1, MAX)? as u64,
    };

    let model = Get::section(&table, "model")?;
    let precision = match model.str("precision")? {
        "auto" => sluice_model::Precision::default_for(device),
        "f32" => sluice_model::Precision::F32,
        "bf16" => sluice_model::Precision::Bf16,
        other => {
            return Err(err(
                "model.precision",
                format!("{other:?} is not auto, f32 or bf16"),
            ))
        }
    };
    let init = model.str("init")?;
    let model_s = ModelSection {
        config: PathBuf::from(model.str("config")?),
        precision,
        init: (!init.is_empty()).then(|| PathBuf::from(init)),
    };

    let rollout = Get::section(&table, "rollout")?;
    let swap = match rollout.str("swap")? {
        "continue" => sluice_runtime::engine::SwapMode::Continue,
        "recompute" => sluice_runtime::engine::SwapMode::Recompute,
        o => {
            return Err(err(
                "rollout.swap",
                format!("{o:?} is not continue or recompute"),
            ))
        }
    };
    let preempt = match rollout.str("preempt")? {
        "recompute" => sluice_runtime::engine::PreemptMode::Recompute,
        "swap" => sluice_runtime::engine::PreemptMode::SwapToHost,
        o => {
            return Err(err(
                "rollout.preempt",
                format!("{o:?} is not recompute or swap"),
            ))
        }
    };
    let replicas = rollout.int("replicas", 1, 64)? as usize;
    // A timeout shorter than an engine step loses every replica at every step; the floor
    // keeps the obvious mistakes out (the scheduler stops a run that loses its replicas over
    // and over without a learner step, whatever the timeout).
    let heartbeat = rollout.float(
        "heartbeat_timeout_s",
        |x| x == 0.0 || x >= HEARTBEAT_FLOOR_S,
        &format!(
            "0 (no heartbeats) or at least {HEARTBEAT_FLOOR_S} s: it must exceed the longest \
             engine step, or every replica is lost at every step"
        ),
    )?;
    let fail_replica = rollout.int("fail_replica", 0, 63)? as usize;
    let fail_at_step = rollout.int("fail_at_step", 0, MAX)? as u64;
    let fail = match rollout.str("fail_kind")? {
        "none" => None,
        kind @ ("hang" | "die") => {
            let (replica, at_step) = (fail_replica, fail_at_step);
            if replica >= replicas {
                return Err(err(
                    "rollout.fail_replica",
                    format!("{replica}: there are {replicas} replica(s), numbered from 0"),
                ));
            }
            if at_step == 0 {
                return Err(err(
                    "rollout.fail_at_step",
                    "must be >= 1 (the engine step at which the replica fails)",
                ));
            }
            if heartbeat == 0.0 {
                return Err(err(
                    "rollout.heartbeat_timeout_s",
                    format!(
                        "is 0 (no heartbeats), so fail_kind = {kind:?} would never be detected"
                    ),
                ));
            }
            Some(sluice_runtime::health::ReplicaFault {
                replica,
                at_step,
                kind: if kind == "hang" {
                    sluice_runtime::health::FailKind::Hang
                } else {
                    sluice_runtime::health::FailKind::Die
                },
            })
        }
        o => {
            return Err(err(
                "rollout.fail_kind",
                format!("{o:?} is not none, hang or die"),
            ))
        }
    };
    let rollout_s = RolloutSection {
        replicas,
        max_seqs: rollout.int("max_seqs", 1, 1 << 20)? as usize,
        max_batch_tokens: rollout.int("max_batch_tokens", 1, 1 << 24)? as usize,
        kv_bytes: rollout.int("kv_bytes", 1, 1 << 40)? as usize,
        block_size: rollout.int("block_size", 1, 1024)? as usize,
        temperature: rollout.float("temperature", |x| x >= 0.0, ">= 0 (0 = greedy)")? as f32,
        top_k: rollout.int("top_k", 0, u32::MAX as i64)? as u32,
        top_p: rollout.float("top_p", |x| x > 0.0 && x <= 1.0, "in (0, 1]")? as f32,
        max_new_tokens: rollout.int("max_new_tokens", 1, 1 << 20)? as u32,
        max_turns: rollout.int("max_turns", 1, 1 << 16)? as u32,
        swap,
        preempt,
        share_correction: rollout.bool("share_correction")?,
        eval_problems: rollout.int("eval_problems", 0, 1 << 20)? as usize,
        heartbeat_timeout_s: (heartbeat > 0.0).then_some(heartbeat),
        fail,
    };

    let buffer = Get::section(&table, "buffer")?;
    let buffer_s = BufferSection {
        group_size: buffer.int("group_size", 1, 4096)? as u32,
        tau: buffer.int("tau", 0, MAX)? as u64,
        eta: buffer.int("eta", 0, MAX)? as u64,
        groups_per_step: buffer.int("groups_per_step", 1, 1 << 20)? as usize,
        env_gate: buffer.bool("env_gate")?,
    };

    let loss = Get::section(&table, "loss")?;
    let mode = sluice_kernels::ops::is_gate_loss::GateMode::parse(loss.str("mode")?)
        .map_err(|e| err("loss.mode", format!("{e}")))?;
    let loss_s = LossSection {
        mode,
        eps_low: loss.float("eps_low", |x| (0.0..1.0).contains(&x), "in [0, 1)")? as f32,
        eps_high: loss.float("eps_high", |x| x >= 0.0, ">= 0")? as f32,
        beta: loss.float("beta", |x| x >= 1.0, ">= 1")? as f32,
        std_free: loss.bool("std_free")?,
        micro_batch_tokens: loss.int("micro_batch_tokens", 1, 1 << 24)? as usize,
    };

    let optim = Get::section(&table, "optim")?;
    let optim_s = OptimSection {
        muon_lr: optim.float("muon_lr", |x| x > 0.0, "> 0")? as f32,
        adamw_lr: optim.float("adamw_lr", |x| x > 0.0, "> 0")? as f32,
        rl_muon_lr: optim.float("rl_muon_lr", |x| x > 0.0, "> 0")? as f32,
        rl_adamw_lr: optim.float("rl_adamw_lr", |x| x > 0.0, "> 0")? as f32,
        clip_norm: optim.float("clip_norm", |x| x >= 0.0, ">= 0 (0: no clipping)")? as f32,
        weight_decay: optim.float("weight_decay", |x| x >= 0.0, ">= 0")? as f32,
        sft_batch: optim.int("sft_batch", 1, 1 << 20)? as usize,
        sft_warmup: optim.int("sft_warmup", 0, MAX)? as u64,
    };

    let sync = Get::section(&table, "sync")?;
    let path = sync.str("path")?.to_string();
    if !matches!(path.as_str(), "inprocess" | "delta" | "disk") {
        return Err(err(
            "sync.path",
            format!("{path:?} is not inprocess, delta or disk"),
        ));
    }
    let sync_s = SyncSection {
        interval: sync.int("interval", 1, MAX)? as u64,
        path,
        reset_optimizer: sync.bool("reset_optimizer")?,
    };

    let baselines = Get::section(&table, "baselines")?;
    let baselines_s = BaselinesSection {
        ablation: baselines.bool("ablation")?,
        rft: baselines.bool("rft")?,
    };

    let cost = Get::section(&table, "cost")?;
    let nonneg = |k: &str| cost.float(k, |x| x >= 0.0, ">= 0");
    let cost_s = CostModel {
        engine_step_us: nonneg("engine_step_us")?,
        prefill_token_us: nonneg("prefill_token_us")?,
        decode_seq_us: nonneg("decode_seq_us")?,
        train_token_us: nonneg("train_token_us")?,
        optim_step_us: nonneg("optim_step_us")?,
        publish_us: nonneg("publish_us")?,
        sync_encode_byte_us: nonneg("sync_encode_byte_us")?,
        sync_transfer_byte_us: nonneg("sync_transfer_byte_us")?,
        sync_apply_byte_us: nonneg("sync_apply_byte_us")?,
        sync_write_byte_us: nonneg("sync_write_byte_us")?,
        replica_restart_us: nonneg("replica_restart_us")?,
    };

    // Stages, and the tasks they name.
    let stages = match table.get("stage") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => return Err(err("stage", "at least one [[stage]] is needed")),
    };
    let tasks_table = match table.get("tasks") {
        Some(Value::Table(t)) => t,
        _ => return Err(err("tasks", "missing [tasks.NAME] tables")),
    };
    let mut stage_s = Vec::with_capacity(stages.len());
    let mut task_names: Vec<String> = Vec::new();
    for (i, s) in stages.iter().enumerate() {
        let Value::Table(t) = s else {
            return Err(err(&format!("stage[{i}]"), "expected a table"));
        };
        let g = Get {
            t,
            prefix: format!("stage[{i}]"),
        };
        let kind = match g.str("kind")? {
            "sft" => StageKind::Sft,
            "rl" => StageKind::Rl,
            o => return Err(err(&g.key("kind"), format!("{o:?} is not sft or rl"))),
        };
        let steps = g.int("steps", 1, MAX)? as u64;
        let names: Vec<String> = match g.value("tasks")? {
            Value::Array(a) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| err(&g.key("tasks"), "expected an array of task names"))?,
            _ => return Err(err(&g.key("tasks"), "expected an array of task names")),
        };
        if names.is_empty() {
            return Err(err(&g.key("tasks"), "a stage needs at least one task"));
        }
        for n in &names {
            if !tasks_table.contains_key(n) {
                let known: Vec<&str> = tasks_table.keys().map(String::as_str).collect();
                return Err(err(
                    &g.key("tasks"),
                    format!(
                        "task {n:?} has no [tasks.{n}] section (defined: {})",
                        known.join(", ")
                    ),
                ));
            }
            if !task_names.contains(n) {
                task_names.push(n.clone());
            }
        }
        stage_s.push(StageSection {
            kind,
            steps,
            tasks: names,
        });
    }
    let mut tasks_s = Vec::with_capacity(task_names.len());
    for name in task_names {
        let Some(Value::Table(t)) = tasks_table.get(&name) else {
            return Err(err(&format!("tasks.{name}"), "expected a table"));
        };
        let g = Get {
            t,
            prefix: format!("tasks.{name}"),
        };
        let lat = g.sub("latency")?;
        let median = lat.float("median_ms", |x| x >= 0.0, ">= 0")?;
        let p99 = lat.float("p99_ms", |x| x >= 0.0, ">= 0")?;
        let latency = match lat.str("dist")? {
            "none" => LatencyModel::None,
            "fixed" => LatencyModel::Fixed { ms: median },
            "lognormal" => LatencyModel::LogNormal {
                median_ms: median,
                p99_ms: p99,
            },
            "pareto" => LatencyModel::Pareto {
                median_ms: median,
                p99_ms: p99,
            },
            o => {
                return Err(err(
                    &lat.key("dist"),
                    format!("{o:?} is not none, fixed, lognormal or pareto"),
                ))
            }
        };
        latency
            .validate()
            .map_err(|e| err(&lat.key("dist"), e.to_string()))?;
        let f = g.sub("faults")?;
        let unit = |k: &str| f.float(k, |x| (0.0..=1.0).contains(&x), "in [0, 1]");
        let faults = FaultRates {
            crash: unit("crash")?,
            timeout: unit("timeout")?,
            garbage: unit("garbage")?,
        };
        faults.validate().map_err(|e| err(&g.key("faults"), e))?;
        tasks_s.push(TaskSection {
            kind: g.str("kind")?.to_string(),
            concurrency: g.int("concurrency", 1, MAX)? as u64,
            timeout_s: g.float("timeout_s", |x| x > 0.0, "> 0")?,
            retries: g.int("retries", 0, 1 << 16)? as u32,
            target_share: g.float("target_share", |x| x >= 0.0, ">= 0")?,
            latency,
            faults,
            options: task_options(&g)?,
            name,
        });
    }
    // Every RL stage's tasks need target shares that say something.
    for (i, s) in stage_s.iter().enumerate() {
        let total: f64 = s
            .tasks
            .iter()
            .filter_map(|n| tasks_s.iter().find(|t| &t.name == n))
            .map(|t| t.target_share)
            .sum();
        if s.kind == StageKind::Rl && total <= 0.0 {
            return Err(err(
                &format!("stage[{i}].tasks"),
                "the tasks' target_share values sum to 0",
            ));
        }
    }
    if buffer_s.groups_per_step as u64 * buffer_s.group_size as u64
        > tasks_s.iter().map(|t| t.concurrency).sum::<u64>().max(1) * 64
    {
        return Err(err(
            "buffer.groups_per_step",
            "a learner step needs far more trajectories than the tasks' concurrency allows",
        ));
    }
    // GRPO advantages are normalised within a group: a group of one has advantage 0, so an RL
    // stage would train nothing while its throughput looks fine. Supervised stages use no
    // groups.
    if buffer_s.group_size < 2 && stage_s.iter().any(|s| s.kind == StageKind::Rl) {
        return Err(err(
            "buffer.group_size",
            format!(
                "{}: an RL stage's advantages are normalised within each group, so a group of \
                 one has advantage 0 and trains nothing; use 2 or more",
                buffer_s.group_size
            ),
        ));
    }
    // Samples carry the version last published: K - 1 steps after a publication they lag the
    // learner by K - 1, so with K - 1 > tau the version gate drops every one of them and the
    // learner waits forever for the step that would publish again.
    if sync_s.interval > buffer_s.tau + 1 && stage_s.iter().any(|s| s.kind == StageKind::Rl) {
        return Err(err(
            "sync.interval",
            format!(
                "{}: with buffer.tau = {}, samples of weights published {} steps apart reach lag \
                 {} > tau before the next publication, so the version gate drops all of them and \
                 the RL stage never completes; use sync.interval <= buffer.tau + 1",
                sync_s.interval,
                buffer_s.tau,
                sync_s.interval,
                sync_s.interval - 1
            ),
        ));
    }
    for t in &tasks_s {
        if t.concurrency < buffer_s.group_size as u64 {
            return Err(err(
                &format!("tasks.{}.concurrency", t.name),
                format!(
                    "{} cannot hold one group of buffer.group_size = {}",
                    t.concurrency, buffer_s.group_size
                ),
            ));
        }
    }
    // The run folder's config.toml records the precision the run computes in (`auto` resolved
    // for run.device), so loading it elsewhere reproduces the run.
    let mut table = table;
    if let Some(Value::Table(m)) = table.get_mut("model") {
        m.insert(
            "precision".into(),
            Value::String(model_s.precision.as_str().into()),
        );
    }
    Ok(TrainConfig {
        run: run_s,
        model: model_s,
        stages: stage_s,
        rollout: rollout_s,
        buffer: buffer_s,
        loss: loss_s,
        optim: optim_s,
        sync: sync_s,
        baselines: baselines_s,
        cost: cost_s,
        tasks: tasks_s,
        table,
    })
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
