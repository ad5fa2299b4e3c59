//! The learner's regularizers (issue 28 item 7): the entropy bonus and the KL to a frozen
//! reference policy, their configuration, and the reference itself (docs/runtime.md, "KL to a
//! reference and the entropy bonus").
//!
//! Both act through the fused loss kernel (kernels/src/ops/is_gate_loss.rs): the entropy from
//! one more online sum of its log-sum-exp pass, the KL from one more per-token input (the
//! reference's log-probs). The reference's log-probs come from the learner's own micro-batches
//! through a forward-only pass on a frozen copy of the weights (a [`ScoringModel`], as on-policy
//! distillation's teachers are), so for equal weights they are the learner's bits.

pub use crate::scoring::ScoringModel;
use sluice_kernels::ops::is_gate_loss::{kl_estimate, KlEstimator};
use sluice_kernels::{Error, Result};

/// Where the KL to the reference acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KlPlace {
    /// `coef * KL` per trained token in the loss, with its gradient.
    Loss,
    /// The trajectory's summed per-token KL (detached, at the behavior policy's tokens),
    /// times `coef`, subtracted from its reward before the GRPO advantages.
    Reward,
}

/// The KL-to-reference term.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlConfig {
    pub estimator: KlEstimator,
    /// 0: the KL is measured (metrics) but acts nowhere.
    pub coef: f32,
    pub place: KlPlace,
}

/// The regularizers of a learner (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Regularizers {
    /// The entropy bonus: `-entropy_coef * H` per trained token (0: off; the entropy of
    /// trained tokens is measured either way).
    pub entropy_coef: f32,
    /// KL to the reference (None: no reference is kept).
    pub kl: Option<KlConfig>,
}

impl Regularizers {
    pub fn validate(&self) -> Result<()> {
        if !(self.entropy_coef.is_finite() && self.entropy_coef >= 0.0) {
            return Err(Error::param(
                "entropy_coef",
                format!("{} must be finite and >= 0", self.entropy_coef),
            ));
        }
        if let Some(kl) = self.kl {
            if !(kl.coef.is_finite() && kl.coef >= 0.0) {
                return Err(Error::param(
                    "kl_coef",
                    format!("{} must be finite and >= 0", kl.coef),
                ));
            }
        }
        Ok(())
    }

    /// The KL term the loss kernel applies (in-loss KL with a coefficient above 0).
    pub fn kl_in_loss(&self) -> Option<KlConfig> {
        self.kl.filter(|k| k.place == KlPlace::Loss && k.coef > 0.0)
    }

    /// The KL term subtracted from rewards.
    pub fn kl_in_reward(&self) -> Option<KlConfig> {
        self.kl
            .filter(|k| k.place == KlPlace::Reward && k.coef > 0.0)
    }
}

/// The frozen reference policy: a scoring model (crate::scoring), the stage's initial compute
/// weights or a checkpoint's.
pub type Reference = ScoringModel;

/// The summed KL estimate of one trajectory's masked tokens at its behavior log-probs (tokens
/// `1..`; `ref_logp` indexed like the trajectory's tokens), in f64.
pub fn trajectory_kl(
    estimator: KlEstimator,
    loss_mask: &[bool],
    behavior_logp: &[f32],
    ref_logp: &[f32],
) -> (f64, u64) {
    let mut sum = 0.0f64;
    let mut n = 0u64;
    for j in 1..loss_mask.len() {
        if loss_mask[j] {
            sum += kl_estimate(estimator, behavior_logp[j], ref_logp[j]).0 as f64;
            n += 1;
        }
    }
    (sum, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand: tokens 1 and 3 trained (token 2 is an observation), behavior log-probs
    /// ln 1/2 and ln 1/4, reference ln 1/4 and ln 1/2. k1: (ln 2) + (-ln 2) = 0. k3 at token 1:
    /// u = ref - logp = -ln 2, e^u - 1 - u = 1/2 - 1 + ln 2 = 0.193147; at token 3: u = ln 2,
    /// 2 - 1 - ln 2 = 0.306853; sum 0.5.
    #[test]
    fn trajectory_kl_sums_the_trained_tokens_estimates() {
        let mask = [false, true, false, true];
        let behavior = [0.0, 0.5f32.ln(), -9.0, 0.25f32.ln()];
        let reference = [0.0, 0.25f32.ln(), 0.0, 0.5f32.ln()];
        let (k1, n) = trajectory_kl(KlEstimator::K1, &mask, &behavior, &reference);
        assert_eq!(n, 2);
        assert!(k1.abs() < 1e-7, "{k1}");
        let (k3, n) = trajectory_kl(KlEstimator::K3, &mask, &behavior, &reference);
        assert_eq!(n, 2);
        // f32 estimates of values near 0.2-0.3: a few ulp.
        assert!((k3 - 0.5).abs() < 1e-6, "{k3}");
    }

    #[test]
    fn only_positive_coefficients_act() {
        let kl = |coef, place| Regularizers {
            entropy_coef: 0.0,
            kl: Some(KlConfig {
                estimator: KlEstimator::K3,
                coef,
                place,
            }),
        };
        assert!(kl(0.0, KlPlace::Loss).kl_in_loss().is_none());
        assert!(kl(0.5, KlPlace::Loss).kl_in_loss().is_some());
        assert!(kl(0.5, KlPlace::Loss).kl_in_reward().is_none());
        assert!(kl(0.5, KlPlace::Reward).kl_in_reward().is_some());
        assert!(kl(-1.0, KlPlace::Loss).validate().is_err());
        let neg = Regularizers {
            entropy_coef: -0.1,
            kl: None,
        };
        assert!(neg.validate().is_err());
    }
}
