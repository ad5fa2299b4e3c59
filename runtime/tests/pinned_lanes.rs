//! `run.pin_lanes`: on the wall clock the replica lanes and the learner lane each compute on a
//! one-thread pool pinned to a CPU of their own; the stage runs as any other (zero-lag tokens
//! still match bit for bit), and the virtual clock refuses the setting.

mod stage;

use sluice_runtime::clock::ClockMode;
use sluice_runtime::system::{pinnable_cpus, Mode, RunError};
use stage::{both_tasks, Recorder, Setup};

#[test]
fn pinned_lanes_run_a_wall_clock_stage_with_zero_mismatch() {
    if pinnable_cpus() < 2 {
        println!(
            "skipped: this process may run on {} CPU(s)",
            pinnable_cpus()
        );
        return;
    }
    for mode in [Mode::Async, Mode::Sync] {
        let mut s = Setup::new(both_tasks(1.0));
        s.clock = ClockMode::Wall;
        s.pin_lanes = true;
        s.mode = mode;
        s.steps = 4;
        let mut rec = Recorder::default();
        let (report, _) = s.run(&mut rec);
        assert_eq!(report.learner.steps, 4, "{mode:?}");
        assert!(report.learner.zero_lag_tokens >= 16, "{mode:?}");
        assert_eq!(report.learner.zero_lag_mismatch_tokens, 0, "{mode:?}");
    }
}

#[test]
fn the_virtual_clock_refuses_pinned_lanes() {
    let mut s = Setup::new(both_tasks(1.0));
    s.pin_lanes = true;
    let mut rec = Recorder::default();
    match s.try_run(&mut rec) {
        Err(RunError::Config(m)) => assert!(m.contains("run.pin_lanes"), "{m}"),
        other => panic!("expected a config error, got {:?}", other.map(|_| ())),
    }
}
