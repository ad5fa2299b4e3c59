//! The stage's public contract: its settings ([`StageConfig`]), what it tells its owner
//! ([`StageObserver`] and the events it is given), why it stops early ([`RunError`]) and what it
//! did ([`StageReport`]). Changes when the scheduler's callers need something new.

use crate::buffer::{BufferCounters, DataBuffer, ReadyGroup};
use crate::clock::{ClockMode, CostModel, Micros};
use crate::engine::Engine;
use crate::health::HealthConfig;
use crate::learner::{Learner, Publication, StepReport};
use crate::metrics::{LearnerTotals, RolloutCounters, Trace};
use crate::orchestrator::{LostSessions, Orchestrator, OrchestratorError, TaskStats};
use crate::sync::lane::SyncOptions;
use crate::sync::ContentHash;
use crate::trajectory::WeightVersion;
use serde_json::Value;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Sync or async (DESIGN 6.7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Sync,
    Async,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Async => "async",
        }
    }
}

/// One RL stage's schedule.
#[derive(Clone, Debug)]
pub struct StageConfig {
    pub name: String,
    pub mode: Mode,
    pub clock: ClockMode,
    /// Learner steps to take in this stage.
    pub steps: u64,
    /// Groups per learner step (async; in sync mode the batch size).
    pub groups_per_step: usize,
    /// Backpressure: rollout at most eta learner steps ahead (async).
    pub eta: u64,
    /// K: publish the weights every K learner steps.
    pub sync_interval: u64,
    /// Reset the optimizer's moments at every publication.
    pub reset_optimizer: bool,
    /// The virtual clock's charges.
    pub cost: CostModel,
    /// A barrier every this many learner steps (see [`StageObserver::on_barrier`]).
    pub barrier_every: Option<u64>,
    /// How publications reach the replicas (`sync.path`), and injected sync faults.
    pub sync: SyncOptions,
    /// Heartbeats, and an injected replica failure.
    pub health: HealthConfig,
    /// Over-sampling with abort (sync mode; None: off).
    pub over_sampling: Option<OverSampling>,
    /// Rollout servers (`rollout.servers`, `http://host:port`): each is one replica, driven
    /// over HTTP ([`crate::remote`]); the stage's `Parts::engines` must then be empty. Empty:
    /// the engines of `Parts` in this process.
    pub servers: Vec<String>,
    /// Wall clock: the replica lanes on CPU 0 and the learner lane on the last CPU, each
    /// running its CPU ops on a one-thread pool of its own pinned there (`run.pin_lanes`), so
    /// their compute can overlap on a small machine instead of sharing every core.
    pub pin_lanes: bool,
}

/// Over-sampling with abort (APRIL; `rollout.over_sampling`, `rollout.partial_rollout`): each
/// sync batch starts ceil(ratio x groups_per_step) groups (the resumed ones included); the
/// learner steps as soon as groups_per_step of them are complete, and the groups still in
/// flight are aborted whole: discarded, or (`keep_partial`) suspended with their partial
/// trajectories and resumed first in the next batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OverSampling {
    /// Groups started per batch over groups trained per step, > 1.
    pub ratio: f64,
    pub keep_partial: bool,
}

impl OverSampling {
    /// Groups a batch holds at its start.
    pub fn batch_groups(&self, groups_per_step: usize) -> u64 {
        (self.ratio * groups_per_step as f64).ceil() as u64
    }
}

/// One replica's install (see [`StageObserver::on_sync`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SyncEvent {
    pub now: Micros,
    pub replica: usize,
    pub version: WeightVersion,
    /// blake3 of the image the replica runs on now.
    pub hash: ContentHash,
    /// blake3 of the image the learner published as `version` (None: not known to the
    /// scheduler yet, possible only on the disk path on the wall clock).
    pub published: Option<ContentHash>,
    /// `inprocess`, `full`, `delta:...` or `disk`.
    pub encoding: String,
    pub sent_bytes: u64,
    /// A restarted replica's first install.
    pub restart: bool,
}

/// A replica declared lost (see [`StageObserver::on_replica_lost`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaLoss {
    pub now: Micros,
    pub replica: usize,
    /// When its oldest unanswered heartbeat went out.
    pub silent_since: Micros,
    /// When the unit of work it never finished started (None: it was idle).
    pub working_since: Option<Micros>,
    /// The trajectories it ended and the sessions that start again elsewhere.
    pub lost: LostSessions,
    /// A rollout server: what its lane last saw (a refused connection, a timeout, another
    /// process); None for an in-process replica, or a server that was silent.
    pub reason: Option<String>,
}

/// What a running stage tells its owner.
pub trait StageObserver {
    /// After every learner step: its metrics line (DESIGN 9) and report.
    fn on_step(&mut self, line: &Value, report: &StepReport) -> Result<(), String>;

    /// The groups a learner step is about to train on (the loss's inputs), before it starts.
    fn on_learner_batch(&mut self, _groups: &[ReadyGroup]) {}

    /// After every event the scheduler handled: the admission figures at that moment.
    fn on_tick(&mut self, _tick: &Tick) {}

