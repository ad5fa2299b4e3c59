//! The three publication paths inside a run (`sync.path` = inprocess | delta | disk) on the
//! virtual clock: corrupted deltas (a flipped byte, a truncation, a wrong base) are refused and
//! healed by a full sync; a torn file on disk is refused and rewritten; a writer killed in the
//! middle of its temp file leaves the replicas on the previous version; and after every
//! publication each replica holds exactly the learner's weights (by blake3, by the engine's
//! version, and by the zero-lag audit: tokens sampled by a replica at the learner's version
//! have the learner's log-prob bit for bit).

mod stage;

use sluice_runtime::clock::CostModel;
use sluice_runtime::sync::disk::{weights_file_name, POINTER_FILE};
use sluice_runtime::sync::{SyncFault, SyncOptions, SyncPath};
use sluice_runtime::trajectory::WeightVersion;
use stage::{both_tasks, Recorder, Setup};
use std::path::PathBuf;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-sync-run-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Checks what the barriers saw: after each learner step every replica runs the learner's
/// weights (the expected version, its blake3, the engine's version), except where `behind`
/// says the replicas were left on an older version (a killed writer).
fn assert_barriers(rec: &Recorder, steps: u64, behind: &[(u64, u64)]) {
    // A barrier after every step but the last.
    assert_eq!(rec.barriers.len() as u64, steps - 1);
    let hash_at = |v: WeightVersion| {
        rec.barriers
            .iter()
            .find(|b| b.learner_version == v)
            .map(|b| b.learner_hash)
    };
    for b in &rec.barriers {
        let expected = behind
            .iter()
            .find(|&&(at, _)| at == b.learner_version.0)
            .map_or(b.learner_version, |&(_, held)| WeightVersion(held));
        for (i, &(version, hash, engine_version)) in b.replicas.iter().enumerate() {
            assert_eq!(
                version,
                Some(expected),
                "replica {i} at {}",
                b.learner_version
            );
            assert_eq!(engine_version, expected, "replica {i}'s engine");
            if expected == b.learner_version {
                assert_eq!(
                    hash,
                    Some(b.learner_hash),
                    "replica {i} at {}: not the learner's bytes",
                    b.learner_version
                );
            } else {
                assert_eq!(hash, hash_at(expected), "replica {i} holds {expected}");
            }
        }
    }
}

fn assert_zero_lag_exact(report: &sluice_runtime::system::StageReport) {
    assert!(
        report.learner.zero_lag_tokens >= 50,
        "{} zero-lag tokens",
        report.learner.zero_lag_tokens
    );
    assert_eq!(report.learner.zero_lag_mismatch_tokens, 0);
}

