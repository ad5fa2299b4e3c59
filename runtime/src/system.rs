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
//! within the backpressure room ([`Admission`], eta steps ahead); the learner takes
//! `groups_per_step` gated groups whenever that many are ready. `sync` (the baseline): a
//! batch of `groups_per_step` groups is rolled out, all of it finishes, the learner takes every
//! group that passes the gates and steps, the weights are published, and the next batch starts.

use crate::buffer::{Admission, BufferCounters, DataBuffer, ReadyGroup};
use crate::clock::{Clock, ClockMode, CostModel, Micros, Timers};
use crate::engine::{Engine, EngineConfig, Event};
use crate::health::{BackendSpec, FailKind, HealthConfig, Heartbeats};
use crate::learner::{Learner, Publication, StepReport};
use crate::metrics::{metrics_line, LearnerTotals, LineInputs, RolloutCounters, Trace, Track};
use crate::orchestrator::{
    Action, EngineCmd, EngineResult, EnvCall, LostSessions, Orchestrator, OrchestratorError, Pace,
    TaskStats,
};
use crate::router::{ReplicaId, Router};
use crate::sync::lane::{
    restart_replica, Delivery, FullSync, Outgoing, StartImage, SyncOptions, SyncPath, SyncReport,
    SyncSink, SyncSource,
};
use crate::sync::{disk, ContentHash, DiskPublication};
use crate::trajectory::WeightVersion;
use serde_json::Value;
use sluice_model::ModelConfig;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

// ---------------------------------------------------------------------------------------------
// Lanes.

/// What a replica lane holds.
struct Replica {
    engine: Engine,
    sink: SyncSink,
    /// The injected failure, armed on the first incarnation of the configured replica.
    fail: Option<Armed>,
}

struct Armed {
    at_step: u64,
    kind: FailKind,
    /// Wall clock, `hang`: the thread blocks on this until the stage ends.
    release: Option<Receiver<()>>,
}

/// One unit of replica work: weight installs, commands in order, then one engine step if the
/// engine has work (on the disk path the pointer is polled first).
struct EngineWork {
    deliveries: Vec<Delivery>,
    cmds: Vec<EngineCmd>,
}

/// What a replica lane's thread is sent.
enum ReplicaIn {
    Work(EngineWork),
    Ping(u64),
}

struct EngineDone {
    results: Vec<EngineResult>,
    events: Vec<Event>,
    stepped: bool,
    prefill_tokens: u64,
    decode_tokens: u64,
    sampled_tokens: u64,
    sync: Vec<SyncReport>,
    has_work: bool,
    error: Option<String>,
}

enum ReplicaOutcome {
    Done(EngineDone),
    /// The injected failure struck: the lane never reports this unit.
    Failed(FailKind),
}

fn replica_run(r: &mut Replica, work: EngineWork) -> ReplicaOutcome {
    let mut done = EngineDone {
        results: Vec::with_capacity(work.cmds.len()),
        events: Vec::new(),
        stepped: false,
        prefill_tokens: 0,
        decode_tokens: 0,
        sampled_tokens: 0,
        sync: Vec::new(),
        has_work: false,
        error: None,
    };
    // Weights first: everything computed in this unit's step uses them.
    let mut refused = false;
    for d in work.deliveries {
        if refused && matches!(&d, Delivery::Bytes(p) if p.is_delta()) {
            done.sync.push(SyncReport::Skipped {
                version: d.version(),
            });
            continue;
        }
        match r.sink.install(&d, &mut r.engine) {
            Ok(report) => {
                refused |= matches!(report, SyncReport::Refused { .. });
                done.sync.push(report);
            }
            Err(e) => {
                done.error = Some(e);
                return ReplicaOutcome::Done(done);
            }
        }
    }
    match r.sink.poll(&mut r.engine) {
        Ok(Some(report)) => done.sync.push(report),
        Ok(None) => {}
        Err(e) => {
            done.error = Some(e);
            return ReplicaOutcome::Done(done);
        }
    }
    let engine = &mut r.engine;
    for cmd in work.cmds {
        done.results.push(match cmd {
            EngineCmd::Submit { group, request } => EngineResult::Submitted {
                group,
                handles: engine.submit(request).map_err(|e| e.to_string()),
            },
            EngineCmd::Observe {
                member,
                handle,
                tokens,
                max_new_tokens,
            } => EngineResult::Observed {
                member,
                result: engine
                    .observe(handle, &tokens, max_new_tokens)
                    .map_err(|e| e.to_string()),
            },
            EngineCmd::Finish {
                member,
                handle,
                reward,
                reason,
            } => EngineResult::Finished {
                member,
                result: engine
                    .finish(handle, reward, reason)
                    .map(Box::new)
                    .map_err(|e| e.to_string()),
            },
        });
    }
    let before = engine.stats();
    if engine.has_work() {
        if let Some(f) = &r.fail {
            if before.steps + 1 >= f.at_step {
                return ReplicaOutcome::Failed(f.kind);
            }
        }
        match engine.step() {
            Ok(ev) => {
                done.events = ev;
                done.stepped = true;
            }
            Err(e) => done.error = Some(e.to_string()),
        }
    }
    let after = engine.stats();
    done.prefill_tokens = after.prefill_tokens - before.prefill_tokens;
    done.decode_tokens = after.decode_tokens - before.decode_tokens;
    done.sampled_tokens = after.sampled_tokens - before.sampled_tokens;
    done.has_work = engine.has_work();
    ReplicaOutcome::Done(done)
}

/// What the learner lane holds: the learner and its side of weight sync.
struct LearnerSide {
    learner: Learner,
    source: SyncSource,
}

struct LearnerWork {
    groups: Vec<ReadyGroup>,
    publish: bool,
    reset_optimizer: bool,
    /// Per replica, the version it will hold when this publication reaches it.
    bases: Vec<Option<WeightVersion>>,
}

struct LearnerDone {
    report: Result<StepReport, String>,
    publication: Option<Arc<Publication>>,
    /// What the sync path made of the publication (None on the virtual clock until the
    /// learner's timer fires: files appear on disk only when the step is over on the run
    /// clock).
    outgoing: Option<Result<Outgoing, String>>,
}

fn learner_run(side: &mut LearnerSide, work: &LearnerWork, send_now: bool) -> LearnerDone {
    let learner = &mut side.learner;
    let mut report = learner.train(&work.groups).map_err(|e| e.to_string());
    let mut publication = None;
    if report.is_ok() && work.publish {
        match learner.publish() {
            Ok(p) => publication = Some(Arc::new(p)),
            Err(e) => report = Err(format!("publication: {e}")),
        }
        if report.is_ok() && work.reset_optimizer {
            if let Err(e) = learner.reset_optimizer() {
                report = Err(format!("optimizer reset: {e}"));
            }
        }
    }
    let outgoing = match (&publication, send_now) {
        (Some(p), true) => Some(side.source.publish(p.clone(), &work.bases)),
        _ => None,
    };
    LearnerDone {
        report,
        publication,
        outgoing,
    }
}

