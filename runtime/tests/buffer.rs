//! The data buffer's gates on hand-built trajectories (DESIGN 6.5): the version gate at exactly
//! tau and tau + 1, judged on the OLDEST version of a trajectory that spans a swap; the
//! environment gate; group repair at G/2 and G/2 + 1; no replay; duplicates; exact counters;
//! and the admission rule.

use sluice_runtime::buffer::{Admission, BufferConfig, BufferError, DataBuffer};
use sluice_runtime::trajectory::{Sample, SamplingParams, TerminalReason, WeightVersion};

/// A trajectory of instance `inst`, member `gi`: two prompt tokens, then one generated token
/// per entry of `versions` (the version that sampled it).
fn traj(inst: &str, gi: u32, versions: &[u64], reason: TerminalReason, reward: f32) -> Sample {
    let n = 2 + versions.len();
    let mut weight_version = vec![WeightVersion(versions.first().copied().unwrap_or(0)); 2];
    weight_version.extend(versions.iter().map(|&v| WeightVersion(v)));
    Sample {
        instance_id: inst.into(),
        group_index: gi,
        session_id: format!("{inst}/{gi}"),
        task: "t".into(),
        prompt_len: 2,
        tokens: (0..n as u32).collect(),
        loss_mask: (0..n).map(|i| i >= 2).collect(),
        behavior_logp: (0..n).map(|i| if i >= 2 { -0.5 } else { 0.0 }).collect(),
        weight_version,
        reward,
        terminal_reason: reason,
        turns: Vec::new(),
        clocks: Default::default(),
        versions: Default::default(),
        sampling: SamplingParams::default(),
    }
}

fn ok(inst: &str, gi: u32, versions: &[u64]) -> Sample {
    traj(inst, gi, versions, TerminalReason::Success, 1.0)
}

fn buffer(g: u32, tau: u64) -> DataBuffer {
    DataBuffer::new(BufferConfig {
        group_size: g,
        tau,
        env_gate: true,
        dynamic_sampling: None,
    })
}

#[test]
fn version_gate_keeps_exactly_tau_and_drops_tau_plus_one() {
    let tau = 3;
    let mut b = buffer(2, tau);
    // Learner at version 10: oldest 7 (lag 3 = tau) passes, oldest 6 (lag 4) does not.
    for gi in 0..2 {
        b.insert(ok("keep", gi, &[7, 7])).unwrap();
    }
    let got = b
        .take(WeightVersion(10), 1)
        .expect("a group at lag tau passes");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].samples.len(), 2);
    assert_eq!(b.counters().stale_dropped, 0);

    for gi in 0..2 {
        b.insert(ok("drop", gi, &[6, 6])).unwrap();
    }
    assert!(b.take(WeightVersion(10), 1).is_none());
    let c = b.counters();
    assert_eq!(c.stale_dropped, 2);
    assert_eq!(c.groups_dropped, 1);
}

#[test]
fn a_trajectory_spanning_a_swap_is_judged_by_its_oldest_token() {
    // G = 3: two fresh members and one whose tokens span versions 5 -> 9. At learner 9 with
    // tau = 3 its newest token is fresh (lag 0) but its oldest has lag 4: it is dropped, and
    // the group (2 of 3 valid > 3/2) is repaired.
    let mut b = buffer(3, 3);
    b.insert(ok("i", 0, &[9, 9])).unwrap();
    b.insert(ok("i", 1, &[5, 7, 9])).unwrap();
    b.insert(ok("i", 2, &[8, 9])).unwrap();
    let g = b.take(WeightVersion(9), 1).expect("repaired group");
    let c = b.counters();
    assert_eq!(c.stale_dropped, 1);
    assert_eq!(c.duplicated, 1);
    assert_eq!(g[0].duplicated, 1);
    let members: Vec<u32> = g[0].samples.iter().map(|s| s.group_index).collect();
    // The valid ones in order, then the repeat of the first valid one.
    assert_eq!(members, vec![0, 2, 0]);
}

#[test]
fn repair_needs_more_than_half_valid() {
    // G = 4: exactly G/2 = 2 valid -> dropped; G/2 + 1 = 3 valid -> repaired to 4.
    let mut b = buffer(4, 100);
    for gi in 0..4 {
        let reason = if gi < 2 {
            TerminalReason::Success
        } else {
            TerminalReason::Environment
        };
        b.insert(traj("half", gi, &[0], reason, 0.0)).unwrap();
    }
    assert!(b.take(WeightVersion(0), 1).is_none());
    let c = b.counters();
    assert_eq!(
        (c.env_dropped, c.groups_dropped, c.valid_in_dropped_groups),
        (2, 1, 2)
    );

    for gi in 0..4 {
        let reason = if gi < 3 {
            TerminalReason::Failure
        } else {
            TerminalReason::Environment
        };
        b.insert(traj("more", gi, &[0], reason, 0.0)).unwrap();
    }
    let g = b.take(WeightVersion(0), 1).expect("3 of 4 valid: repaired");
    assert_eq!(g[0].samples.len(), 4);
    assert_eq!(g[0].duplicated, 1);
    assert!(g[0]
        .samples
        .iter()
        .all(|s| s.terminal_reason != TerminalReason::Environment));
    let c = b.counters();
    assert_eq!(c.env_dropped, 3);
    assert_eq!(c.groups_dropped, 1);
    assert_eq!(c.duplicated, 1);
    assert_eq!(c.groups_released, 1);
    assert_eq!(c.trajectories_released, 4);
    assert_eq!(c.trajectories_in, 8);
    assert_eq!(c.groups_complete, 2);
}

