//! The learner (DESIGN 6.6): GRPO advantages per group, token-budget micro-batches, the
//! is_gate_loss objective at the rollout's temperature, the backward, Muon + AdamW, and weight
//! publications with a version.
//!
//! Versions count learner steps (calls of [`Learner::train`]): the learner's parameters after
//! `s` steps are version `s`, and a publication after step `s` carries version `s`. A token's
//! lag is the learner's version minus the token's version when the learner trains on it. A
//! step is one optimizer step, or with minibatches and epochs ([`LearnerConfig::minibatches`],
//! [`LearnerConfig::epochs`]) `minibatches x epochs` of them: the batch's groups split in order
//! into contiguous minibatches, each its own token mean and optimizer step, the sequence
//! repeated `epochs` times (AReaL's and verl's PPO minibatches; the version moves once per
//! batch, as their policy versions do).
//!
//! Zero-lag audit: a generated token is *zero-lag* when its version equals the learner's and
//! every earlier token of its trajectory carries that version too (the engine records on
//! prompt and observation tokens the version that computed their K/V), i.e. its whole context
//! came from the learner's current weights. With minibatches only the first optimizer step of
//! a batch runs on the weights of the learner's version; tokens of later minibatches are
//! counted as drift (`mismatch_lagpos`), never as zero-lag. For those tokens the design promises that the
//! learner's logp equals the rollout's behavior_logp bit for bit (same kernels, batch-invariant,
//! the sampler and the loss sharing one row reduction); the learner counts them and every one
//! whose bits differ (`zero_lag_mismatch_tokens`, expected 0).
//!
//! On-policy distillation (crate::distill): with teachers, every trained token also gets its
//! teacher's log-prob from a forward-only pass (as the KL reference's), and the student trains
//! on the per-token log-ratio as its advantage, or on a KL term toward the teacher in the loss.
//!
//! Precision: the learner computes in its model's precision ([`Model::precision`]). In bf16 the
//! forward and backward read the bf16 compute copy, the optimizer updates the f32 master
//! weights and refreshes the copy after every step, and a publication carries the copy: the
//! weights the engines run on are exactly the ones the learner's logp is computed with.

mod report;
mod scoring;

pub use crate::advantage::{advantages, advantages_of};
use crate::buffer::ReadyGroup;
use crate::distill::{token_advantages, OpdConfig, OpdForm, Teachers};
pub use crate::mismatch::Mismatch;
use crate::regularize::{trajectory_kl, KlConfig, KlPlace, Reference, Regularizers};
use crate::trajectory::{Sample, WeightVersion};
pub use report::{StepReport, TaskStep};
use sluice_kernels::ops::elementwise::residual_add;
use sluice_kernels::ops::is_gate_loss::{GateMode, GateParams, KlPenalty, TokenInputs};
use sluice_kernels::{Backend, DType, Error, Result};
use sluice_model::forward::policy_loss_and_grad_on;
use sluice_model::optim::{OptimConfig, OptimState, Optimizer, StepStats};
use sluice_model::{Arena, Model, PackedBatch};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// How the learner turns groups into a gradient step.
#[derive(Clone, Copy, Debug)]
pub struct LearnerConfig {
    /// Mode, eps_low, eps_high, beta of is_gate_loss (its temperature is taken per
    /// trajectory from the rollout's sampling parameters).
    pub loss: GateParams,
    /// GRPO advantage without the std: r - mean.
    pub std_free: bool,
    /// eps of (r - mean) / (std + eps).
    pub adv_eps: f32,
    /// Token budget of one micro-batch (a longer sequence gets one of its own).
    pub micro_batch_tokens: usize,
    /// How the per-token terms are averaged into an optimizer step's loss.
    pub aggregation: Aggregation,
    /// Optimizer steps per pass over a batch: its groups split in order into this many
    /// contiguous minibatches (fewer when the batch has fewer groups). 1: one step per batch.
    pub minibatches: usize,
    /// Passes over a batch's minibatches.
    pub epochs: usize,
    /// Decoupled PPO (AReaL): `Some(cap)` clips the ratio to the proximal policy (the weights
    /// at the start of the learner step) and weights each token by the stop-gradient
    /// pi_prox / mu, zeroed above `cap` (see [`Learner::train`]). Needs the `ppo` mode.
    pub decoupled: Option<f32>,
    /// The entropy bonus and the KL to a reference (crate::regularize); `loss.entropy` and
    /// `loss.kl` stay None (the learner sets them per micro-batch).
    pub regularizers: Regularizers,
    /// On-policy distillation (crate::distill; its teachers come with
    /// [`Learner::set_teachers`]). None: off.
    pub opd: Option<OpdConfig>,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            loss: GateParams::default(),
            std_free: false,
            adv_eps: 1e-6,
            micro_batch_tokens: 4096,
            aggregation: Aggregation::Token,
            minibatches: 1,
            epochs: 1,
            decoupled: None,
            regularizers: Regularizers::default(),
            opd: None,
        }
    }
}

