//! The lanes: what a replica lane and the learner lane hold, one unit of their work (weight
//! installs, commands and one engine step; one learner step and its publication), and where
//! it runs (inline on the virtual clock, on a thread of its own on the wall clock). Changes
//! when what a unit of work does changes.

use super::scheduler::Scheduler;
use super::stage::RunError;
use crate::buffer::ReadyGroup;
use crate::clock::Micros;
use crate::engine::{Engine, EngineConfig, Event};
use crate::health::{BackendSpec, FailKind};
use crate::learner::{Learner, Publication, StepReport};
use crate::orchestrator::{EngineCmd, EngineResult};
use crate::remote::{unit, ClientError, ServerClient};
use crate::sync::lane::{Delivery, Outgoing, SyncReport, SyncSink, SyncSource};
use crate::sync::ContentHash;
use crate::trajectory::WeightVersion;
use sluice_model::ModelConfig;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What a replica lane holds.
pub(super) struct Replica {
    pub(super) engine: Engine,
    pub(super) sink: SyncSink,
    /// The injected failure, armed on the first incarnation of the configured replica.
    pub(super) fail: Option<Armed>,
}

pub(super) struct Armed {
    pub(super) at_step: u64,
    pub(super) kind: FailKind,
    /// Wall clock, `hang`: the thread blocks on this until the stage ends.
    pub(super) release: Option<Receiver<()>>,
}

/// One unit of replica work: weight installs, commands in order, then one engine step if the
/// engine has work (on the disk path the pointer is polled first).
pub(super) struct EngineWork {
    pub(super) deliveries: Vec<Delivery>,
    pub(super) cmds: Vec<EngineCmd>,
}

/// What a replica lane's thread is sent.
pub(super) enum ReplicaIn {
    Work(EngineWork),
    Ping(u64),
}

pub(super) struct EngineDone {
    pub(super) results: Vec<EngineResult>,
    pub(super) events: Vec<Event>,
    pub(super) stepped: bool,
    pub(super) prefill_tokens: u64,
    pub(super) decode_tokens: u64,
    pub(super) sampled_tokens: u64,
    pub(super) sync: Vec<SyncReport>,
    pub(super) has_work: bool,
    pub(super) error: Option<String>,
}

pub(super) enum ReplicaOutcome {
    Done(EngineDone),
    /// The injected failure struck: the lane never reports this unit.
    Failed(FailKind),
}

/// A replica lane's component: an engine in this process, or a `sluice serve` process driven
/// over HTTP ([`crate::remote`]).
pub(super) enum ReplicaWorker {
    Local(Box<Replica>),
    Remote(ServerClient),
}

impl ReplicaWorker {
    /// The version it runs on (None: nothing installed yet).
    pub(super) fn version(&self) -> Option<WeightVersion> {
        match self {
            ReplicaWorker::Local(r) => r.sink.version(),
            ReplicaWorker::Remote(c) => c.version(),
        }
    }

    pub(super) fn hash(&self) -> Option<ContentHash> {
        match self {
            ReplicaWorker::Local(r) => r.sink.hash(),
            ReplicaWorker::Remote(c) => c.hash(),
        }
    }

    /// Answers heartbeat `seq` (a server is asked: one that does not answer, or another
    /// process than the one joined, leaves it unanswered).
    fn pong(&self, seq: u64) -> Option<u64> {
        match self {
            ReplicaWorker::Local(_) => Some(seq),
            ReplicaWorker::Remote(c) => c.health().ok().map(|()| seq),
        }
    }
}

impl EngineDone {
    fn empty(cmds: usize) -> EngineDone {
        EngineDone {
            results: Vec::with_capacity(cmds),
            events: Vec::new(),
            stepped: false,
            prefill_tokens: 0,
            decode_tokens: 0,
            sampled_tokens: 0,
            sync: Vec::new(),
            has_work: false,
            error: None,
        }
    }
}

pub(super) fn replica_run(w: &mut ReplicaWorker, work: EngineWork) -> ReplicaOutcome {
    match w {
        ReplicaWorker::Local(r) => local_run(r, work),
        ReplicaWorker::Remote(c) => remote_run(c, work),
    }
}