    /// After a replica installed weights (each publication, each full sync after a refusal,
    /// each restart): what it runs on now and what the learner published as that version.
    fn on_sync(&mut self, _event: &SyncEvent) {}

    /// A replica stopped answering heartbeats and was declared lost.
    fn on_replica_lost(&mut self, _loss: &ReplicaLoss) {}

    /// At a barrier (every `barrier_every` learner steps): no trajectory is in flight, the
    /// learner is idle, every replica has applied every command. A checkpoint taken here
    /// restarts the run exactly (the owner saves what it needs from `view`).
    fn on_barrier(&mut self, _view: &BarrierView<'_>) -> Result<(), String> {
        Ok(())
    }
}

/// The admission figures after one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tick {
    pub now: Micros,
    /// Trajectories started so far in the stage.
    pub started: u64,
    /// Trajectories of groups the buffer dropped whole.
    pub discarded: u64,
    /// Learner steps completed (the learner's version).
    pub learner_steps: u64,
    /// Trajectories per learner step (groups per step x G) and eta.
    pub per_step: u64,
    pub eta: u64,
    pub in_flight: u64,
}

/// The system's state at a barrier.
pub struct BarrierView<'a> {
    pub now: Micros,
    pub learner: &'a Learner,
    /// Each replica's engine (idle, no sequence held).
    pub engines: Vec<&'a Engine>,
    /// Each replica's weights: the version and the blake3 of the image it runs on.
    pub replica_weights: Vec<(Option<WeightVersion>, Option<ContentHash>)>,
    pub buffer: &'a DataBuffer,
    pub orchestrator: &'a Orchestrator,
    pub totals: &'a LearnerTotals,
    /// The last publication (or the stage's start weights): what every replica holds, unless
    /// its writer died on the disk path.
    pub engine_weights: &'a Publication,
    /// The stage's trace so far.
    pub trace: &'a Trace,
    /// When the stage began on the run clock.
    pub stage_began: Micros,
}

/// Why a stage stopped early.
#[derive(Debug)]
pub enum RunError {
    Orchestrator(OrchestratorError),
    /// An engine replica failed (a kernel or an internal error).
    Engine {
        replica: usize,
        message: String,
    },
    Learner(String),
    Observer(String),
    /// Weight sync failed in a way a full sync cannot heal (a file cannot be written).
    Sync(String),
    /// The stage's settings are inconsistent (checked before anything runs).
    Config(String),
    /// Nothing can happen any more (no timer, no busy lane, nothing to start).
    Stalled(String),
    /// Replicas were lost `losses` times without a learner step completing in between: the
    /// heartbeat timeout is shorter than an engine step takes, so every replica would be lost
    /// and restarted for ever.
    HeartbeatTooShort {
        losses: u64,
        timeout: Micros,
    },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Orchestrator(e) => write!(f, "{e}"),
            RunError::Engine { replica, message } => {
                write!(f, "engine replica {replica}: {message}")
            }
            RunError::Learner(m) => write!(f, "learner: {m}"),
            RunError::Observer(m) => write!(f, "{m}"),
            RunError::Sync(m) => write!(f, "weight sync: {m}"),
            RunError::Config(m) => write!(f, "stage settings: {m}"),
            RunError::Stalled(m) => write!(f, "the run stalled: {m}"),
            RunError::HeartbeatTooShort { losses, timeout } => write!(
                f,
                "replicas were lost {losses} times without a learner step completing: the \
                 heartbeat timeout ({:.3} s) is shorter than one engine step takes (on the \
                 virtual clock, the cost model's charge for it); raise it, or set 0 to turn \
                 heartbeats off",
                timeout.secs()
            ),
        }
    }
}

impl std::error::Error for RunError {}

impl From<OrchestratorError> for RunError {
    fn from(e: OrchestratorError) -> Self {
        RunError::Orchestrator(e)
    }
}

/// What a stage did.
#[derive(Debug)]
pub struct StageReport {
    pub elapsed: Micros,
    pub wall: Duration,
    pub learner: LearnerTotals,
    pub rollout: RolloutCounters,
    pub buffer: BufferCounters,
    pub tasks: Vec<(String, f64, TaskStats)>,
    pub trace: Trace,
    /// Steps whose publication happened (versions sent to the replicas).
    pub publications: u64,
    /// Events the scheduler handled (timers and lane results).
    pub events: u64,
    /// Wall time spent running lanes inline (the virtual clock's compute); the rest of `wall`
    /// is the scheduler's own work.
    pub inline_time: Duration,
}

/// The parts a stage runs on.
pub struct Parts {
    pub learner: Learner,
    pub engines: Vec<Engine>,
}

/// Where a stage starts: the run clock, the totals so far (a resumed stage continues them),
/// and the weights the engines hold.
pub struct StageStart {
    /// The run clock now.
    pub clock: Micros,
    /// When the stage began on the run clock (earlier than `clock` for a resumed stage).
    pub stage_began: Micros,
    pub totals: LearnerTotals,
    pub engine_weights: Arc<Publication>,
}
