//! Handing work to the lanes and taking their results back: the learner's next step (which
//! groups, whether it publishes), each replica's next unit of work, the virtual clock's charge
//! for it, and what a finished unit means for the orchestrator, the counters and the metrics
//! line. Changes when what flows between the lanes and the rest of the system changes.

use super::event_loop::{SyncPhase, TimerEv};
use super::lanes::{
    learner_run, replica_run, EngineDone, EngineWork, Exec, LearnerDone, LearnerWork, ReplicaIn,
    ReplicaOutcome,
};
use super::scheduler::Scheduler;
use super::stage::{Mode, RunError, StageObserver};
use crate::buffer::ReadyGroup;
use crate::clock::Micros;
use crate::health::FailKind;
use crate::metrics::{metrics_line, LineInputs, Track};
use crate::sync::lane::{SyncPath, SyncReport};
use crate::trajectory::WeightVersion;
use std::collections::BTreeSet;
use std::time::Instant;

impl Scheduler<'_> {
    /// Starts the learner's next step when it is idle and its groups are ready (async:
    /// `groups_per_step` gated groups; sync: the whole batch, started and finished).
    pub(super) fn start_learner(
        &mut self,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
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
                let SyncPhase::Rollout { unadmitted } = self.phase else {
                    return Ok(());
                };
                // Over-sampling: the step goes as soon as it has its groups; the rest of the
                // batch is aborted (suspended or discarded) and what was not started never is.
                if let Some(os) = self.cfg.over_sampling {
                    let orch = &self.orch;
                    if let Some(g) =
                        self.buffer
                            .take_by(version, self.cfg.groups_per_step, |tasks, n| {
                                orch.pick(tasks, n)
                            })
                    {
                        let actions = self.orch.abort_in_flight(os.keep_partial);
                        self.apply(actions)?;
                        self.empty_batches = 0;
                        self.phase = SyncPhase::Train;
                        self.note_trained_lengths(&g);
                        return self.step_learner(g, observer);
                    }
                }
                // The whole batch started and finished.
                if unadmitted > 0 || self.orch.in_flight() > 0 {
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
        self.note_trained_lengths(&groups);
        self.step_learner(groups, observer)
    }

    fn note_trained_lengths(&mut self, groups: &[ReadyGroup]) {
        let c = self.orch.counters_mut();
        for s in groups.iter().flat_map(|g| g.samples.iter()) {
            c.trained_lengths.add(s.generated_tokens());
        }
    }

    /// Hands the learner its next step on `groups`.
    fn step_learner(
        &mut self,
        groups: Vec<ReadyGroup>,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
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

    /// Hands every live, idle replica that has something to do its next unit of work.
    pub(super) fn dispatch_engines(&mut self) -> Result<(), RunError> {
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

    /// A replica's unit of work is over: its installs, its command results, its engine events.
    pub(super) fn engine_done(
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

    /// A learner step is over: the totals, the trace, its publication, the metrics line.
    pub(super) fn learner_done(
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
        self.losses_since_step = 0;
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
            clock: self.cfg.clock,
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
}
