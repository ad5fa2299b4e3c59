//! The baselines `sluice train` runs beside RL (`[baselines]`), so that the table says what RL
//! added over what the warm-up data could give by themselves:
//!
//! - **ablation**: the supervised warm-up continued from the warm-up's weights (the model as the
//!   first RL stage found it) on the same demonstrations, for as many optimizer steps as the RL
//!   stages took, each step on as many trained (loss-carrying) tokens as RL's learner trained
//!   per step on average. If this arm matched RL, RL's gain would be more warm-up.
//! - **rft**: rejection-sampling fine-tuning on RL's sample budget: the warm-up model samples,
//!   per task, as many episodes as RL's rollout *sampled* (every episode that finished, the
//!   ones the version and environment gates dropped and the groups the learner never consumed
//!   included, rounded up to whole groups of G per training problem; at the rollout's sampling
//!   settings, answered by the task directly), and trains, supervised, on the ones that
//!   passed: one pass over them in as many optimizer steps as RL took. (Until 2026-12-06 it
//!   drew only the episodes RL trained on, 13-16% fewer in the main job, docs/perf/train.md:
//!   counting what RL paid for, not what it kept, can only make this arm stronger.)
//!
//! Both arms train with RL's optimizer settings (`optim.rl_muon_lr`, `optim.rl_adamw_lr`,
//! constant, the same clip and weight decay) from a fresh optimizer state, so that each
//! differs from RL in its training signal only: demonstrations, or the warm-up's own passing
//! samples, against RL's rewarded groups. (At the warm-up's final learning rates, 4x RL's
//! 5e-4 of then, the ablation arm gained 4-5 points on the sort task where RL gained none;
//! docs/perf/train.md.)
//! Every arm (and the warm-up and RL) is evaluated on the same held-out problems: greedy, and
//! sampled at the rollout temperature (one sample per problem; the warm-up G per problem, so
//! its pass@G stands beside RL's pass@1).

use crate::config::{TaskSection, TrainConfig};
use crate::progress::Progress;
use serde_json::{json, Value};
use sluice_kernels::testing::Rng;
use sluice_kernels::Backend;
use sluice_model::forward::loss_and_grad_on;
use sluice_model::optim::{LrSchedule, OptimConfig, OptimState, Optimizer};
use sluice_model::{Model, PackedBatch};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::env::{Split, Task};
use sluice_runtime::eval::{pass_at_k, pass_rate, run_episodes};
use sluice_runtime::hash::{hash_str, mix64};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

/// Held-out pass rates of one model on one task.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ArmEval {
    /// Greedy decoding.
    pub greedy: f64,
    /// Sampled at the rollout temperature: the share of all episodes that passed.
    pub sampled: f64,
    /// Samples per problem behind `sampled` and `pass_at_k`.
    pub k: usize,
    /// The share of problems with at least one of k samples passing.
    pub pass_at_k: f64,
    /// Distinct held-out problems.
    pub problems: usize,
}

/// What RL consumed, which the baselines match.
#[derive(Clone, Debug, Default)]
pub struct RlBudget {
    /// RL optimizer steps (all RL stages).
    pub steps: u64,
    /// Tokens RL's learner trained on (loss-carrying, accepted).
    pub trained_tokens: u64,
    /// Episodes RL's rollout finished, per task: trained, dropped by a gate, or left in the
    /// buffer at the stage's end (the rejection-sampling arm's budget).
    pub sampled: BTreeMap<String, u64>,
}

/// Sequences of one supervised batch and the tokens each trains on.
#[derive(Default)]
pub(crate) struct Batch {
    pub seqs: Vec<Vec<i32>>,
    pub masks: Vec<Vec<bool>>,
}

impl Batch {
    pub fn push(&mut self, tokens: &[u32], mask: Vec<bool>) {
        self.seqs.push(tokens.iter().map(|&t| t as i32).collect());
        self.masks.push(mask);
    }

    /// Loss-carrying tokens (the model's own tokens after the first).
    pub fn trained_tokens(&self) -> u64 {
        self.masks
            .iter()
            .map(|m| m.iter().skip(1).filter(|&&x| x).count() as u64)
            .sum()
    }
}

