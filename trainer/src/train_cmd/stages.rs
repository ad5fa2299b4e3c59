//! The stages of `sluice train`: the supervised warm-up, the RL stage (and its observer, which
//! writes metrics and checkpoints at barriers), held-out evaluation and the baselines.

use super::*;
use sluice_runtime::regularize::Reference;

/// The KL reference's weights in an RL checkpoint (runs with a KL term).
const REFERENCE_FILE: &str = "reference.safetensors";

impl RunContext<'_> {
    /// Supervised warm-up on the tasks' demonstrations, mixed by target share.
    pub(super) fn sft_stage(
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
                    min_ratio: self.cfg.optim.sft_min_lr_ratio,
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
        let mut progress = Progress::new(&format!("sft #{index}"), steps, self.cfg.run.log_every);
        let start = Instant::now();
        let mut tokens = 0u64;
        let seed = self.cfg.run.seed;
        let vocab = model.config.vocab;
        for step in 1..=steps {
            let mut seqs: Vec<Vec<i32>> = Vec::with_capacity(self.cfg.optim.sft_batch);
            let mut masks: Vec<Vec<bool>> = Vec::with_capacity(self.cfg.optim.sft_batch);
            for i in 0..self.cfg.optim.sft_batch {
                // The task by target share (uniform when every share is 0), as the ablation
                // arm's continued warm-up draws it.
                let (pick, mut rng) =
                    crate::arms::draw_demo_task(&tasks, seed, &format!("sft{index}"), step, i);
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
    pub(super) fn evaluate(
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

    pub(super) fn engine_config(&self) -> EngineConfig {
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
    pub(super) fn rl_stage(&mut self, index: usize, model: Model) -> Result<Model, TrainError> {
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
        // With rollout.servers the servers are the replicas: no engine in this process.
        let local = if cfg.rollout.servers.is_empty() {
            cfg.rollout.replicas
        } else {
            0
        };
        let mut engines = Vec::with_capacity(local);
        for _ in 0..local {
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
                    eps_neg: cfg.loss.eps_neg,
                    beta: cfg.loss.beta,
                    temperature: 1.0,
                    entropy: None,
                    kl: None,
                },
                std_free: cfg.loss.std_free,
                adv_eps: 1e-6,
                micro_batch_tokens: cfg.loss.micro_batch_tokens,
                aggregation: cfg.loss.aggregation,
                minibatches: cfg.optim.minibatches,
                epochs: cfg.optim.epochs,
                decoupled: cfg.loss.decoupled,
                regularizers: sluice_runtime::regularize::Regularizers {
                    entropy_coef: cfg.loss.entropy_coef,
                    kl: cfg.loss.kl,
                },
                opd: cfg.opd.as_ref().map(|o| o.config),
            },
            self.state.rl_version,
        )
        .map_err(run_err)?;
        // The KL reference: the stage's initial weights (the learner's copy), a checkpoint, or
        // on resume the reference the checkpoint saved.
        let reference_file = match (&resume, &self.resume_from) {
            (Some(_), Some(ck)) if cfg.loss.kl.is_some() => Some(ck.join(REFERENCE_FILE)),
            _ => cfg.loss.kl_reference.clone(),
        };
        if let Some(path) = reference_file {
            let r = Reference::load(
                &path,
                learner.backend(),
                learner.model(),
                "the KL reference",
            )
            .map_err(|e| {
                TrainError::Input(match &resume {
                    Some(_) => format!("resume: the KL reference: {e}"),
                    None => format!("loss.kl_reference: {e}"),
                })
            })?;
            learner.set_reference(r).map_err(run_err)?;
        }
        // On-policy distillation's teachers, from their files (on resume too).
        if let Some(o) = &cfg.opd {
            let teachers = super::opd::load_teachers(o, &learner)?;
            learner.set_teachers(teachers).map_err(run_err)?;
        }
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
            dynamic_sampling: cfg.buffer.dynamic_sampling,
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
            over_sampling: cfg.rollout.over_sampling,
            servers: cfg.rollout.servers.clone(),
            pin_lanes: cfg.run.pin_lanes,
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
        let (parts, _orch, buffer, report) = run_stage(
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
        t.optimizer_steps += l.optimizer_steps;
        t.clipped += l.clipped;
        t.entropy_sum += l.entropy_sum;
        t.entropy_tokens += l.entropy_tokens;
        t.kl_sum += l.kl_sum;
        t.kl_tokens += l.kl_tokens;
        t.opd_gap_sum += l.opd_gap_sum;
        t.opd_tokens += l.opd_tokens;
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
        t.zero_signal_dropped += report.buffer.zero_signal_dropped;
        t.zero_signal_trained += report.buffer.zero_signal_released;
        t.aborts.add(&report.rollout);
        t.env_calls += report.rollout.env_calls;
        for (k, n) in &report.rollout.env_faults {
            *t.env_faults.entry(k.clone()).or_default() += n;
        }
        t.round_trip.add(&report.rollout.round_trip);
        for (k, n) in &report.rollout.by_terminal {
            *t.by_terminal.entry(k.clone()).or_default() += n;
        }
        for (task, m) in buffer.by_turns() {
            for (turns, c) in m {
                let e = t
                    .by_turns
                    .entry(task.clone())
                    .or_default()
                    .entry(*turns)
                    .or_default();
                e.0 += c.trajectories_in;
                e.1 += c.stale_dropped;
                e.2 += c.env_dropped;
            }
        }
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
    pub(super) fn arms(
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
            sampled: t.flow.iter().map(|(k, v)| (k.clone(), v.0)).collect(),
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

    fn on_replica_lost(&mut self, loss: &sluice_runtime::system::ReplicaLoss) {
        // A rollout server's loss is an operator's business: say which and why.
        if let Some(reason) = &loss.reason {
            let _ = writeln!(
                self.out,
                "  rollout server {} lost ({reason}): {} trajectories ended as environment; it \
                 rejoins after a full sync when it answers",
                loss.replica, loss.lost.trajectories
            );
        }
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
                if let Some(r) = learner.reference() {
                    r.save(&dir.join(REFERENCE_FILE), learner.model())
                        .map_err(|e| format!("checkpoint: {e}"))?;
                }
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