fn local_run(r: &mut Replica, work: EngineWork) -> ReplicaOutcome {
    let mut done = EngineDone::empty(work.cmds.len());
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
    done.results = unit::apply_commands(&mut r.engine, work.cmds);
    if r.engine.has_work() {
        if let Some(f) = &r.fail {
            if r.engine.stats().steps + 1 >= f.at_step {
                return ReplicaOutcome::Failed(f.kind);
            }
        }
    }
    fill(&mut done, unit::step_once(&mut r.engine));
    ReplicaOutcome::Done(done)
}

fn fill(done: &mut EngineDone, s: unit::Stepped) {
    done.events = s.events;
    done.stepped = s.stepped;
    done.prefill_tokens = s.prefill_tokens;
    done.decode_tokens = s.decode_tokens;
    done.sampled_tokens = s.sampled_tokens;
    done.has_work = s.has_work;
    done.error = s.error;
}

/// The same unit of work on a server: each delivery by `POST /weights`, then the commands and
/// one engine step by `POST /lane/step`. A server that does not answer (or restarted) makes
/// the lane go silent like a dead in-process replica: heartbeats declare it lost.
fn remote_run(c: &mut ServerClient, work: EngineWork) -> ReplicaOutcome {
    let mut done = EngineDone::empty(work.cmds.len());
    let mut refused = false;
    for d in work.deliveries {
        let Delivery::Bytes(p) = &d else {
            done.error = Some(format!(
                "internal: an in-process delivery of {} reached a server",
                d.version()
            ));
            return ReplicaOutcome::Done(done);
        };
        if refused && p.is_delta() {
            done.sync.push(SyncReport::Skipped { version: p.version });
            continue;
        }
        match c.install(p) {
            Ok(report) => {
                refused |= matches!(report, SyncReport::Refused { .. });
                done.sync.push(report);
            }
            Err(ClientError::Lost(_)) => return ReplicaOutcome::Failed(FailKind::Die),
            Err(ClientError::Protocol(m)) => {
                done.error = Some(m);
                return ReplicaOutcome::Done(done);
            }
        }
    }
    let answer = match c.step(work.cmds) {
        Ok(a) => a,
        Err(ClientError::Lost(_)) => return ReplicaOutcome::Failed(FailKind::Die),
        Err(ClientError::Protocol(m)) => {
            done.error = Some(m);
            return ReplicaOutcome::Done(done);
        }
    };
    done.results = answer.results.into_iter().map(EngineResult::from).collect();
    fill(
        &mut done,
        unit::Stepped {
            events: answer.events.into_iter().map(Event::from).collect(),
            stepped: answer.stepped,
            prefill_tokens: answer.prefill_tokens,
            decode_tokens: answer.decode_tokens,
            sampled_tokens: answer.sampled_tokens,
            has_work: answer.has_work,
            error: answer.error,
        },
    );
    ReplicaOutcome::Done(done)
}

/// What the learner lane holds: the learner and its side of weight sync.
pub(super) struct LearnerSide {
    pub(super) learner: Learner,
    pub(super) source: SyncSource,
}

pub(super) struct LearnerWork {
    pub(super) groups: Vec<ReadyGroup>,
    pub(super) publish: bool,
    pub(super) reset_optimizer: bool,
    /// Per replica, the version it will hold when this publication reaches it.
    pub(super) bases: Vec<Option<WeightVersion>>,
}

pub(super) struct LearnerDone {
    pub(super) report: Result<StepReport, String>,
    pub(super) publication: Option<Arc<Publication>>,
    /// What the sync path made of the publication (None on the virtual clock until the
    /// learner's timer fires: files appear on disk only when the step is over on the run
    /// clock).
    pub(super) outgoing: Option<Result<Outgoing, String>>,
}