/// One supervised optimizer step on `batch` (next-token loss on the masked tokens); returns the
/// loss and the packed length.
pub(crate) fn supervised_step(
    backend: &Backend,
    model: &mut Model,
    opt: &Optimizer,
    state: &mut OptimState,
    batch: &Batch,
) -> Result<(f32, usize), String> {
    let packed = PackedBatch::pack(&batch.seqs, model.config.vocab).map_err(|e| e.to_string())?;
    let n = packed.len();
    let mut targets = vec![0i32; n];
    let mut mask = vec![0.0f32; n];
    for (b, (s, m)) in batch.seqs.iter().zip(&batch.masks).enumerate() {
        let r = packed.seq_range(b);
        for j in 0..s.len().saturating_sub(1) {
            targets[r.start + j] = s[j + 1];
            mask[r.start + j] = if m[j + 1] { 1.0 } else { 0.0 };
        }
    }
    let loss =
        loss_and_grad_on(backend, model, &packed, &targets, &mask).map_err(|e| e.to_string())?;
    if !loss.is_finite() {
        return Err(format!(
            "the loss is {loss}; lower optim.muon_lr / optim.adamw_lr"
        ));
    }
    opt.step(
        backend,
        &mut model.params,
        &model.grads,
        state,
        model.compute.as_mut(),
    )
    .map_err(|e| e.to_string())?;
    Ok((loss, n))
}

/// The task of demonstration `i` of a step, by target share (uniform when every share is 0),
/// and its random stream: keyed by (seed, `stream`, step, i), so a stream is the same in every
/// run with the seed.
pub(crate) fn draw_demo_task(
    tasks: &[(&TaskSection, &Arc<dyn Task>)],
    seed: u64,
    stream: &str,
    step: u64,
    i: usize,
) -> (usize, Rng) {
    let shares: f64 = tasks.iter().map(|(t, _)| t.target_share.max(0.0)).sum();
    let mut rng = Rng::new(mix64(hash_str(seed, stream) ^ mix64(step << 20 | i as u64)));
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
    (pick, rng)
}

/// The sections and tasks of `names`.
fn rl_tasks<'b>(
    cfg: &'b TrainConfig,
    tasks: &'b BTreeMap<String, Arc<dyn Task>>,
    names: &[String],
) -> Vec<(&'b TaskSection, &'b Arc<dyn Task>)> {
    names
        .iter()
        .filter_map(|n| Some((cfg.task(n)?, tasks.get(n)?)))
        .collect()
}

/// Runs the baselines and their evaluations (see the module docs).
pub(crate) struct Arms<'a> {
    pub cfg: &'a TrainConfig,
    pub tasks: &'a BTreeMap<String, Arc<dyn Task>>,
    pub progress: &'a mut dyn Write,
    pub metrics: &'a mut dyn Write,
}

