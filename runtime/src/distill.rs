//! On-policy distillation (issue 28 item 6; docs/runtime.md, "On-policy distillation"):
//! teachers, frozen checkpoints of the policy's architecture and vocabulary
//! ([`ScoringModel`]s, as the KL reference is), score the tokens the student sampled, and the
//! learner trains on their log-probs. Each teacher scores the trajectories of its tasks, so
//! several teachers are mixed by the tasks' shares of the learner's data.
//!
//! Per generated (trained) token t with the rollout's behavior log-prob b_t = log mu(y_t) and
//! the teacher's q_t = log pi_T(y_t | context) (the same context, at the trajectory's
//! sampling temperature, through the learner's forward-only pass):
//!
//! - [`OpdForm::Advantage`] (GLM-5's on-policy cross-stage distillation; Thinking Machines'
//!   on-policy distillation): the per-token advantage A_t = coef x (q_t - b_t), detached, in
//!   place of GRPO's per-trajectory advantage (groups of one need no group), or with
//!   `with_grpo` added to it, A_t = A_grpo + coef x (q_t - b_t) (slime's documented form,
//!   A_t - coef x KL_t with KL_t = b_t - q_t). With `center` the step's mean of q - b over
//!   the scored tokens is subtracted first, A_t = coef x ((q_t - b_t) - mean(q - b)) (a
//!   baseline: the tinker cookbook's form of its KL penalty, `kl_coef x (avg_logp_diff -
//!   logp_diff_t)`), so the distillation advantages have mean 0 instead of -KL. It goes
//!   through the IS-gate loss unchanged: the kernel's advantages are per token.
//! - [`OpdForm::Kl`]: coef x k3(logp_t, q_t) per trained token in the loss, with its gradient
//!   (the fused kernel's KL input, the teacher's log-probs where the KL reference's would go),
//!   added to GRPO's loss.
//!
//! The measure either way is the mean of b_t - q_t over the scored tokens: the k1 estimate, at
//! the student's own samples, of the reverse KL(mu || pi_T) (slime's `opd_reverse_kl`).

pub use crate::scoring::ScoringModel;
use sluice_kernels::ops::is_gate_loss::KlEstimator;
use sluice_kernels::{Error, Result};

/// How the teachers' log-probs train the student.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpdForm {
    /// A_t = coef (q_t - b_t) per token; `with_grpo`: added to GRPO's advantage, else in its
    /// place; `center`: less the step's mean of q - b (a baseline).
    Advantage { with_grpo: bool, center: bool },
    /// coef x KL estimate to the teacher per trained token in the loss, with its gradient.
    Kl(KlEstimator),
}

/// On-policy distillation in an RL stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpdConfig {
    /// None: the teachers score and the gap is measured, nothing is trained on it.
    pub form: Option<OpdForm>,
    pub coef: f32,
}

impl OpdConfig {
    pub fn validate(&self) -> Result<()> {
        if !(self.coef.is_finite() && self.coef > 0.0) {
            return Err(Error::param(
                "opd.coef",
                format!("{} must be finite and > 0", self.coef),
            ));
        }
        if self.form == Some(OpdForm::Kl(KlEstimator::K1)) {
            // d k1 / d logp = 1 whatever the teacher says: the term's gradient is coef x
            // grad log pi(y_t), which ignores the teacher (and has mean 0 at on-policy
            // samples).
            return Err(Error::param(
                "opd.kl_estimator",
                "k1 in the loss has a gradient that does not depend on the teacher; use k3, or \
                 the advantage form (k1 as a detached per-token reward)",
            ));
        }
        Ok(())
    }

    /// Whether the student trains on the teachers without any group (no GRPO advantage).
    pub fn needs_no_group(&self) -> bool {
        matches!(
            self.form,
            Some(OpdForm::Advantage {
                with_grpo: false,
                ..
            }) | Some(OpdForm::Kl(_))
        )
    }
}

