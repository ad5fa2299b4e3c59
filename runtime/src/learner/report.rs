//! What a learner step reports ([`StepReport`]), and the per-micro-batch audit that fills it:
//! acceptance, ratios, lags, entropy and the zero-lag check of the design's log-prob promise.

use super::{Learner, MicroBatch, StepInputs};
use crate::mismatch::Mismatch;
use crate::trajectory::WeightVersion;
use sluice_kernels::ops::is_gate_loss::{GateMode, GateReference};
use sluice_model::optim::StepStats;
use sluice_model::PackedBatch;
use std::collections::BTreeMap;
use std::time::Duration;

/// Per-task figures of one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskStep {
    pub groups: u64,
    /// Trajectories, repeats included.
    pub samples: u64,
    /// Sum of rewards over the unique (not repeated) trajectories.
    pub reward_sum: f64,
    pub unique_samples: u64,
    /// With teachers: the task's share of [`StepReport::opd_gap_sum`] and
    /// [`StepReport::opd_tokens`] (its teacher scored them).
    pub opd_gap_sum: f64,
    pub opd_tokens: u64,
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
    /// Of `accepted_unique_tokens`, those whose advantage is not 0: the tokens that carry a
    /// gradient (a group whose rewards are all equal carries none, unless a teacher gives its
    /// tokens advantages of their own).
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
    /// With teachers (on-policy distillation, crate::distill): the sum over the masked tokens
    /// they scored (repeats included) of behavior logp - teacher logp (the k1 estimate of
    /// KL(mu || teacher)), and the count of those tokens (each teacher log-prob recorded).
    pub opd_gap_sum: f64,
    pub opd_tokens: u64,
    /// Wall time of the step's compute.
    pub compute: Duration,
}

impl Learner {
    /// Counts acceptance, ratios, lags and the zero-lag audit of one micro-batch.
    /// `at_version`: the weights are still those of `learner` (the batch's first optimizer
    /// step); otherwise no token is zero-lag.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn audit(
        &self,
        report: &mut StepReport,
        inputs: &StepInputs<'_, '_>,
        mb: &MicroBatch,
        batch: &PackedBatch,
        out: &GateReference,
        learner: WeightVersion,
        at_version: bool,
    ) {
        for (b, &i) in mb.seqs.iter().enumerate() {
            let (s, grpo_advantage, repeat) = inputs.flat[i];
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
                // The token's own advantage where a teacher gave one (its sign picks the clip
                // bounds, as in the kernel).
                let advantage = inputs.token_adv.map_or(grpo_advantage, |t| t[i][j]);
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
