//! The learner-vs-behavior log-prob mismatch of trained tokens (the learner's zero-lag audit
//! and drift figures, crate::learner).

/// Sums of the learner-vs-behavior log-prob mismatch over a set of trained tokens (slime's
/// `train_rollout_logprob_abs_diff`, verl's rollout-correction metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Mismatch {
    pub tokens: u64,
    /// Sum over the tokens of |logp_learner - logp_behavior|.
    pub abs_diff_sum: f64,
    /// Max over the tokens of |logp_learner - logp_behavior| (0 with no tokens).
    pub abs_diff_max: f64,
    /// Sum over the tokens of Schulman's k3 estimator of KL(behavior || learner):
    /// (r - 1) - ln r with r = exp(logp_learner - logp_behavior), an unbiased, non-negative
    /// per-sample estimate for tokens sampled from the behavior policy.
    pub k3_sum: f64,
}

impl Mismatch {
    /// Adds one token's learner and behavior log-probs.
    pub fn add_token(&mut self, logp_learner: f32, logp_behavior: f32) {
        let d = logp_learner as f64 - logp_behavior as f64;
        self.tokens += 1;
        self.abs_diff_sum += d.abs();
        self.abs_diff_max = self.abs_diff_max.max(d.abs());
        // k3 = (r - 1) - ln r with ln r = d; exp_m1 keeps it accurate for small d.
        self.k3_sum += d.exp_m1() - d;
    }

    /// Adds another set's sums.
    pub fn merge(&mut self, o: &Mismatch) {
        self.tokens += o.tokens;
        self.abs_diff_sum += o.abs_diff_sum;
        self.abs_diff_max = self.abs_diff_max.max(o.abs_diff_max);
        self.k3_sum += o.k3_sum;
    }

    /// Mean |logp_learner - logp_behavior| (0 with no tokens).
    pub fn abs_diff_mean(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.abs_diff_sum / self.tokens as f64
        }
    }

    /// Mean k3 estimate of KL(behavior || learner) per token (0 with no tokens).
    pub fn k3_kl(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.k3_sum / self.tokens as f64
        }
    }
}
