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
//! Precision: the learner computes in its model's precision ([`Model::precision`]). In bf16 the
//! forward and backward read the bf16 compute copy, the optimizer updates the f32 master
//! weights and refreshes the copy after every step, and a publication carries the copy: the
//! weights the engines run on are exactly the ones the learner's logp is computed with.

pub use crate::advantage::{advantages, advantages_of};
use crate::buffer::ReadyGroup;
pub use crate::mismatch::Mismatch;
use crate::regularize::{trajectory_kl, Reference, Regularizers};
use crate::trajectory::{Sample, WeightVersion};
use sluice_kernels::ops::elementwise::residual_add;
use sluice_kernels::ops::is_gate_loss::{GateMode, GateParams, KlPenalty, TokenInputs};
use sluice_kernels::{Backend, DType, Error, Result};
use sluice_model::forward::{policy_loss_and_grad_on, token_logps_of_on};
use sluice_model::optim::{OptimConfig, OptimState, Optimizer, StepStats};
use sluice_model::{Arena, Model, PackedBatch};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Per-task figures of one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskStep {
    pub groups: u64,
    /// Trajectories, repeats included.
    pub samples: u64,
    /// Sum of rewards over the unique (not repeated) trajectories.
    pub reward_sum: f64,
    pub unique_samples: u64,
}

/// What one learner step did.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// The learner's version after the step.
    pub version: WeightVersion,
    /// The loss: the mean over the first epoch's minibatches of each one's token mean (the
    /// batch's token mean with one minibatch).
    pub loss: f64,
    /// The last optimizer step's statistics.
    pub optim: Option<StepStats>,
    /// Optimizer steps taken (minibatches x epochs).
    pub optimizer_steps: u64,
    /// Masked tokens (repeats included) whose clipped surrogate took the clipped branch
    /// (`ppo` and `icepop`: A > 0 and rho > 1 + eps_high, or A < 0 and rho < 1 - eps_low).
    pub clipped: u64,
    pub micro_batches: u64,
    /// Tokens in the packed batches (prompts and observations included).
    pub tokens: u64,
    /// Masked (trained-on) tokens, repeats included.
    pub masked_tokens: u64,
    /// Masked tokens the hard gate kept, over unique trajectories only (the numerator of
    /// effective throughput).
    pub accepted_unique_tokens: u64,
    /// Masked tokens of unique trajectories.
    pub masked_unique_tokens: u64,
    /// Of `accepted_unique_tokens`, those of trajectories whose advantage is not 0: the
    /// tokens that carry a gradient (a group whose rewards are all equal carries none).
    pub gradient_unique_tokens: u64,
    pub ratio_sum: f64,
    pub ratio_min: f32,
    pub ratio_max: f32,
    pub gated_low: u64,
    pub gated_high: u64,
    pub zero_lag_tokens: u64,
    pub zero_lag_mismatch_tokens: u64,
    /// Masked tokens (repeats included) by lag = learner version - token version.
    pub lag_hist: Vec<u64>,
    /// Learner-vs-behavior log-prob mismatch of the masked tokens (repeats included) whose
    /// whole context is at the learner's version (the zero-lag tokens above, repeats
    /// included): expected exactly 0.
    pub mismatch_lag0: Mismatch,
    /// The same over every other masked token (the token or an earlier one of its trajectory
    /// at an older version): policy drift.
    pub mismatch_lagpos: Mismatch,
    pub per_task: BTreeMap<String, TaskStep>,
    /// Sum of the softmax entropy (under the learner's weights of each token's optimizer step,
    /// first epoch) over the masked tokens, repeats included, and their count.
    pub entropy_sum: f64,
    pub entropy_tokens: u64,
    /// With a KL reference: the sum over masked tokens (repeats included) of the KL estimate
    /// at the behavior log-probs (KL(mu || ref)), and their count.
    pub kl_sum: f64,
    pub kl_tokens: u64,
    /// Wall time of the step's compute.
    pub compute: Duration,
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
}

impl std::fmt::Debug for Learner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Learner(v{}, {:?})", self.steps, self.cfg)
    }
}

