//! `sluice bench`: every case becomes one row of the JSONL file the moment it finishes, the
//! report is built from that file, and the timed loop allocates nothing on the emulator (the
//! killed run: trainer/tests/bench_kill.rs). No timing is asserted: timings belong in benches.

use sluice_kernels::bench::{read_rows, TimingConfig};
use sluice_kernels::bench_cases::Preset;
use sluice_kernels::Device;
use sluice_trainer::bench_cmd::{run_bench, BenchOptions};
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn quick_timing() -> TimingConfig {
    TimingConfig {
        warmup: 1,
        samples: 3,
        ..TimingConfig::default()
    }
}

fn opts<'a>(
    device: Device,
    filter: Option<&'a str>,
    preset: Preset,
    jsonl: &'a Path,
) -> BenchOptions<'a> {
    BenchOptions {
        device,
        filter,
        preset,
        timing: quick_timing(),
        jsonl: Some(jsonl),
        json: None,
        markdown: None,
        verified: None,
        profile: false,
    }
}

#[test]
fn bench_reports_every_matching_case() {
    let dir = scratch("cpu");
    let jsonl = dir.join("rows.jsonl");
    let json = dir.join("bench.json");
    let mut o = opts(Device::Cpu, Some("topk"), Preset::Quick, &jsonl);
    o.json = Some(&json);
    let out = run_bench(&o).unwrap();
    assert_eq!(out.failed, 0);
    assert!(
        out.report
            .contains("| topk | forward | default | T=4096 E=256 k=8 f32 | wall |"),
        "{}",
        out.report
    );
    assert!(
        out.report.contains("wall clock (not a GPU"),
        "{}",
        out.report
    );
    let rows = read_rows(&jsonl).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].op(), "topk");
    assert!(rows[0].median_s().unwrap() > 0.0);
    assert_eq!(rows[0].0["clock"], "wall");
    let parsed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(parsed.as_array().unwrap().len(), 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// The dry run's shapes on the emulator: one row per case, every op present forward (and
/// backward where it has one), both GEMM paths, the model steps, and no fresh storage
/// allocation inside any op's timed loop (outputs come from the bench's pool; the count is the
/// tensors' own counter).
#[test]
fn tiny_preset_on_emu_allocates_nothing_in_the_timed_loop() {
    let dir = scratch("emu");
    let jsonl = dir.join("rows.jsonl");
    let out = run_bench(&opts(Device::Emu, None, Preset::Tiny, &jsonl)).unwrap();
    assert_eq!(out.failed, 0, "{}", out.report);
    let rows = read_rows(&jsonl).unwrap();
    let cases = sluice_trainer::bench_cmd::cases(Preset::Tiny).unwrap();
    assert_eq!(rows.len(), cases.len());
    for r in &rows {
        if r.0["skipped"].is_string() {
            assert_eq!(
                r.op(),
                "cublas_gemm_bf16",
                "only cuBLAS may skip off a GPU: {:?}",
                r.0
            );
            continue;
        }
        if r.pass() == "step" {
            // A train step updates the router's weights, so the MoE's expert segments (and the
            // sizes of their buffers) change from run to run: the pool cannot always match a
            // size. The row reports the count; it is not held to 0.
            assert!(r.0["timed_allocs"].is_u64(), "{:?}", r.0);
            continue;
        }
        assert_eq!(r.0["timed_allocs"], 0, "{:?}", r.0);
        assert_eq!(r.0["allocs_per_run"], 0, "{:?}", r.0);
    }
    let have = |op: &str, pass: &str, path: &str| {
        rows.iter()
            .any(|r| r.op() == op && r.pass() == pass && (path.is_empty() || r.0["path"] == path))
    };
    for (op, pass, path) in [
        ("gemm", "forward", "mma"),
        ("gemm", "forward", "wgmma"),
        ("attention_forward", "forward", ""),
        ("attention_backward", "backward", ""),
        ("moe_forward", "forward", ""),
        ("moe_backward", "backward", ""),
        ("d2d_copy", "ceiling", ""),
        ("train_step", "step", "micro"),
        ("decode_step", "step", "micro"),
    ] {
        assert!(have(op, pass, path), "no {op} {pass} {path} row");
    }
    // The launch counter saw the kernels.
    let gemm = rows.iter().find(|r| r.op() == "gemm").unwrap();
    assert_eq!(gemm.0["launches_per_run"], 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// The same on the CPU: its references allocate their results, and the row says so (the
/// counter is not blind).
#[test]
fn cpu_references_show_their_allocations() {
    let dir = scratch("cpu-allocs");
    let jsonl = dir.join("rows.jsonl");
    run_bench(&opts(Device::Cpu, Some("rmsnorm"), Preset::Tiny, &jsonl)).unwrap();
    let rows = read_rows(&jsonl).unwrap();
    assert!(
        rows[0].0["timed_allocs"].as_u64().unwrap() >= 3,
        "{:?}",
        rows[0].0
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_with_no_matching_case_is_an_error() {
    let dir = scratch("none");
    let jsonl = dir.join("rows.jsonl");
    let err = run_bench(&opts(
        Device::Cpu,
        Some("no-such-op"),
        Preset::Quick,
        &jsonl,
    ))
    .err()
    .expect("an error");
    assert!(err.to_string().contains("no-such-op"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--profile` on emu adds the profiler's counters and the bound to every row, in the report
/// and in the JSON; off emu it is an error that says why.
#[test]
fn bench_profile_adds_counters_and_the_bound_on_emu() {
    let dir = scratch("profile");
    let jsonl = dir.join("rows.jsonl");
    let json = dir.join("bench.json");
    let mut o = opts(Device::Emu, Some("rmsnorm"), Preset::Quick, &jsonl);
    o.json = Some(&json);
    o.profile = true;
    let out = run_bench(&o).unwrap();
    assert!(out.report.contains("H200 bound"), "{}", out.report);
    assert!(
        out.report.contains("| rmsnorm | T=1024 d=1024 f32 | 1 |"),
        "{}",
        out.report
    );
    let parsed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = parsed.as_array().unwrap();
    // `rmsnorm` selects the forward and rmsnorm_backward (bench_cases/layer.rs).
    let ops: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["rmsnorm", "rmsnorm_backward"]);
    assert!(!rows[1]["profile"]["kernels"].as_array().unwrap().is_empty());
    let profile = &rows[0]["profile"];
    assert_eq!(profile["kernels"].as_array().unwrap().len(), 1);
    assert!(
        profile["kernels"][0]["totals"]["global_load_requests"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(profile["bound"]["seconds"].as_f64().unwrap() > 0.0);

    let mut on_cpu = opts(Device::Cpu, Some("rmsnorm"), Preset::Quick, &jsonl);
    on_cpu.profile = true;
    let err = run_bench(&on_cpu).err().expect("--profile needs emu");
    assert!(err.to_string().contains("--device emu"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--op` takes a comma-separated list: a case runs if its op contains any of the names.
#[test]
fn a_list_of_ops_selects_each() {
    let dir = scratch("list");
    let jsonl = dir.join("rows.jsonl");
    run_bench(&opts(
        Device::Cpu,
        Some("topk, rmsnorm"),
        Preset::Tiny,
        &jsonl,
    ))
    .unwrap();
    let ops: Vec<String> = read_rows(&jsonl)
        .unwrap()
        .iter()
        .map(|r| r.op().to_string())
        .collect();
    // A name selects every op containing it: rmsnorm_backward too.
    assert_eq!(ops, ["topk", "rmsnorm", "rmsnorm_backward"]);
    std::fs::remove_dir_all(&dir).ok();
}
