//! Barriers: every `barrier_every` learner steps admission and the learner wait until
//! nothing is in flight, the owner looks at (and checkpoints) the whole system, and prefix
//! caches are reset so a run resumed from there continues exactly. Changes with what a
//! checkpoint needs.

use super::lanes::{Exec, Replica, ReplicaWorker};
use super::scheduler::Scheduler;
use super::stage::{BarrierView, RunError, StageObserver};

impl Scheduler<'_> {
    /// Whether a barrier is due: new work waits until everything in flight has landed.
    pub(super) fn at_barrier(&self) -> bool {
        self.next_barrier
            .is_some_and(|b| self.learner.steps >= b && self.totals.steps < self.target_steps())
    }

    pub(super) fn barrier(&mut self, observer: &mut dyn StageObserver) -> Result<(), RunError> {
        let now = self.clock.now();
        // Every lane is idle: take the components back from their threads to look at them.
        for (i, r) in self.replicas.iter_mut().enumerate() {
            let rep = r.exec.make_inline().ok_or_else(|| RunError::Engine {
                replica: i,
                message: "a replica thread panicked".into(),
            })?;
            // Identical state in a run resumed from here: nothing cached from before. (A
            // server's cache is its own: a run with servers is on the wall clock, which does
            // not replay exactly anyway.)
            if let ReplicaWorker::Local(rep) = rep {
                rep.engine.reset_prefix_cache();
            }
        }
        if self.learner.exec.make_inline().is_none() {
            return Err(RunError::Learner("the learner thread panicked".into()));
        }
        {
            let learner = match &self.learner.exec {
                Exec::Inline(l) => &l.learner,
                _ => return Err(RunError::Learner("the learner is gone".into())),
            };
            let workers: Vec<&ReplicaWorker> = self
                .replicas
                .iter()
                .filter_map(|r| match &r.exec {
                    Exec::Inline(e) => Some(e),
                    _ => None,
                })
                .collect();
            let inline: Vec<&Replica> = workers
                .iter()
                .filter_map(|w| match w {
                    ReplicaWorker::Local(r) => Some(r.as_ref()),
                    ReplicaWorker::Remote(_) => None,
                })
                .collect();
            observer
                .on_barrier(&BarrierView {
                    now,
                    learner,
                    engines: inline.iter().map(|r| &r.engine).collect(),
                    replica_weights: workers.iter().map(|w| (w.version(), w.hash())).collect(),
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
}
