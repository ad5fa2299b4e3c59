//! The trajectory schema (DESIGN.md 6.2) and its validator.
//!
//! A [`Sample`] is what the rollout side hands the learner: token ids (never text: the action
//! contract of DESIGN 6.1), a loss mask, the behavior log-prob and the weight version of every
//! generated token (the policy contract), and how the episode ended (the environment contract).
//! [`Sample::validate`] is the gate every trajectory passes before it enters the data buffer; it
//! names the first thing that is wrong as a [`TrajectoryError`].

use std::fmt;
use std::str::FromStr;

/// A token id of the model's vocabulary.
pub type TokenId = u32;

/// The version of the policy weights that produced a token. The learner bumps it on every weight
/// refresh; the data buffer's version gate compares it with the learner's own.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct WeightVersion(pub u64);

impl fmt::Display for WeightVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// How a trajectory ended (DESIGN 6.1, the environment contract). `Environment` ends (the
/// environment crashed, timed out or failed) are never trained on as policy failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TerminalReason {
    Success,
    Failure,
    /// The length or turn limit was reached.
    Budget,
    /// The environment crashed, timed out or failed.
    Environment,
}

impl TerminalReason {
    /// The schema's spelling: `success`, `failure`, `budget`, `environment`.
    pub fn as_str(self) -> &'static str {
        match self {
            TerminalReason::Success => "success",
            TerminalReason::Failure => "failure",
            TerminalReason::Budget => "budget",
            TerminalReason::Environment => "environment",
        }
    }
}

impl fmt::Display for TerminalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TerminalReason {
    type Err = TrajectoryError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "success" => Ok(TerminalReason::Success),
            "failure" => Ok(TerminalReason::Failure),
            "budget" => Ok(TerminalReason::Budget),
            "environment" => Ok(TerminalReason::Environment),
            other => Err(TrajectoryError::UnknownTerminalReason(other.to_string())),
        }
    }
}

/// The first token of one turn: turn k's tokens are `tokens[start_k .. start_{k+1}]` (the last
/// turn runs to the end). The prompt precedes the first boundary.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct TurnBoundary {
    pub start: usize,
}

/// Timestamps on the four clocks of DESIGN 6.7, taken when the trajectory finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ClockStamps {
    /// Environment steps taken so far by the orchestrator (all sessions together).
    pub environment_step: u64,
    /// The newest weight version the rollout engine held when the trajectory finished.
    pub behavior_version: WeightVersion,
    /// The learner's optimizer step count.
    pub learner_step: u64,
    /// How many weight refreshes the inference side had received.
    pub inference_refresh: u64,
}

/// Versions of everything outside the weights that shaped the tokens; a learner can refuse data
/// produced under a template or tokenizer it does not use.
#[derive(Clone, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ArtifactVersions {
    pub template: String,
    pub tokenizer: String,
    pub environment: String,
}

/// The sampling parameters the trajectory was generated with.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: u32,
    /// 1.0 = no nucleus cut.
    pub top_p: f32,
    pub max_new_tokens: u32,
    /// Seed of the sampler's counter-based random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 256,
            seed: 0,
        }
    }
}

/// One trajectory (DESIGN 6.2). Per-token vectors (`tokens`, `loss_mask`, `behavior_logp`,
/// `weight_version`) have one entry per token of the prompt and all turns.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// The prompt this trajectory answers; the data buffer groups by it.
    pub instance_id: String,
    /// Index of this sample within its GRPO group (0..G).
    pub group_index: u32,
    /// The agent session; the router keeps a session on one replica.
    pub session_id: String,
    pub task: String,
    /// Number of prompt tokens at the start of `tokens`.
    pub prompt_len: usize,
    pub tokens: Vec<TokenId>,
    /// true on model-generated tokens (trained on), false on prompt and observation tokens.
    pub loss_mask: Vec<bool>,
    /// The sampler's log-prob of each generated token; exactly 0.0 where masked. (Saved as
    /// bit patterns: a resumed run must see the very same bits.)
    #[serde(with = "crate::trajectory::f32_bits")]
    pub behavior_logp: Vec<f32>,
    /// The weight version behind each token: for a generated token, the weights that sampled
    /// it; for a prompt or observation token (masked), the weights that last computed its K/V
    /// in the engine. A generated token whose every earlier token carries its own version was
    /// produced from one set of weights end to end (the learner's zero-lag tokens). The
    /// validator checks monotonicity over generated tokens only.
    pub weight_version: Vec<WeightVersion>,
    pub reward: f32,
    pub terminal_reason: TerminalReason,
    pub turns: Vec<TurnBoundary>,
    pub clocks: ClockStamps,
    pub versions: ArtifactVersions,
    pub sampling: SamplingParams,
}