#[test]
fn no_replay_and_no_duplicate_members() {
    let mut b = buffer(2, 10);
    b.insert(ok("a", 0, &[1])).unwrap();
    assert!(matches!(
        b.insert(ok("a", 0, &[1])),
        Err(BufferError::DuplicateMember { .. })
    ));
    assert!(matches!(
        b.insert(ok("a", 2, &[1])),
        Err(BufferError::DuplicateMember { .. })
    ));
    b.insert(ok("a", 1, &[1])).unwrap();
    assert_eq!(b.take(WeightVersion(1), 1).unwrap().len(), 1);
    // The instance was released: a late member is refused, never trained twice.
    assert!(matches!(
        b.insert(ok("a", 0, &[1])),
        Err(BufferError::Replay { .. })
    ));
    let c = b.counters();
    assert_eq!((c.duplicate_refused, c.replay_refused), (2, 1));
    assert_eq!(c.trajectories_in, 2);
    // An invalid trajectory is refused with its reason and changes nothing.
    let mut bad = ok("b", 0, &[1]);
    bad.behavior_logp[2] = 0.5;
    assert!(matches!(b.insert(bad), Err(BufferError::Invalid(_))));
    assert_eq!(b.counters().trajectories_in, 2);
}

#[test]
fn take_waits_for_n_groups_and_regates_waiting_ones() {
    let mut b = buffer(1, 1);
    b.insert(ok("x", 0, &[0])).unwrap();
    // One group passes at version 1 but the learner wants 2: it waits as a candidate.
    assert!(b.take(WeightVersion(1), 2).is_none());
    assert_eq!(b.groups_waiting(), 1);
    b.insert(ok("y", 0, &[2])).unwrap();
    // The learner moved to 2: x (oldest 0, lag 2 > tau 1) is judged again and dropped.
    assert!(b.take(WeightVersion(2), 2).is_none());
    assert_eq!(b.counters().stale_dropped, 1);
    b.insert(ok("z", 0, &[2])).unwrap();
    let g = b.take(WeightVersion(2), 2).unwrap();
    let ids: Vec<&str> = g.iter().map(|g| g.instance_id.as_str()).collect();
    assert_eq!(ids, vec!["y", "z"]);
}

#[test]
fn take_by_follows_the_pickers_choice() {
    let mut b = buffer(1, 10);
    for (i, task) in ["fast", "fast", "slow", "fast"].iter().enumerate() {
        let mut s = ok(&format!("g{i}"), 0, &[0]);
        s.task = task.to_string();
        b.insert(s).unwrap();
    }
    let g = b
        .take_by(WeightVersion(0), 2, |tasks, n| {
            assert_eq!(tasks, ["fast", "fast", "slow", "fast"]);
            assert_eq!(n, 2);
            Some(vec![2, 0])
        })
        .unwrap();
    let ids: Vec<&str> = g.iter().map(|g| g.instance_id.as_str()).collect();
    assert_eq!(ids, vec!["g0", "g2"]);
    assert_eq!(b.groups_waiting(), 2);
    // A picker that waits releases nothing.
    assert!(b.take_by(WeightVersion(0), 1, |_, _| None).is_none());
    assert_eq!(b.groups_waiting(), 2);
}

#[test]
fn admission_is_the_areal_rule() {
    let a = Admission {
        eta: 2,
        per_step: 16,
    };
    // (steps + eta + 1) * per_step trajectories may have started.
    assert_eq!(a.room(0, 0, 0), 48);
    assert_eq!(a.room(48, 0, 0), 0);
    assert_eq!(a.room(48, 0, 1), 16);
    // Dropped groups give their room back.
    assert_eq!(a.room(48, 8, 0), 8);
    assert_eq!(a.room(100, 0, 0), 0);
}