pub(super) fn learner_run(
    side: &mut LearnerSide,
    work: &LearnerWork,
    send_now: bool,
) -> LearnerDone {
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
pub(super) enum LaneMsg {
    Engine(usize, u64, Box<EngineDone>),
    Pong(usize, u64, u64),
    Learner(Box<LearnerDone>),
}

/// Where a component runs: inline (virtual clock) or on its own thread (wall clock).
pub(super) enum Exec<W, In> {
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
    ///
    /// `pin`: the lane runs on a one-thread pool of its own pinned to that CPU, so its CPU ops
    /// (which split work over the current pool, kernels/src/par.rs) stay on that core.
    fn spawn(
        mut worker: W,
        name: String,
        out: Sender<LaneMsg>,
        pin: Option<usize>,
        mut run: impl FnMut(&mut W, In) -> Option<LaneMsg> + Send + 'static,
    ) -> Result<Exec<W, In>, RunError> {
        let (tx, rx) = channel::<In>();
        let pool = pin.map(|cpu| pinned_pool(&name, cpu)).transpose()?;
        let lane = move || {
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
        };
        let join = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || match pool {
                Some(pool) => pool.install(lane),
                None => lane(),
            })
            .map_err(|e| RunError::Stalled(format!("cannot start thread {name}: {e}")))?;
        Ok(Exec::Thread { tx, join })
    }

    /// The component, running inline from now on (a thread lane is stopped and joined).
    pub(super) fn make_inline(&mut self) -> Option<&mut W> {
        if let Exec::Thread { .. } = self {
            let w = std::mem::replace(self, Exec::Gone).into_inner()?;
            *self = Exec::Inline(w);
        }
        match self {
            Exec::Inline(w) => Some(w),
            _ => None,
        }
    }

    pub(super) fn into_inner(self) -> Option<W> {
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
pub(super) struct ReplicaSpec {
    pub(super) backend: BackendSpec,
    pub(super) model: ModelConfig,
    pub(super) engine: EngineConfig,
}

pub(super) struct ReplicaLane {
    pub(super) exec: Exec<ReplicaWorker, ReplicaIn>,
    pub(super) pending: Vec<EngineCmd>,
    pub(super) deliveries: Vec<Delivery>,
    /// Run a unit of work even with nothing queued (the disk path's poll after a
    /// publication).
    pub(super) wake: bool,
    pub(super) busy_since: Option<Micros>,
    pub(super) has_work: bool,
    /// Inline result waiting for its timer.
    pub(super) done: Option<EngineDone>,
    /// Bumped when the replica is lost: older results and timers are ignored.
    pub(super) incarnation: u64,
    pub(super) alive: bool,
    /// The version it will hold once its queued deliveries are installed (the base of its
    /// next delta).
    pub(super) expected: Option<WeightVersion>,
    /// The version it reported installed last.
    pub(super) installed: Option<WeightVersion>,
    /// When it was lost (for the restart's trace span).
    pub(super) lost_at: Option<Micros>,
    pub(super) restart_attempts: u32,
    /// A server lane: why its client last found it lost (see [`ServerClient::lost_because`]).
    pub(super) lost_because: Option<Arc<std::sync::Mutex<Option<String>>>>,
}

impl ReplicaLane {
    pub(super) fn new(replica: ReplicaWorker) -> ReplicaLane {
        let v = replica.version();
        let lost_because = match &replica {
            ReplicaWorker::Remote(c) => Some(c.lost_because()),
            ReplicaWorker::Local(_) => None,
        };
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
            lost_because,
        }
    }

    pub(super) fn idle(&self) -> bool {
        self.busy_since.is_none()
            && self.pending.is_empty()
            && self.deliveries.is_empty()
            && !self.wake
            && !self.has_work
    }
}

pub(super) struct LearnerLane {
    pub(super) exec: Exec<LearnerSide, LearnerWork>,
    pub(super) busy_since: Option<Micros>,
    pub(super) done: Option<LearnerDone>,
    /// Inline: the replicas' bases of the step in flight (its publication is sent when its
    /// timer fires).
    pub(super) bases: Option<Vec<Option<WeightVersion>>>,
    /// Task names of the groups in the step being computed.
    pub(super) tasks: Vec<String>,
    /// Version of the learner (steps done), known without asking the lane.
    pub(super) steps: u64,
}

/// A one-thread pool whose thread is pinned to `cpu` (`run.pin_lanes`).
pub(super) fn pinned_pool(lane: &str, cpu: usize) -> Result<rayon::ThreadPool, RunError> {
    let core = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.id == cpu)
        .ok_or_else(|| {
            RunError::Config(format!(
                "run.pin_lanes: lane {lane} cannot be pinned to CPU {cpu}: this process may not \
                 run there"
            ))
        })?;
    let name = format!("{lane}-cpu{cpu}");
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .thread_name(move |_| name.clone())
        .start_handler(move |_| {
            // Checked above that the process may run there; a refusal leaves the thread
            // unpinned (it still runs its ops alone).
            let _ = core_affinity::set_for_current(core);
        })
        .build()
        .map_err(|e| RunError::Config(format!("run.pin_lanes: lane {lane}: {e}")))
}