impl Arms<'_> {
    fn engine(&self, model: &Model, version: u64) -> Result<Engine, String> {
        let r = &self.cfg.rollout;
        let backend = Backend::open(self.cfg.run.device).map_err(|e| e.to_string())?;
        Engine::new(
            backend,
            &model.config,
            model.compute_weights(),
            WeightVersion(version),
            EngineConfig {
                kv_bytes: r.kv_bytes,
                block_size: r.block_size,
                max_batch_tokens: r.max_batch_tokens,
                max_seqs: r.max_seqs,
                preempt: r.preempt,
                swap: r.swap,
                precision: self.cfg.model.precision,
            },
        )
        .map_err(|e| e.to_string())
    }

    fn sampling(&self, temperature: f32) -> SamplingParams {
        let r = &self.cfg.rollout;
        SamplingParams {
            temperature,
            top_k: if temperature == 0.0 { 0 } else { r.top_k },
            top_p: if temperature == 0.0 { 1.0 } else { r.top_p },
            max_new_tokens: r.max_new_tokens,
            seed: self.cfg.run.seed,
        }
    }

    /// Held-out pass rates of `model` on `names`: greedy (`greedy` if already known) and
    /// sampled with `k` samples per problem.
    pub fn evaluate(
        &mut self,
        model: &Model,
        names: &[String],
        k: usize,
        greedy: &BTreeMap<String, f64>,
    ) -> Result<BTreeMap<String, ArmEval>, String> {
        let n = self.cfg.rollout.eval_problems;
        let mut out = BTreeMap::new();
        if n == 0 {
            return Ok(out);
        }
        let mut engine = self.engine(model, 0)?;
        let seed = self.cfg.run.seed;
        let turns = self.cfg.rollout.max_turns;
        for name in names {
            if out.contains_key(name) {
                continue;
            }
            let task = self
                .tasks
                .get(name)
                .ok_or_else(|| format!("no task {name}"))?;
            let g = match greedy.get(name) {
                Some(&g) => g,
                None => pass_rate(
                    &mut engine,
                    task.as_ref(),
                    n,
                    seed,
                    self.sampling(0.0),
                    turns,
                )
                .map_err(|e| e.to_string())?
                .rate(),
            };
            let s = pass_at_k(
                &mut engine,
                task.as_ref(),
                n,
                k,
                seed,
                self.sampling(self.cfg.rollout.temperature),
                turns,
            )
            .map_err(|e| e.to_string())?;
            out.insert(
                name.clone(),
                ArmEval {
                    greedy: g,
                    sampled: s.pass_at_1,
                    k: s.k,
                    pass_at_k: s.pass_at_k,
                    problems: s.problems,
                },
            );
        }
        Ok(out)
    }

    fn optimizer(&self, backend: &Backend, model: &Model) -> Result<Optimizer, String> {
        let o = &self.cfg.optim;
        let mut c = OptimConfig::with_lrs(o.rl_muon_lr, o.rl_adamw_lr, LrSchedule::Constant);
        c.clip_norm = (o.clip_norm > 0.0).then_some(o.clip_norm);
        c.muon.weight_decay = o.weight_decay;
        c.adamw.weight_decay = o.weight_decay;
        Optimizer::new(backend, model.layout().clone(), c).map_err(|e| e.to_string())
    }

    fn line(&mut self, v: &Value) -> Result<(), String> {
        writeln!(self.metrics, "{v}").map_err(|e| format!("metrics.jsonl: {e}"))
    }

    /// The ablation arm: the warm-up continued on the tasks' demonstrations (`names`, mixed
    /// by target share) for `budget.steps` steps of at least `budget.trained_tokens / steps`
    /// trained tokens each. Returns the model and the tokens it trained on.
    pub fn ablation(
        &mut self,
        backend: &Backend,
        mut model: Model,
        names: &[String],
        budget: &RlBudget,
    ) -> Result<(Model, u64), String> {
        let steps = budget.steps;
        let per_step = budget.trained_tokens.div_ceil(steps.max(1)).max(1);
        let opt = self.optimizer(backend, &model)?;
        let mut state = opt.new_state(backend).map_err(|e| e.to_string())?;
        let tasks = rl_tasks(self.cfg, self.tasks, names);
        if tasks.is_empty() {
            return Err("the ablation arm has no task".into());
        }
        let mut progress = Progress::new("ablation", steps, self.cfg.run.log_every);
        let start = Instant::now();
        let mut trained = 0u64;
        for step in 1..=steps {
            let mut batch = Batch::default();
            let mut i = 0usize;
            while batch.trained_tokens() < per_step {
                let (pick, mut rng) =
                    draw_demo_task(&tasks, self.cfg.run.seed, "ablation", step, i);
                i += 1;
                let task = tasks[pick].1;
                let problem = task.problem(&mut rng, Split::Train);
                let demo = task.demonstration(&problem, &mut rng).ok_or_else(|| {
                    format!(
                        "baselines.ablation: task {} has no demonstrations",
                        task.name()
                    )
                })?;
                batch.push(&demo.tokens, demo.loss_mask);
            }
            let (loss, _) = supervised_step(backend, &mut model, &opt, &mut state, &batch)
                .map_err(|e| format!("ablation step {step}: {e}"))?;
            trained += batch.trained_tokens();
            self.line(&json!({
                "stage": "ablation",
                "step": step,
                "loss": loss,
                "sequences": batch.seqs.len(),
                "trained_tokens": batch.trained_tokens(),
                "wall_s": start.elapsed().as_secs_f64(),
            }))?;
            progress.update(self.progress, step, &format!("loss {loss:.4}"));
        }
        progress.finish(
            self.progress,
            &format!(
                "{:.1}s; {trained} trained tokens ({per_step} per step at least, as RL's)",
                start.elapsed().as_secs_f64()
            ),
        );
        Ok((model, trained))
    }

    /// The rejection-sampling arm: per task, `budget.sampled[task]` episodes rounded up to
    /// whole groups (training problems of G samples each) from the warm-up model, and
    /// `budget.steps` supervised steps over the passing ones (one pass). Returns the model and
    /// (samples drawn, samples kept, tokens trained).
    pub fn rft(
        &mut self,
        backend: &Backend,
        mut model: Model,
        names: &[String],
        budget: &RlBudget,
    ) -> Result<(Model, (u64, u64, u64)), String> {
        let g = self.cfg.buffer.group_size as usize;
        let start = Instant::now();
        let mut engine = self.engine(&model, 0)?;
        let sampling = self.sampling(self.cfg.rollout.temperature);
        let mut kept: Vec<(Vec<u32>, Vec<bool>)> = Vec::new();
        let mut drawn = 0u64;
        for (t, task) in rl_tasks(self.cfg, self.tasks, names) {
            let sampled = budget.sampled.get(&t.name).copied().unwrap_or(0) as usize;
            let groups = sampled.div_ceil(g.max(1));
            let mut rng = Rng::new(hash_str(self.cfg.run.seed, &format!("rft/{}", t.name)));
            let problems: Vec<_> = (0..groups)
                .map(|_| task.problem(&mut rng, Split::Train))
                .collect();
            let eps = run_episodes(
                &mut engine,
                task.as_ref(),
                &problems,
                g,
                sampling,
                self.cfg.rollout.max_turns,
                "rft",
            )
            .map_err(|e| format!("rft sampling of {}: {e}", t.name))?;
            drawn += eps.len() as u64;
            for e in eps {
                if e.sample.reward > 0.0 {
                    kept.push((e.sample.tokens, e.sample.loss_mask));
                }
            }
        }
        let _ = writeln!(
            self.progress,
            "  rft: {} of {drawn} samples of the warm-up model passed ({:.1}s)",
            kept.len(),
            start.elapsed().as_secs_f64()
        );
        // A fixed shuffle, then one pass in budget.steps batches.
        let mut rng = Rng::new(hash_str(self.cfg.run.seed, "rft/order"));
        for i in (1..kept.len()).rev() {
            kept.swap(i, rng.below(i + 1));
        }
        let steps = budget.steps;
        let opt = self.optimizer(backend, &model)?;
        let mut state = opt.new_state(backend).map_err(|e| e.to_string())?;
        let mut progress = Progress::new("rft", steps, self.cfg.run.log_every);
        let mut trained = 0u64;
        let n = kept.len();
        for step in 1..=steps {
            let (lo, hi) = (
                (step - 1) as usize * n / steps as usize,
                step as usize * n / steps as usize,
            );
            if lo == hi {
                // Fewer passing samples than steps: this step has none to train on.
                continue;
            }
            let mut batch = Batch::default();
            for (tokens, mask) in &kept[lo..hi] {
                batch.push(tokens, mask.clone());
            }
            let (loss, _) = supervised_step(backend, &mut model, &opt, &mut state, &batch)
                .map_err(|e| format!("rft step {step}: {e}"))?;
            trained += batch.trained_tokens();
            self.line(&json!({
                "stage": "rft",
                "step": step,
                "loss": loss,
                "sequences": batch.seqs.len(),
                "trained_tokens": batch.trained_tokens(),
                "wall_s": start.elapsed().as_secs_f64(),
            }))?;
            progress.update(self.progress, step, &format!("loss {loss:.4}"));
        }
        progress.finish(
            self.progress,
            &format!(
                "{:.1}s; {trained} trained tokens",
                start.elapsed().as_secs_f64()
            ),
        );
        Ok((model, (drawn, n as u64, trained)))
    }
}

