//! The scheduler's state: built from the stage's parts and settings at the start (every
//! setting checked before anything runs), and taken apart at the end (busy lanes drained,
//! the parts and the report handed back). Changes when the scheduler holds something new.

use super::event_loop::{SyncPhase, TimerEv};
use super::lanes::{
    Armed, Exec, LaneMsg, LearnerLane, LearnerSide, Replica, ReplicaLane, ReplicaSpec,
    ReplicaWorker,
};
use super::publication::InFlightPublication;
use super::stage::{Parts, RunError, StageConfig, StageObserver, StageReport, StageStart};
use crate::buffer::{Admission, DataBuffer};
use crate::clock::{Clock, ClockMode, Micros, Timers};
use crate::health::{BackendSpec, Heartbeats};
use crate::learner::Publication;
use crate::metrics::{LearnerTotals, Trace};
use crate::orchestrator::Orchestrator;
use crate::remote::ServerClient;
use crate::router::{ReplicaId, Router};
use crate::sync::lane::{StartImage, SyncPath, SyncSink, SyncSource};
use crate::sync::{ContentHash, DiskPublication};
use crate::trajectory::WeightVersion;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(super) struct Scheduler<'a> {
    pub(super) cfg: &'a StageConfig,
    /// Events handled, and wall time spent in inline lanes (the StageReport's figures).
    pub(super) events: u64,
    pub(super) inline_time: Duration,
    pub(super) clock: Clock,
    pub(super) stage_start: Micros,
    pub(super) wall_start: Instant,
    pub(super) timers: Timers<TimerEv>,
    pub(super) replicas: Vec<ReplicaLane>,
    pub(super) specs: Vec<ReplicaSpec>,
    pub(super) learner: LearnerLane,
    pub(super) router: Router,
    pub(super) rx: Option<Receiver<LaneMsg>>,
    /// Where lane threads send their results (kept to start threads again after a barrier).
    pub(super) lane_tx: Sender<LaneMsg>,
    pub(super) orch: Orchestrator,
    pub(super) buffer: DataBuffer,
    pub(super) totals: LearnerTotals,
    /// The weights every replica holds once its queued installs are done.
    pub(super) engine_weights: Arc<Publication>,
    /// blake3 of each version published in this stage (the start weights included).
    pub(super) published_hashes: BTreeMap<WeightVersion, ContentHash>,
    /// Delta path: the newest full image (for refusals and restarts).
    pub(super) latest_full: Option<Arc<crate::sync::Publication>>,
    /// Disk path: the newest file and its bytes, and whether it was rewritten already.
    pub(super) disk_last: Option<(DiskPublication, Arc<[u8]>)>,
    pub(super) disk_repaired: Option<WeightVersion>,
    pub(super) heartbeats: Option<Heartbeats>,
    /// Wall clock, injected hang: dropping it releases the hung thread.
    pub(super) hang_release: Option<Sender<()>>,
    /// Threads of lost lanes, never joined (a hung one may never end).
    pub(super) abandoned: Vec<JoinHandle<ReplicaWorker>>,
    pub(super) trace: Trace,
    pub(super) phase: SyncPhase,
    pub(super) admission: Admission,
    pub(super) group_size: u64,
    pub(super) publications: Vec<InFlightPublication>,
    pub(super) published: u64,
    /// The learner step count at which the next barrier happens.
    pub(super) next_barrier: Option<u64>,
    /// Sync mode: consecutive batches of which no group passed the gates.
    pub(super) empty_batches: u32,
    /// Replicas lost since the last learner step completed.
    pub(super) losses_since_step: u64,
}