/// A lane's result on the wall clock. Replica messages carry the lane's incarnation: results
/// of a lane that was lost and replaced are ignored.
enum LaneMsg {
    Engine(usize, u64, Box<EngineDone>),
    Pong(usize, u64, u64),
    Learner(Box<LearnerDone>),
}

/// Where a component runs: inline (virtual clock) or on its own thread (wall clock).
enum Exec<W, In> {
    Inline(W),
    Thread {
        tx: Sender<In>,
        join: JoinHandle<W>,
    },
    /// Taken back (between the end of the loop and the return), or lost.
    Gone,
}

impl<W: Send + 'static, In: Send + 'static> Exec<W, In> {
    /// Runs `worker` on a thread that feeds it what it is sent; `run` answers with a message
    /// for the scheduler, or None when the lane ends (an injected death).
    fn spawn(
        mut worker: W,
        name: String,
        out: Sender<LaneMsg>,
        mut run: impl FnMut(&mut W, In) -> Option<LaneMsg> + Send + 'static,
    ) -> Result<Exec<W, In>, RunError> {
        let (tx, rx) = channel::<In>();
        let join = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                // Ends when the scheduler drops its sender; gives the component back.
                while let Ok(work) = rx.recv() {
                    match run(&mut worker, work) {
                        Some(msg) => {
                            if out.send(msg).is_err() {
                                break;
                            }
                        }
                        None => break,
                    }
                }
                worker
            })
            .map_err(|e| RunError::Stalled(format!("cannot start thread {name}: {e}")))?;
        Ok(Exec::Thread { tx, join })
    }

    /// The component, running inline from now on (a thread lane is stopped and joined).
    fn make_inline(&mut self) -> Option<&mut W> {
        if let Exec::Thread { .. } = self {
            let w = std::mem::replace(self, Exec::Gone).into_inner()?;
            *self = Exec::Inline(w);
        }
        match self {
            Exec::Inline(w) => Some(w),
            _ => None,
        }
    }

    fn into_inner(self) -> Option<W> {
        match self {
            Exec::Inline(w) => Some(w),
            Exec::Thread { tx, join } => {
                drop(tx);
                join.join().ok()
            }
            Exec::Gone => None,
        }
    }
}

/// What a restart needs to build a replica's engine again.
struct ReplicaSpec {
    backend: BackendSpec,
    model: ModelConfig,
    engine: EngineConfig,
}

struct ReplicaLane {
    exec: Exec<Replica, ReplicaIn>,
    pending: Vec<EngineCmd>,
    deliveries: Vec<Delivery>,
    /// Run a unit of work even with nothing queued (the disk path's poll after a
    /// publication).
    wake: bool,
    busy_since: Option<Micros>,
    has_work: bool,
    /// Inline result waiting for its timer.
    done: Option<EngineDone>,
    /// Bumped when the replica is lost: older results and timers are ignored.
    incarnation: u64,
    alive: bool,
    /// The version it will hold once its queued deliveries are installed (the base of its
    /// next delta).
    expected: Option<WeightVersion>,
    /// The version it reported installed last.
    installed: Option<WeightVersion>,
    /// When it was lost (for the restart's trace span).
    lost_at: Option<Micros>,
    restart_attempts: u32,
}

impl ReplicaLane {
    fn new(replica: Replica) -> ReplicaLane {
        let v = replica.sink.version();
        ReplicaLane {
            exec: Exec::Inline(replica),
            pending: Vec::new(),
            deliveries: Vec::new(),
            wake: false,
            busy_since: None,
            has_work: false,
            done: None,
            incarnation: 0,
            alive: true,
            expected: v,
            installed: v,
            lost_at: None,
            restart_attempts: 0,
        }
    }

    fn idle(&self) -> bool {
        self.busy_since.is_none()
            && self.pending.is_empty()
            && self.deliveries.is_empty()
            && !self.wake
            && !self.has_work
    }
}

struct LearnerLane {
    exec: Exec<LearnerSide, LearnerWork>,
    busy_since: Option<Micros>,
    done: Option<LearnerDone>,
    /// Inline: the replicas' bases of the step in flight (its publication is sent when its
    /// timer fires).
    bases: Option<Vec<Option<WeightVersion>>>,
    /// Task names of the groups in the step being computed.
    tasks: Vec<String>,
    /// Version of the learner (steps done), known without asking the lane.
    steps: u64,
}

#[derive(Debug)]
enum TimerEv {
    Env(EnvCall),
    EngineDone(usize, u64),
    LearnerDone,
    Restart(usize),
}

/// Sync mode's phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SyncPhase {
    /// Ready to start a rollout batch.
    Start,
    /// A batch is rolling out.
    Rollout,
    /// The learner is stepping on the batch.
    Train,
}

/// A publication on its way to the replicas: the replicas that have not installed it yet.
struct InFlightPublication {
    version: WeightVersion,
    start: Micros,
    waiting: BTreeSet<usize>,
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

struct Scheduler<'a> {
    cfg: &'a StageConfig,
    /// Events handled, and wall time spent in inline lanes (the StageReport's figures).
    events: u64,
    inline_time: Duration,
    clock: Clock,
    stage_start: Micros,
    wall_start: Instant,
    timers: Timers<TimerEv>,
    replicas: Vec<ReplicaLane>,
    specs: Vec<ReplicaSpec>,
    learner: LearnerLane,
    router: Router,
    rx: Option<Receiver<LaneMsg>>,
    /// Where lane threads send their results (kept to start threads again after a barrier).
    lane_tx: Sender<LaneMsg>,
    orch: Orchestrator,
    buffer: DataBuffer,
    totals: LearnerTotals,
    /// The weights every replica holds once its queued installs are done.
    engine_weights: Arc<Publication>,
    /// blake3 of each version published in this stage (the start weights included).
    published_hashes: BTreeMap<WeightVersion, ContentHash>,
    /// Delta path: the newest full image (for refusals and restarts).
    latest_full: Option<Arc<crate::sync::Publication>>,
    /// Disk path: the newest file and its bytes, and whether it was rewritten already.
    disk_last: Option<(DiskPublication, Arc<[u8]>)>,
    disk_repaired: Option<WeightVersion>,
    heartbeats: Option<Heartbeats>,
    /// Wall clock, injected hang: dropping it releases the hung thread.
    hang_release: Option<Sender<()>>,
    /// Threads of lost lanes, never joined (a hung one may never end).
    abandoned: Vec<JoinHandle<Replica>>,
    trace: Trace,
    phase: SyncPhase,
    admission: Admission,
    group_size: u64,
    publications: Vec<InFlightPublication>,
    published: u64,
    /// The learner step count at which the next barrier happens.
    next_barrier: Option<u64>,
    /// Sync mode: consecutive batches of which no group passed the gates.
    empty_batches: u32,
}

/// Restart attempts of one lost replica before the stage gives up.
const MAX_RESTART_ATTEMPTS: u32 = 5;

