//! Tasks and environments (DESIGN 6.4).
//!
//! A [`Task`] is a family of problems with a verifier. Its environment is a pure function: given
//! a [`Problem`], the turn index and the token ids the model generated in that turn, it returns
//! a [`Reply`]: observation token ids (the next turn's input, loss-masked) or the end of the
//! episode with a reward and a terminal reason. Text, if a task has any, lives only at this
//! boundary (the task may decode the ids it gets and encode what it returns); the rollout and
//! the learner see token ids only (the action contract of DESIGN 6.1).
//!
//! What a real environment adds on top of the pure function -- latency drawn from a heavy-tailed
//! distribution ([`latency`]) and injected crashes, timeouts and garbage output ([`faults`]) --
//! is planned per call by [`faults::plan_call`] from a key (seed, session, turn, attempt), so a
//! call's latency and fate do not depend on the order in which calls happen: a run on the
//! virtual clock replays bit for bit.
//!
//! Built-in synthetic tasks on token ids ([`synthetic`]): `recall` (single turn, binary reward)
//! and `lookup` (two turns: the answer is in the environment's observation).
//!
//! Environments outside the process ([`external`]): a program speaking JSON lines on its
//! stdin/stdout, or an HTTP server; the orchestrator reaches them through [`Task::call`], which
//! knows the call's session and attempt, and [`Task::prefetch`], which sends a call as soon as
//! it is planned so that many sessions are in flight at once.

pub mod external;
pub mod faults;
pub mod latency;
pub mod synthetic;

use crate::engine::StopConfig;
use crate::trajectory::{ArtifactVersions, Sample, TerminalReason, TokenId};
use faults::{CallFault, CallKey};
use sluice_kernels::testing::Rng;
use std::fmt;

/// Which stream a problem comes from: training problems and held-out ones never overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    HeldOut,
}

/// One problem: an id (the data buffer's instance key), the prompt, and the task's own
/// description of it (text the task reads back in [`Task::respond`]; kept as a string so run
/// state can be saved and reloaded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub id: String,
    pub prompt: Vec<TokenId>,
    pub spec: String,
}

/// The environment's answer to one turn.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// Observation tokens: appended to the trajectory (loss-masked), then the model continues.
    Observe(Vec<TokenId>),
    /// The episode is over.
    End { reward: f32, reason: TerminalReason },
}

/// A supervised demonstration of a problem: the full token sequence (prompt, model turns,
/// observations) and which tokens are the model's (trained on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Demonstration {
    pub tokens: Vec<TokenId>,
    pub loss_mask: Vec<bool>,
}

/// What a text round trip did to the model turns of one finished trajectory
/// ([`Task::round_trip`]); summed over a run in [`crate::metrics::RolloutCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RoundTripCounts {
    /// Model turns (runs of generated tokens between observations) looked at.
    pub turns: u64,
    /// Of those, turns whose decode-then-encode gives other ids than the sampled ones.
    pub turns_changed: u64,
    /// Of those, turns handed to the learner as the re-encoded ids (0 unless the task was
    /// asked to retokenize).
    pub turns_retokenized: u64,
    /// Generated tokens as sampled, and as handed to the learner.
    pub tokens_sampled: u64,
    pub tokens_trained: u64,
}

impl RoundTripCounts {
    pub fn add(&mut self, o: &RoundTripCounts) {
        self.turns += o.turns;
        self.turns_changed += o.turns_changed;
        self.turns_retokenized += o.turns_retokenized;
        self.tokens_sampled += o.tokens_sampled;
        self.tokens_trained += o.tokens_trained;
    }
}

/// A task's environment failed in a way the task itself reports (a malformed problem spec).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskError(pub String);

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TaskError {}

/// How one environment call of [`Task::call`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// The environment process crashed or hung (a timeout): transient, so the orchestrator
    /// retries the call within the task's retry budget, then ends the trajectory as
    /// `environment`.
    Fault(CallFault, String),
    /// The reply broke the protocol (the message names the message, field and session):
    /// counted as `malformed`, not retried (it would repeat), the trajectory ends as
    /// `environment`.
    Malformed(String),
    /// The task (or the environment, by saying so) failed: counted as `error`, ends as
    /// `environment`.
    Task(TaskError),
}

impl CallError {
    /// The metric's name for this failure (`crash`, `timeout`, `malformed`, `error`).
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::Fault(f, _) => f.as_str(),
            CallError::Malformed(_) => "malformed",
            CallError::Task(_) => "error",
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Fault(k, m) => write!(f, "{k}: {m}"),
            CallError::Malformed(m) => write!(f, "malformed: {m}"),
            CallError::Task(e) => write!(f, "error: {e}"),
        }
    }
}

/// A family of verifiable problems and its environment (see the module docs).
pub trait Task: Send + Sync {
    /// The name configs, trajectories and metrics use.
    fn name(&self) -> &str;

    /// Whether an episode may take several turns (the engine pauses between them).
    fn multi_turn(&self) -> bool;

    /// A problem drawn from `rng`; `split` keeps held-out problems apart from training ones.
    fn problem(&self, rng: &mut Rng, split: Split) -> Problem;

    /// The environment's reply to the tokens the model generated in turn `turn` (0-based) of an
    /// episode on `problem`. Pure: the same arguments give the same reply. A bad `problem.spec`
    /// (not one this task made) is an error, which the orchestrator ends as `environment`.
    fn respond(
        &self,
        problem: &Problem,
        turn: u32,
        generated: &[TokenId],
    ) -> Result<Reply, TaskError>;

    /// When a turn's generation stops (EOS, stop sequences).
    fn stop(&self) -> StopConfig;

    /// The template, tokenizer and environment versions recorded on every trajectory.
    fn versions(&self) -> ArtifactVersions;

    /// A correct demonstration of `problem` for supervised warm-up, where the task has one.
    fn demonstration(&self, _problem: &Problem, _rng: &mut Rng) -> Option<Demonstration> {
        None
    }

    /// The orchestrator's form of [`Task::respond`]: `key` names the call (session, turn,
    /// attempt), which an environment outside the process needs; a failure says whether it
    /// may be retried. The default answers with `respond`.
    fn call(
        &self,
        key: CallKey<'_>,
        problem: &Problem,
        generated: &[TokenId],
    ) -> Result<Reply, CallError> {
        self.respond(problem, key.turn, generated)
            .map_err(CallError::Task)
    }

    /// Called when the call `key` is planned, before its latency timer: an environment
    /// outside the process sends the request now, so the calls of many sessions are in flight
    /// together, and [`Task::call`] collects the reply. The default does nothing.
    fn prefetch(&self, _key: CallKey<'_>, _problem: &Problem, _generated: &[TokenId]) {}

    /// A text task's round trip of a finished trajectory's model turns (decode the sampled ids,
    /// encode the text again), called once per trajectory before it goes to the data buffer.
    /// The default does nothing and returns None: the learner trains the ids as sampled (the
    /// action contract of DESIGN 6.1). A task may count the turns a round trip would change,
    /// and, for `sluice experiment tito` only (`rollout.retokenize`), replace them with the
    /// re-encoded ids: the failure the contract exists to prevent
    /// (trainer/src/tasks/round_trip.rs).
    fn round_trip(&self, _sample: &mut Sample) -> Option<RoundTripCounts> {
        None
    }
}