impl<'a> Scheduler<'a> {
    pub(super) fn new(
        cfg: &'a StageConfig,
        parts: Parts,
        mut orch: Orchestrator,
        buffer: DataBuffer,
        start: StageStart,
    ) -> Result<Scheduler<'a>, RunError> {
        if parts.engines.is_empty() && cfg.servers.is_empty() {
            return Err(RunError::Stalled("no engine replica".into()));
        }
        check_servers(cfg, parts.engines.len())?;
        if cfg.pin_lanes && cfg.clock == crate::clock::ClockMode::Virtual {
            return Err(RunError::Config(
                "run.pin_lanes needs the wall clock (run.replay = false): on the virtual clock \
                 the lanes run inline on the scheduler's thread"
                    .into(),
            ));
        }
        if cfg.groups_per_step == 0 || cfg.sync_interval == 0 {
            return Err(RunError::Stalled(
                "groups_per_step and sync_interval must be >= 1".into(),
            ));
        }
        // GRPO advantages are normalised within a group: a group of one has advantage 0 and
        // the stage would train nothing while its throughput looked fine (unless the learner
        // distils from teachers, whose per-token signal needs no group).
        if buffer.config().group_size < 2 && parts.learner.needs_groups() {
            return Err(RunError::Config(format!(
                "buffer.group_size = {}: the learner's advantages are normalised within each \
                 group, so a group of one has advantage 0 and trains nothing; use 2 or more",
                buffer.config().group_size
            )));
        }
        let n = parts.engines.len().max(cfg.servers.len());
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
            replicas.push(ReplicaLane::new(ReplicaWorker::Local(Box::new(Replica {
                engine: e,
                sink,
                fail,
            }))));
        }
        if let Some(full) = &latest_full {
            for (i, url) in cfg.servers.iter().enumerate() {
                replicas.push(ReplicaLane::new(ReplicaWorker::Remote(join_server(
                    cfg, i, url, full,
                )?)));
            }
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
            losses_since_step: 0,
            events: 0,
            inline_time: Duration::ZERO,
        };
        if wall {
            sched.start_threads()?;
        }
        Ok(sched)
    }

    /// Stops: abandons what is in flight, waits for busy lanes, takes the parts back.
    pub(super) fn finish(
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
            if !self.cfg.servers.is_empty() {
                // A server keeps its engine; the next stage joins it again.
                continue;
            }
            let engine = match (alive, exec.into_inner()) {
                (true, Some(ReplicaWorker::Local(rep))) => rep.engine,
                (true, Some(ReplicaWorker::Remote(_))) => {
                    return Err(RunError::Engine {
                        replica: i,
                        message: "internal: a server lane in a stage without servers".into(),
                    })
                }
                (true, None) => {
                    return Err(RunError::Engine {
                        replica: i,
                        message: "the replica's thread panicked".into(),
                    })
                }
                // Lost and not restarted yet: the next stage gets a fresh one.
                (false, _) => {
                    let (engine, _, report) =
                        self.fresh_engine(i).map_err(|message| RunError::Engine {
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

/// The settings a stage with servers needs (named as the config keys that set them).
fn check_servers(cfg: &StageConfig, engines: usize) -> Result<(), RunError> {
    if cfg.servers.is_empty() {
        return Ok(());
    }
    let refuse = |m: String| Err(RunError::Config(m));
    if engines > 0 {
        return refuse(format!(
            "rollout.servers lists {} server(s) and the stage was also given {engines} \
             in-process engine(s): a stage runs on one or the other",
            cfg.servers.len()
        ));
    }
    if cfg.clock != ClockMode::Wall {
        return refuse(
            "run.replay = true (the virtual clock) cannot drive rollout.servers: a server's \
             steps take wall time the run clock cannot charge; use the wall clock or \
             in-process replicas"
                .into(),
        );
    }
    if cfg.sync.path != SyncPath::Delta {
        return refuse(format!(
            "rollout.servers needs sync.path = \"delta\" (weights go to a server over HTTP), \
             not {:?}",
            cfg.sync.path.name()
        ));
    }
    if cfg.health.heartbeat_timeout.is_none() {
        return refuse(
            "rollout.servers needs heartbeats (rollout.heartbeat_timeout_s > 0): a server \
             that stops answering is found by them"
                .into(),
        );
    }
    if cfg.health.fail.is_some() {
        return refuse(
            "rollout.fail_kind injects a failure into an in-process engine; with \
             rollout.servers, stop a server process instead"
                .into(),
        );
    }
    Ok(())
}

/// Joins server `i` with a full sync of the stage's start image.
fn join_server(
    cfg: &StageConfig,
    i: usize,
    url: &str,
    full: &crate::sync::Publication,
) -> Result<ServerClient, RunError> {
    let timeout = cfg
        .health
        .heartbeat_timeout
        .map_or(Duration::from_secs(30), |t| Duration::from_micros(t.0));
    let mut c = ServerClient::new(url, timeout);
    c.join(full).map_err(|e| RunError::Engine {
        replica: i,
        message: format!("rollout.servers[{i}]: cannot join: {e}"),
    })?;
    Ok(c)
}
