//! The merged table to a typed [`TrainConfig`], every value range-checked and every cross-key
//! rule checked (an error names the key or keys).

use super::merge::join;
use super::*;

/// Typed access to the merged table with range checks.
pub(super) struct Get<'a> {
    pub(super) t: &'a Table,
    pub(super) prefix: String,
}

impl<'a> Get<'a> {
    pub(super) fn section(root: &'a Table, name: &str) -> Result<Get<'a>, ConfigError> {
        match root.get(name) {
            Some(Value::Table(t)) => Ok(Get {
                t,
                prefix: name.to_string(),
            }),
            _ => Err(err(name, "missing section")),
        }
    }

    pub(super) fn key(&self, k: &str) -> String {
        join(&self.prefix, k)
    }

    pub(super) fn value(&self, k: &str) -> Result<&'a Value, ConfigError> {
        self.t.get(k).ok_or_else(|| err(&self.key(k), "missing"))
    }

    pub(super) fn str(&self, k: &str) -> Result<&'a str, ConfigError> {
        self.value(k)?
            .as_str()
            .ok_or_else(|| err(&self.key(k), "expected a string"))
    }

    pub(super) fn bool(&self, k: &str) -> Result<bool, ConfigError> {
        self.value(k)?
            .as_bool()
            .ok_or_else(|| err(&self.key(k), "expected true or false"))
    }

    pub(super) fn int(&self, k: &str, min: i64, max: i64) -> Result<i64, ConfigError> {
        let v = self
            .value(k)?
            .as_integer()
            .ok_or_else(|| err(&self.key(k), "expected an integer"))?;
        if v < min || v > max {
            return Err(err(&self.key(k), format!("{v} is outside {min}..={max}")));
        }
        Ok(v)
    }

    pub(super) fn float(
        &self,
        k: &str,
        ok: impl Fn(f64) -> bool,
        what: &str,
    ) -> Result<f64, ConfigError> {
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

    pub(super) fn sub(&self, k: &str) -> Result<Get<'a>, ConfigError> {
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
/// `run.pin_lanes`: the wall clock only, and a machine with two CPUs or more to pin to.
fn pin_lanes(run: &Get<'_>) -> Result<bool, ConfigError> {
    if !run.bool("pin_lanes")? {
        return Ok(false);
    }
    if run.bool("replay")? {
        return Err(err(
            "run.pin_lanes",
            "needs run.replay = false: on the virtual clock the lanes run inline on one thread, \
             and compute is charged by [cost], not measured",
        ));
    }
    let cpus = sluice_runtime::system::pinnable_cpus();
    if cpus < 2 {
        return Err(err(
            "run.pin_lanes",
            format!(
                "needs two CPUs (one for the engines, one for the learner); this process may \
                 run on {cpus}"
            ),
        ));
    }
    Ok(true)
}

/// `rollout.over_sampling` and `rollout.partial_rollout` (None: off).
fn over_sampling(
    rollout: &Get<'_>,
    mode: sluice_runtime::system::Mode,
) -> Result<Option<sluice_runtime::system::OverSampling>, ConfigError> {
    let ratio = rollout.float(
        "over_sampling",
        |x| (1.0..=8.0).contains(&x),
        "in [1, 8]: groups started per batch over groups trained per step (1: off)",
    )?;
    let keep_partial = rollout.bool("partial_rollout")?;
    if ratio == 1.0 {
        if keep_partial {
            return Err(err(
                "rollout.partial_rollout",
                "needs rollout.over_sampling > 1: only an over-sampled batch aborts groups, \
                 and partial rollout keeps what they generated",
            ));
        }
        return Ok(None);
    }
    if mode != sluice_runtime::system::Mode::Sync {
        return Err(err(
            "rollout.over_sampling",
            "needs run.mode = \"sync\": in async mode rollout never waits for a batch's \
             slowest groups (its backpressure room, buffer.eta, already starts groups ahead)",
        ));
    }
    Ok(Some(sluice_runtime::system::OverSampling {
        ratio,
        keep_partial,
    }))
}

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
    let string = |k: &str| -> Result<Option<String>, ConfigError> {
        match g.t.get(k) {
            None => Ok(None),
            Some(_) => Ok(Some(g.str(k)?.to_string())),
        }
    };
    let args = match g.t.get("args") {
        None => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| err(&format!("{}[{i}]", g.key("args")), "expected a string"))
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(err(&g.key("args"), "expected an array of strings")),
    };
    Ok(crate::tasks::TaskOptions {
        command: string("command")?,
        args,
        url: string("url")?,
        digits: int("digits")?,
        min_digits: int("min_digits")?,
        tool_fraction: frac("tool_fraction")?,
        wrong_call_fraction: frac("wrong_call_fraction")?,
        chain_fraction: frac("chain_fraction")?,
        chain_call_fraction: frac("chain_call_fraction")?,
        items: int("items")?,
    })
}