/// Why a trajectory was rejected. Indices are token positions in `tokens`.
#[derive(Clone, Debug, PartialEq)]
pub enum TrajectoryError {
    /// No tokens at all.
    Empty,
    /// `prompt_len` exceeds the number of tokens.
    PromptLongerThanTokens { prompt_len: usize, tokens: usize },
    /// A per-token field does not have one entry per token.
    LengthMismatch {
        field: &'static str,
        len: usize,
        tokens: usize,
    },
    /// A prompt token is marked as model-generated.
    PromptTokenInLoss { index: usize },
    /// A masked token (prompt or observation) carries a behavior log-prob other than 0.0.
    MaskedLogpNotZero { index: usize, value: f32 },
    /// A generated token's behavior log-prob is NaN or infinite.
    NonFiniteLogp { index: usize, value: f32 },
    /// A generated token's behavior log-prob is above 0 (a probability above 1).
    PositiveLogp { index: usize, value: f32 },
    /// A generated token has an older weight version than an earlier generated token.
    VersionsNotMonotone {
        index: usize,
        previous: WeightVersion,
        got: WeightVersion,
    },
    /// A turn boundary is not inside `prompt_len..tokens.len()`.
    TurnBoundaryOutOfRange {
        turn: usize,
        start: usize,
        prompt_len: usize,
        tokens: usize,
    },
    /// Turn boundaries are not strictly increasing.
    TurnBoundariesNotIncreasing {
        turn: usize,
        previous: usize,
        start: usize,
    },
    /// The reward is NaN or infinite.
    NonFiniteReward(f32),
    /// A terminal reason string outside success|failure|budget|environment.
    UnknownTerminalReason(String),
}

impl fmt::Display for TrajectoryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use TrajectoryError::*;
        match self {
            Empty => write!(f, "trajectory has no tokens"),
            PromptLongerThanTokens { prompt_len, tokens } => write!(
                f,
                "prompt_len {prompt_len} exceeds the trajectory's {tokens} tokens"
            ),
            LengthMismatch { field, len, tokens } => write!(
                f,
                "`{field}` has {len} entries but the trajectory has {tokens} tokens (one per token expected)"
            ),
            PromptTokenInLoss { index } => write!(
                f,
                "loss_mask[{index}] is set on a prompt token; prompt tokens are never trained on"
            ),
            MaskedLogpNotZero { index, value } => write!(
                f,
                "behavior_logp[{index}] = {value} on a masked token; masked tokens carry 0.0"
            ),
            NonFiniteLogp { index, value } => write!(
                f,
                "behavior_logp[{index}] = {value} on a generated token; the sampler records finite log-probs"
            ),
            PositiveLogp { index, value } => write!(
                f,
                "behavior_logp[{index}] = {value} > 0 on a generated token (a probability above 1)"
            ),
            VersionsNotMonotone { index, previous, got } => write!(
                f,
                "weight_version[{index}] = {got} is older than {previous} on an earlier generated token; versions must not decrease"
            ),
            TurnBoundaryOutOfRange { turn, start, prompt_len, tokens } => write!(
                f,
                "turn {turn} starts at token {start}, outside {prompt_len}..{tokens} (after the prompt, inside the trajectory)"
            ),
            TurnBoundariesNotIncreasing { turn, previous, start } => write!(
                f,
                "turn {turn} starts at token {start}, not after turn {}'s start {previous}",
                turn - 1
            ),
            NonFiniteReward(r) => write!(f, "reward {r} is not finite"),
            UnknownTerminalReason(s) => write!(
                f,
                "unknown terminal reason {s:?}; expected success, failure, budget or environment"
            ),
        }
    }
}