/// One teacher: its weights and the tasks whose trajectories it scores.
pub struct Teacher {
    pub model: ScoringModel,
    pub tasks: Vec<String>,
}

impl std::fmt::Debug for Teacher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Teacher({:?}, {:?})", self.model, self.tasks)
    }
}

/// The teachers of a learner: every task scored by at most one.
#[derive(Debug)]
pub struct Teachers {
    list: Vec<Teacher>,
}

impl Teachers {
    /// At least one teacher, each with at least one task, no task named twice.
    pub fn new(list: Vec<Teacher>) -> Result<Teachers> {
        if list.is_empty() {
            return Err(Error::param(
                "opd.teachers",
                "at least one teacher is needed",
            ));
        }
        for (i, t) in list.iter().enumerate() {
            if t.tasks.is_empty() {
                return Err(Error::param(
                    "opd.teachers",
                    format!("teacher {i} scores no task"),
                ));
            }
            for task in &t.tasks {
                if let Some(j) = list[..i].iter().position(|o| o.tasks.contains(task)) {
                    return Err(Error::param(
                        "opd.teachers",
                        format!("task {task:?} has two teachers ({j} and {i})"),
                    ));
                }
                if t.tasks.iter().filter(|x| *x == task).count() > 1 {
                    return Err(Error::param(
                        "opd.teachers",
                        format!("teacher {i} names task {task:?} twice"),
                    ));
                }
            }
        }
        Ok(Teachers { list })
    }

    /// The index of the teacher of `task`.
    pub fn of(&self, task: &str) -> Option<usize> {
        self.list
            .iter()
            .position(|t| t.tasks.iter().any(|x| x == task))
    }

