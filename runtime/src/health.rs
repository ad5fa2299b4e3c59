//! Rollout health (DESIGN 6.8): heartbeats to the engine replicas, the injected replica
//! failures tests use, and what a restart needs.
//!
//! Every `timeout / 4` the scheduler pings each live replica that has no ping outstanding. A
//! replica answers between units of work: at once when idle, after its current engine step when
//! busy, never when its lane hangs or has died. A replica whose oldest unanswered ping is
//! `timeout` old is declared lost, so a hang is detected between `timeout` and `1.25 x timeout`
//! after it starts (the first ping after it goes out within a quarter timeout, and the check runs
//! at every ping tick). An engine step longer than the timeout is indistinguishable from a hang:
//! the timeout must exceed the longest step (a stage that keeps losing its replicas without a
//! learner step stops with [`crate::system::RunError::HeartbeatTooShort`]).
//!
//! On the virtual clock pings are ticks on the run clock and an idle replica answers at the
//! tick; on the wall clock they are messages to the lane's thread, answered in order after the
//! work queued before them. [`Heartbeats`] holds only the bookkeeping, so both clocks share it.

use crate::clock::Micros;
use sluice_kernels::{Backend, Device};

/// How a replica fails when injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailKind {
    /// Its lane stops answering (an engine step that never returns); on the wall clock its
    /// thread blocks until the stage ends.
    Hang,
    /// Its lane ends (the process died); on the wall clock its thread exits.
    Die,
}

impl FailKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailKind::Hang => "hang",
            FailKind::Die => "die",
        }
    }
}

/// An injected replica failure: `replica` fails as `kind` when its engine is about to take its
/// `at_step`-th step (counted from the engine's creation). Only the first incarnation fails; a
/// restarted replica runs normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaFault {
    pub replica: usize,
    pub at_step: u64,
    pub kind: FailKind,
}

/// Health settings of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HealthConfig {
    /// A replica that leaves a heartbeat unanswered this long is lost, then restarted. None:
    /// no heartbeats (a replica that hangs stalls the stage).
    pub heartbeat_timeout: Option<Micros>,
    pub fail: Option<ReplicaFault>,
}