impl<'a> Scheduler<'a> {
    fn new(
        cfg: &'a StageConfig,
        parts: Parts,
        mut orch: Orchestrator,
        buffer: DataBuffer,
        start: StageStart,
    ) -> Result<Scheduler<'a>, RunError> {
        if parts.engines.is_empty() {
            return Err(RunError::Stalled("no engine replica".into()));
        }
        if cfg.groups_per_step == 0 || cfg.sync_interval == 0 {
            return Err(RunError::Stalled(
                "groups_per_step and sync_interval must be >= 1".into(),
            ));
        }
        let n = parts.engines.len();
        // Zero mismatch needs the engines to compute in the learner's precision (the same
        // rounding points on both sides).
        let precision = parts.learner.model().precision();
        if let Some((i, e)) = parts
            .engines
            .iter()
            .enumerate()
            .find(|(_, e)| e.precision() != precision)
        {
            return Err(RunError::Config(format!(
                "model.precision: engine replica {i} computes in {}, the learner in {precision}; \
                 both must use the same precision",
                e.precision()
            )));
        }
        cfg.sync.validate(n).map_err(RunError::Config)?;
        cfg.health.validate(n).map_err(RunError::Config)?;
        cfg.cost.validate().map_err(RunError::Config)?;
        let wall = cfg.clock == ClockMode::Wall;
        let (tx, rx) = channel::<LaneMsg>();
        let steps = parts.learner.version().0;
        let model_cfg = parts.learner.model().config.clone();
        let image = StartImage::of(&start.engine_weights).map_err(RunError::Sync)?;
        let source = SyncSource::new(&cfg.sync, &model_cfg, &start.engine_weights, &image)
            .map_err(RunError::Sync)?;
        let latest_full = match cfg.sync.path {
            SyncPath::Delta => Some(Arc::new(crate::sync::Publication {
                version: image.version,
                hash: image.hash,
                full_bytes: image.bytes.len() as u64,
                payload: crate::sync::Payload::Full(image.bytes.clone()),
            })),
            _ => None,
        };
        let (hang_tx, hang_rx) = channel::<()>();
        let mut hang_rx = Some(hang_rx);
        let mut replicas = Vec::with_capacity(n);
        let mut specs = Vec::with_capacity(n);
        for (i, e) in parts.engines.into_iter().enumerate() {
            specs.push(ReplicaSpec {
                backend: BackendSpec::of(e.backend()),
                model: e.model_config().clone(),
                engine: e.config().clone(),
            });
            let sink =
                SyncSink::new(&cfg.sync.path, e.model_config(), &image).map_err(RunError::Sync)?;
            let fail = cfg.health.fail.filter(|f| f.replica == i).map(|f| Armed {
                at_step: f.at_step,
                kind: f.kind,
                release: hang_rx.take(),
            });
            replicas.push(ReplicaLane::new(Replica {
                engine: e,
                sink,
                fail,
            }));
        }
        let learner = LearnerLane {
            exec: Exec::Inline(LearnerSide {
                learner: parts.learner,
                source,
            }),
            busy_since: None,
            done: None,
            bases: None,
            tasks: Vec::new(),
            steps,
        };
        let router = Router::new((0..n as u32).map(ReplicaId))
            .map_err(|e| RunError::Stalled(format!("router: {e}")))?;
        let group_size = buffer.config().group_size as u64;
        let next_barrier = cfg
            .barrier_every
            .filter(|&b| b > 0)
            .map(|b| (steps / b + 1) * b);
        orch.set_learner_step(steps);
        let mut published_hashes = BTreeMap::new();
        published_hashes.insert(image.version, image.hash);
        let mut sched = Scheduler {
            cfg,
            clock: Clock::new(cfg.clock, start.clock),
            stage_start: start.stage_began.min(start.clock),
            wall_start: Instant::now(),
            timers: Timers::default(),
            replicas,
            specs,
            learner,
            router,
            rx: if wall { Some(rx) } else { None },
            lane_tx: tx,
            orch,
            buffer,
            totals: start.totals,
            engine_weights: start.engine_weights,
            published_hashes,
            latest_full,
            disk_last: None,
            disk_repaired: None,
            heartbeats: cfg
                .health
                .heartbeat_timeout
                .map(|t| Heartbeats::new(n, t, start.clock)),
            hang_release: Some(hang_tx),
            abandoned: Vec::new(),
            trace: Trace::default(),
            phase: SyncPhase::Start,
            admission: Admission {
                eta: cfg.eta,
                per_step: cfg.groups_per_step as u64 * group_size,
            },
            group_size,
            publications: Vec::new(),
            published: 0,
            next_barrier,
            empty_batches: 0,
            events: 0,
            inline_time: Duration::ZERO,
        };
        if wall {
            sched.start_threads()?;
        }
        Ok(sched)
    }

    /// Wall clock: moves every lane onto its own thread.
    fn start_threads(&mut self) -> Result<(), RunError> {
        for i in 0..self.replicas.len() {
            self.start_replica_thread(i)?;
        }
        if let Exec::Inline(_) = self.learner.exec {
            let Exec::Inline(l) = std::mem::replace(&mut self.learner.exec, Exec::Gone) else {
                unreachable!("matched just above")
            };
            self.learner.exec =
                Exec::spawn(l, "sluice-learner".into(), self.lane_tx.clone(), |l, w| {
                    Some(LaneMsg::Learner(Box::new(learner_run(l, &w, true))))
                })?;
        }
        Ok(())
    }

    fn start_replica_thread(&mut self, i: usize) -> Result<(), RunError> {
        let r = &mut self.replicas[i];
        if !matches!(r.exec, Exec::Inline(_)) {
            return Ok(());
        }
        let Exec::Inline(e) = std::mem::replace(&mut r.exec, Exec::Gone) else {
            unreachable!("matched just above")
        };
        let incarnation = r.incarnation;
        r.exec = Exec::spawn(
            e,
            format!("sluice-engine-{i}"),
            self.lane_tx.clone(),
            move |rep: &mut Replica, input| match input {
                ReplicaIn::Ping(seq) => Some(LaneMsg::Pong(i, incarnation, seq)),
                ReplicaIn::Work(w) => match replica_run(rep, w) {
                    ReplicaOutcome::Done(d) => Some(LaneMsg::Engine(i, incarnation, Box::new(d))),
                    ReplicaOutcome::Failed(kind) => {
                        if kind == FailKind::Hang {
                            // Blocks until the stage ends and drops the sender (a real hang
                            // would block for ever; the scheduler never waits for it).
                            if let Some(rx) = rep.fail.as_mut().and_then(|f| f.release.take()) {
                                let _ = rx.recv();
                            }
                        }
                        None
                    }
                },
            },
        )?;
        Ok(())
    }

    fn target_steps(&self) -> u64 {
        // The learner's version when the stage started plus the stage's steps.
        self.cfg.steps
    }

    fn done(&self) -> bool {
        self.totals.steps >= self.target_steps() && self.learner.busy_since.is_none()
    }

    /// Whether a barrier is due: new work waits until everything in flight has landed.
    fn at_barrier(&self) -> bool {
        self.next_barrier
            .is_some_and(|b| self.learner.steps >= b && self.totals.steps < self.target_steps())
    }

    fn run(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        loop {
            if self.done() {
                return Ok(());
            }
            if self.at_barrier() && self.quiescent() {
                self.barrier(observer)?;
                continue;
            }
            self.admit()?;
            self.start_learner(observer)?;
            self.dispatch_engines()?;
            if self.quiescent() && !self.at_barrier() {
                return Err(RunError::Stalled(self.stall_report()));
            }
            self.wait_and_handle(observer)?;
            self.events += 1;
            observer.on_tick(&Tick {
                now: self.clock.now(),
                started: self.orch.counters().trajectories_started,
                discarded: self.discarded(),
                learner_steps: self.learner.steps,
                per_step: self.admission.per_step,
                eta: self.admission.eta,
                in_flight: self.orch.in_flight(),
            });
        }
    }

    /// Nothing is running or pending: no timer, no busy lane, no queued command (heartbeats
    /// do not count: they only watch).
    fn quiescent(&self) -> bool {
        self.timers.is_empty()
            && self.learner.busy_since.is_none()
            && self.replicas.iter().all(ReplicaLane::idle)
            && self.orch.in_flight() == 0
    }

    /// No timer, no busy lane, nothing queued for any lane (trajectories may still be in
    /// flight, but nothing can move them).
    fn nothing_running(&self) -> bool {
        self.timers.is_empty()
            && self.learner.busy_since.is_none()
            && self.replicas.iter().all(ReplicaLane::idle)
    }

    fn stall_report(&self) -> String {
        format!(
            "learner at step {} of {}, {} groups waiting in the buffer (need {}), {} \
             trajectories in flight, backpressure room {} (eta {}); check buffer.tau, \
             buffer.group_size and the tasks' concurrency",
            self.totals.steps,
            self.target_steps(),
            self.buffer.groups_waiting(),
            self.cfg.groups_per_step,
            self.orch.in_flight(),
            self.room(),
            self.cfg.eta
        )
    }

    fn barrier(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        let now = self.clock.now();
        // Every lane is idle: take the components back from their threads to look at them.
        for (i, r) in self.replicas.iter_mut().enumerate() {
            let rep = r.exec.make_inline().ok_or_else(|| RunError::Engine {
                replica: i,
                message: "a replica thread panicked".into(),
            })?;
            // Identical state in a run resumed from here: nothing cached from before.
            rep.engine.reset_prefix_cache();
        }
        if self.learner.exec.make_inline().is_none() {
            return Err(RunError::Learner("the learner thread panicked".into()));
        }
        {
            let learner = match &self.learner.exec {
                Exec::Inline(l) => &l.learner,
                _ => return Err(RunError::Learner("the learner is gone".into())),
            };
            let inline: Vec<&Replica> = self
                .replicas
                .iter()
                .filter_map(|r| match &r.exec {
                    Exec::Inline(e) => Some(e),
                    _ => None,
                })
                .collect();
            observer
                .on_barrier(&BarrierView {
                    now,
                    learner,
                    engines: inline.iter().map(|r| &r.engine).collect(),
                    replica_weights: inline
                        .iter()
                        .map(|r| (r.sink.version(), r.sink.hash()))
                        .collect(),
                    buffer: &self.buffer,
                    orchestrator: &self.orch,
                    totals: &self.totals,
                    engine_weights: &self.engine_weights,
                    trace: &self.trace,
                    stage_began: self.stage_start,
                })
                .map_err(RunError::Observer)?;
        }
        if !self.clock.is_virtual() {
            self.start_threads()?;
        }
        self.next_barrier = self
            .next_barrier
            .zip(self.cfg.barrier_every)
            .map(|(b, every)| b + every);
        Ok(())
    }

    fn discarded(&self) -> u64 {
        self.buffer
            .counters()
            .discarded_in_dropped_groups(self.group_size as u32)
    }

    fn room(&self) -> u64 {
        self.admission.room(
            self.orch.counters().trajectories_started,
            self.discarded(),
            self.learner.steps,
        )
    }

    /// The replica a session goes to: the router's choice among live replicas, or `fallback`
    /// (a replica being restarted) when none is live.
    fn route_or(router: &Router, session: &str, fallback: usize) -> usize {
        router.route(session).map_or(fallback, |r| r.0 as usize)
    }

    fn admit(&mut self) -> Result<(), RunError> {
        if self.at_barrier() || self.totals.steps >= self.target_steps() {
            return Ok(());
        }
        // Every replica is down: new groups wait for a restart.
        if self.router.replicas().next().is_none() {
            return Ok(());
        }
        let room = match self.cfg.mode {
            Mode::Async => self.room(),
            Mode::Sync => {
                if self.phase != SyncPhase::Start || self.learner.busy_since.is_some() {
                    0
                } else {
                    self.phase = SyncPhase::Rollout;
                    self.cfg.groups_per_step as u64 * self.group_size
                }
            }
        };
        if room < self.group_size {
            return Ok(());
        }
        let now = self.clock.now();
        let router = &self.router;
        let mut route = |session: &str| Self::route_or(router, session, 0);
        let waiting = self.buffer.waiting_by_task();
        // The learner's pace so far in this stage (1 s before its first step); from the
        // stage's beginning, so a resumed stage computes what the original did.
        let done = self.totals.steps;
        let pace = Pace {
            step_s: if done > 0 {
                now.since(self.stage_start).secs() / done as f64
            } else {
                1.0
            },
            groups_per_step: self.cfg.groups_per_step,
        };
        let actions = self.orch.admit(now, room, &mut route, &waiting, pace);
        self.apply(actions)
    }

    fn start_learner(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        if self.learner.busy_since.is_some() || self.totals.steps >= self.target_steps() {
            return Ok(());
        }
        if self.next_barrier.is_some_and(|b| self.learner.steps >= b) {
            return Ok(());
        }
        let version = WeightVersion(self.learner.steps);
        let groups = match self.cfg.mode {
            Mode::Async => {
                let orch = &self.orch;
                match self
                    .buffer
                    .take_by(version, self.cfg.groups_per_step, |tasks, n| {
                        orch.pick(tasks, n)
                    }) {
                    Some(g) => g,
                    None => return Ok(()),
                }
            }
            Mode::Sync => {
                if self.phase != SyncPhase::Rollout || self.orch.in_flight() > 0 {
                    return Ok(());
                }
                let g = self.buffer.take_all(version);
                if g.is_empty() {
                    // Every group of the batch was dropped: roll out another batch.
                    self.empty_batches += 1;
                    if self.empty_batches >= 20 {
                        return Err(RunError::Stalled(
                            "20 consecutive sync batches lost every group to the gates".into(),
                        ));
                    }
                    self.phase = SyncPhase::Start;
                    return Ok(());
                }
                self.empty_batches = 0;
                self.phase = SyncPhase::Train;
                g
            }
        };
        self.orch
            .on_consumed(groups.iter().map(|g| g.task.as_str()));
        observer.on_learner_batch(&groups);
        let tokens: u64 = groups
            .iter()
            .flat_map(|g| g.samples.iter())
            .map(|s| s.tokens.len() as u64)
            .sum();
        let next_step = self.learner.steps + 1;
        let bases: Vec<Option<WeightVersion>> = self
            .replicas
            .iter()
            .map(|r| if r.alive { r.expected } else { None })
            .collect();
        let work = LearnerWork {
            publish: next_step.is_multiple_of(self.cfg.sync_interval),
            reset_optimizer: self.cfg.reset_optimizer,
            groups,
            bases,
        };
        self.learner.tasks = work.groups.iter().map(|g| g.task.clone()).collect();
        let now = self.clock.now();
        self.learner.busy_since = Some(now);
        match &mut self.learner.exec {
            Exec::Inline(side) => {
                let t0 = Instant::now();
                let done = learner_run(side, &work, false);
                self.inline_time += t0.elapsed();
                let mut cost = self.cfg.cost.learner_step(tokens);
                if work.publish {
                    let image = side.learner.model().compute_weights().tensor().len_bytes() as u64;
                    cost = cost.plus(self.cfg.cost.publish());
                    cost = cost.plus(match self.cfg.sync.path {
                        SyncPath::InProcess => Micros(0),
                        SyncPath::Delta => {
                            let bases: BTreeSet<WeightVersion> =
                                work.bases.iter().flatten().copied().collect();
                            self.cfg.cost.sync_encode(image, bases.len() as u64)
                        }
                        SyncPath::Disk(_) => self.cfg.cost.sync_write(image),
                    });
                }
                self.learner.done = Some(done);
                self.learner.bases = Some(work.bases);
                self.timers.push(now.plus(cost), TimerEv::LearnerDone);
            }
            Exec::Thread { tx, .. } => {
                tx.send(work)
                    .map_err(|_| RunError::Learner("the learner thread ended".into()))?;
            }
            Exec::Gone => return Err(RunError::Learner("the learner is gone".into())),
        }
        Ok(())
    }

    fn dispatch_engines(&mut self) -> Result<(), RunError> {
        let now = self.clock.now();
        for i in 0..self.replicas.len() {
            let r = &mut self.replicas[i];
            if !r.alive || r.busy_since.is_some() || r.idle() {
                continue;
            }
            let work = EngineWork {
                deliveries: std::mem::take(&mut r.deliveries),
                cmds: std::mem::take(&mut r.pending),
            };
            r.wake = false;
            r.busy_since = Some(now);
            let incarnation = r.incarnation;
            let outcome = match &mut r.exec {
                Exec::Inline(rep) => {
                    let t0 = Instant::now();
                    let out = replica_run(rep, work);
                    self.inline_time += t0.elapsed();
                    out
                }
                Exec::Thread { tx, .. } => {
                    // A lane whose thread ended (an injected death) takes nothing; heartbeats
                    // find it.
                    let _ = tx.send(ReplicaIn::Work(work));
                    continue;
                }
                Exec::Gone => {
                    return Err(RunError::Engine {
                        replica: i,
                        message: "the replica is gone".into(),
                    })
                }
            };
            match outcome {
                ReplicaOutcome::Done(done) => {
                    let cost = self.engine_cost(&done);
                    self.replicas[i].done = Some(done);
                    self.timers
                        .push(now.plus(cost), TimerEv::EngineDone(i, incarnation));
                }
                // The lane goes silent: no result, no timer; heartbeats find it.
                ReplicaOutcome::Failed(FailKind::Die) => self.replicas[i].exec = Exec::Gone,
                ReplicaOutcome::Failed(FailKind::Hang) => {}
            }
        }
        Ok(())
    }

    /// The virtual clock's charge for one unit of replica work.
    fn engine_cost(&self, done: &EngineDone) -> Micros {
        let c = &self.cfg.cost;
        let mut cost = if done.stepped {
            c.engine_step(done.prefill_tokens, done.decode_tokens)
        } else {
            Micros(0)
        };
        for s in &done.sync {
            cost = cost.plus(match s {
                SyncReport::Installed {
                    sent_bytes,
                    image_bytes,
                    encoding,
                    ..
                } => {
                    if encoding == "inprocess" {
                        c.publish()
                    } else {
                        c.publish().plus(c.sync_install(*sent_bytes, *image_bytes))
                    }
                }
                SyncReport::Refused { .. } => c.publish(),
                SyncReport::Skipped { .. } => Micros(0),
            });
        }
        cost
    }

    /// When the virtual clock's next event is due: the earliest timer, or the heartbeat tick
    /// (timers first on a tie). None: nothing is scheduled.
    fn next_virtual(&self) -> Option<(Micros, bool)> {
        let timer = self.timers.next_due();
        let beat = self.heartbeats.as_ref().map(Heartbeats::next_tick);
        match (timer, beat) {
            (Some(t), Some(b)) if b < t => Some((b, true)),
            (Some(t), _) => Some((t, false)),
            // Heartbeats matter only while a lane is busy (it may have hung): with nothing
            // running or queued anywhere they could only tick for ever.
            (None, Some(b)) if !self.nothing_running() => Some((b, true)),
            _ => None,
        }
    }

    /// Waits for the next event (the earliest timer or heartbeat on the virtual clock; a lane
    /// message, a due timer or a heartbeat tick on the wall clock) and handles it.
    fn wait_and_handle(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        if self.clock.is_virtual() {
            let (at, beat) = self
                .next_virtual()
                .ok_or_else(|| RunError::Stalled(self.stall_report()))?;
            self.clock.advance_to(at);
            if beat {
                return self.heartbeat_tick(observer);
            }
            let (_, ev) = self
                .timers
                .pop()
                .ok_or_else(|| RunError::Stalled(self.stall_report()))?;
            return self.handle_timer(ev, observer);
        }
        let now = self.clock.now();
        if self
            .heartbeats
            .as_ref()
            .is_some_and(|h| h.next_tick() <= now)
        {
            return self.heartbeat_tick(observer);
        }
        if let Some((_, ev)) = self.timers.pop_due(now) {
            return self.handle_timer(ev, observer);
        }
        let due = [
            self.timers.next_due(),
            self.heartbeats.as_ref().map(Heartbeats::next_tick),
        ]
        .into_iter()
        .flatten()
        .min();
        let timeout = due
            .map(|t| self.clock.wait_until(t))
            .unwrap_or(Duration::from_secs(3600));
        let rx = self
            .rx
            .as_ref()
            .ok_or_else(|| RunError::Stalled("no lane channel on the wall clock".into()))?;
        match rx.recv_timeout(timeout) {
            Ok(LaneMsg::Engine(i, inc, done)) => {
                if self.replicas[i].incarnation == inc {
                    self.engine_done(i, *done, observer)
                } else {
                    Ok(())
                }
            }
            Ok(LaneMsg::Pong(i, inc, seq)) => {
                if self.replicas[i].incarnation == inc {
                    if let Some(h) = &mut self.heartbeats {
                        h.answer(i, seq);
                    }
                }
                Ok(())
            }
            Ok(LaneMsg::Learner(done)) => self.learner_done(*done, observer),
            Err(RecvTimeoutError::Timeout) => Ok(()),
            Err(RecvTimeoutError::Disconnected) => {
                Err(RunError::Stalled("every lane thread ended".into()))
            }
        }
    }

    /// A heartbeat tick: pings, then every replica silent for the timeout is lost.
    fn heartbeat_tick(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        let now = self.clock.now();
        let Some(h) = self.heartbeats.as_mut() else {
            return Ok(());
        };
        for (i, seq) in h.tick(now) {
            let r = &self.replicas[i];
            match &r.exec {
                // Inline lanes answer at once when idle; a busy one answers when its unit of
                // work ends (a hung one never).
                Exec::Inline(_) if r.busy_since.is_none() => h.answer(i, seq),
                Exec::Inline(_) | Exec::Gone => {}
                // A lane whose thread ended cannot take the ping: it stays unanswered.
                Exec::Thread { tx, .. } => {
                    let _ = tx.send(ReplicaIn::Ping(seq));
                }
            }
        }
        for i in h.overdue(now) {
            self.lose_replica(i, observer)?;
        }
        Ok(())
    }

    fn handle_timer(
        &mut self,
        ev: TimerEv,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
        match ev {
            TimerEv::Env(call) => {
                let now = self.clock.now();
                let actions = self.orch.on_env(call, now)?;
                self.apply(actions)
            }
            TimerEv::EngineDone(i, inc) => {
                if self.replicas[i].incarnation != inc {
                    return Ok(());
                }
                let done = self.replicas[i]
                    .done
                    .take()
                    .ok_or_else(|| RunError::Engine {
                        replica: i,
                        message: "internal: no result for its timer".into(),
                    })?;
                self.engine_done(i, done, observer)
            }
            TimerEv::LearnerDone => {
                let mut done =
                    self.learner.done.take().ok_or_else(|| {
                        RunError::Learner("internal: no result for its timer".into())
                    })?;
                // The step is over on the run clock: now its publication goes out.
                let bases = self.learner.bases.take();
                if let (Some(p), Some(bases), Exec::Inline(side)) =
                    (done.publication.clone(), bases, &mut self.learner.exec)
                {
                    done.outgoing = Some(side.source.publish(p, &bases));
                }
                self.learner_done(done, observer)
            }
            TimerEv::Restart(i) => self.restart(i, observer),
        }
    }

    fn engine_done(
        &mut self,
        i: usize,
        done: EngineDone,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
        let now = self.clock.now();
        if let Some(message) = done.error {
            return Err(RunError::Engine {
                replica: i,
                message,
            });
        }
        if let Some(h) = &mut self.heartbeats {
            h.alive(i);
        }
        let r = &mut self.replicas[i];
        let since = r.busy_since.take().unwrap_or(now);
        r.has_work = done.has_work;
        let c = self.orch.counters_mut();
        c.engine_busy = c.engine_busy.plus(now.since(since));
        c.sampled_tokens += done.sampled_tokens;
        if done.stepped {
            c.engine_steps += 1;
        }
        for report in done.sync {
            self.sync_report(i, report, false, observer)?;
        }
        let mut actions = Vec::new();
        for res in done.results {
            actions.extend(self.orch.on_result(i, res, now)?);
        }
        for ev in done.events {
            actions.extend(self.orch.on_event(i, ev, now)?);
        }
        self.apply(actions)
    }

    /// What a replica did with its weights: an install (checked against what was published),
    /// or a refusal answered by a full sync.
    fn sync_report(
        &mut self,
        i: usize,
        report: SyncReport,
        restart: bool,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
        let now = self.clock.now();
        match report {
            SyncReport::Installed {
                version,
                hash,
                sent_bytes,
                encoding,
                ..
            } => {
                self.replicas[i].installed = Some(version);
                self.credit_install(i, version, now);
                observer.on_sync(&SyncEvent {
                    now,
                    replica: i,
                    version,
                    hash,
                    published: self.published_hashes.get(&version).copied(),
                    encoding,
                    sent_bytes,
                    restart,
                });
            }
            SyncReport::Refused { version, reason } => {
                self.orch.counters_mut().sync_refused += 1;
                self.trace.push(
                    Track::Health,
                    format!(
                        "replica {i} refused {}",
                        version.map_or("the newest version".to_string(), |v| v.to_string())
                    ),
                    now,
                    now,
                    vec![("reason".into(), reason)],
                );
                self.full_sync_after_refusal(i)?;
            }
            SyncReport::Skipped { .. } => {}
        }
        Ok(())
    }

    /// Answers a refusal with a full sync: the newest full image (delta path), or the newest
    /// file rewritten whole (disk path).
    fn full_sync_after_refusal(&mut self, i: usize) -> Result<(), RunError> {
        match &self.cfg.sync.path {
            SyncPath::Delta => {
                let full = self.latest_full.clone().ok_or_else(|| {
                    RunError::Sync("a refused delta but no full image to send".into())
                })?;
                let r = &mut self.replicas[i];
                // Queued deltas start from versions it will not hold: the full image replaces
                // them all.
                r.deliveries.clear();
                r.expected = Some(full.version);
                let bytes = full.sync_bytes();
                r.deliveries.push(Delivery::Bytes(full));
                let c = self.orch.counters_mut();
                c.sync_full_resyncs += 1;
                c.sync_bytes += bytes;
            }
            SyncPath::Disk(_) => {
                let Some((publication, bytes)) = &self.disk_last else {
                    return Ok(());
                };
                if self.disk_repaired != Some(publication.version) {
                    disk::repair(publication, bytes).map_err(|e| RunError::Sync(e.to_string()))?;
                    self.disk_repaired = Some(publication.version);
                    self.orch.counters_mut().sync_full_resyncs += 1;
                }
                let newest = publication.version;
                for r in self.replicas.iter_mut().filter(|r| r.alive) {
                    if r.installed.is_none_or(|v| v < newest) {
                        r.wake = true;
                    }
                }
            }
            SyncPath::InProcess => {
                return Err(RunError::Sync(format!(
                    "replica {i} refused an in-process publication"
                )))
            }
        }
        Ok(())
    }

    /// Replica `i` runs `version` now: it no longer waits for any publication up to it.
    fn credit_install(&mut self, i: usize, version: WeightVersion, now: Micros) {
        for p in &mut self.publications {
            if p.version <= version {
                p.waiting.remove(&i);
            }
        }
        self.close_publications(now);
    }

    /// Publications every live replica has installed end their trace span.
    fn close_publications(&mut self, now: Micros) {
        let (done, open): (Vec<_>, Vec<_>) = std::mem::take(&mut self.publications)
            .into_iter()
            .partition(|p| p.waiting.is_empty());
        self.publications = open;
        for p in done {
            self.trace.push(
                Track::Sync,
                format!("publish {}", p.version),
                p.start,
                now,
                vec![("version".into(), p.version.0.to_string())],
            );
        }
    }

    fn learner_done(
        &mut self,
        done: LearnerDone,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
        let now = self.clock.now();
        let report = done.report.map_err(RunError::Learner)?;
        let since = self.learner.busy_since.take().unwrap_or(now);
        self.learner.steps = report.version.0;
        self.orch.set_learner_step(self.learner.steps);
        {
            let c = self.orch.counters_mut();
            c.learner_busy = c.learner_busy.plus(now.since(since));
        }
        self.totals.add(&report);
        self.trace.push(
            Track::Learner,
            format!("step {}", report.version.0),
            since,
            now,
            vec![
                ("groups".into(), self.learner.tasks.len().to_string()),
                ("tokens".into(), report.tokens.to_string()),
                ("loss".into(), format!("{:.6}", report.loss)),
            ],
        );
        let mut sync = None;
        if let (Some(p), Some(out)) = (done.publication, done.outgoing) {
            let out = out.map_err(RunError::Sync)?;
            sync = Some(self.send(p, out, now));
        }
        if self.cfg.mode == Mode::Sync {
            self.phase = SyncPhase::Start;
        }
        let tasks = self.orch.task_names();
        let (sync_bytes, sync_label) = sync.unzip();
        let line = metrics_line(&LineInputs {
            stage: &self.cfg.name,
            time_s: now.since(self.stage_start).secs(),
            wall_s: self.wall_start.elapsed().as_secs_f64(),
            step: &report,
            learner: &self.totals,
            rollout: self.orch.counters(),
            buffer: &self.buffer.counters(),
            tasks: &tasks,
            sync: sync_bytes.zip(sync_label.as_deref()),
        });
        observer.on_step(&line, &report).map_err(RunError::Observer)
    }

    /// Queues a publication to every live replica; returns its `sync_bytes` and
    /// `sync_encoding`.
    fn send(&mut self, p: Arc<Publication>, out: Outgoing, now: Micros) -> (u64, String) {
        let live = self.replicas.iter().filter(|r| r.alive).count();
        let metric = out.sync_metric(&self.cfg.sync.path, live);
        if let Some(why) = &out.failed {
            // Disk path: the writer died; the replicas keep what they run.
            self.orch.counters_mut().sync_failed_writes += 1;
            self.trace.push(
                Track::Health,
                format!("publish {} failed", out.version),
                now,
                now,
                vec![("reason".into(), why.clone())],
            );
            return metric;
        }
        self.published += 1;
        self.published_hashes.insert(out.version, out.hash);
        {
            let c = self.orch.counters_mut();
            c.publications += 1;
            c.sync_bytes += metric.0;
        }
        let waiting: BTreeSet<usize> = (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.alive && r.installed.is_none_or(|v| v < out.version)
            })
            .collect();
        self.publications.push(InFlightPublication {
            version: out.version,
            start: now,
            waiting,
        });
        let disk = matches!(self.cfg.sync.path, SyncPath::Disk(_));
        for (r, d) in self.replicas.iter_mut().zip(out.deliveries) {
            if !r.alive {
                continue;
            }
            if let Some(d) = d {
                r.deliveries.push(d);
            }
            if disk {
                // The replica polls at the start of its next unit of work.
                r.wake = true;
            }
            r.expected = Some(out.version);
        }
        if out.full.is_some() {
            self.latest_full = out.full;
        }
        if out.disk.is_some() {
            self.disk_last = out.disk;
        }
        self.engine_weights = p;
        self.close_publications(now);
        metric
    }

    /// Replica `i` stopped answering: abandon its lane, end its groups (their sessions start
    /// again elsewhere), drop it from the router, and schedule its restart.
    fn lose_replica(&mut self, i: usize, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        let now = self.clock.now();
        let silent_since = self
            .heartbeats
            .as_ref()
            .and_then(|h| h.silent_since(i))
            .unwrap_or(now);
        if let Some(h) = &mut self.heartbeats {
            h.unwatch(i);
        }
        let r = &mut self.replicas[i];
        let working_since = r.busy_since;
        r.alive = false;
        r.incarnation += 1;
        r.busy_since = None;
        r.done = None;
        r.pending.clear();
        r.deliveries.clear();
        r.wake = false;
        r.has_work = false;
        r.expected = None;
        r.installed = None;
        r.lost_at = Some(now);
        match std::mem::replace(&mut r.exec, Exec::Gone) {
            // Never joined: a hung thread may never end (it keeps its engine).
            Exec::Thread { tx, join } => {
                drop(tx);
                self.abandoned.push(join);
            }
            Exec::Inline(_) | Exec::Gone => {}
        }
        let _ = self.router.remove_replica(ReplicaId(i as u32));
        let router = &self.router;
        let mut route = |session: &str| Self::route_or(router, session, i);
        let (actions, lost) = self.orch.on_replica_lost(i, now, &mut route)?;
        self.apply(actions)?;
        for p in &mut self.publications {
            p.waiting.remove(&i);
        }
        self.close_publications(now);
        self.orch.counters_mut().replicas_lost += 1;
        self.trace.push(
            Track::Health,
            format!("replica {i} lost"),
            silent_since,
            now,
            vec![
                ("trajectories_lost".into(), lost.trajectories.to_string()),
                ("sessions_restarted".into(), lost.sessions.len().to_string()),
            ],
        );
        observer.on_replica_lost(&ReplicaLoss {
            now,
            replica: i,
            silent_since,
            working_since,
            lost,
        });
        let delay = if self.clock.is_virtual() {
            let image = self.engine_image_bytes();
            self.cfg
                .cost
                .replica_restart()
                .plus(self.cfg.cost.sync_install(image, image))
        } else {
            Micros(0)
        };
        self.timers.push(now.plus(delay), TimerEv::Restart(i));
        Ok(())
    }

    fn engine_image_bytes(&self) -> u64 {
        self.engine_weights.params.tensor().len_bytes() as u64
    }

    /// A fresh engine for replica `i` from a full sync of the newest weights.
    fn fresh_replica(&self, i: usize) -> Result<(Engine, SyncSink, SyncReport), String> {
        let spec = &self.specs[i];
        let backend = spec.backend.open()?;
        let full = match &self.cfg.sync.path {
            SyncPath::InProcess => {
                let hash = self
                    .published_hashes
                    .get(&self.engine_weights.version)
                    .copied()
                    .ok_or("internal: the newest weights have no hash")?;
                FullSync::Arena(&self.engine_weights, hash)
            }
            SyncPath::Delta => FullSync::Bytes(
                self.latest_full
                    .as_deref()
                    .ok_or("internal: no full image to restart from")?,
            ),
            SyncPath::Disk(dir) => FullSync::Disk(dir),
        };
        restart_replica(backend, &spec.model, spec.engine.clone(), full)
    }

    /// Restarts lost replica `i`: a fresh engine on a full sync, back in the router.
    fn restart(&mut self, i: usize, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        let now = self.clock.now();
        let (engine, sink, report) = match self.fresh_replica(i) {
            Ok(x) => x,
            Err(e) => {
                let r = &mut self.replicas[i];
                r.restart_attempts += 1;
                if r.restart_attempts >= MAX_RESTART_ATTEMPTS {
                    return Err(RunError::Engine {
                        replica: i,
                        message: format!("restart failed {} times, last: {e}", r.restart_attempts),
                    });
                }
                self.trace.push(
                    Track::Health,
                    format!("replica {i} restart failed"),
                    now,
                    now,
                    vec![("reason".into(), e)],
                );
                let retry = self
                    .heartbeats
                    .as_ref()
                    .map_or(Micros::from_secs(1.0), Heartbeats::interval);
                self.timers.push(now.plus(retry), TimerEv::Restart(i));
                return Ok(());
            }
        };
        let r = &mut self.replicas[i];
        let lost_at = r.lost_at.take().unwrap_or(now);
        let incarnation = r.incarnation;
        let pending = std::mem::take(&mut r.pending);
        *r = ReplicaLane::new(Replica {
            engine,
            sink,
            fail: None,
        });
        r.incarnation = incarnation;
        // Sessions re-run while every replica was down waited here.
        r.pending = pending;
        if !self.clock.is_virtual() {
            self.start_replica_thread(i)?;
        }
        let _ = self.router.add_replica(ReplicaId(i as u32));
        if let Some(h) = &mut self.heartbeats {
            h.watch(i);
        }
        {
            let c = self.orch.counters_mut();
            c.replica_restarts += 1;
            if let SyncReport::Installed { sent_bytes, .. } = &report {
                c.sync_bytes += sent_bytes;
            }
        }
        self.trace.push(
            Track::Health,
            format!("replica {i} restarted"),
            lost_at,
            now,
            vec![],
        );
        self.sync_report(i, report, true, observer)?;
        // Publications it missed while down are covered by the full sync; a newer one
        // published since is sent like to any replica.
        Ok(())
    }

    fn apply(&mut self, actions: Vec<Action>) -> Result<(), RunError> {
        for a in actions {
            match a {
                Action::Engine { replica, cmd } => {
                    let r = self
                        .replicas
                        .get_mut(replica)
                        .ok_or_else(|| RunError::Engine {
                            replica,
                            message: "no such replica".into(),
                        })?;
                    r.pending.push(cmd);
                }
                Action::EnvTimer { at, call } => self.timers.push(at, TimerEv::Env(call)),
                Action::Finished(sample) => {
                    // Refusals are counted by the buffer (replays, duplicates); an invalid
                    // trajectory is an engine bug worth stopping for.
                    if let Err(e @ crate::buffer::BufferError::Invalid(_)) =
                        self.buffer.insert(*sample)
                    {
                        return Err(RunError::Engine {
                            replica: 0,
                            message: format!("a trajectory failed validation: {e}"),
                        });
                    }
                }
                Action::Span(s) => self.trace.spans.push(s),
            }
        }
        Ok(())
    }

    /// Stops: abandons what is in flight, waits for busy lanes, takes the parts back.
    fn finish(
        mut self,
        observer: &mut dyn StageObserver,
    ) -> Result<(Parts, Orchestrator, DataBuffer, StageReport), RunError> {
        self.orch.abandon_all();
        // Wall clock: let busy lanes hand back their last results before the threads stop. A
        // lane that does not answer within the heartbeat timeout is abandoned.
        if let Some(rx) = self.rx.take() {
            let mut waiting: BTreeSet<usize> = (0..self.replicas.len())
                .filter(|&i| self.replicas[i].alive && self.replicas[i].busy_since.is_some())
                .collect();
            let mut learner_busy = self.learner.busy_since.is_some();
            let bound = self
                .heartbeats
                .as_ref()
                .map(|h| Duration::from_micros(h.timeout().0));
            while !waiting.is_empty() || learner_busy {
                let msg = match bound {
                    Some(t) => rx.recv_timeout(t).ok(),
                    None => rx.recv().ok(),
                };
                match msg {
                    Some(LaneMsg::Engine(i, inc, _)) if self.replicas[i].incarnation == inc => {
                        waiting.remove(&i);
                    }
                    Some(LaneMsg::Learner(_)) => learner_busy = false,
                    Some(_) => {}
                    None => break,
                }
            }
            for i in waiting {
                let r = &mut self.replicas[i];
                r.alive = false;
                if let Exec::Thread { tx, join } = std::mem::replace(&mut r.exec, Exec::Gone) {
                    drop(tx);
                    self.abandoned.push(join);
                }
            }
        }
        // A hung lane's thread may go now; abandoned threads are never joined.
        self.hang_release = None;
        self.abandoned.clear();
        let learner = std::mem::replace(&mut self.learner.exec, Exec::Gone)
            .into_inner()
            .ok_or_else(|| RunError::Learner("the learner thread panicked".into()))?
            .learner;
        let mut engines = Vec::with_capacity(self.replicas.len());
        for i in 0..self.replicas.len() {
            let exec = std::mem::replace(&mut self.replicas[i].exec, Exec::Gone);
            let alive = self.replicas[i].alive;
            let engine = match (alive, exec.into_inner()) {
                (true, Some(rep)) => rep.engine,
                (true, None) => {
                    return Err(RunError::Engine {
                        replica: i,
                        message: "the replica's thread panicked".into(),
                    })
                }
                // Lost and not restarted yet: the next stage gets a fresh one.
                (false, _) => {
                    let (engine, _, report) =
                        self.fresh_replica(i).map_err(|message| RunError::Engine {
                            replica: i,
                            message: format!("restart at the end of the stage: {message}"),
                        })?;
                    self.orch.counters_mut().replica_restarts += 1;
                    self.sync_report(i, report, true, observer)?;
                    engine
                }
            };
            engines.push(engine);
        }
        for (i, e) in engines.iter_mut().enumerate() {
            e.abort_all().map_err(|err| RunError::Engine {
                replica: i,
                message: format!("clearing abandoned trajectories: {err}"),
            })?;
        }
        let now = self.clock.now();
        let names = self.orch.task_names();
        let tasks = names
            .iter()
            .zip(self.orch.tasks())
            .zip(self.orch.stats())
            .map(|((n, t), s)| (n.clone(), t.target_share, s.clone()))
            .collect();
        let report = StageReport {
            elapsed: now.since(self.stage_start),
            wall: self.wall_start.elapsed(),
            learner: self.totals,
            rollout: self.orch.counters().clone(),
            buffer: self.buffer.counters(),
            tasks,
            trace: self.trace,
            publications: self.published,
            events: self.events,
            inline_time: self.inline_time,
        };
        Ok((Parts { learner, engines }, self.orch, self.buffer, report))
    }
}
