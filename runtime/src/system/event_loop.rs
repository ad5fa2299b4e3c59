//! The event loop and the run clock: each turn admits what the backpressure room (async) or
//! the batch (sync) allows, starts idle lanes, then waits for the next event (the earliest
//! timer or heartbeat on the virtual clock; a lane message, a due timer or a heartbeat on the
//! wall clock) and handles it. Changes when the order of events or admission changes.

use super::lanes::{Exec, LaneMsg, ReplicaLane};
use super::scheduler::Scheduler;
use super::stage::{Mode, RunError, StageObserver, Tick};
use crate::clock::Micros;
use crate::health::Heartbeats;
use crate::orchestrator::{Action, EngineCmd, EnvCall, Pace};
use crate::router::Router;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

/// What a timer delivers when it comes due.
#[derive(Debug)]
pub(super) enum TimerEv {
    Env(EnvCall),
    EngineDone(usize, u64),
    LearnerDone,
    Restart(usize),
}

/// Sync mode's phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SyncPhase {
    /// Ready to start a rollout batch.
    Start,
    /// A batch is rolling out; `unadmitted` of its trajectories have not started yet (they
    /// start as the tasks' concurrency frees).
    Rollout { unadmitted: u64 },
    /// The learner is stepping on the batch.
    Train,
}

impl Scheduler<'_> {
    pub(super) fn target_steps(&self) -> u64 {
        // The learner's version when the stage started plus the stage's steps.
        self.cfg.steps
    }

    pub(super) fn done(&self) -> bool {
        self.totals.steps >= self.target_steps() && self.learner.busy_since.is_none()
    }

    pub(super) fn run(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        loop {
            if self.done() {
                return Ok(());
            }
            if self.at_barrier() && self.orch.suspended_groups() > 0 {
                // A checkpoint holds nothing in flight: partial trajectories are discarded.
                let actions = self.orch.discard_suspended();
                self.apply(actions)?;
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

    pub(super) fn discarded(&self) -> u64 {
        self.buffer
            .counters()
            .discarded_in_dropped_groups(self.group_size as u32)
    }

    pub(super) fn room(&self) -> u64 {
        self.admission.room(
            self.orch.counters().trajectories_started,
            self.discarded(),
            self.learner.steps,
        )
    }

    /// The replica a session goes to: the router's choice among live replicas, or `fallback`
    /// (a replica being restarted) when none is live.
    pub(super) fn route_or(router: &Router, session: &str, fallback: usize) -> usize {
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
            // A batch is admitted as the tasks' concurrency allows and topped up as its
            // groups finish, until all of it has started: a batch larger than the tasks'
            // concurrency is still trained whole.
            Mode::Sync if self.learner.busy_since.is_some() => 0,
            Mode::Sync => match self.phase {
                SyncPhase::Start => {
                    let mut groups = self.cfg.groups_per_step as u64;
                    if let Some(os) = self.cfg.over_sampling {
                        // Partial rollout: the groups suspended at the last step come first
                        // and count in the batch.
                        let (actions, resumed) = self.orch.resume_suspended()?;
                        self.apply(actions)?;
                        groups = os
                            .batch_groups(self.cfg.groups_per_step)
                            .saturating_sub(resumed as u64);
                    }
                    let batch = groups * self.group_size;
                    self.phase = SyncPhase::Rollout { unadmitted: batch };
                    batch
                }
                SyncPhase::Rollout { unadmitted } => unadmitted,
                SyncPhase::Train => 0,
            },
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
        if let SyncPhase::Rollout { unadmitted } = &mut self.phase {
            let started = actions
                .iter()
                .filter(|a| {
                    matches!(
                        a,
                        Action::Engine {
                            cmd: EngineCmd::Submit { .. },
                            ..
                        }
                    )
                })
                .count() as u64;
            *unadmitted = unadmitted.saturating_sub(started * self.group_size);
        }
        self.apply(actions)
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

    pub(super) fn apply(&mut self, actions: Vec<Action>) -> Result<(), RunError> {
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
}