/// The model of one arm, from where it starts.
pub(crate) enum Start<'a> {
    /// A checkpoint file (the warm-up's end).
    File(&'a std::path::Path),
    /// A fresh initialisation (no stage before the first RL stage).
    Fresh(&'a sluice_model::ModelConfig),
}

impl Start<'_> {
    fn load(&self, cfg: &TrainConfig, backend: &Backend) -> Result<Model, String> {
        let mut m = match self {
            Start::File(p) => Model::from_checkpoint(p, backend),
            Start::Fresh(c) => Model::new((*c).clone(), backend),
        }
        .map_err(|e| format!("the warm-up's weights: {e}"))?;
        m.set_precision(backend, cfg.model.precision)
            .map_err(|e| e.to_string())?;
        Ok(m)
    }
}

fn evals_json(e: &BTreeMap<String, ArmEval>) -> Value {
    json!(e)
}

impl Arms<'_> {
    /// Evaluates the warm-up (`warm_greedy`: its greedy pass rates, already measured) and the
    /// RL model (`rl_greedy`), runs the enabled baselines from `start`, and returns summary.json's
    /// `arms` object and the seconds each baseline took.
    pub fn run_all(
        &mut self,
        start: Start<'_>,
        rl_model: &Model,
        names: &[String],
        budget: &RlBudget,
        warm_greedy: &BTreeMap<String, f64>,
        rl_greedy: &BTreeMap<String, f64>,
    ) -> Result<(Value, Vec<(String, f64)>), String> {
        let backend = Backend::open(self.cfg.run.device).map_err(|e| e.to_string())?;
        let g = self.cfg.buffer.group_size as usize;
        let mut arms = serde_json::Map::new();
        let mut times = Vec::new();
        let t0 = Instant::now();
        let warm = start.load(self.cfg, &backend)?;
        let e = self.evaluate(&warm, names, g, warm_greedy)?;
        arms.insert("warm_up".into(), json!({ "tasks": evals_json(&e) }));
        let e = self.evaluate(rl_model, names, 1, rl_greedy)?;
        arms.insert(
            "rl".into(),
            json!({
                "tasks": evals_json(&e),
                "steps": budget.steps,
                "trained_tokens": budget.trained_tokens,
            }),
        );
        times.push(("eval-arms".to_string(), t0.elapsed().as_secs_f64()));
        if self.cfg.baselines.ablation {
            let t = Instant::now();
            let (m, trained) = self.ablation(&backend, warm, names, budget)?;
            let e = self.evaluate(&m, names, 1, &BTreeMap::new())?;
            arms.insert(
                "ablation".into(),
                json!({
                    "tasks": evals_json(&e),
                    "steps": budget.steps,
                    "trained_tokens": trained,
                }),
            );
            times.push(("ablation".to_string(), t.elapsed().as_secs_f64()));
        }
        if self.cfg.baselines.rft {
            let t = Instant::now();
            let warm = start.load(self.cfg, &backend)?;
            let (m, (drawn, kept, trained)) = self.rft(&backend, warm, names, budget)?;
            let e = self.evaluate(&m, names, 1, &BTreeMap::new())?;
            arms.insert(
                "rft".into(),
                json!({
                    "tasks": evals_json(&e),
                    "steps": budget.steps,
                    "samples_drawn": drawn,
                    "rl_samples": budget.sampled.values().sum::<u64>(),
                    "samples_kept": kept,
                    "trained_tokens": trained,
                }),
            );
            times.push(("rft".to_string(), t.elapsed().as_secs_f64()));
        }
        Ok((Value::Object(arms), times))
    }
}