#[test]
fn corrupted_deltas_are_refused_and_healed_by_a_full_sync() {
    let mut s = Setup::new(both_tasks(20.0));
    s.steps = 8;
    s.barrier_every = Some(1);
    s.sync = SyncOptions {
        path: SyncPath::Delta,
        faults: vec![
            SyncFault::FlipByte {
                version: 2,
                replica: 0,
            },
            SyncFault::Truncate {
                version: 3,
                replica: 1,
            },
            SyncFault::WrongBase {
                version: 5,
                replica: 0,
            },
        ],
        ..SyncOptions::default()
    };
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_eq!(report.learner.steps, 8);
    assert_eq!(report.publications, 8);
    let c = &report.rollout;
    assert_eq!(c.sync_refused, 3, "each corrupted delta is refused once");
    assert_eq!(c.sync_full_resyncs, 3);
    // Every publication reached both replicas exactly once, three of them as full images (the
    // last one, published as the stage ends, is not installed: the stage is over).
    assert_eq!(rec.syncs.len(), 14);
    let full: Vec<(usize, u64)> = rec
        .syncs
        .iter()
        .filter(|e| e.encoding == "full")
        .map(|e| (e.replica, e.version.0))
        .collect();
    assert_eq!(full, vec![(0, 2), (1, 3), (0, 5)]);
    assert!(rec
        .syncs
        .iter()
        .filter(|e| e.encoding != "full")
        .all(|e| e.encoding.starts_with("delta:")));
    rec.assert_every_install_is_the_learners();
    assert_barriers(&rec, 8, &[]);
    assert_zero_lag_exact(&report);
    // The metrics lines: every step published, as deltas.
    for line in &rec.lines {
        let enc = line["sync_encoding"].as_str().unwrap();
        assert!(
            enc.split('|').all(|l| l.starts_with("delta:")),
            "sync_encoding {enc}"
        );
        assert!(line["sync_bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(rec.lines.last().unwrap()["sync_refused"], 3);
    // The refusals are on the trace's health track with their reasons.
    let refusals: Vec<&str> = report
        .trace
        .spans
        .iter()
        .filter(|sp| sp.name.contains("refused"))
        .map(|sp| sp.args[0].1.as_str())
        .collect();
    assert_eq!(refusals.len(), 3);
    assert!(refusals[2].contains("applies to v3"), "{}", refusals[2]);
}

#[test]
fn every_path_trains_the_same_weights_when_sync_costs_nothing() {
    // With the per-byte sync charges at 0 the three paths cost the same on the virtual clock,
    // so the runs interleave identically, and the replicas must have run on identical weights
    // for the learner to end on identical bits.
    let dir = scratch("same");
    let mut runs = Vec::new();
    for path in [
        SyncPath::InProcess,
        SyncPath::Delta,
        SyncPath::Disk(dir.clone()),
    ] {
        let mut s = Setup::new(both_tasks(20.0));
        s.steps = 6;
        s.cost = CostModel {
            sync_encode_byte_us: 0.0,
            sync_transfer_byte_us: 0.0,
            sync_apply_byte_us: 0.0,
            sync_write_byte_us: 0.0,
            ..CostModel::default()
        };
        s.sync = SyncOptions {
            path: path.clone(),
            ..SyncOptions::default()
        };
        let mut rec = Recorder::default();
        let (report, weights) = s.run(&mut rec);
        assert_eq!(report.learner.steps, 6);
        rec.assert_every_install_is_the_learners();
        assert_zero_lag_exact(&report);
        runs.push((path.name(), rec, weights));
    }
    let strip = |l: &serde_json::Value| {
        let mut l = l.clone();
        let m = l.as_object_mut().unwrap();
        for k in ["wall_s", "sync_bytes", "sync_encoding"] {
            m.remove(k);
        }
        l
    };
    let (_, base, w0) = &runs[0];
    for (name, rec, w) in &runs[1..] {
        assert!(
            w == w0,
            "{name}: the learner's final weights differ from inprocess"
        );
        assert_eq!(rec.lines.len(), base.lines.len());
        for (a, b) in rec.lines.iter().zip(&base.lines) {
            assert_eq!(strip(a), strip(b), "{name}");
        }
    }
    // What each path logged per publication.
    let full = runs[0].1.lines[0]["sync_bytes"].as_u64().unwrap() / 2;
    for (name, rec, _) in &runs {
        for line in &rec.lines {
            let bytes = line["sync_bytes"].as_u64().unwrap();
            let enc = line["sync_encoding"].as_str().unwrap();
            match *name {
                "inprocess" => assert_eq!((bytes, enc), (2 * full, "inprocess")),
                // Both replicas hold the same base: one delta, sent twice, under the full size.
                "delta" => {
                    assert!(enc.starts_with("delta:") && !enc.contains('|'), "{enc}");
                    assert!(bytes < 2 * full, "{bytes} bytes for two {full}-byte images");
                }
                // Each replica reads the whole file: the views (the arena less its padding)
                // and the safetensors header.
                _ => {
                    assert_eq!(enc, "disk");
                    assert!(
                        bytes > 2 * full * 9 / 10 && bytes < 2 * (full + 16384),
                        "{bytes} bytes for two {full}-byte images"
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disk_path_hot_reloads_heals_a_torn_file_and_survives_a_killed_writer() {
    let dir = scratch("disk");
    // A stale version of another run in the folder must never be loaded.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(weights_file_name(WeightVersion(40))), b"stale").unwrap();
    std::fs::write(dir.join(POINTER_FILE), b"{\"stale\":true}").unwrap();
    let mut s = Setup::new(both_tasks(20.0));
    s.steps = 8;
    s.barrier_every = Some(1);
    s.sync = SyncOptions {
        path: SyncPath::Disk(dir.clone()),
        faults: vec![
            SyncFault::TornFile { version: 3 },
            SyncFault::KilledWriter { version: 5 },
        ],
        ..SyncOptions::default()
    };
    let mut rec = Recorder::default();
    let (report, _) = s.run(&mut rec);
    assert_eq!(report.learner.steps, 8);
    let c = &report.rollout;
    // Both replicas polled the torn file and refused it; it was rewritten once.
    assert_eq!(c.sync_refused, 2);
    assert_eq!(c.sync_full_resyncs, 1);
    assert_eq!(c.sync_failed_writes, 1);
    assert_eq!(report.publications, 7, "version 5 was never published");
    rec.assert_every_install_is_the_learners();
    // Version 5 never reached a replica; every other version reached both (but the last,
    // published as the stage ends).
    let mut installed: Vec<(usize, u64)> =
        rec.syncs.iter().map(|e| (e.replica, e.version.0)).collect();
    installed.sort();
    let expected: Vec<(usize, u64)> = (0..2)
        .flat_map(|r| [1, 2, 3, 4, 6, 7].map(|v| (r, v)))
        .collect();
    assert_eq!(installed, expected);
    // After step 5 the replicas still ran version 4 (the pointer never moved), bit for bit.
    assert_barriers(&rec, 8, &[(5, 4)]);
    assert_zero_lag_exact(&report);
    let line5 = &rec.lines[4];
    assert_eq!(line5["sync_encoding"], "disk:failed");
    assert_eq!(line5["sync_bytes"], 0);
    // The dead writer's half file is still there and was never read; the pointer names v8;
    // the folder keeps the last three versions; the stale files are gone.
    let tmp = dir.join(format!("{}.tmp", weights_file_name(WeightVersion(5))));
    assert!(tmp.is_file());
    let pointer = std::fs::read_to_string(dir.join(POINTER_FILE)).unwrap();
    assert!(pointer.contains("\"version\":8"), "{pointer}");
    let mut weights: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    weights.sort();
    assert_eq!(
        weights,
        [
            "weights-v6.safetensors",
            "weights-v7.safetensors",
            "weights-v8.safetensors"
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