/// What every optimizer step of a learner step reads: the flattened trajectories (sample,
/// advantage, is a repeat), prompt-aggregation weights, decoupled PPO's proximal log-probs,
/// and the KL reference's (both [trajectory][position]).
struct StepInputs<'a, 's> {
    flat: &'a [(&'s Sample, f32, bool)],
    weights: Option<&'a [f32]>,
    prox: Option<&'a [Vec<f32>]>,
    reference: Option<&'a [Vec<f32>]>,
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
        })
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
        if reference.params().layout() != self.model.layout()
            || reference.params().dtype() != self.model.compute_weights().dtype()
        {
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
                    reference: reference.as_deref(),
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

    /// The log-prob of every masked token of `flat` under `weights` (decoupled PPO's proximal
    /// policy: the learner's current weights; the KL reference), forward only, through the same
    /// micro-batches and row reduction as the training pass (so equal weights give the
    /// learner's bits, and at zero lag the rollout's). Indexed [trajectory][position]; 0 where
    /// not masked.
    fn token_logps(&self, flat: &[(&Sample, f32, bool)], weights: &Arena) -> Result<Vec<Vec<f32>>> {
        let mut out: Vec<Vec<f32>> = flat
            .iter()
            .map(|(s, _, _)| vec![0.0; s.tokens.len()])
            .collect();
        for mb in self.micro_batches(flat, 0..flat.len()) {
            let seqs: Vec<Vec<i32>> = mb
                .seqs
                .iter()
                .map(|&i| flat[i].0.tokens.iter().map(|&t| t as i32).collect())
                .collect();
            let batch = PackedBatch::pack(&seqs, self.model.config.vocab)?;
            let mut targets = vec![0i32; batch.len()];
            for (b, &i) in mb.seqs.iter().enumerate() {
                let s = flat[i].0;
                let r = batch.seq_range(b);
                for j in 0..s.tokens.len() - 1 {
                    targets[r.start + j] = s.tokens[j + 1] as i32;
                }
            }
            let logp = token_logps_of_on(
                &self.backend,
                &self.model.config,
                weights,
                &batch,
                &targets,
                mb.temperature,
            )?;
            for (b, &i) in mb.seqs.iter().enumerate() {
                let r = batch.seq_range(b);
                for j in 0..flat[i].0.tokens.len() - 1 {
                    if flat[i].0.loss_mask[j + 1] {
                        out[i][j + 1] = logp[r.start + j];
                    }
                }
            }
        }
        Ok(out)
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
            let kl_loss = self.cfg.regularizers.kl_in_loss();
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
                        if let (Some(refs), true) = (inputs_in.reference, kl_loss.is_some()) {
                            ref_logp[r.start + j] = refs[i][j + 1];
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
                kl: kl_loss.map(|k| KlPenalty {
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
                self.audit(report, flat, mb, &batch, &out, version, pass.at_version);
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

    /// Groups the trajectories `flat[range]` by sampling temperature, then packs them in order
    /// into micro-batches of at most `micro_batch_tokens` tokens.
    fn micro_batches(
        &self,
        flat: &[(&Sample, f32, bool)],
        range: std::ops::Range<usize>,
    ) -> Vec<MicroBatch> {
        let mut by_temp: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, (s, _, _)) in flat.iter().enumerate().take(range.end).skip(range.start) {
            by_temp
                .entry(loss_temperature(s).to_bits())
                .or_default()
                .push(i);
        }
        let mut out = Vec::new();
        for (bits, idx) in by_temp {
            let temperature = f32::from_bits(bits);
            let mut cur = MicroBatch {
                seqs: Vec::new(),
                temperature,
                tokens: 0,
            };
            for i in idx {
                let len = flat[i].0.tokens.len();
                if !cur.seqs.is_empty() && cur.tokens + len > self.cfg.micro_batch_tokens {
                    out.push(std::mem::replace(
                        &mut cur,
                        MicroBatch {
                            seqs: Vec::new(),
                            temperature,
                            tokens: 0,
                        },
                    ));
                }
                cur.seqs.push(i);
                cur.tokens += len;
            }
            if !cur.seqs.is_empty() {
                out.push(cur);
            }
        }
        out
    }

    /// Counts acceptance, ratios, lags and the zero-lag audit of one micro-batch.
    /// `at_version`: the weights are still those of `learner` (the batch's first optimizer
    /// step); otherwise no token is zero-lag.
    #[allow(clippy::too_many_arguments)]
    fn audit(
        &self,
        report: &mut StepReport,
        flat: &[(&Sample, f32, bool)],
        mb: &MicroBatch,
        batch: &PackedBatch,
        out: &sluice_kernels::ops::is_gate_loss::GateReference,
        learner: WeightVersion,
        at_version: bool,
    ) {
        for (b, &i) in mb.seqs.iter().enumerate() {
            let (s, advantage, repeat) = flat[i];
            let r0 = batch.seq_range(b).start;
            // Tokens [0, same) all carry the learner's version (and the weights are it).
            let same = if at_version {
                s.weight_version
                    .iter()
                    .position(|&v| v != learner)
                    .unwrap_or(s.tokens.len())
            } else {
                0
            };
            for j in 1..s.tokens.len() {
                if !s.loss_mask[j] {
                    continue;
                }
                let row = r0 + j - 1;
                let lag = learner.0.saturating_sub(s.weight_version[j].0) as usize;
                if report.lag_hist.len() <= lag {
                    report.lag_hist.resize(lag + 1, 0);
                }
                report.lag_hist[lag] += 1;
                report.masked_tokens += 1;
                if let Some(&h) = out.entropy.get(row) {
                    report.entropy_sum += h as f64;
                    report.entropy_tokens += 1;
                }
                let rho = out.ratio[row];
                report.ratio_sum += rho as f64;
                report.ratio_min = report.ratio_min.min(rho);
                report.ratio_max = report.ratio_max.max(rho);
                let accepted = out.accepted[row] != 0;
                if matches!(self.cfg.loss.mode, GateMode::Ppo | GateMode::Icepop) && accepted {
                    let (el, eh) = self.cfg.loss.bounds(advantage);
                    if (advantage > 0.0 && rho > 1.0 + eh) || (advantage < 0.0 && rho < 1.0 - el) {
                        report.clipped += 1;
                    }
                }
                if !repeat {
                    report.masked_unique_tokens += 1;
                    report.accepted_unique_tokens += u64::from(accepted);
                    report.gradient_unique_tokens += u64::from(accepted && advantage != 0.0);
                }
                if !accepted {
                    // Which side of the gate (the kernel's counters hold the batch totals).
                    if rho < 1.0 {
                        report.gated_low += 1;
                    } else {
                        report.gated_high += 1;
                    }
                }
                if j < same {
                    report
                        .mismatch_lag0
                        .add_token(out.logp[row], s.behavior_logp[j]);
                } else {
                    report
                        .mismatch_lagpos
                        .add_token(out.logp[row], s.behavior_logp[j]);
                }
                if j < same && !repeat {
                    report.zero_lag_tokens += 1;
                    if out.logp[row].to_bits() != s.behavior_logp[j].to_bits() {
                        report.zero_lag_mismatch_tokens += 1;
                    }
                }
            }
        }
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