impl std::error::Error for TrajectoryError {}

impl Sample {
    /// Checks every invariant of DESIGN 6.2; returns the first violation found, checking in the
    /// order: emptiness, prompt length, per-token lengths, prompt masking, log-probs, versions,
    /// turn boundaries, reward.
    pub fn validate(&self) -> Result<(), TrajectoryError> {
        let n = self.tokens.len();
        if n == 0 {
            return Err(TrajectoryError::Empty);
        }
        if self.prompt_len > n {
            return Err(TrajectoryError::PromptLongerThanTokens {
                prompt_len: self.prompt_len,
                tokens: n,
            });
        }
        for (field, len) in [
            ("loss_mask", self.loss_mask.len()),
            ("behavior_logp", self.behavior_logp.len()),
            ("weight_version", self.weight_version.len()),
        ] {
            if len != n {
                return Err(TrajectoryError::LengthMismatch {
                    field,
                    len,
                    tokens: n,
                });
            }
        }
        if let Some(index) = self.loss_mask[..self.prompt_len].iter().position(|&m| m) {
            return Err(TrajectoryError::PromptTokenInLoss { index });
        }
        let mut newest: Option<WeightVersion> = None;
        for (index, ((&m, &value), &v)) in self
            .loss_mask
            .iter()
            .zip(&self.behavior_logp)
            .zip(&self.weight_version)
            .enumerate()
        {
            if !m {
                // Bit-exact 0.0 (or -0.0): NaN and every other value are rejected.
                if value != 0.0 {
                    return Err(TrajectoryError::MaskedLogpNotZero { index, value });
                }
                continue;
            }
            if !value.is_finite() {
                return Err(TrajectoryError::NonFiniteLogp { index, value });
            }
            if value > 0.0 {
                return Err(TrajectoryError::PositiveLogp { index, value });
            }
            if let Some(previous) = newest {
                if v < previous {
                    return Err(TrajectoryError::VersionsNotMonotone {
                        index,
                        previous,
                        got: v,
                    });
                }
            }
            newest = Some(v);
        }
        for (turn, b) in self.turns.iter().enumerate() {
            if b.start < self.prompt_len || b.start >= n {
                return Err(TrajectoryError::TurnBoundaryOutOfRange {
                    turn,
                    start: b.start,
                    prompt_len: self.prompt_len,
                    tokens: n,
                });
            }
            if turn > 0 && b.start <= self.turns[turn - 1].start {
                return Err(TrajectoryError::TurnBoundariesNotIncreasing {
                    turn,
                    previous: self.turns[turn - 1].start,
                    start: b.start,
                });
            }
        }
        if !self.reward.is_finite() {
            return Err(TrajectoryError::NonFiniteReward(self.reward));
        }
        Ok(())
    }

    /// The oldest weight version among generated tokens (what the data buffer's version gate
    /// compares with the learner's version); None when no token is generated.
    pub fn oldest_behavior_version(&self) -> Option<WeightVersion> {
        self.loss_mask
            .iter()
            .zip(&self.weight_version)
            .filter(|(&m, _)| m)
            .map(|(_, &v)| v)
            .min()
    }

    /// Number of model-generated (trained-on) tokens.
    pub fn generated_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }
}

/// Serde for f32 vectors as their bit patterns, so a saved and reloaded trajectory has the same
/// bits (decimal text round trips are not guaranteed to be exact through every parser).
pub mod f32_bits {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        v.iter()
            .map(|x| x.to_bits())
            .collect::<Vec<u32>>()
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        Ok(Vec::<u32>::deserialize(d)?
            .into_iter()
            .map(f32::from_bits)
            .collect())
    }
}

/// Serde for one f32 as its bit pattern (infinities and NaN included, which JSON cannot hold).
pub mod f32_bit {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        v.to_bits().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        Ok(f32::from_bits(u32::deserialize(d)?))
    }
}
