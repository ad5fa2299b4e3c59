//! `sluice bench` killed mid-run keeps every row it finished in its JSONL file (rows are
//! written and synced as each case finishes), and the report can be rebuilt from the cut file.

use sluice_kernels::bench::read_rows;
use sluice_kernels::bench_cases::Preset;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// Killed after its first rows land, the bench leaves every row it reported finished in the
/// JSONL, each a whole JSON object, and the report can be rebuilt from the cut file.
#[test]
fn a_killed_bench_keeps_every_finished_row() {
    use std::io::{BufRead, BufReader};
    let dir = std::env::temp_dir().join(format!("sluice-bench-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jsonl = dir.join("rows.jsonl");
    let mut child = std::process::Command::new(BIN)
        .env("SLUICE_DEBUG", "1")
        .args([
            "bench",
            "--device",
            "cpu",
            "--preset",
            "quick",
            "--samples",
            "3",
            "--warmup",
            "1",
        ])
        .arg("--jsonl")
        .arg(&jsonl)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut finished = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("row ") {
            finished.push(rest.to_string());
            if finished.len() == 3 {
                break;
            }
        }
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the bench finished before it was killed");
    let total = sluice_trainer::bench_cmd::cases(Preset::Quick)
        .unwrap()
        .len();
    let rows = read_rows(&jsonl).unwrap();
    assert!(
        rows.len() >= finished.len() && rows.len() < total,
        "{} rows, {finished:?}",
        rows.len()
    );
    for (i, f) in finished.iter().enumerate() {
        // "N written: OP SHAPE"
        let (_, what) = f.split_once(" written: ").unwrap();
        let got = format!("{} {}", rows[i].op(), rows[i].0["shape"].as_str().unwrap());
        assert_eq!(got, what, "row {}", i + 1);
    }
    let report = sluice_trainer::bench_cmd::report_from(&jsonl, None).unwrap();
    assert!(report.contains(&format!("{} rows", rows.len())), "{report}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Bad settings are errors that name the setting, exit 2, before anything runs.
#[test]
fn bad_bench_input_exits_2_naming_it() {
    for (args, names) in [
        (&["--preset", "huge"][..], "huge"),
        (&["--samples", "0"][..], "--samples"),
        (&["--warmup", "0"][..], "--warmup"),
        (&["--full", "--preset", "tiny"][..], "--full"),
        (&["--device", "gpu"][..], "gpu"),
    ] {
        let out = std::process::Command::new(BIN)
            .env("SLUICE_DEBUG", "1")
            .arg("bench")
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(names), "{args:?}: {err}");
    }
}
