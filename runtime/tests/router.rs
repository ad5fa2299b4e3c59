//! Router: stickiness, and rendezvous hashing's minimal movement on join and leave.

use sluice_runtime::router::*;

fn ids(n: u32) -> Vec<ReplicaId> {
    (0..n).map(ReplicaId).collect()
}

fn sessions(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("session-{i}")).collect()
}

#[test]
fn same_session_same_replica() {
    let r = Router::new(ids(5)).unwrap();
    let r2 = Router::new(ids(5).into_iter().rev()).unwrap();
    for s in sessions(1000) {
        let a = r.route(&s).unwrap();
        assert_eq!(r.route(&s).unwrap(), a);
        // Insertion order does not matter.
        assert_eq!(r2.route(&s).unwrap(), a);
    }
}

/// Sessions spread evenly: each of N replicas gets 1/N of 100k within 0.01 (std of a share is
/// sqrt(p(1-p)/n) <= 0.0016 at n = 100k, so 0.01 is > 6 std).
#[test]
fn load_is_balanced() {
    let n = 5;
    let r = Router::new(ids(n)).unwrap();
    let mut count = vec![0usize; n as usize];
    let ss = sessions(100_000);
    for s in &ss {
        count[r.route(s).unwrap().0 as usize] += 1;
    }
    for c in count {
        let share = c as f64 / ss.len() as f64;
        assert!((share - 1.0 / n as f64).abs() < 0.01, "share {share}");
    }
}

/// Adding replica N to N replicas: under ideal hashing each session moves independently with
/// probability p = 1/(N+1), so moved/total over n = 100k sessions has std sqrt(p(1-p)/n), at most
/// sqrt(0.25/1e5) = 0.0016 (p = 1/2 at N = 1). The bound 0.01 is over 6 std for every N here: a
/// failure means the hash is biased, not bad luck. Every moved session must move TO the new one.
#[test]
fn adding_a_replica_moves_about_one_in_n_plus_one_all_to_it() {
    let ss = sessions(100_000);
    for n in 1..=8u32 {
        let before = Router::new(ids(n)).unwrap();
        let mut after = before.clone();
        after.add_replica(ReplicaId(n)).unwrap();
        let mut moved = 0usize;
        for s in &ss {
            let a = before.route(s).unwrap();
            let b = after.route(s).unwrap();
            if a != b {
                moved += 1;
                assert_eq!(
                    b,
                    ReplicaId(n),
                    "{s} moved from {a} to {b}, not to the new replica"
                );
            }
        }
        let frac = moved as f64 / ss.len() as f64;
        let p = 1.0 / (n as f64 + 1.0);
        assert!(
            (frac - p).abs() < 0.01,
            "N = {n}: moved {frac}, expected {p}"
        );
    }
}

#[test]
fn removing_a_replica_moves_only_its_sessions() {
    let ss = sessions(100_000);
    let before = Router::new(ids(6)).unwrap();
    for gone in [0u32, 3, 5] {
        let mut after = before.clone();
        after.remove_replica(ReplicaId(gone)).unwrap();
        let mut moved = 0usize;
        for s in &ss {
            let a = before.route(s).unwrap();
            let b = after.route(s).unwrap();
            if a == ReplicaId(gone) {
                moved += 1;
                assert_ne!(b, ReplicaId(gone));
            } else {
                assert_eq!(
                    a, b,
                    "{s} was on {a}, not the removed replica, but moved to {b}"
                );
            }
        }
        assert!(moved > 0);
    }
}

#[test]
fn errors_and_counters() {
    let mut r = Router::new([]).unwrap();
    assert_eq!(r.route("x"), Err(RouterError::NoReplicas));
    r.add_replica(ReplicaId(7)).unwrap();
    assert_eq!(
        r.add_replica(ReplicaId(7)),
        Err(RouterError::DuplicateReplica(ReplicaId(7)))
    );
    assert_eq!(
        r.remove_replica(ReplicaId(1)),
        Err(RouterError::UnknownReplica(ReplicaId(1)))
    );
    assert_eq!(
        r.finish(ReplicaId(1)),
        Err(RouterError::UnknownReplica(ReplicaId(1)))
    );
    let a = r.dispatch("s").unwrap();
    assert_eq!(a, ReplicaId(7));
    r.dispatch("t").unwrap();
    r.finish(a).unwrap();
    r.record_prefill(a, 100, 25).unwrap();
    let snap = r.snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].routed, 2);
    assert_eq!(snap[0].in_flight, 1);
    assert_eq!(snap[0].prompt_tokens, 100);
    assert_eq!(snap[0].prefix_hit_tokens, 25);
    assert_eq!(snap[0].prefix_hit_rate, 0.25);
}
