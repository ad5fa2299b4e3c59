//! The RL system on one scheduler (DESIGN 6.7): engine replicas, environments, the data
//! buffer and the learner, joined by messages and driven by one event loop over the run clock.
//!
//! Flow (DESIGN 6.8): the orchestrator admits groups -> `EngineCmd::Submit` to a replica lane
//! -> engine events (turn ended / finished) -> environment calls (timers) -> observations back
//! to the engine or the end of the trajectory -> the finished `Sample` into the buffer -> ready
//! groups to the learner lane -> a `Publication` every K steps -> `EngineCmd::Swap` to every
//! replica.
//!
//! Lanes. Each engine replica and the learner is a *lane*: it holds its component and takes
//! one unit of work at a time (a batch of commands plus one engine step; one learner step). On
//! the wall clock a lane is a thread and its result arrives on a channel when it is done. On
//! the virtual clock (replay) the lane runs its work inline, and its result is delivered by a
//! timer at start + the cost model's charge; the loop always handles the earliest event, so
//! the interleaving is decided by the clock and never by thread timing, and a run with a seed
//! replays bit for bit.
//!
//! Modes. `async`: rollout and learner run concurrently; rollout may start a trajectory only
//! within the backpressure room ([`Admission`], eta steps ahead); the learner takes
//! `groups_per_step` gated groups whenever that many are ready. `sync` (the baseline): a
//! batch of `groups_per_step` groups is rolled out, all of it finishes, the learner takes every
//! group that passes the gates and steps, the weights are published, and the next batch starts.

use crate::buffer::{Admission, BufferCounters, DataBuffer, ReadyGroup};
use crate::clock::{Clock, ClockMode, CostModel, Micros, Timers};
use crate::engine::{Engine, Event};
use crate::learner::{Learner, Publication, StepReport};
use crate::metrics::{metrics_line, LearnerTotals, LineInputs, RolloutCounters, Trace, Track};
use crate::orchestrator::{
    Action, EngineCmd, EngineResult, EnvCall, Orchestrator, OrchestratorError, Pace, TaskStats,
};
use crate::router::{ReplicaId, Router};
use crate::trajectory::WeightVersion;
use serde_json::Value;
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
}

/// What a running stage tells its owner.
pub trait StageObserver {
    /// After every learner step: its metrics line (DESIGN 9) and report.
    fn on_step(&mut self, line: &Value, report: &StepReport) -> Result<(), String>;

    /// The groups a learner step is about to train on (the loss's inputs), before it starts.
    fn on_learner_batch(&mut self, _groups: &[ReadyGroup]) {}

    /// After every event the scheduler handled: the admission figures at that moment.
    fn on_tick(&mut self, _tick: &Tick) {}

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
    pub buffer: &'a DataBuffer,
    pub orchestrator: &'a Orchestrator,
    pub totals: &'a LearnerTotals,
    /// The weights every replica holds (the last publication, or the stage's start weights).
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
}

// ---------------------------------------------------------------------------------------------
// Lanes.

/// One unit of engine work: commands in order, then one step if the engine has work.
struct EngineWork {
    cmds: Vec<EngineCmd>,
}

struct EngineDone {
    results: Vec<EngineResult>,
    events: Vec<Event>,
    stepped: bool,
    prefill_tokens: u64,
    decode_tokens: u64,
    sampled_tokens: u64,
    swaps: u64,
    has_work: bool,
    error: Option<String>,
}

