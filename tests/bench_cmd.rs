//! `sluice bench` runs its cases and reports every one (no timing is asserted: timings belong
//! in benches, not tests).

use sluice_kernels::Device;
use sluice_trainer::bench_cmd::{run_bench, BenchOptions};

#[test]
fn bench_reports_every_matching_case() {
    let dir = std::env::temp_dir().join(format!("sluice-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let opts = BenchOptions {
        device: Device::Cpu,
        filter: Some("topk"),
        quick: true,
        budget_s: 0.0,
        json: Some(&json),
        markdown: None,
        profile: false,
    };
    let report = run_bench(&opts).unwrap();
    assert!(
        report.contains("| topk | T=4096 E=256 k=8 f32 |"),
        "{report}"
    );
    let parsed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = parsed.as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["op"], "topk");
    assert!(rows[0]["median_s"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_with_no_matching_case_is_an_error() {
    let opts = BenchOptions {
        device: Device::Cpu,
        filter: Some("no-such-op"),
        quick: true,
        budget_s: 0.0,
        json: None,
        markdown: None,
        profile: false,
    };
    let err = run_bench(&opts).expect_err("an error");
    assert!(err.to_string().contains("no-such-op"), "{err}");
}

/// `--profile` on emu adds the profiler's counters and the bound to every row, in the report
/// and in the JSON; off emu it is an error that says why.
#[test]
fn bench_profile_adds_counters_and_the_bound_on_emu() {
    let dir = std::env::temp_dir().join(format!("sluice-bench-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let opts = BenchOptions {
        device: Device::Emu,
        filter: Some("rmsnorm"),
        quick: true,
        budget_s: 0.0,
        json: Some(&json),
        markdown: None,
        profile: true,
    };
    let report = run_bench(&opts).unwrap();
    assert!(report.contains("H200 bound"), "{report}");
    assert!(
        report.contains("| rmsnorm | T=1024 d=1024 f32 | 1 |"),
        "{report}"
    );
    let parsed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = parsed.as_array().unwrap();
    assert_eq!(rows.len(), 1);
    let profile = &rows[0]["profile"];
    assert_eq!(profile["kernels"].as_array().unwrap().len(), 1);
    assert!(
        profile["kernels"][0]["totals"]["global_load_requests"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(profile["bound"]["seconds"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(&dir).ok();

    let on_cpu = BenchOptions {
        device: Device::Cpu,
        filter: Some("rmsnorm"),
        quick: true,
        budget_s: 0.0,
        json: None,
        markdown: None,
        profile: true,
    };
    let err = run_bench(&on_cpu).expect_err("--profile needs emu");
    assert!(err.to_string().contains("--device emu"), "{err}");
}