/// The CPUs of `run.pin_lanes`: the replica lanes' and the learner lane's.
fn lane_cpus() -> (usize, usize) {
    let cpus = core_affinity::get_core_ids().unwrap_or_default();
    let first = cpus.iter().map(|c| c.id).min().unwrap_or(0);
    let last = cpus.iter().map(|c| c.id).max().unwrap_or(0);
    (first, last)
}

impl Scheduler<'_> {
    /// Wall clock: moves every lane onto its own thread.
    pub(super) fn start_threads(&mut self) -> Result<(), RunError> {
        for i in 0..self.replicas.len() {
            self.start_replica_thread(i)?;
        }
        if let Exec::Inline(_) = self.learner.exec {
            let Exec::Inline(l) = std::mem::replace(&mut self.learner.exec, Exec::Gone) else {
                unreachable!("matched just above")
            };
            let pin = self.cfg.pin_lanes.then(|| lane_cpus().1);
            self.learner.exec = Exec::spawn(
                l,
                "sluice-learner".into(),
                self.lane_tx.clone(),
                pin,
                |l, w| Some(LaneMsg::Learner(Box::new(learner_run(l, &w, true)))),
            )?;
        }
        Ok(())
    }

    pub(super) fn start_replica_thread(&mut self, i: usize) -> Result<(), RunError> {
        let r = &mut self.replicas[i];
        if !matches!(r.exec, Exec::Inline(_)) {
            return Ok(());
        }
        let Exec::Inline(e) = std::mem::replace(&mut r.exec, Exec::Gone) else {
            unreachable!("matched just above")
        };
        let incarnation = r.incarnation;
        let pin = self.cfg.pin_lanes.then(|| lane_cpus().0);
        r.exec = Exec::spawn(
            e,
            format!("sluice-engine-{i}"),
            self.lane_tx.clone(),
            pin,
            move |rep: &mut ReplicaWorker, input| match input {
                ReplicaIn::Ping(seq) => rep.pong(seq).map(|seq| LaneMsg::Pong(i, incarnation, seq)),
                ReplicaIn::Work(w) => match replica_run(rep, w) {
                    ReplicaOutcome::Done(d) => Some(LaneMsg::Engine(i, incarnation, Box::new(d))),
                    ReplicaOutcome::Failed(kind) => {
                        if kind == FailKind::Hang {
                            // Blocks until the stage ends and drops the sender (a real hang
                            // would block for ever; the scheduler never waits for it).
                            let fail = match rep {
                                ReplicaWorker::Local(r) => r.fail.as_mut(),
                                ReplicaWorker::Remote(_) => None,
                            };
                            if let Some(rx) = fail.and_then(|f| f.release.take()) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPUs the calling thread may run on, from /proc (None: not Linux).
    fn allowed_cpus() -> Option<String> {
        let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
        let line = status
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))?;
        Some(line.split_whitespace().nth(1)?.to_string())
    }

    #[test]
    fn a_pinned_pool_runs_its_ops_on_one_thread_on_its_cpu() {
        let (first, last) = lane_cpus();
        for cpu in [first, last] {
            let pool = pinned_pool("test", cpu).unwrap();
            let (threads, allowed) =
                pool.install(|| (rayon::current_num_threads(), allowed_cpus()));
            assert_eq!(threads, 1);
            if let Some(allowed) = allowed {
                assert_eq!(allowed, cpu.to_string());
            }
        }
        match pinned_pool("test", usize::MAX) {
            Err(RunError::Config(m)) => assert!(m.contains("run.pin_lanes"), "{m}"),
            other => panic!("expected a config error, got {:?}", other.map(|_| ())),
        }
    }
}
