//! Rollout health: a replica that hangs or dies mid-run is found by its unanswered heartbeats
//! within the timeout; the run completes; every trajectory of the groups it was running ends as
//! `environment` and none reaches the loss; its sessions start again on other replicas (the
//! router moves only its sessions); it is restarted from a full sync, runs the learner's exact
//! weights, and takes sessions again.

mod stage;

use sluice_runtime::clock::{ClockMode, Micros};
use sluice_runtime::health::{FailKind, HealthConfig, ReplicaFault};
use sluice_runtime::metrics::Track;
use sluice_runtime::router::{ReplicaId, Router};
use sluice_runtime::sync::{SyncOptions, SyncPath};
use sluice_runtime::system::{Mode, RunError, StageReport};
use sluice_runtime::trajectory::TerminalReason;
use stage::{both_tasks, session_of, Recorder, Setup};
use std::collections::BTreeSet;

fn health(timeout_s: f64, replica: usize, at_step: u64, kind: FailKind) -> HealthConfig {
    HealthConfig {
        heartbeat_timeout: Some(Micros::from_secs(timeout_s)),
        fail: Some(ReplicaFault {
            replica,
            at_step,
            kind,
        }),
    }
}

/// Zero-lag tokens every replica-loss run compares at least: the virtual-clock runs have 121
/// to 354 (fixed by their seeds), the wall-clock one about 140 (it varies with timing).
const MIN_ZERO_LAG: u64 = 50;

/// What every replica-loss run must show, whatever the clock, path or mode.
fn assert_loss_handled(rec: &Recorder, report: &StageReport, replica: usize, steps: u64) {
    assert_eq!(report.learner.steps, steps, "the run completes");
    let c = &report.rollout;
    assert!(!rec.losses.is_empty(), "the failure was never detected");
    assert!(rec.losses.iter().all(|l| l.replica == replica));
    assert_eq!(c.replicas_lost, rec.losses.len() as u64);
    assert_eq!(
        c.replica_restarts, c.replicas_lost,
        "every lost replica came back"
    );
    // What it lost: whole groups, every member ended as `environment`.
    let lost: BTreeSet<(String, u32)> = rec
        .losses
        .iter()
        .flat_map(|l| l.lost.members.iter().cloned())
        .collect();
    let lost_instances: BTreeSet<&str> = lost.iter().map(|(i, _)| i.as_str()).collect();
    assert_eq!(
        c.trajectories_lost,
        rec.losses.iter().map(|l| l.lost.trajectories).sum::<u64>()
    );
    assert_eq!(c.trajectories_lost as usize, lost.len());
    assert!(*c.by_terminal.get("environment").unwrap_or(&0) >= c.trajectories_lost);
    // None of it reached the loss: no batch holds a trajectory of a lost group.
    for g in rec.batches.iter().flatten() {
        assert!(
            !lost_instances.contains(g.instance_id.as_str()),
            "group {} of a lost replica was trained",
            g.instance_id
        );
        for s in &g.samples {
            assert_ne!(s.terminal_reason, TerminalReason::Environment);
        }
    }
    // The restarted replica runs exactly the learner's weights, and so does every later
    // install.
    rec.assert_every_install_is_the_learners();
    let restarts: Vec<_> = rec.syncs.iter().filter(|e| e.restart).collect();
    assert_eq!(restarts.len() as u64, c.replica_restarts);
    assert!(restarts.iter().all(|e| e.replica == replica));
    // Zero mismatch means something only over enough tokens.
    assert!(
        report.learner.zero_lag_tokens >= MIN_ZERO_LAG,
        "{} zero-lag tokens",
        report.learner.zero_lag_tokens
    );
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
    assert_eq!(rec.lines.last().unwrap()["replicas_lost"], c.replicas_lost);
}