    pub fn get(&self, i: usize) -> &Teacher {
        &self.list[i]
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Teacher> {
        self.list.iter()
    }
}

/// The advantage form's per-token advantages of one trajectory (indexed like its tokens; 0
/// where not trained): coef ((q_t - b_t) + `mean_gap`), plus `grpo` (its GRPO advantage) when
/// given. `mean_gap` is 0, or with centering the step's mean of b - q. A token whose teacher
/// or behavior log-prob is not finite gets no distillation signal.
pub fn token_advantages(
    coef: f32,
    loss_mask: &[bool],
    behavior_logp: &[f32],
    teacher_logp: &[f32],
    grpo: Option<f32>,
    mean_gap: f32,
) -> Vec<f32> {
    let mut out = vec![0.0f32; loss_mask.len()];
    for j in 1..loss_mask.len() {
        if loss_mask[j] {
            let (q, b) = (teacher_logp[j], behavior_logp[j]);
            let distill = if q.is_finite() && b.is_finite() {
                coef * ((q - b) + mean_gap)
            } else {
                0.0
            };
            out[j] = grpo.unwrap_or(0.0) + distill;
        }
    }
    out
}

/// The sum over a trajectory's trained tokens (after the first) of b_t - q_t, in f64, and
/// their count: the k1 estimate of KL(mu || pi_T) summed over the tokens the teacher scored
/// (tokens with a non-finite log-prob are left out).
pub fn trajectory_gap(
    loss_mask: &[bool],
    behavior_logp: &[f32],
    teacher_logp: &[f32],
) -> (f64, u64) {
    let mut sum = 0.0f64;
    let mut n = 0u64;
    for j in 1..loss_mask.len() {
        let (q, b) = (teacher_logp[j], behavior_logp[j]);
        if loss_mask[j] && q.is_finite() && b.is_finite() {
            sum += b as f64 - q as f64;
            n += 1;
        }
    }
    (sum, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand, a trajectory of 5 tokens: the prompt (token 0), generated tokens 1, 2 and 4,
    /// an observation at 3. Behavior ln 1/2, ln 1/4, -, ln 1/8; teacher ln 1/4, ln 1/2, -,
    /// ln 1/8. q - b: -ln 2, +ln 2, 0 (the teacher agrees). With coef 0.5: -0.34657,
    /// +0.34657, 0; with the GRPO advantage 1.5 added: 1.15343, 1.84657, 1.5. The gap
    /// b - q sums to ln 2 - ln 2 + 0 = 0 over 3 tokens.
    #[test]
    fn per_token_advantages_and_the_gap_by_hand() {
        let mask = [false, true, true, false, true];
        let b = [0.0, 0.5f32.ln(), 0.25f32.ln(), 0.0, 0.125f32.ln()];
        let q = [-7.0, 0.25f32.ln(), 0.5f32.ln(), -3.0, 0.125f32.ln()];
        let ln2 = std::f32::consts::LN_2;
        let a = token_advantages(0.5, &mask, &b, &q, None, 0.0);
        // Each is one f32 subtraction of two logs and one product: within 2 ulp of the value.
        let close = |x: f32, y: f32| (x - y).abs() <= 2.0 * f32::EPSILON * y.abs().max(1.0);
        assert_eq!(a[0], 0.0);
        assert_eq!(a[3], 0.0, "observation tokens carry nothing");
        assert!(close(a[1], -0.5 * ln2), "{a:?}");
        assert!(close(a[2], 0.5 * ln2), "{a:?}");
        assert_eq!(a[4], 0.0, "a teacher that agrees gives 0");
        let with = token_advantages(0.5, &mask, &b, &q, Some(1.5), 0.0);
        assert!(close(with[1], 1.5 - 0.5 * ln2), "{with:?}");
        assert!(close(with[2], 1.5 + 0.5 * ln2), "{with:?}");
        assert_eq!(with[4], 1.5);
        assert_eq!((with[0], with[3]), (0.0, 0.0));
        let (gap, n) = trajectory_gap(&mask, &b, &q);
        assert_eq!(n, 3);
        assert!(gap.abs() < 1e-6, "{gap}");
        // A teacher that gives the sampled tokens half the student's probability: the gap is
        // ln 2 per token.
        let half = [0.0, 0.25f32.ln(), 0.125f32.ln(), 0.0, 0.0625f32.ln()];
        let (gap, n) = trajectory_gap(&mask, &b, &half);
        assert_eq!(n, 3);
        assert!((gap - 3.0 * std::f64::consts::LN_2).abs() < 1e-6, "{gap}");
        // A non-finite log-prob gives no signal and is not counted.
        let inf = [0.0, f32::NEG_INFINITY, 0.5f32.ln(), 0.0, 0.125f32.ln()];
        assert_eq!(token_advantages(1.0, &mask, &b, &inf, None, 0.0)[1], 0.0);
        // Centered on a step whose mean gap b - q is ln 2 (the `half` teacher): every token's
        // q - b is -ln 2, so every advantage is 0.
        let centered = token_advantages(0.5, &mask, &b, &half, None, std::f32::consts::LN_2);
        assert!(
            centered.iter().all(|a| a.abs() <= 2.0 * f32::EPSILON),
            "{centered:?}"
        );
        assert_eq!(trajectory_gap(&mask, &b, &inf).1, 2);
    }

    #[test]
    fn configs_and_teacher_lists_are_checked() {
        let ok = OpdConfig {
            form: Some(OpdForm::Kl(KlEstimator::K3)),
            coef: 0.5,
        };
        assert!(ok.validate().is_ok());
        assert!(ok.needs_no_group());
        let k1 = OpdConfig {
            form: Some(OpdForm::Kl(KlEstimator::K1)),
            ..ok
        };
        assert!(k1.validate().unwrap_err().to_string().contains("k1"));
        for coef in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(OpdConfig { coef, ..ok }.validate().is_err(), "{coef}");
        }
        let grpo = OpdConfig {
            form: Some(OpdForm::Advantage {
                with_grpo: true,
                center: false,
            }),
            coef: 1.0,
        };
        assert!(!grpo.needs_no_group());
        let log = OpdConfig {
            form: None,
            coef: 1.0,
        };
        assert!(!log.needs_no_group());
        assert!(Teachers::new(Vec::new()).is_err());
    }
}
