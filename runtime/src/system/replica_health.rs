//! Replica health: heartbeat ticks, a silent replica declared lost (its lane abandoned, its
//! groups ended and started again elsewhere) and its restart from a full sync. Changes with
//! the failure model.

use super::event_loop::TimerEv;
use super::lanes::{Exec, Replica, ReplicaIn, ReplicaLane, ReplicaWorker};
use super::scheduler::Scheduler;
use super::stage::{ReplicaLoss, RunError, StageObserver};
use crate::clock::Micros;
use crate::engine::Engine;
use crate::health::Heartbeats;
use crate::metrics::Track;
use crate::remote::{ClientError, ServerClient};
use crate::router::ReplicaId;
use crate::sync::lane::{restart_replica, FullSync, SyncPath, SyncReport, SyncSink};

/// Why a replica could not be brought back.
enum RestartError {
    /// Try again later (an engine that could not be built, a server that does not answer).
    Retry(String),
    /// A server that answers and refuses its join (another model or precision): polling it
    /// again cannot heal that.
    Refused(String),
}

/// Restart attempts of one lost replica before the stage gives up.
const MAX_RESTART_ATTEMPTS: u32 = 5;

/// Replica losses (per replica of the stage) without a learner step completing before the
/// stage stops with [`RunError::HeartbeatTooShort`]. A real failure loses a replica once and
/// the others keep the learner fed; a timeout shorter than a step loses them all, again and
/// again.
const LOSSES_PER_REPLICA_WITHOUT_A_STEP: u64 = 3;

impl Scheduler<'_> {
    /// A heartbeat tick: pings, then every replica silent for the timeout is lost.
    pub(super) fn heartbeat_tick(
        &mut self,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
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
        let reason = r
            .lost_because
            .as_ref()
            .and_then(|slot| slot.lock().ok()?.take());
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
            [
                ("trajectories_lost".into(), lost.trajectories.to_string()),
                ("sessions_restarted".into(), lost.sessions.len().to_string()),
            ]
            .into_iter()
            .chain(reason.clone().map(|r| ("reason".to_string(), r)))
            .collect(),
        );
        observer.on_replica_lost(&ReplicaLoss {
            now,
            replica: i,
            silent_since,
            working_since,
            lost,
            reason,
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
        // A timeout shorter than an engine step loses every replica at every step: stop
        // rather than restart them for ever.
        self.losses_since_step += 1;
        let limit = LOSSES_PER_REPLICA_WITHOUT_A_STEP * self.replicas.len() as u64;
        if self.losses_since_step >= limit {
            return Err(RunError::HeartbeatTooShort {
                losses: self.losses_since_step,
                timeout: self
                    .heartbeats
                    .as_ref()
                    .map_or(Micros(0), Heartbeats::timeout),
            });
        }
        Ok(())
    }

    fn engine_image_bytes(&self) -> u64 {
        self.engine_weights.params.tensor().len_bytes() as u64
    }

    /// Replica `i` again from a full sync of the newest weights: a fresh engine, or its server
    /// joined again (Err while it does not answer).
    fn fresh_worker(&self, i: usize) -> Result<(ReplicaWorker, SyncReport), RestartError> {
        let Some(url) = self.cfg.servers.get(i) else {
            let (engine, sink, report) = self.fresh_engine(i).map_err(RestartError::Retry)?;
            let worker = ReplicaWorker::Local(Box::new(Replica {
                engine,
                sink,
                fail: None,
            }));
            return Ok((worker, report));
        };
        let full = self.latest_full.as_deref().ok_or_else(|| {
            RestartError::Refused("internal: no full image to join a server with".into())
        })?;
        let timeout = self
            .heartbeats
            .as_ref()
            .map_or(Micros::from_secs(30.0), Heartbeats::timeout);
        let mut client = ServerClient::new(url, std::time::Duration::from_micros(timeout.0));
        match client.join(full) {
            Ok(report) => Ok((ReplicaWorker::Remote(client), report)),
            Err(ClientError::Lost(m)) => Err(RestartError::Retry(m)),
            Err(ClientError::Protocol(m)) => Err(RestartError::Refused(m)),
        }
    }

    /// A fresh engine for replica `i` from a full sync of the newest weights.
    pub(super) fn fresh_engine(&self, i: usize) -> Result<(Engine, SyncSink, SyncReport), String> {
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
    pub(super) fn restart(
        &mut self,
        i: usize,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
        let now = self.clock.now();
        let (worker, report) = match self.fresh_worker(i) {
            Ok(x) => x,
            Err(RestartError::Refused(m)) => {
                return Err(RunError::Engine {
                    replica: i,
                    message: format!("rollout.servers[{i}] refused to rejoin: {m}"),
                })
            }
            Err(RestartError::Retry(e)) => {
                // A server is polled for as long as another replica keeps the run going: it
                // rejoins when it answers again (restarted by its operator).
                let patient = i < self.cfg.servers.len() && self.router.replicas().next().is_some();
                let r = &mut self.replicas[i];
                r.restart_attempts += 1;
                if r.restart_attempts >= MAX_RESTART_ATTEMPTS && !patient {
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
        *r = ReplicaLane::new(worker);
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
}