/// How an optimizer step's loss averages its tokens' terms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Aggregation {
    /// The mean over the step's masked tokens (DESIGN 3.6's `D = sum m`).
    #[default]
    Token,
    /// The mean over each prompt's group of masked tokens first, then over the step's groups:
    /// per-token weights `c = 1 / (masked tokens of the token's group)`, so `D = sum m c` is
    /// the number of groups (the loss kernel's weight input; its structure unchanged). Long
    /// answers then weigh no more than short ones (MiMo's "prompt-mean"; DAPO's token mean is
    /// the other choice).
    Prompt,
}

/// Weights published to the rollout side.
#[derive(Clone, Debug)]
pub struct Publication {
    pub version: WeightVersion,
    /// The learner's compute weights at `version` (a copy; the learner keeps training its
    /// own): the f32 parameters, or in bf16 the bf16 compute copy (half the bytes).
    pub params: Arc<Arena>,
}

/// The learner: the model, its optimizer and state, on one backend.
pub struct Learner {
    backend: Backend,
    model: Model,
    optimizer: Optimizer,
    state: OptimState,
    cfg: LearnerConfig,
    steps: u64,
    /// The frozen KL reference (with `cfg.regularizers.kl`).
    reference: Option<Reference>,
    /// On-policy distillation's teachers (with `cfg.opd`).
    teachers: Option<Teachers>,
}

impl std::fmt::Debug for Learner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Learner(v{}, {:?})", self.steps, self.cfg)
    }
}

/// What every optimizer step of a learner step reads: the flattened trajectories (sample,
/// GRPO advantage, is a repeat), prompt-aggregation weights, decoupled PPO's proximal
/// log-probs, the per-token advantages of OPD's advantage form (which replace the GRPO ones),
/// and the log-probs of the KL term's target in the loss (the reference's or the teachers'),
/// all [trajectory][position].
struct StepInputs<'a, 's> {
    flat: &'a [(&'s Sample, f32, bool)],
    weights: Option<&'a [f32]>,
    prox: Option<&'a [Vec<f32>]>,
    token_adv: Option<&'a [Vec<f32>]>,
    kl_target: Option<(KlConfig, &'a [Vec<f32>])>,
}

/// How one optimizer step of a learner step is counted in its report.
#[derive(Clone, Copy)]
struct Pass {
    /// The first epoch: its tokens are counted (each once) and audited.
    count: bool,
    /// The batch's first optimizer step: the weights are those of the learner's version.
    at_version: bool,
    /// Its loss's weight in the report's loss (1 / minibatches).
    loss_weight: f64,
}

/// One packed row set: the sequences of a micro-batch and their per-token inputs.
struct MicroBatch {
    /// Indices into the flattened trajectory list.
    seqs: Vec<usize>,
    temperature: f32,
    tokens: usize,
}