/// The table of held-out pass rates per arm and task (from summary.json's `arms`).
pub fn table(arms: &Value) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let Some(obj) = arms.as_object() else {
        return t;
    };
    let order = ["warm_up", "rl", "ablation", "rft"];
    let label = |a: &str| match a {
        "warm_up" => "warm-up (before RL)",
        "rl" => "RL",
        "ablation" => "ablation (warm-up continued)",
        _ => "rejection-sampling FT",
    };
    let names: Vec<String> = obj
        .get("warm_up")
        .and_then(|w| w["tasks"].as_object())
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let pct = |v: &Value| {
        v.as_f64()
            .map_or("-".to_string(), |x| format!("{:.1}%", 100.0 * x))
    };
    let _ = writeln!(
        t,
        "\n| held-out pass rate | task | greedy | sampled (pass@1) | pass@k | problems |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|");
    for name in &names {
        for a in order {
            let Some(v) = obj.get(a).map(|x| &x["tasks"][name]) else {
                continue;
            };
            let k = v["k"].as_u64().unwrap_or(1);
            let _ = writeln!(
                t,
                "| {} | {name} | {} | {} | {} | {} |",
                label(a),
                pct(&v["greedy"]),
                pct(&v["sampled"]),
                if k > 1 {
                    format!("{} (k = {k})", pct(&v["pass_at_k"]))
                } else {
                    "-".to_string()
                },
                v["problems"]
            );
        }
    }
    for name in &names {
        let g = |a: &str| obj.get(a).and_then(|x| x["tasks"][name]["greedy"].as_f64());
        let mut parts = Vec::new();
        for (a, what) in [("ablation", "the ablation"), ("rft", "rejection sampling")] {
            if let (Some(r), Some(b)) = (g("rl"), g(a)) {
                parts.push(format!("{:+.1} points over {what}", 100.0 * (r - b)));
            }
        }
        if !parts.is_empty() {
            let _ = writeln!(t, "RL on {name} (greedy): {}", parts.join(", "));
        }
    }
    t
}