#[test]
fn a_hung_replica_is_found_within_the_timeout_and_its_sessions_move() {
    let timeout = 2.0;
    let mut s = Setup::new(both_tasks(30.0));
    s.replicas = 3;
    s.steps = 14;
    s.sync = SyncOptions {
        path: SyncPath::Delta,
        ..SyncOptions::default()
    };
    s.health = health(timeout, 1, 25, FailKind::Hang);
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_loss_handled(&rec, &report, 1, 14);
    assert_eq!(rec.losses.len(), 1);
    let loss = &rec.losses[0];
    // Detected between the timeout and 1.25 timeouts after the hung step started.
    let t = Micros::from_secs(timeout);
    let started = loss.working_since.expect("it hung in a unit of work");
    let took = loss.now.since(started);
    assert!(
        took >= t && took.0 <= t.0 + t.0 / 4,
        "detected {:.3}s after the hang began",
        took.secs()
    );
    assert_eq!(loss.now.since(loss.silent_since), t);
    assert!(loss.lost.trajectories > 0, "it was running sessions");
    assert_eq!(
        loss.lost.sessions.len() as u64,
        report.rollout.sessions_restarted
    );
    // Routing: before the loss and after the restart every trajectory ran where the full
    // router sends its session; while it was down, where a router without it sends it
    // (so only its own sessions moved).
    let all = Router::new((0..3).map(ReplicaId)).unwrap();
    let without = Router::new([0, 2].map(ReplicaId)).unwrap();
    let back = rec
        .syncs
        .iter()
        .find(|e| e.restart)
        .expect("a restart install")
        .now;
    let mut moved = 0;
    let mut checked = 0;
    for sp in &report.trace.spans {
        let Track::Rollout { replica } = sp.track else {
            continue;
        };
        if sp.name.ends_with(" lost") {
            assert_eq!(replica, 1);
            continue;
        }
        let session = session_of(&sp.name);
        let full = all.route(session).unwrap().0 as usize;
        let down = without.route(session).unwrap().0 as usize;
        if full != 1 {
            assert_eq!(
                full, down,
                "rendezvous moves only the lost replica's sessions"
            );
        }
        // The group started when the span started; where it ran depends on that moment.
        let expected = if sp.start >= loss.now && sp.start < back {
            down
        } else if sp.start < loss.now || sp.start >= back {
            full
        } else {
            unreachable!()
        };
        // A restarted session keeps its id but started after the loss.
        assert_eq!(replica, expected, "{} started at {:?}", sp.name, sp.start);
        checked += 1;
        if full == 1 && replica != 1 {
            moved += 1;
        }
    }
    println!(
        "lost at {:.2}s (step {} of 14): {} trajectories of {} sessions; {checked} trajectories \
         routed as expected, {moved} of them moved off replica 1; back at {:.2}s",
        loss.now.secs(),
        rec.lines.iter().filter(|l| l["replicas_lost"] == 0).count(),
        loss.lost.trajectories,
        loss.lost.sessions.len(),
        back.secs()
    );
    assert!(checked > 100, "{checked} trajectories checked");
    assert!(moved > 0, "no session of the lost replica ran elsewhere");
    // The lost sessions continued on other replicas and were trained there.
    let lost_sessions: BTreeSet<&str> = loss.lost.sessions.iter().map(String::as_str).collect();
    let continued: BTreeSet<&str> = rec
        .batches
        .iter()
        .flatten()
        .flat_map(|g| &g.samples)
        .map(|s| s.session_id.as_str())
        .filter(|s| lost_sessions.contains(s))
        .collect();
    assert!(
        !continued.is_empty(),
        "none of {} restarted sessions was trained",
        lost_sessions.len()
    );
    // It took sessions again after the restart, and installed later publications.
    assert!(report
        .trace
        .spans
        .iter()
        .any(|sp| sp.track == Track::Rollout { replica: 1 }
            && sp.start >= back
            && !sp.name.ends_with(" lost")));
    assert!(rec
        .syncs
        .iter()
        .any(|e| e.replica == 1 && !e.restart && e.now > back));
}

