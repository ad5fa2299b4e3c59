//! The RL system on one scheduler (DESIGN 6.7): engine replicas, environments, the data
//! buffer and the learner, joined by messages and driven by one event loop over the run clock.
//!
//! Flow (DESIGN 6.8): the orchestrator admits groups -> `EngineCmd::Submit` to a replica lane
//! -> engine events (turn ended / finished) -> environment calls (timers) -> observations back
//! to the engine or the end of the trajectory -> the finished group's `Sample`s into the
//! buffer -> ready groups to the learner lane -> a publication every K steps -> to every
//! replica by the stage's sync path ([`crate::sync::lane`]).
//!
//! Lanes. Each engine replica and the learner is a *lane*: it holds its component and takes
//! one unit of work at a time (weight installs, a batch of commands, then one engine step; one
//! learner step and its publication). On the wall clock a lane is a thread and its result
//! arrives on a channel when it is done. On the virtual clock (replay) the lane runs its work
//! inline, and its result is delivered by a timer at start + the cost model's charge; the loop
//! always handles the earliest event, so the interleaving is decided by the clock and never by
//! thread timing, and a run with a seed replays bit for bit.
//! A replica lane's component is an engine in this process, or a `sluice serve` process
//! (`rollout.servers`, [`crate::remote`]) that the lane's thread sends the same unit of work
//! over HTTP (wall clock only).
//!
//! Weight sync. The learner lane turns a publication into what each replica is sent (in
//! process: the arena; delta: a delta against the version the replica will hold, or the full
//! image; disk: files written atomically, which replicas poll at the start of every unit of
//! work). A replica that refuses what it was sent (a delta that fails its checks, a damaged
//! file) keeps what it ran and is answered with a full sync (the full image; the file
//! rewritten whole). Every install reports the blake3 of the image the replica now runs on
//! ([`StageObserver::on_sync`]). On the virtual clock the cost model charges the encode or the
//! write on the learner lane and the transfer and install on each replica lane.
//!
//! Health ([`crate::health`]). With a heartbeat timeout, every replica is pinged a quarter
//! timeout apart and answers between units of work; one that leaves a ping unanswered for the
//! timeout is lost: its lane is abandoned (on the wall clock its thread is left behind, never
//! joined, so a hung thread cannot hang the run), every group it ran ends as `environment`
//! failures and starts again on another replica, the router drops it, and after the cost
//! model's restart time a fresh engine is built from a full sync and rejoins the router. The
//! restart runs on the scheduler's thread (on the wall clock the loop waits for the engine to
//! be built).
//!
//! Modes. `async`: rollout and learner run concurrently; rollout may start a trajectory only
//! within the backpressure room ([`Admission`](crate::buffer::Admission), eta steps ahead); the learner takes
//! `groups_per_step` gated groups whenever that many are ready. `sync` (the baseline): a
//! batch of `groups_per_step` groups is rolled out (started as the tasks' concurrency allows and
//! topped up as groups finish, so a batch larger than the concurrency is still whole), all of
//! it finishes, the learner takes every group that passes the gates and steps, the weights are
//! published, and the next batch starts. With over-sampling ([`OverSampling`]) a sync batch
//! starts more groups than a step needs, the learner steps as soon as the step's groups are
//! complete, and the groups still in flight are aborted (discarded, or suspended and resumed
//! first in the next batch); a barrier discards the suspended ones.
//!
//! Files, one job each: `stage` the public contract (the stage's settings, its observer,
//! its report and errors); `scheduler` the scheduler's state, built at the stage's start and
//! taken apart at its end; `event_loop` the loop over the run clock (admission, waiting for
//! the next event, timers); `lanes` what a lane is and runs (one unit of replica work, one
//! learner step, a lane's thread); `dispatch` handing work to the lanes and taking their
//! results back; `publication` weight publications on their way to the replicas and what
//! each replica did with them; `replica_health` heartbeats, lost replicas and restarts;
//! `barrier` the barriers a checkpoint is taken at.

mod barrier;
mod dispatch;
mod event_loop;
mod lanes;
mod publication;
mod replica_health;
mod scheduler;
mod stage;

pub use stage::{
    BarrierView, Mode, OverSampling, Parts, ReplicaLoss, RunError, StageConfig, StageObserver,
    StageReport, StageStart, SyncEvent, Tick,
};

use crate::buffer::DataBuffer;
use crate::orchestrator::Orchestrator;
use scheduler::Scheduler;

/// CPUs this process may run on, as `run.pin_lanes` sees them (0: not known).
pub fn pinnable_cpus() -> usize {
    core_affinity::get_core_ids().map_or(0, |c| c.len())
}

/// Runs one RL stage until the learner has taken `cfg.steps` steps; returns the parts (for
/// the next stage or a final checkpoint) and the stage's report.
pub fn run_stage(
    cfg: &StageConfig,
    parts: Parts,
    orchestrator: Orchestrator,
    buffer: DataBuffer,
    start: StageStart,
    observer: &mut dyn StageObserver,
) -> Result<(Parts, Orchestrator, DataBuffer, StageReport), RunError> {
    let mut s = Scheduler::new(cfg, parts, orchestrator, buffer, start)?;
    let outcome = s.run(observer);
    let (parts, orch, buffer, report) = s.finish(observer)?;
    outcome?;
    Ok((parts, orch, buffer, report))
}
