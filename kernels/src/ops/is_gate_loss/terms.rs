//! The per-token half of `is_gate_loss`: the gate modes and their parameters (clip bounds, the
//! four bounds, the KL to a reference and the entropy bonus), the gate decision, and one
//! token's term and d term / d logp, shared by the CPU reference and mirrored by the CUDA
//! kernel (see the parent module's definitions).

use crate::error::{Error, Result};

/// The gate of DESIGN.md 3.6.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// GLM-5 direct double-sided importance sampling (open interval, stop-gradient ratio).
    Dis,
    /// Hard gate on the closed [1/beta, beta], PPO surrogate inside.
    Icepop,
    /// The clipped surrogate alone.
    Ppo,
    /// Plain policy gradient.
    Pg,
}

impl GateMode {
    /// The integer the kernels take.
    pub fn code(self) -> i32 {
        match self {
            GateMode::Dis => 0,
            GateMode::Icepop => 1,
            GateMode::Ppo => 2,
            GateMode::Pg => 3,
        }
    }

    pub fn parse(s: &str) -> Result<GateMode> {
        match s.trim() {
            "dis" => Ok(GateMode::Dis),
            "icepop" => Ok(GateMode::Icepop),
            "ppo" => Ok(GateMode::Ppo),
            "pg" => Ok(GateMode::Pg),
            other => Err(Error::param(
                "mode",
                format!("`{other}` is not one of dis, icepop, ppo, pg"),
            )),
        }
    }
}

/// The estimator of KL(pi || ref) at a token sampled from pi (Schulman, "Approximating KL
/// divergence", 2020).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KlEstimator {
    /// `log pi - log ref`: unbiased, can be negative per token.
    K1,
    /// `ref/pi - 1 - log(ref/pi)`: unbiased, never negative, lower variance near pi = ref.
    K3,
}

impl KlEstimator {
    /// The integer the kernels take (0 is "off").
    pub fn code(self) -> i32 {
        match self {
            KlEstimator::K1 => 1,
            KlEstimator::K3 => 2,
        }
    }

    pub fn parse(s: &str) -> Result<KlEstimator> {
        match s.trim() {
            "k1" => Ok(KlEstimator::K1),
            "k3" => Ok(KlEstimator::K3),
            other => Err(Error::param(
                "kl_estimator",
                format!("`{other}` is not one of k1, k3"),
            )),
        }
    }
}

/// The KL-to-reference term of the loss: `coef * estimator` per masked token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlPenalty {
    pub estimator: KlEstimator,
    pub coef: f32,
}

/// One token's KL estimate and its d / d logp (the device's `kl_term` without the factor).
#[inline]
pub fn kl_estimate(estimator: KlEstimator, logp: f32, ref_logp: f32) -> (f32, f32) {
    if logp == f32::NEG_INFINITY || ref_logp == f32::NEG_INFINITY {
        return (0.0, 0.0);
    }
    match estimator {
        KlEstimator::K1 => (logp - ref_logp, 1.0),
        KlEstimator::K3 => {
            let u = ref_logp - logp;
            let q = u.exp();
            ((q - 1.0) + -u, 1.0 - q)
        }
    }
}

/// Scalar parameters of the loss (defaults of DESIGN.md 3.6).
#[derive(Clone, Copy, Debug)]
pub struct GateParams {
    pub mode: GateMode,
    pub eps_low: f32,
    pub eps_high: f32,
    /// (eps_low, eps_high) for tokens with a negative advantage; None: the pair above for every
    /// token (see the module docs).
    pub eps_neg: Option<(f32, f32)>,
    pub beta: f32,
    /// The sampling temperature the tokens were drawn at: logp is taken under
    /// log_softmax(logits * (1 / temperature)), the sampler's exact scaling (one f32 multiply
    /// by the same `1 / temperature`), so behavior_logp and logp agree bit for bit at any
    /// temperature. 1 (the default) leaves the logits untouched; greedy rollouts record the
    /// temperature-1 log-prob, so their learner uses 1.
    pub temperature: f32,
    /// The softmax entropy of each row: None, not computed; Some(c), computed (the `entropy`
    /// output) and, with c != 0, the bonus `-c * k * H` in each masked token's term.
    pub entropy: Option<f32>,
    /// KL to a reference policy (needs the `ref_logp` input); None: off.
    pub kl: Option<KlPenalty>,
}

impl Default for GateParams {
    fn default() -> Self {
        GateParams {
            mode: GateMode::Dis,
            eps_low: 0.2,
            eps_high: 0.28,
            eps_neg: None,
            beta: 2.0,
            temperature: 1.0,
            entropy: None,
            kl: None,
        }
    }
}