#[test]
fn a_dead_replica_in_sync_mode_on_the_disk_path() {
    let mut s = Setup::new(both_tasks(30.0));
    s.mode = Mode::Sync;
    s.steps = 6;
    s.sync = SyncOptions {
        path: SyncPath::Disk(
            std::env::temp_dir().join(format!("sluice-health-disk-{}", std::process::id())),
        ),
        ..SyncOptions::default()
    };
    s.health = health(1.0, 0, 12, FailKind::Die);
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_loss_handled(&rec, &report, 0, 6);
    // Sync mode still trains every token at lag 0 (the restarted replica polled the newest
    // file before its first step).
    assert_eq!(report.learner.lag_hist.len(), 1);
}

#[test]
fn the_only_replica_dies_and_its_sessions_wait_for_the_restart() {
    let mut s = Setup::new(both_tasks(30.0));
    s.replicas = 1;
    s.steps = 6;
    s.health = health(1.0, 0, 15, FailKind::Die);
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_loss_handled(&rec, &report, 0, 6);
    // With nobody to move to, the sessions restarted on the replica itself once it was back.
    let back = rec.syncs.iter().find(|e| e.restart).unwrap().now;
    let lost_sessions: BTreeSet<&str> = rec.losses[0]
        .lost
        .sessions
        .iter()
        .map(String::as_str)
        .collect();
    assert!(!lost_sessions.is_empty());
    for sp in &report.trace.spans {
        if lost_sessions.contains(session_of(&sp.name)) && sp.end > rec.losses[0].now {
            assert!(sp.name.ends_with(" lost") || sp.end >= back, "{}", sp.name);
        }
    }
}

#[test]
fn a_hung_thread_on_the_wall_clock_does_not_hang_the_run() {
    // The lane's thread really blocks; the scheduler abandons it, and the stage releases it at
    // the end. Environment latencies are real time here, so they are short.
    let mut s = Setup::new(both_tasks(2.0));
    s.clock = ClockMode::Wall;
    s.steps = 5;
    s.health = health(1.5, 1, 6, FailKind::Hang);
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_loss_handled(&rec, &report, 1, 5);
    // Its rates are per wall-clock second, and say so.
    assert!(rec.lines.iter().all(|l| l["clock"] == "wall"));
}

#[test]
fn a_heartbeat_timeout_shorter_than_an_engine_step_stops_the_run() {
    // Every engine step costs 5 ms on the virtual clock; the timeout is 1 ms. Every replica is
    // lost at every step: the stage must stop with an error saying so, not restart them for
    // ever. Run on a thread so that a stage that never stops fails the test instead of
    // hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut s = Setup::new(both_tasks(5.0));
        s.cost.engine_step_us = 5_000.0;
        s.health = HealthConfig {
            heartbeat_timeout: Some(Micros::from_secs(0.001)),
            fail: None,
        };
        let mut rec = Recorder::default();
        let outcome = s.try_run(&mut rec).map(|(r, _)| r.learner.steps);
        let _ = tx.send((outcome, rec.losses.len(), rec.lines.len()));
    });
    let (outcome, losses, steps) = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the stage never stopped: replicas lost and restarted for ever");
    match outcome {
        Err(RunError::HeartbeatTooShort { losses: n, timeout }) => {
            assert_eq!(n, 6, "3 losses per replica (2 replicas)");
            assert_eq!(timeout, Micros::from_secs(0.001));
        }
        other => panic!("expected HeartbeatTooShort, got {other:?}"),
    }
    assert_eq!(losses, 6);
    assert_eq!(steps, 0, "no learner step completed");
    let msg = RunError::HeartbeatTooShort {
        losses: 6,
        timeout: Micros::from_secs(0.001),
    }
    .to_string();
    assert!(msg.contains("heartbeat timeout"), "{msg}");
}
