//! Tests of the profile cases: every op has one at both presets, the small ones build and run
//! on the CPU, the doc FLOPs and the strata are what DESIGN 9.1 and the docs say.
use super::*;
use crate::runner::OpCall;

/// Ops whose compulsory bytes count only the touched part of an input.
const PARTIAL: &[&str] = &[
    "paged_attention",
    "kv_append",
    "paged_prefill",
    "embedding",
    "muon_gather",
    "muon_apply",
];

#[test]
fn every_runner_op_has_a_case() {
    assert_eq!(ops().len(), runner::ops().len());
    for (a, b) in ops().iter().zip(runner::ops()) {
        assert_eq!(*a, b.name);
    }
    for op in ops() {
        for preset in [Preset::Small, Preset::Doc] {
            let s = shape(op, preset);
            assert!(s.as_deref().is_some_and(|s| !s.is_empty()), "{op}");
        }
    }
}

#[test]
fn unknown_op_is_an_error_naming_it() {
    let err = case("no_such_op", Preset::Small, &Backend::Cpu)
        .err()
        .expect("an unknown op is an error");
    assert!(matches!(err, Error::Invalid(_)), "{err}");
    assert!(err.to_string().contains("no_such_op"), "{err}");
    assert!(shape("no_such_op", Preset::Doc).is_none());
}

/// Every small case builds, passes the runner's checks and runs on the CPU; its bytes are
/// its inputs and outputs (or less, where only part of an input is touched).
#[test]
fn small_cases_run_on_cpu() {
    for op in ops() {
        let c = case(op, Preset::Small, &Backend::Cpu).unwrap();
        assert_eq!(c.op, op);
        assert!(c.op_flops >= 0.0 && c.compulsory_bytes > 0.0, "{op}");
        let inputs: f64 = c.tensors.values().map(|t| t.len_bytes() as f64).sum();
        let spec = runner::find(op).unwrap();
        let call = OpCall::new(spec, c.tensors, c.params).unwrap_or_else(|e| panic!("{op}: {e}"));
        let outputs = (spec.run)(&Backend::Cpu, &call).unwrap_or_else(|e| panic!("{op}: {e}"));
        let written: f64 = outputs.iter().map(|(_, t)| t.len_bytes() as f64).sum();
        if PARTIAL.contains(&op) {
            assert!(c.compulsory_bytes < inputs + written, "{op}");
        } else {
            assert_eq!(c.compulsory_bytes, inputs + written, "{op}");
        }
    }
}

/// Every small case profiles on the emulator in well under 2 s (ignored: run with
/// `--ignored --nocapture` to see the times).
#[test]
#[ignore = "prints timings (no timing is asserted in tests); run with --ignored --nocapture"]
fn small_cases_profile_quickly_on_emu() {
    let emu = Backend::emu_with_seed(0);
    // The second round runs with every kernel family already loaded.
    for round in ["cold", "warm"] {
        let mut total = 0.0;
        for op in ops() {
            let start = std::time::Instant::now();
            let p = super::super::profile_op(&emu, op, Preset::Small, None)
                .unwrap_or_else(|e| panic!("{op}: {e}"));
            let s = start.elapsed().as_secs_f64();
            total += s;
            println!(
                "{round} {op:20} {s:6.2} s  {:3} launches  {}",
                p.kernels.len(),
                p.shape
            );
            assert!(!p.kernels.is_empty(), "{op}");
        }
        println!("{round} total {total:.2} s");
    }
}

/// Every doc case builds and profiles on the emulator with 8 sampled blocks per launch;
/// prints the time and the peak resident memory of each (ignored: minutes; run with
/// `--ignored --nocapture`; SLUICE_PROFILE_OPS=a,b limits it to some ops).
#[test]
#[ignore = "minutes on 2 cores; scripts/profile-doc is the supported way to profile the doc shapes"]
fn doc_cases_profile_sampled_on_emu() {
    let emu = Backend::emu_with_seed(0);
    let only = std::env::var("SLUICE_PROFILE_OPS").unwrap_or_default();
    let peak_mib = || -> f64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    for op in ops() {
        if !only.is_empty() && !only.split(',').any(|o| o == op) {
            continue;
        }
        // Resets the peak resident size (Linux: clear_refs 5).
        std::fs::write("/proc/self/clear_refs", "5").ok();
        let start = std::time::Instant::now();
        let p = super::super::profile_op(&emu, op, Preset::Doc, Some(8))
            .unwrap_or_else(|e| panic!("{op}: {e}"));
        println!(
            "{op:20} {:7.2} s  peak {:7.0} MiB  {:3} launches  {}",
            start.elapsed().as_secs_f64(),
            peak_mib(),
            p.kernels.len(),
            p.shape
        );
    }
}

#[test]
fn doc_flops_follow_design_9_1() {
    let flops = |op: &str| plan(op, Preset::Doc).unwrap().flops;
    assert_eq!(flops("gemm"), 2.0 * 4096f64.powi(3));
    let attn = 4.0 * 128.0 * 32.0 * 8.0 * (4096.0 * 4097.0 / 2.0);
    assert_eq!(flops("attention_forward"), attn);
    assert_eq!(flops("attention_backward"), 2.5 * attn);
    assert_eq!(
        flops("paged_attention"),
        4.0 * 128.0 * 32.0 * 256.0 * 4096.0
    );
    let moe = 2.0 * 16384.0 * 2048.0 * 64.0 + 6.0 * 16384.0 * 8.0 * 2048.0 * 1024.0;
    assert_eq!(flops("moe_forward"), moe);
    assert_eq!(flops("moe_backward"), 2.0 * moe);
}

#[test]
fn strata_run_index_producers_in_full() {
    let moe = plan("moe_forward", Preset::Small).unwrap().strata;
    for k in [
        "moe_sort_count",
        "moe_sort_scan",
        "moe_sort_scatter",
        "topk_f32_c2",
        "gemm_f32",
        "elementwise_softmax_f32",
        "moe_gates",
    ] {
        assert_eq!(moe(k), Strata::Full, "{k}");
    }
    assert_eq!(moe("gemm_bf16_mma"), Strata::Axis(0));
    assert_eq!(moe("moe_combine"), Strata::Uniform);
    let attn = plan("attention_backward", Preset::Small).unwrap().strata;
    assert_eq!(attn("attention_forward_bf16"), Strata::Axis(0));
    assert_eq!(attn("attention_bwd_dkdv_bf16"), Strata::Axis(0));
    assert_eq!(attn("attention_bwd_delta_bf16"), Strata::Uniform);
}