impl GateParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.eps_low.is_finite() && (0.0..1.0).contains(&self.eps_low)) {
            return Err(Error::param("eps_low", "must be in [0, 1)"));
        }
        if !(self.eps_high.is_finite() && self.eps_high >= 0.0) {
            return Err(Error::param("eps_high", "must be finite and >= 0"));
        }
        if let Some((lo, hi)) = self.eps_neg {
            if !(lo.is_finite() && (0.0..1.0).contains(&lo)) {
                return Err(Error::param("eps_low_neg", "must be in [0, 1)"));
            }
            if !(hi.is_finite() && hi >= 0.0) {
                return Err(Error::param("eps_high_neg", "must be finite and >= 0"));
            }
        }
        if !(self.beta.is_finite() && self.beta >= 1.0) {
            return Err(Error::param("beta", "must be finite and >= 1"));
        }
        if let Some(c) = self.entropy {
            if !(c.is_finite() && c >= 0.0) {
                return Err(Error::param(
                    "entropy_coef",
                    format!("{c} must be finite and >= 0"),
                ));
            }
        }
        if let Some(kl) = self.kl {
            if !(kl.coef.is_finite() && kl.coef >= 0.0) {
                return Err(Error::param(
                    "kl_coef",
                    format!("{} must be finite and >= 0", kl.coef),
                ));
            }
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::param(
                "temperature",
                format!(
                    "{} must be finite and > 0 (greedy rollouts record the temperature-1 \
                     log-prob: use 1)",
                    self.temperature
                ),
            ));
        }
        Ok(())
    }

    /// The (eps_low, eps_high) of a token with advantage `adv` (the device picks the same).
    pub fn bounds(&self, adv: f32) -> (f32, f32) {
        match self.eps_neg {
            Some(neg) if adv < 0.0 => neg,
            _ => (self.eps_low, self.eps_high),
        }
    }

    /// The pair for negative advantages as the kernels take it (the positive pair when unset).
    pub(super) fn neg_pair(&self) -> (f32, f32) {
        self.eps_neg.unwrap_or((self.eps_low, self.eps_high))
    }

    /// The multiplier applied to the logits: `1 / temperature`, computed exactly as the
    /// sampler's `SampleParams::scale` (exactly 1 at temperature 1).
    pub fn scale(&self) -> f32 {
        1.0 / self.temperature
    }
}

/// Where a token falls relative to the hard gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Inside,
    Low,
    High,
    /// Neither inside nor out (a NaN ratio).
    Undefined,
}

/// The gate of a ratio, for a token with advantage `adv` (the device's `gate_of`, expression
/// for expression).
#[inline]
pub fn gate_of(p: &GateParams, rho: f32, adv: f32) -> Gate {
    let (eps_low, eps_high) = p.bounds(adv);
    let (inside, low, high) = match p.mode {
        GateMode::Dis => {
            let lo = 1.0 - eps_low;
            let hi = 1.0 + eps_high;
            (rho > lo && rho < hi, rho <= lo, rho >= hi)
        }
        GateMode::Icepop => {
            let lo = 1.0 / p.beta;
            let hi = p.beta;
            (rho >= lo && rho <= hi, rho < lo, rho > hi)
        }
        GateMode::Ppo | GateMode::Pg => (true, false, false),
    };
    if inside {
        Gate::Inside
    } else if low {
        Gate::Low
    } else if high {
        Gate::High
    } else {
        Gate::Undefined
    }
}

/// One token's gate, loss term (before the 1/D) and d term / d logp.
#[derive(Clone, Copy, Debug)]
pub struct TokenTerm {
    pub rho: f32,
    pub gate: Gate,
    pub accepted: bool,
    pub term: f32,
    pub dterm: f32,
}

/// The per-token math of DESIGN.md 3.6 (the device's `token_term`, in the same order).
#[inline]
pub fn token_term(p: &GateParams, logp: f32, behavior: f32, adv: f32, m: f32, c: f32) -> TokenTerm {
    let rho = (logp - behavior).exp();
    let gate = gate_of(p, rho, adv);
    let masked = m != 0.0;
    let k = m * c;
    let accepted = masked && gate == Gate::Inside;
    let (mut term, mut dterm) = (0.0f32, 0.0f32);
    if accepted && k != 0.0 {
        match p.mode {
            GateMode::Dis | GateMode::Pg => {
                let g = if p.mode == GateMode::Dis {
                    k * rho * adv
                } else {
                    k * adv
                };
                if g != 0.0 {
                    // A zero-probability token (logp = -inf) would make the term infinite
                    // (and two of opposite signs NaN): its term is 0, its gradient is kept.
                    if logp != f32::NEG_INFINITY {
                        term = -(g * logp);
                    }
                    dterm = -g;
                }
            }
            GateMode::Icepop | GateMode::Ppo => {
                let s1 = rho * adv;
                let (eps_low, eps_high) = p.bounds(adv);
                let clipped = rho.max(1.0 - eps_low).min(1.0 + eps_high);
                let s2 = clipped * adv;
                term = -(k * s1.min(s2));
                if s1 <= s2 {
                    dterm = -(k * adv * rho);
                }
            }
        }
    }
    TokenTerm {
        rho,
        gate,
        accepted,
        term,
        dterm,
    }
}