pub(super) fn resolve(table: Table) -> Result<TrainConfig, ConfigError> {
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
        pin_lanes: pin_lanes(&run)?,
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
        over_sampling: over_sampling(&rollout, mode)?,
        servers: super::servers::parse(rollout.value("servers")?)?,
        retokenize: rollout.bool("retokenize")?,
    };

    let buffer = Get::section(&table, "buffer")?;
    let mut buffer_s = BufferSection {
        group_size: buffer.int("group_size", 1, 4096)? as u32,
        tau: buffer.int("tau", 0, MAX)? as u64,
        eta: buffer.int("eta", 0, MAX)? as u64,
        groups_per_step: buffer.int("groups_per_step", 1, 1 << 20)? as usize,
        env_gate: buffer.bool("env_gate")?,
        dynamic_sampling: None,
    };
    let max_drops = buffer.int("dynamic_sampling_max_drops", 1, MAX)? as u64;
    if buffer.bool("dynamic_sampling")? {
        if buffer_s.group_size < 2 {
            return Err(err(
                "buffer.dynamic_sampling",
                format!(
                    "needs buffer.group_size >= 2: with group_size = {} every group has one \
                     reward and no GRPO signal, so every group would be dropped",
                    buffer_s.group_size
                ),
            ));
        }
        buffer_s.dynamic_sampling = Some(max_drops);
    }

    let loss = Get::section(&table, "loss")?;
    let mode = sluice_kernels::ops::is_gate_loss::GateMode::parse(loss.str("mode")?)
        .map_err(|e| err("loss.mode", format!("{e}")))?;
    let loss_s = LossSection {
        mode,
        eps_low: loss.float("eps_low", |x| (0.0..1.0).contains(&x), "in [0, 1)")? as f32,
        eps_high: loss.float("eps_high", |x| x >= 0.0, ">= 0")? as f32,
        eps_neg: {
            let pair = (
                loss.float("eps_low_neg", |x| (0.0..1.0).contains(&x), "in [0, 1)")? as f32,
                loss.float("eps_high_neg", |x| x >= 0.0, ">= 0")? as f32,
            );
            loss.bool("four_bounds")?.then_some(pair)
        },
        beta: loss.float("beta", |x| x >= 1.0, ">= 1")? as f32,
        std_free: loss.bool("std_free")?,
        decoupled: {
            let cap = loss.float("decoupled_weight_cap", |x| x > 0.0, "> 0")? as f32;
            let on = loss.bool("decoupled")?;
            if on && mode != sluice_kernels::ops::is_gate_loss::GateMode::Ppo {
                return Err(err(
                    "loss.decoupled",
                    format!(
                        "decoupled PPO clips a PPO surrogate: it needs loss.mode = \"ppo\", not \
                         {:?}",
                        loss.str("mode")?
                    ),
                ));
            }
            on.then_some(cap)
        },
        aggregation: match loss.str("aggregation")? {
            "token" => sluice_runtime::learner::Aggregation::Token,
            "prompt" => sluice_runtime::learner::Aggregation::Prompt,
            other => {
                return Err(err(
                    "loss.aggregation",
                    format!("{other:?} is not token or prompt"),
                ))
            }
        },
        micro_batch_tokens: loss.int("micro_batch_tokens", 1, 1 << 24)? as usize,
        entropy_coef: loss.float("entropy_coef", |x| x >= 0.0, ">= 0 (0: off)")? as f32,
        kl: regularizer_kl(&loss)?,
        kl_reference: {
            let path = loss.str("kl_reference")?;
            (!path.is_empty()).then(|| PathBuf::from(path))
        },
    };
    if let Some(path) = &loss_s.kl_reference {
        if loss_s.kl.is_none() {
            return Err(err(
                "loss.kl_reference",
                "a KL reference without a KL term: set loss.kl_coef above 0 or loss.kl_log = \
                 true",
            ));
        }
        if !path.is_file() {
            return Err(err(
                "loss.kl_reference",
                format!("no checkpoint file at {}", path.display()),
            ));
        }
    }

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
        sft_min_lr_ratio: optim.float(
            "sft_min_lr_ratio",
            |x| (0.0..=1.0).contains(&x),
            "in [0, 1]",
        )? as f32,
        minibatches: optim.int("minibatches", 1, 1 << 20)? as usize,
        epochs: optim.int("epochs", 1, 1024)? as usize,
    };
    if optim_s.minibatches > buffer_s.groups_per_step {
        return Err(err(
            "optim.minibatches",
            format!(
                "{} minibatches of a learner step's {} groups (buffer.groups_per_step): at most \
                 one minibatch per group",
                optim_s.minibatches, buffer_s.groups_per_step
            ),
        ));
    }

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

    let tok = Get::section(&table, "tokenizer")?;
    let tok_path = tok.str("path")?;
    let tokenizer_s = TokenizerSection {
        kind: match tok.str("kind")? {
            "char" => TokenizerKind::Char,
            "bpe" => TokenizerKind::Bpe,
            o => return Err(err("tokenizer.kind", format!("{o:?} is not char or bpe"))),
        },
        path: (!tok_path.is_empty()).then(|| PathBuf::from(tok_path)),
        max_vocab: tok.int("max_vocab", 1, i32::MAX as i64)? as usize,
    };
    if tokenizer_s.kind == TokenizerKind::Bpe && tokenizer_s.path.is_none() {
        return Err(err(
            "tokenizer.path",
            "tokenizer.kind = \"bpe\" needs the path of a tokenizer.json (`sluice tokenizer \
             train` writes one)",
        ));
    }

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
    let opd_s = super::opd::resolve_opd(&table, &stage_s, &buffer_s, &loss_s)?;
    // GRPO advantages are normalised within a group: a group of one has advantage 0, so an RL
    // stage would train nothing while its throughput looks fine. Supervised stages use no
    // groups, nor does on-policy distillation's signal (the teacher's, per token).
    let needs_no_group = opd_s.as_ref().is_some_and(|o| o.config.needs_no_group());
    if buffer_s.group_size < 2 && stage_s.iter().any(|s| s.kind == StageKind::Rl) && !needs_no_group
    {
        return Err(err(
            "buffer.group_size",
            format!(
                "{}: an RL stage's advantages are normalised within each group, so a group of \
                 one has advantage 0 and trains nothing; use 2 or more (or distil from a \
                 teacher: opd.form, which needs no group)",
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
    retokenize(&rollout_s, &tokenizer_s, &stage_s, &tasks_s)?;
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
    let mut cfg = TrainConfig {
        run: run_s,
        model: model_s,
        stages: stage_s,
        rollout: rollout_s,
        buffer: buffer_s,
        loss: loss_s,
        opd: opd_s,
        optim: optim_s,
        sync: sync_s,
        baselines: baselines_s,
        tokenizer: tokenizer_s,
        cost: cost_s,
        tasks: tasks_s,
        table,
    };
    super::servers::check(&mut cfg, replicas)?;
    Ok(cfg)
}

/// `rollout.retokenize`: a BPE (the character tokenizer's decode and encode are inverse, so
/// the round trip would change no id and the arm would train what tito trains), and RL stages
/// of text tasks only (raw-id tasks have no text to round-trip).
fn retokenize(
    rollout: &RolloutSection,
    tokenizer: &TokenizerSection,
    stages: &[StageSection],
    tasks: &[TaskSection],
) -> Result<(), ConfigError> {
    if !rollout.retokenize {
        return Ok(());
    }
    if tokenizer.kind == TokenizerKind::Char {
        return Err(err(
            "rollout.retokenize",
            "needs tokenizer.kind = \"bpe\": the character tokenizer's decode and encode are \
             inverse, so the round trip would change no id (configs/bpe.toml has a BPE)",
        ));
    }
    for s in stages.iter().filter(|s| s.kind == StageKind::Rl) {
        for name in &s.tasks {
            if let Some(t) = tasks.iter().find(|t| &t.name == name) {
                if !crate::tasks::is_text(&t.kind) {
                    return Err(err(
                        "rollout.retokenize",
                        format!(
                            "task {name} (kind {}) works on raw ids: it has no text to \
                             round-trip",
                            t.kind
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The KL-to-reference keys of `[loss]` (issue 28 item 7): None unless `kl_coef > 0` or
/// `kl_log`; the estimator and the place are checked whether or not the term is on.
fn regularizer_kl(
    loss: &Get<'_>,
) -> Result<Option<sluice_runtime::regularize::KlConfig>, ConfigError> {
    use sluice_runtime::regularize::{KlConfig, KlPlace};
    let coef = loss.float("kl_coef", |x| x >= 0.0, ">= 0 (0: off)")? as f32;
    let estimator = sluice_kernels::ops::is_gate_loss::KlEstimator::parse(
        loss.str("kl_estimator")?,
    )
    .map_err(|_| {
        err(
            "loss.kl_estimator",
            format!(
                "{:?} is not k1 or k3",
                loss.str("kl_estimator").unwrap_or("")
            ),
        )
    })?;
    let place = match loss.str("kl_in")? {
        "loss" => KlPlace::Loss,
        "reward" => KlPlace::Reward,
        other => {
            return Err(err(
                "loss.kl_in",
                format!("{other:?} is not loss or reward"),
            ))
        }
    };
    let log = loss.bool("kl_log")?;
    Ok((coef > 0.0 || log).then_some(KlConfig {
        estimator,
        coef,
        place,
    }))
}