#[test]
fn without_the_environment_gate_env_ended_trajectories_are_released_and_counted_once() {
    // G = 2: one member ended by the environment, one passed.
    let run = |env_gate: bool| {
        let mut b = DataBuffer::new(BufferConfig {
            group_size: 2,
            tau: 4,
            env_gate,
            dynamic_sampling: None,
        });
        b.insert(traj("i", 0, &[0, 0], TerminalReason::Environment, 0.0))
            .unwrap();
        b.insert(ok("i", 1, &[0])).unwrap();
        // Gated at version 1 while waiting for two groups (none released), then again.
        assert!(b.take(WeightVersion(1), 2).is_none());
        (b.take(WeightVersion(2), 1), b.counters())
    };
    let (got, c) = run(false);
    let got = got.expect("both members pass without the gate");
    assert_eq!(got[0].duplicated, 0);
    assert_eq!(
        got[0].samples[0].terminal_reason,
        TerminalReason::Environment
    );
    assert_eq!((c.env_trained, c.env_dropped), (1, 0));
    // With the gate, the environment-ended member is dropped and the group (1 of 2 valid,
    // not more than half) with it.
    let (got, c) = run(true);
    assert!(got.is_none());
    assert_eq!((c.env_trained, c.env_dropped, c.groups_dropped), (0, 1, 1));
}

#[test]
fn drops_are_counted_per_task_and_number_of_model_turns() {
    let mut b = buffer(2, 1);
    // A two-turn trajectory: generated, an observation, generated.
    let mut two = ok("old", 0, &[0, 0, 0]);
    two.loss_mask = vec![false, false, true, false, true];
    two.behavior_logp[3] = 0.0;
    b.insert(two).unwrap();
    b.insert(ok("old", 1, &[0])).unwrap();
    b.insert(ok("new", 0, &[5])).unwrap();
    b.insert(ok("new", 1, &[5])).unwrap();
    // At learner 5 the "old" group is stale (lag 5 > tau 1).
    let got = b.take(WeightVersion(5), 1).expect("the fresh group");
    assert_eq!(got[0].instance_id, "new");
    let t = &b.by_turns()["t"];
    assert_eq!(t[&1].trajectories_in, 3);
    assert_eq!(t[&1].stale_dropped, 1);
    assert_eq!(t[&2].trajectories_in, 1);
    assert_eq!(t[&2].stale_dropped, 1);
    assert_eq!(sluice_runtime::buffer::model_turns(&ok("x", 0, &[1, 1])), 1);
}

/// Dynamic sampling (DAPO's filter): with G = 2 and a cap of 2 per learner version, of four
/// groups (rewards [1, 1], [0, 1], [0, 0], [1, 1] in completion order) at version 3 the first
/// and third are dropped, the fourth passes the spent cap and is released, counted; at version
/// 4 the cap starts again. Off, every group is released and the zero-signal ones are counted.
#[test]
fn dynamic_sampling_drops_groups_without_reward_variance_up_to_its_cap() {
    let with_rewards = |b: &mut DataBuffer, inst: &str, r: [f32; 2]| {
        for (gi, &reward) in r.iter().enumerate() {
            b.insert(traj(inst, gi as u32, &[3], TerminalReason::Success, reward))
                .unwrap();
        }
    };
    let mut b = DataBuffer::new(BufferConfig {
        group_size: 2,
        tau: 4,
        env_gate: true,
        dynamic_sampling: Some(2),
    });
    with_rewards(&mut b, "a", [1.0, 1.0]);
    with_rewards(&mut b, "b", [0.0, 1.0]);
    with_rewards(&mut b, "c", [0.0, 0.0]);
    with_rewards(&mut b, "d", [1.0, 1.0]);
    let got = b.take(WeightVersion(3), 2).expect("b and d pass");
    let ids: Vec<&str> = got.iter().map(|g| g.instance_id.as_str()).collect();
    assert_eq!(ids, ["b", "d"]);
    let c = b.counters();
    assert_eq!((c.zero_signal_dropped, c.zero_signal_released), (2, 1));
    assert_eq!((c.groups_released, c.groups_dropped), (2, 0));
    // The dropped groups count as discarded, so rollout may start their trajectories again.
    assert_eq!(c.discarded_in_dropped_groups(2), 4);
    // A dropped instance is closed: a late member is a replay.
    assert!(matches!(
        b.insert(ok("a", 0, &[3])),
        Err(BufferError::Replay { .. })
    ));
    // A new version, a new cap: the next zero-signal group is dropped.
    with_rewards(&mut b, "e", [0.5, 0.5]);
    assert!(b.take(WeightVersion(4), 1).is_none());
    assert_eq!(b.counters().zero_signal_dropped, 3);

    let mut off = buffer(2, 4);
    with_rewards(&mut off, "a", [1.0, 1.0]);
    with_rewards(&mut off, "b", [0.0, 1.0]);
    assert_eq!(off.take(WeightVersion(3), 2).map(|g| g.len()), Some(2));
    let c = off.counters();
    assert_eq!((c.zero_signal_dropped, c.zero_signal_released), (0, 1));
}