impl Learner {
    /// A learner training `model` (on `backend`) with `optim`, at version `steps`.
    pub fn new(
        backend: Backend,
        model: Model,
        optim: OptimConfig,
        cfg: LearnerConfig,
        steps: u64,
    ) -> Result<Learner> {
        cfg.loss.validate()?;
        cfg.regularizers.validate()?;
        if cfg.loss.entropy.is_some() || cfg.loss.kl.is_some() {
            return Err(Error::param(
                "loss",
                "the entropy and KL terms are set through LearnerConfig::regularizers",
            ));
        }
        if cfg.micro_batch_tokens == 0 {
            return Err(Error::param(
                "micro_batch_tokens",
                "must be at least 1 token",
            ));
        }
        if cfg.minibatches == 0 || cfg.epochs == 0 {
            return Err(Error::param(
                "minibatches",
                format!(
                    "{} minibatches x {} epochs: both must be at least 1",
                    cfg.minibatches, cfg.epochs
                ),
            ));
        }
        if let Some(cap) = cfg.decoupled {
            if cfg.loss.mode != GateMode::Ppo {
                return Err(Error::param(
                    "decoupled",
                    format!(
                        "decoupled PPO clips a PPO surrogate: the mode is {:?}",
                        cfg.loss.mode
                    ),
                ));
            }
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::param(
                    "decoupled",
                    format!("weight cap {cap} must be > 0"),
                ));
            }
        }
        if let Some(opd) = cfg.opd {
            opd.validate()?;
            // The loss kernel takes one KL target: the reference's or the teachers'.
            if matches!(opd.form, Some(OpdForm::Kl(_))) && cfg.regularizers.kl_in_loss().is_some() {
                return Err(Error::param(
                    "opd",
                    "the KL form toward the teachers and a KL to the reference in the loss \
                     both need the loss kernel's one KL input",
                ));
            }
        }
        if !(cfg.adv_eps.is_finite() && cfg.adv_eps > 0.0) {
            return Err(Error::param(
                "adv_eps",
                format!("{} must be a number > 0", cfg.adv_eps),
            ));
        }
        let optimizer = Optimizer::new(&backend, model.layout().clone(), optim)?;
        let state = optimizer.new_state(&backend)?;
        // The KL reference: the weights the learner starts from (replace it with
        // [`Learner::set_reference`]).
        let reference = match cfg.regularizers.kl {
            Some(_) => Some(Reference::copy_of(&backend, model.compute_weights())?),
            None => None,
        };
        Ok(Learner {
            backend,
            model,
            optimizer,
            state,
            cfg,
            steps,
            reference,
            teachers: None,
        })
    }

    /// Gives on-policy distillation its teachers (each must have the policy's layout and
    /// compute precision); needed before the first step of a learner with `cfg.opd`.
    pub fn set_teachers(&mut self, teachers: Teachers) -> Result<()> {
        if self.cfg.opd.is_none() {
            return Err(Error::Invalid(
                "teachers were given to a learner without on-policy distillation".into(),
            ));
        }
        if let Some(i) = (0..teachers.len()).find(|&i| !teachers.get(i).model.fits(&self.model)) {
            return Err(Error::Invalid(format!(
                "OPD teacher {i}'s weights are not the policy's layout and precision"
            )));
        }
        self.teachers = Some(teachers);
        Ok(())
    }

    /// Whether the learner's signal needs GRPO groups of 2 or more: false when on-policy
    /// distillation gives every token its own advantage (or a KL term) without GRPO's.
    pub fn needs_groups(&self) -> bool {
        !self.cfg.opd.is_some_and(|o| o.needs_no_group())
    }

    /// The teachers, if the learner distils.
    pub fn teachers(&self) -> Option<&Teachers> {
        self.teachers.as_ref()
    }

    /// The KL reference, if the learner keeps one.
    pub fn reference(&self) -> Option<&Reference> {
        self.reference.as_ref()
    }

    /// Replaces the KL reference (a checkpoint's weights, or a resumed run's saved reference).
    pub fn set_reference(&mut self, reference: Reference) -> Result<()> {
        if self.cfg.regularizers.kl.is_none() {
            return Err(Error::Invalid(
                "a KL reference was given to a learner without a KL term".into(),
            ));
        }
        if !reference.fits(&self.model) {
            return Err(Error::Invalid(
                "the KL reference's weights are not the policy's layout and precision".into(),
            ));
        }
        self.reference = Some(reference);
        Ok(())
    }

    pub fn version(&self) -> WeightVersion {
        WeightVersion(self.steps)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    pub fn optimizer_state(&self) -> &OptimState {
        &self.state
    }

    /// The model and optimizer state back (for the next stage or a final checkpoint).
    pub fn into_parts(self) -> (Backend, Model, OptimState) {
        (self.backend, self.model, self.state)
    }

    /// The current weights as a publication (a copy of the compute weights: the parameter
    /// arena in f32, the bf16 compute copy in bf16).
    pub fn publish(&self) -> Result<Publication> {
        let w = self.model.compute_weights();
        Ok(Publication {
            version: self.version(),
            params: Arc::new(w.cast_copy(&self.backend, w.dtype())?),
        })
    }

    /// Clears the optimizer's moments (the optional reset on refresh, DESIGN 6.6).
    pub fn reset_optimizer(&mut self) -> Result<()> {
        self.state.reset(&self.backend)
    }

    /// Saves weights and optimizer state (checkpoint::save_with_meta through OptimState) with
    /// the learner's version.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.state
            .save(path, &self.model.config, &self.model.params)
    }

    /// Loads weights and optimizer state saved by [`Learner::save`] and takes `steps` as its
    /// version; all or nothing.
    pub fn load(&mut self, path: &Path, steps: u64) -> Result<()> {
        let cfg = self.model.config.clone();
        self.state
            .load(path, &self.backend, &cfg, &mut self.model.params)?;
        self.model.refresh_compute(&self.backend)?;
        self.steps = steps;
        Ok(())
    }

    /// One learner step on `groups` (each of G trajectories): one optimizer step, or
    /// `minibatches x epochs` of them (see the module docs). Errors before the first optimizer
    /// step leave the weights as they were (the optimizer checks everything before it writes);
    /// with several optimizer steps, an error in a later one leaves the earlier ones applied and
    /// the version unchanged (the run stops on a learner error).
    pub fn train(&mut self, groups: &[ReadyGroup]) -> Result<StepReport> {
        // The step's temporaries go back to this thread's cache when dropped and serve the
        // next step (kernels/src/tensor/pool.rs): a steady-state step allocates nothing.
        let _pool = sluice_kernels::tensor::PoolScope::enter();
        let start = Instant::now();
        let version = self.version();
        let mut report = StepReport {
            ratio_min: f32::INFINITY,
            ratio_max: f32::NEG_INFINITY,
            ..StepReport::default()
        };
        // Flatten: (sample, advantage, is a repeat); `group_start[g]` is group g's first.
        // Prompt aggregation: each trajectory's token weight, 1 / its group's masked tokens.
        let mut flat: Vec<(&Sample, f32, bool)> = Vec::new();
        let mut group_start = Vec::with_capacity(groups.len() + 1);
        let mut token_weight: Vec<f32> = Vec::new();
        for g in groups {
            group_start.push(flat.len());
            if self.cfg.aggregation == Aggregation::Prompt {
                let masked: usize = g.samples.iter().map(masked_tokens).sum();
                let w = if masked > 0 { 1.0 / masked as f32 } else { 0.0 };
                token_weight.extend(std::iter::repeat_n(w, g.samples.len()));
            }
            let unique = g.samples.len() - g.duplicated;
            let t = report.per_task.entry(g.task.clone()).or_default();
            t.groups += 1;
            t.samples += g.samples.len() as u64;
            for (i, s) in g.samples.iter().enumerate() {
                if s.tokens.len() < 2 {
                    return Err(Error::Invalid(format!(
                        "trajectory {}/{} has {} token(s); a trained sequence needs at least 2",
                        s.instance_id,
                        s.group_index,
                        s.tokens.len()
                    )));
                }
                if i < unique {
                    t.reward_sum += s.reward as f64;
                    t.unique_samples += 1;
                }
                // The advantage comes below, from the (possibly KL-shaped) rewards.
                flat.push((s, 0.0, i >= unique));
            }
        }
        group_start.push(flat.len());
        if flat.is_empty() {
            return Err(Error::Invalid(
                "a learner step needs at least one group".into(),
            ));
        }
        // The KL reference's log-prob of every masked token; the KL at the behavior log-probs
        // (measured, and in the reward form subtracted from the rewards, detached).
        let reference = match &self.reference {
            Some(r) => Some(self.token_logps(&flat, r.params())?),
            None => None,
        };
        // On-policy distillation: every masked token's teacher log-prob (its task's teacher),
        // and the gap to it measured.
        let teacher = self.opd_scores(&flat, &mut report)?;
        let mut penalty = vec![0.0f64; flat.len()];
        if let (Some(refs), Some(kl)) = (&reference, self.cfg.regularizers.kl) {
            let in_reward = self.cfg.regularizers.kl_in_reward().is_some();
            for (i, (s, _, _)) in flat.iter().enumerate() {
                let (sum, n) =
                    trajectory_kl(kl.estimator, &s.loss_mask, &s.behavior_logp, &refs[i]);
                report.kl_sum += sum;
                report.kl_tokens += n;
                if in_reward {
                    penalty[i] = kl.coef as f64 * sum;
                }
            }
        }
        for w in group_start.windows(2) {
            let rewards: Vec<f64> = (w[0]..w[1])
                .map(|i| flat[i].0.reward as f64 - penalty[i])
                .collect();
            let adv = advantages_of(&rewards, self.cfg.std_free, self.cfg.adv_eps);
            for (i, a) in (w[0]..w[1]).zip(adv) {
                flat[i].1 = a;
            }
        }
        // OPD's advantage form: per-token advantages, in place of GRPO's or added to them.
        let opd = self.cfg.opd.and_then(|o| Some((o.form?, o.coef)));
        let token_adv: Option<Vec<Vec<f32>>> = match (opd, &teacher) {
            (Some((OpdForm::Advantage { with_grpo, center }, coef)), Some(q)) => {
                // The step's mean gap b - q over the scored tokens (the centering baseline).
                let mean_gap = if center && report.opd_tokens > 0 {
                    (report.opd_gap_sum / report.opd_tokens as f64) as f32
                } else {
                    0.0
                };
                Some(
                    flat.iter()
                        .zip(q)
                        .map(|((s, a, _), q)| {
                            let grpo = with_grpo.then_some(*a);
                            let (m, b) = (&s.loss_mask, &s.behavior_logp);
                            token_advantages(coef, m, b, q, grpo, mean_gap)
                        })
                        .collect(),
                )
            }
            _ => None,
        };
        // The KL term in the loss: toward the teachers (OPD's KL form) or the reference.
        let kl_target = match (
            opd,
            &teacher,
            self.cfg.regularizers.kl_in_loss(),
            &reference,
        ) {
            (Some((OpdForm::Kl(estimator), coef)), Some(q), _, _) => Some((
                KlConfig {
                    estimator,
                    coef,
                    place: KlPlace::Loss,
                },
                q.as_slice(),
            )),
            (_, _, Some(k), Some(r)) => Some((k, r.as_slice())),
            _ => None,
        };
        // Decoupled PPO: every masked token's log-prob under the proximal policy, the weights
        // now, before any optimizer step of this learner step.
        let prox = match self.cfg.decoupled {
            Some(_) => Some(self.token_logps(&flat, self.model.compute_weights())?),
            None => None,
        };
        // Minibatch i: groups [i n / m, (i + 1) n / m), in order.
        let m = self.cfg.minibatches.min(groups.len());
        for epoch in 0..self.cfg.epochs {
            for i in 0..m {
                let range =
                    group_start[i * groups.len() / m]..group_start[(i + 1) * groups.len() / m];
                let pass = Pass {
                    count: epoch == 0,
                    at_version: epoch == 0 && i == 0,
                    loss_weight: 1.0 / m as f64,
                };
                let weights = (!token_weight.is_empty()).then_some(token_weight.as_slice());
                let inputs = StepInputs {
                    flat: &flat,
                    weights,
                    prox: prox.as_deref(),
                    token_adv: token_adv.as_deref(),
                    kl_target,
                };
                let stats = self.optimizer_step(&inputs, range, &mut report, version, pass)?;
                report.optim = Some(stats);
                report.optimizer_steps += 1;
            }
        }
        self.steps += 1;
        report.version = self.version();
        report.compute = start.elapsed();
        Ok(report)
    }

    /// One optimizer step on the trajectories `flat[range]`: their loss is their own token mean,
    /// or with `weights` (one per trajectory of `flat`) their own weighted mean. With `prox`
    /// (decoupled PPO) the kernel's ratio is pi_theta / pi_prox and each advantage carries the
    /// stop-gradient weight pi_prox / mu (0 above the cap): every mode is linear in a positive
    /// scaling of A, so the kernel needs nothing new.
    fn optimizer_step(
        &mut self,
        inputs_in: &StepInputs<'_, '_>,
        range: std::ops::Range<usize>,
        report: &mut StepReport,
        version: WeightVersion,
        pass: Pass,
    ) -> Result<StepStats> {
        let (flat, weights) = (inputs_in.flat, inputs_in.weights);
        let total_masked: usize = flat[range.clone()]
            .iter()
            .map(|(s, _, _)| masked_tokens(s))
            .sum();
        // With weights, D = sum of the weights over masked tokens, in flat order.
        let total_weight: f32 = weights.map_or(0.0, |w| {
            range.clone().fold(0.0f32, |acc, i| {
                acc + w[i] * masked_tokens(flat[i].0) as f32
            })
        });
        let batches = self.micro_batches(flat, range);
        let mut acc: Option<Arena> = None;
        for mb in &batches {
            let seqs: Vec<Vec<i32>> = mb
                .seqs
                .iter()
                .map(|&i| flat[i].0.tokens.iter().map(|&t| t as i32).collect())
                .collect();
            let batch = PackedBatch::pack(&seqs, self.model.config.vocab)?;
            let n = batch.len();
            let mut targets = vec![0i32; n];
            let mut mask = vec![0.0f32; n];
            let mut behavior = vec![0.0f32; n];
            let mut adv = vec![0.0f32; n];
            let mut weight = vec![0.0f32; if weights.is_some() { n } else { 0 }];
            let kl_loss = inputs_in.kl_target;
            let mut ref_logp = vec![0.0f32; if kl_loss.is_some() { n } else { 0 }];
            let mut masked_here = 0usize;
            let mut weight_here = 0.0f32;
            for (b, &i) in mb.seqs.iter().enumerate() {
                let (s, a, _) = flat[i];
                let r = batch.seq_range(b);
                for j in 0..s.tokens.len() - 1 {
                    targets[r.start + j] = s.tokens[j + 1] as i32;
                    if s.loss_mask[j + 1] {
                        mask[r.start + j] = 1.0;
                        behavior[r.start + j] = s.behavior_logp[j + 1];
                        // The token's own advantage in OPD's advantage form, else its
                        // trajectory's.
                        let a = inputs_in.token_adv.map_or(a, |t| t[i][j + 1]);
                        adv[r.start + j] = a;
                        if let (Some(prox), Some(cap)) = (inputs_in.prox, self.cfg.decoupled) {
                            let p = prox[i][j + 1];
                            let w = (p - s.behavior_logp[j + 1]).exp();
                            behavior[r.start + j] = p;
                            adv[r.start + j] = if w <= cap { a * w } else { 0.0 };
                        }
                        masked_here += 1;
                        if let Some(w) = weights {
                            weight[r.start + j] = w[i];
                        }
                        if let Some((_, target)) = kl_loss {
                            ref_logp[r.start + j] = target[i][j + 1];
                        }
                    }
                }
                if let Some(w) = weights {
                    weight_here += w[i] * masked_tokens(s) as f32;
                }
            }
            // Each micro-batch's loss is its own (weighted) token mean; scaling its advantages
            // (and the regularizers' coefficients) by D_mb / D_total makes the sum over
            // micro-batches the step's mean (every mode is linear in positive scalings of A).
            let share = match weights {
                None if total_masked > 0 => masked_here as f32 / total_masked as f32,
                Some(_) if total_weight > 0.0 => weight_here / total_weight,
                _ => 0.0,
            };
            for a in adv.iter_mut() {
                *a *= share;
            }
            let inputs = TokenInputs {
                tokens: &targets,
                behavior_logp: &behavior,
                advantages: &adv,
                mask: &mask,
                weight: weights.map(|_| weight.as_slice()),
                ref_logp: kl_loss.map(|_| ref_logp.as_slice()),
            };
            // The entropy is always measured (one more sum in the kernel's lse pass: the loss
            // and gradient bits are unchanged unless the bonus is on).
            let params = GateParams {
                temperature: mb.temperature,
                entropy: Some(self.cfg.regularizers.entropy_coef * share),
                kl: kl_loss.map(|(k, _)| KlPenalty {
                    estimator: k.estimator,
                    coef: k.coef * share,
                }),
                ..self.cfg.loss
            };
            let out =
                policy_loss_and_grad_on(&self.backend, &mut self.model, &batch, &inputs, &params)?;
            if pass.count {
                report.loss += out.loss as f64 * pass.loss_weight;
                report.micro_batches += 1;
                report.tokens += n as u64;
                self.audit(
                    report,
                    inputs_in,
                    mb,
                    &batch,
                    &out,
                    version,
                    pass.at_version,
                );
            }
            // Several micro-batches: sum their gradients (the backward overwrites the
            // gradient arena), in micro-batch order.
            if batches.len() > 1 {
                acc = Some(match acc {
                    None => self.model.grads.cast_copy(&self.backend, DType::F32)?,
                    Some(mut a) => {
                        let sum =
                            residual_add(&self.backend, a.tensor(), self.model.grads.tensor())?;
                        a.replace_tensor(sum)?;
                        a
                    }
                });
            }
        }
        if let Some(a) = acc {
            self.model.grads = a;
        }
        self.optimizer.step(
            &self.backend,
            &mut self.model.params,
            &self.model.grads,
            &mut self.state,
            self.model.compute.as_mut(),
        )
    }
}

/// A trajectory's masked (trained-on) tokens after the first.
fn masked_tokens(s: &Sample) -> usize {
    s.loss_mask[1..].iter().filter(|&&m| m).count()
}

/// The temperature the learner computes a trajectory's log-probs at: its sampling temperature,
/// or 1 for greedy rollouts (which record the temperature-1 log-prob).
pub fn loss_temperature(s: &Sample) -> f32 {
    if s.sampling.temperature > 0.0 {
        s.sampling.temperature
    } else {
        1.0
    }
}