fn engine_run(engine: &mut Engine, work: EngineWork) -> EngineDone {
    let mut results = Vec::with_capacity(work.cmds.len());
    let mut swaps = 0;
    for cmd in work.cmds {
        results.push(match cmd {
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
            EngineCmd::Swap(p) => {
                swaps += 1;
                EngineResult::Swapped(
                    engine
                        .swap_weights(&p.params, p.version, None)
                        .map_err(|e| e.to_string()),
                )
            }
        });
    }
    let before = engine.stats();
    let mut done = EngineDone {
        results,
        events: Vec::new(),
        stepped: false,
        prefill_tokens: 0,
        decode_tokens: 0,
        sampled_tokens: 0,
        swaps,
        has_work: false,
        error: None,
    };
    if engine.has_work() {
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
    done
}

struct LearnerWork {
    groups: Vec<ReadyGroup>,
    publish: bool,
    reset_optimizer: bool,
}

struct LearnerDone {
    report: Result<StepReport, String>,
    publication: Option<Arc<Publication>>,
}

fn learner_run(learner: &mut Learner, work: LearnerWork) -> LearnerDone {
    let report = learner.train(&work.groups).map_err(|e| e.to_string());
    let mut publication = None;
    let mut report = report;
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
    LearnerDone {
        report,
        publication,
    }
}

/// A lane's result on the wall clock.
enum LaneMsg {
    Engine(usize, Box<EngineDone>),
    Learner(Box<LearnerDone>),
}

/// Where a component runs: inline (virtual clock) or on its own thread (wall clock).
enum Exec<W, In> {
    Inline(W),
    Thread {
        tx: Sender<In>,
        join: JoinHandle<W>,
    },
    /// Taken back (between the end of the loop and the return).
    Gone,
}

impl<W: Send + 'static, In: Send + 'static> Exec<W, In> {
    fn spawn(
        mut worker: W,
        name: String,
        out: Sender<LaneMsg>,
        mut run: impl FnMut(&mut W, In) -> LaneMsg + Send + 'static,
    ) -> Result<Exec<W, In>, RunError> {
        let (tx, rx) = channel::<In>();
        let join = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                // Ends when the scheduler drops its sender; gives the component back.
                while let Ok(work) = rx.recv() {
                    if out.send(run(&mut worker, work)).is_err() {
                        break;
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

struct ReplicaLane {
    exec: Exec<Engine, EngineWork>,
    pending: Vec<EngineCmd>,
    busy_since: Option<Micros>,
    has_work: bool,
    /// Inline result waiting for its timer.
    done: Option<EngineDone>,
}

struct LearnerLane {
    exec: Exec<Learner, LearnerWork>,
    busy_since: Option<Micros>,
    done: Option<LearnerDone>,
    /// Task names of the groups in the step being computed.
    tasks: Vec<String>,
    /// Version of the learner (steps done), known without asking the lane.
    steps: u64,
}

#[derive(Debug)]
enum TimerEv {
    Env(EnvCall),
    EngineDone(usize),
    LearnerDone,
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

/// Publications on their way to the replicas: (version, published at, replicas left).
struct InFlightPublication {
    version: WeightVersion,
    start: Micros,
    left: usize,
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
    let (parts, orch, buffer, report) = s.finish()?;
    outcome?;
    Ok((parts, orch, buffer, report))
}

struct Scheduler<'a> {
    cfg: &'a StageConfig,
    clock: Clock,
    stage_start: Micros,
    wall_start: Instant,
    timers: Timers<TimerEv>,
    replicas: Vec<ReplicaLane>,
    learner: LearnerLane,
    router: Router,
    rx: Option<Receiver<LaneMsg>>,
    /// Where lane threads send their results (kept to start threads again after a barrier).
    lane_tx: Sender<LaneMsg>,
    orch: Orchestrator,
    buffer: DataBuffer,
    totals: LearnerTotals,
    /// The weights every replica holds once its queued swaps are applied.
    engine_weights: Arc<Publication>,
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

impl<'a> Scheduler<'a> {
    fn new(
        cfg: &'a StageConfig,
        parts: Parts,
        orch: Orchestrator,
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
        let wall = cfg.clock == ClockMode::Wall;
        let (tx, rx) = channel::<LaneMsg>();
        let steps = parts.learner.version().0;
        let n = parts.engines.len();
        let mut replicas = Vec::with_capacity(n);
        for e in parts.engines {
            replicas.push(ReplicaLane {
                exec: Exec::Inline(e),
                pending: Vec::new(),
                busy_since: None,
                has_work: false,
                done: None,
            });
        }
        let learner = LearnerLane {
            exec: Exec::Inline(parts.learner),
            busy_since: None,
            done: None,
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
        let mut sched = Scheduler {
            cfg,
            clock: Clock::new(cfg.clock, start.clock),
            stage_start: start.stage_began.min(start.clock),
            wall_start: Instant::now(),
            timers: Timers::default(),
            replicas,
            learner,
            router,
            rx: if wall { Some(rx) } else { None },
            lane_tx: tx,
            orch,
            buffer,
            totals: start.totals,
            engine_weights: start.engine_weights,
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
        };
        if wall {
            sched.start_threads()?;
        }
        Ok(sched)
    }

    /// Wall clock: moves every lane onto its own thread.
    fn start_threads(&mut self) -> Result<(), RunError> {
        for (i, r) in self.replicas.iter_mut().enumerate() {
            if let Exec::Inline(_) = r.exec {
                let Exec::Inline(e) = std::mem::replace(&mut r.exec, Exec::Gone) else {
                    unreachable!("matched just above")
                };
                r.exec = Exec::spawn(
                    e,
                    format!("sluice-engine-{i}"),
                    self.lane_tx.clone(),
                    move |e, w| LaneMsg::Engine(i, Box::new(engine_run(e, w))),
                )?;
            }
        }
        if let Exec::Inline(_) = self.learner.exec {
            let Exec::Inline(l) = std::mem::replace(&mut self.learner.exec, Exec::Gone) else {
                unreachable!("matched just above")
            };
            self.learner.exec =
                Exec::spawn(l, "sluice-learner".into(), self.lane_tx.clone(), |l, w| {
                    LaneMsg::Learner(Box::new(learner_run(l, w)))
                })?;
        }
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

    /// Nothing is running or pending: no timer, no busy lane, no queued command.
    fn quiescent(&self) -> bool {
        self.timers.is_empty()
            && self.learner.busy_since.is_none()
            && self
                .replicas
                .iter()
                .all(|r| r.busy_since.is_none() && r.pending.is_empty() && !r.has_work)
            && self.orch.in_flight() == 0
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
        for r in &mut self.replicas {
            let e = r.exec.make_inline().ok_or_else(|| RunError::Engine {
                replica: 0,
                message: "a replica thread panicked".into(),
            })?;
            // Identical state in a run resumed from here: nothing cached from before.
            e.reset_prefix_cache();
        }
        if self.learner.exec.make_inline().is_none() {
            return Err(RunError::Learner("the learner thread panicked".into()));
        }
        {
            let learner = match &self.learner.exec {
                Exec::Inline(l) => l,
                _ => return Err(RunError::Learner("the learner is gone".into())),
            };
            let engines: Vec<&Engine> = self
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
                    engines,
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

    fn admit(&mut self) -> Result<(), RunError> {
        if self.at_barrier() || self.totals.steps >= self.target_steps() {
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
        let mut route = |session: &str| router.route(session).map_or(0, |r| r.0 as usize);
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
        let work = LearnerWork {
            publish: next_step.is_multiple_of(self.cfg.sync_interval),
            reset_optimizer: self.cfg.reset_optimizer,
            groups,
        };
        self.learner.tasks = work.groups.iter().map(|g| g.task.clone()).collect();
        let now = self.clock.now();
        self.learner.busy_since = Some(now);
        match &mut self.learner.exec {
            Exec::Inline(l) => {
                let publish = work.publish;
                let done = learner_run(l, work);
                let mut cost = self.cfg.cost.learner_step(tokens);
                if publish {
                    cost = cost.plus(self.cfg.cost.publish());
                }
                self.learner.done = Some(done);
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
            if r.busy_since.is_some() || (r.pending.is_empty() && !r.has_work) {
                continue;
            }
            let work = EngineWork {
                cmds: std::mem::take(&mut r.pending),
            };
            r.busy_since = Some(now);
            match &mut r.exec {
                Exec::Inline(e) => {
                    let done = engine_run(e, work);
                    let mut cost = if done.stepped {
                        self.cfg
                            .cost
                            .engine_step(done.prefill_tokens, done.decode_tokens)
                    } else {
                        Micros(0)
                    };
                    for _ in 0..done.swaps {
                        cost = cost.plus(self.cfg.cost.publish());
                    }
                    r.done = Some(done);
                    self.timers.push(now.plus(cost), TimerEv::EngineDone(i));
                }
                Exec::Thread { tx, .. } => {
                    tx.send(work).map_err(|_| RunError::Engine {
                        replica: i,
                        message: "the replica's thread ended".into(),
                    })?;
                }
                Exec::Gone => {
                    return Err(RunError::Engine {
                        replica: i,
                        message: "the replica is gone".into(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Waits for the next event (the earliest timer on the virtual clock; a lane message or
    /// a due timer on the wall clock) and handles it.
    fn wait_and_handle(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        if self.clock.is_virtual() {
            let (at, ev) = self
                .timers
                .pop()
                .ok_or_else(|| RunError::Stalled(self.stall_report()))?;
            self.clock.advance_to(at);
            return self.handle_timer(ev, observer);
        }
        let now = self.clock.now();
        if let Some((_, ev)) = self.timers.pop_due(now) {
            return self.handle_timer(ev, observer);
        }
        let timeout = self
            .timers
            .next_due()
            .map(|t| self.clock.wait_until(t))
            .unwrap_or(Duration::from_secs(3600));
        let rx = self
            .rx
            .as_ref()
            .ok_or_else(|| RunError::Stalled("no lane channel on the wall clock".into()))?;
        match rx.recv_timeout(timeout) {
            Ok(LaneMsg::Engine(i, done)) => self.engine_done(i, *done),
            Ok(LaneMsg::Learner(done)) => self.learner_done(*done, observer),
            Err(RecvTimeoutError::Timeout) => Ok(()),
            Err(RecvTimeoutError::Disconnected) => {
                Err(RunError::Stalled("every lane thread ended".into()))
            }
        }
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
            TimerEv::EngineDone(i) => {
                let done = self.replicas[i]
                    .done
                    .take()
                    .ok_or_else(|| RunError::Engine {
                        replica: i,
                        message: "internal: no result for its timer".into(),
                    })?;
                self.engine_done(i, done)
            }
            TimerEv::LearnerDone => {
                let done =
                    self.learner.done.take().ok_or_else(|| {
                        RunError::Learner("internal: no result for its timer".into())
                    })?;
                self.learner_done(done, observer)
            }
        }
    }

    fn engine_done(&mut self, i: usize, done: EngineDone) -> Result<(), RunError> {
        let now = self.clock.now();
        if let Some(message) = done.error {
            return Err(RunError::Engine {
                replica: i,
                message,
            });
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
        let mut actions = Vec::new();
        for res in done.results {
            if matches!(res, EngineResult::Swapped(_)) {
                self.swap_applied(now);
            }
            actions.extend(self.orch.on_result(i, res, now)?);
        }
        for ev in done.events {
            actions.extend(self.orch.on_event(i, ev, now)?);
        }
        self.apply(actions)
    }

    /// One replica installed the oldest publication in flight.
    fn swap_applied(&mut self, now: Micros) {
        if let Some(p) = self.publications.first_mut() {
            p.left -= 1;
            if p.left == 0 {
                let p = self.publications.remove(0);
                self.trace.push(
                    Track::Sync,
                    format!("publish {}", p.version),
                    p.start,
                    now,
                    vec![("version".into(), p.version.0.to_string())],
                );
            }
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
        if let Some(p) = done.publication {
            let bytes = (p.params.tensor().numel() * 4) as u64;
            self.published += 1;
            let c = self.orch.counters_mut();
            c.publications += 1;
            c.sync_bytes += bytes * self.replicas.len() as u64;
            sync = Some((bytes * self.replicas.len() as u64, "inprocess"));
            self.publications.push(InFlightPublication {
                version: p.version,
                start: now,
                left: self.replicas.len(),
            });
            for r in &mut self.replicas {
                r.pending.push(EngineCmd::Swap(p.clone()));
            }
            self.engine_weights = p;
        }
        if self.cfg.mode == Mode::Sync {
            self.phase = SyncPhase::Start;
        }
        let tasks = self.orch.task_names();
        let line = metrics_line(&LineInputs {
            stage: &self.cfg.name,
            time_s: now.since(self.stage_start).secs(),
            wall_s: self.wall_start.elapsed().as_secs_f64(),
            step: &report,
            learner: &self.totals,
            rollout: self.orch.counters(),
            buffer: &self.buffer.counters(),
            tasks: &tasks,
            sync,
        });
        observer.on_step(&line, &report).map_err(RunError::Observer)
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
                Action::Finished(mut sample) => {
                    sample.clocks.learner_step = self.learner.steps;
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
    fn finish(mut self) -> Result<(Parts, Orchestrator, DataBuffer, StageReport), RunError> {
        self.orch.abandon_all();
        // Wall clock: let busy lanes hand back their last results before the threads stop.
        if let Some(rx) = self.rx.take() {
            let mut busy = self
                .replicas
                .iter()
                .filter(|r| r.busy_since.is_some())
                .count()
                + usize::from(self.learner.busy_since.is_some());
            while busy > 0 {
                match rx.recv() {
                    Ok(_) => busy -= 1,
                    Err(_) => break,
                }
            }
        }
        let learner = std::mem::replace(&mut self.learner.exec, Exec::Gone)
            .into_inner()
            .ok_or_else(|| RunError::Learner("the learner thread panicked".into()))?;
        let mut engines = Vec::with_capacity(self.replicas.len());
        for (i, r) in self.replicas.iter_mut().enumerate() {
            engines.push(
                std::mem::replace(&mut r.exec, Exec::Gone)
                    .into_inner()
                    .ok_or_else(|| RunError::Engine {
                        replica: i,
                        message: "the replica's thread panicked".into(),
                    })?,
            );
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
        };
        Ok((Parts { learner, engines }, self.orch, self.buffer, report))
    }
}