impl HealthConfig {
    pub fn validate(&self, replicas: usize) -> Result<(), String> {
        if let Some(t) = self.heartbeat_timeout {
            if t.0 < 4 {
                return Err(format!(
                    "heartbeat timeout {}us is too short (at least 4us)",
                    t.0
                ));
            }
        }
        if let Some(f) = self.fail {
            if f.replica >= replicas {
                return Err(format!(
                    "fail_replica = {} but the stage has {replicas} replica(s)",
                    f.replica
                ));
            }
            if f.at_step == 0 {
                return Err("fail_at_step must be >= 1 (engine steps count from 1)".into());
            }
            if self.heartbeat_timeout.is_none() {
                return Err(format!(
                    "an injected replica failure ({}) needs heartbeats to be detected: set a \
                     heartbeat timeout",
                    f.kind.as_str()
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ping {
    seq: u64,
    sent: Micros,
}

/// Heartbeat bookkeeping for a fixed set of replica slots (see the module docs).
#[derive(Clone, Debug)]
pub struct Heartbeats {
    interval: Micros,
    timeout: Micros,
    next_tick: Micros,
    /// Per replica: its oldest unanswered ping.
    outstanding: Vec<Option<Ping>>,
    /// Per replica: whether it is watched (alive and in the stage).
    watched: Vec<bool>,
    next_seq: u64,
}

impl Heartbeats {
    /// Heartbeats for `replicas` slots, all watched, the first tick a quarter timeout after
    /// `now`.
    pub fn new(replicas: usize, timeout: Micros, now: Micros) -> Heartbeats {
        let interval = Micros((timeout.0 / 4).max(1));
        Heartbeats {
            interval,
            timeout,
            next_tick: now.plus(interval),
            outstanding: vec![None; replicas],
            watched: vec![true; replicas],
            next_seq: 0,
        }
    }

    pub fn timeout(&self) -> Micros {
        self.timeout
    }

    pub fn interval(&self) -> Micros {
        self.interval
    }

    /// When the next tick is due.
    pub fn next_tick(&self) -> Micros {
        self.next_tick
    }

    /// A tick at `now`: the pings to send (replica, sequence number): one to each watched
    /// replica without one outstanding. Schedules the next tick.
    pub fn tick(&mut self, now: Micros) -> Vec<(usize, u64)> {
        self.next_tick = now.plus(self.interval);
        let mut out = Vec::new();
        for i in 0..self.outstanding.len() {
            if self.watched[i] && self.outstanding[i].is_none() {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.outstanding[i] = Some(Ping { seq, sent: now });
                out.push((i, seq));
            }
        }
        out
    }

    /// `replica` answered ping `seq` (or showed it is alive after it: any ping up to `seq`
    /// counts as answered).
    pub fn answer(&mut self, replica: usize, seq: u64) {
        if let Some(slot) = self.outstanding.get_mut(replica) {
            if slot.is_some_and(|p| p.seq <= seq) {
                *slot = None;
            }
        }
    }

    /// `replica` finished a unit of work, so it is alive now: every ping sent to it so far
    /// counts as answered.
    pub fn alive(&mut self, replica: usize) {
        if let Some(slot) = self.outstanding.get_mut(replica) {
            *slot = None;
        }
    }

    /// Watched replicas whose oldest unanswered ping is at least `timeout` old at `now`.
    pub fn overdue(&self, now: Micros) -> Vec<usize> {
        (0..self.outstanding.len())
            .filter(|&i| {
                self.watched[i]
                    && self.outstanding[i].is_some_and(|p| now.since(p.sent) >= self.timeout)
            })
            .collect()
    }

    /// When `replica`'s oldest unanswered ping was sent.
    pub fn silent_since(&self, replica: usize) -> Option<Micros> {
        self.outstanding
            .get(replica)
            .copied()
            .flatten()
            .map(|p| p.sent)
    }

    /// Stops watching `replica` (lost).
    pub fn unwatch(&mut self, replica: usize) {
        if replica < self.watched.len() {
            self.watched[replica] = false;
            self.outstanding[replica] = None;
        }
    }

    /// Watches `replica` again (restarted), with nothing outstanding.
    pub fn watch(&mut self, replica: usize) {
        if replica < self.watched.len() {
            self.watched[replica] = true;
            self.outstanding[replica] = None;
        }
    }
}

/// How to open a backend like an existing one, for a restarted replica (the emulator keeps its
/// schedule seed; a CUDA device is opened again by ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendSpec {
    Cpu,
    Emu { seed: u64 },
    Cuda(Device),
}

impl BackendSpec {
    pub fn of(b: &Backend) -> BackendSpec {
        match b {
            Backend::Cpu => BackendSpec::Cpu,
            Backend::Emu(e) => BackendSpec::Emu { seed: e.seed },
            Backend::Cuda(_) => BackendSpec::Cuda(b.device()),
        }
    }

    pub fn open(&self) -> Result<Backend, String> {
        match *self {
            BackendSpec::Cpu => Ok(Backend::Cpu),
            BackendSpec::Emu { seed } => Ok(Backend::emu_with_seed(seed)),
            BackendSpec::Cuda(d) => Backend::open(d).map_err(|e| e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_replica_is_overdue_after_the_timeout_and_not_before() {
        let mut h = Heartbeats::new(3, Micros(400), Micros(0));
        assert_eq!(h.interval(), Micros(100));
        assert_eq!(h.next_tick(), Micros(100));
        // Every replica is pinged at the first tick.
        assert_eq!(h.tick(Micros(100)), vec![(0, 0), (1, 1), (2, 2)]);
        // 0 answers, 1 finishes a unit of work, 2 stays silent.
        h.answer(0, 0);
        h.alive(1);
        assert_eq!(h.tick(Micros(200)), vec![(0, 3), (1, 4)]);
        h.answer(0, 3);
        h.answer(1, 4);
        assert_eq!(h.silent_since(2), Some(Micros(100)));
        assert!(h.overdue(Micros(499)).is_empty());
        assert_eq!(h.overdue(Micros(500)), vec![2]);
        // An answer to an older ping does not clear a newer one.
        h.tick(Micros(300));
        h.answer(0, 3);
        assert_eq!(h.silent_since(0), Some(Micros(300)));
        // A lost replica is not watched until it is restarted.
        h.unwatch(2);
        assert!(h.overdue(Micros(10_000)).iter().all(|&r| r != 2));
        assert!(h.tick(Micros(400)).iter().all(|&(r, _)| r != 2));
        h.watch(2);
        assert!(h.tick(Micros(500)).iter().any(|&(r, _)| r == 2));
    }

    #[test]
    fn config_checks_name_the_problem() {
        let f = ReplicaFault {
            replica: 2,
            at_step: 5,
            kind: FailKind::Hang,
        };
        let c = HealthConfig {
            heartbeat_timeout: Some(Micros(1_000_000)),
            fail: Some(f),
        };
        assert!(c.validate(3).is_ok());
        assert!(c.validate(2).unwrap_err().contains("fail_replica"));
        let no_beat = HealthConfig {
            heartbeat_timeout: None,
            ..c
        };
        assert!(no_beat.validate(3).unwrap_err().contains("heartbeat"));
        let step0 = HealthConfig {
            fail: Some(ReplicaFault { at_step: 0, ..f }),
            ..c
        };
        assert!(step0.validate(3).unwrap_err().contains("fail_at_step"));
    }
}
