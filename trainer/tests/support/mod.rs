//! Helpers shared by the tests that run the `sluice` binary (each test file uses some).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub const BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// The repository root (configs/ lives there).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn sluice(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        // Tests run checked (kernels/src/debug.rs); the binary's default is off.
        .env("SLUICE_DEBUG", "1")
        .current_dir(root())
        .output()
        .expect("run sluice")
}

pub fn run_ok(args: &[&str]) -> String {
    let out = sluice(args);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "sluice {args:?} failed:\n{text}");
    text
}

/// metrics.jsonl without the wall-time fields (every key with "wall" in its name).
pub fn metrics_without_wall(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut()
                .unwrap()
                .retain(|k, _| !k.contains("wall"));
            v
        })
        .collect()
}

pub fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// The learner-vs-behavior mismatch keys of every RL metrics line and of summary.json.
pub const MISMATCH_KEYS: [&str; 12] = [
    "mismatch.lag0.tokens",
    "mismatch.lag0.abs_diff_mean",
    "mismatch.lag0.abs_diff_max",
    "mismatch.lag0.k3_kl",
    "mismatch.lagpos.tokens",
    "mismatch.lagpos.abs_diff_mean",
    "mismatch.lagpos.abs_diff_max",
    "mismatch.lagpos.k3_kl",
    "is_clip_fraction",
    "is_gated_low_fraction",
    "is_gated_high_fraction",
    "is_accepted_fraction",
];

/// Zero mismatch says something only over enough tokens: the run compared at least `min`
/// zero-lag tokens, and none of them differed from the rollout's log-prob in any bit.
pub fn assert_zero_mismatch(s: &serde_json::Value, min: u64, what: &str) {
    let n = s["zero_lag_tokens"].as_u64().unwrap();
    eprintln!("{what}: {n} zero-lag tokens");
    assert!(
        n >= min,
        "{what}: only {n} zero-lag tokens (at least {min})"
    );
    assert_eq!(s["zero_lag_mismatch_tokens"], 0, "{what}");
}

/// No trained token is older than the version gate allows: in every RL metrics line of the
/// run folder, the lag histogram is empty above the run's buffer.tau.
pub fn assert_no_lag_above_tau(out: &Path) {
    let cfg: toml::Table = std::fs::read_to_string(out.join("config.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let tau = cfg["buffer"]["tau"].as_integer().unwrap() as usize;
    let mut trained = 0;
    for l in metrics_without_wall(out) {
        if !l["stage"].as_str().unwrap().starts_with("rl#") {
            continue;
        }
        let hist: Vec<u64> = l["policy_lag_hist"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        trained = hist.iter().sum();
        assert!(
            hist.iter().skip(tau + 1).all(|&n| n == 0),
            "step {}: tokens trained at a lag above tau = {tau}: {hist:?}",
            l["step"]
        );
    }
    assert!(trained > 0, "no RL token was trained");
}
