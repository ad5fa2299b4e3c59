//! `sluice train` from the outside: the run folder of DESIGN 7.1, replay determinism (cpu and
//! emu), and bad configs (one clear error naming the key, exit code 2, no run folder).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use support::*;

/// A short run of configs/tiny.toml: its supervised warm-up, then 12 async RL steps with
/// faulty, heavy-tailed environments.
fn short_config(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(root().join("configs/tiny.toml"))
        .unwrap()
        .replace("steps = 40", "steps = 12")
        .replace("eval_problems = 32", "eval_problems = 8")
        // The baselines have their own test (tests/arms.rs).
        + "\n[baselines]\nablation = false\nrft = false\n";
    let p = dir.join("short.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_run_leaves_the_run_folder() {
    let dir = scratch("folder");
    let cfg = short_config(&dir);
    let out = dir.join("run");
    let text = run_ok(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(text.contains("held-out pass rate before RL"), "{text}");
    // Drawn without replacement: the 8 problems asked for are 8 distinct ones.
    assert!(text.contains("/8 distinct problems"), "{text}");
    for f in [
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "trace.json",
        "final.safetensors",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let s = summary(&out);
    for key in [
        "final_weights_sha256",
        "learner_steps",
        "samples_trained",
        "wall_s",
        "clock",
        "effective_tokens_per_s",
        "gradient_tokens_per_s",
        "raw_tokens_per_s",
        "token_accept_rate",
        "stale_drop_rate",
        "env_drop_rate",
        "group_dup_rate",
        "zero_lag_tokens",
        "zero_lag_mismatch_tokens",
    ] {
        assert!(s.get(key).is_some(), "summary.json lacks {key}");
    }
    for key in MISMATCH_KEYS {
        assert!(s[key].is_number(), "summary.json lacks {key}");
    }
    // Lag 0 exactly 0 over enough tokens; drift, where any, finite and non-negative.
    assert!(s["mismatch.lag0.tokens"].as_u64().unwrap() >= 1000, "{s}");
    assert_eq!(s["mismatch.lag0.abs_diff_max"], 0.0, "{s}");
    assert_eq!(s["mismatch.lag0.k3_kl"], 0.0, "{s}");
    for key in ["mismatch.lagpos.abs_diff_mean", "mismatch.lagpos.k3_kl"] {
        assert!(s[key].as_f64().unwrap() >= 0.0, "{key}: {s}");
    }
    let clip = s["is_clip_fraction"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&clip), "{s}");
    assert!((clip + s["is_accepted_fraction"].as_f64().unwrap() - 1.0).abs() < 1e-9);
    let svg = std::fs::read_to_string(out.join("mismatch.svg")).expect("mismatch.svg");
    assert!(
        roxmltree::Document::parse(&svg).is_ok(),
        "mismatch.svg is not XML"
    );
    assert_eq!(s["learner_steps"], 12);
    // About 3,000 zero-lag tokens (a wall-clock run: the count varies).
    assert_zero_mismatch(&s, 1000, "the run folder's run");
    assert_no_lag_above_tau(&out);
    // Gradient-carrying throughput beside effective throughput: never above it.
    let (eff, grad) = (
        s["effective_tokens_per_s"].as_f64().unwrap(),
        s["gradient_tokens_per_s"].as_f64().unwrap(),
    );
    assert!(
        grad > 0.0 && grad <= eff,
        "gradient {grad} vs effective {eff}"
    );
    assert!(text.contains("gradient tok/s"), "the end table: {text}");
    assert!(text.contains("grad "), "the progress lines: {text}");
    // The clock every rate is per second of, in summary.json, the progress lines and the table.
    assert_eq!(s["clock"], "wall");
    assert!(text.contains("(wall clock)"), "the progress lines: {text}");
    assert!(
        text.contains("per second of the wall clock"),
        "the end table: {text}"
    );
    for task in ["sort", "tool"] {
        let t = &s["tasks"][task];
        for key in [
            "target_share",
            "learner_share",
            "pass_rate_before",
            "pass_rate_after",
        ] {
            assert!(t[key].is_number(), "tasks.{task}.{key}: {t}");
        }
        assert_eq!(t["held_out_problems"], 8, "tasks.{task}: {t}");
    }
    // Every RL metrics line carries DESIGN 9's keys.
    let lines = metrics_without_wall(&out);
    let rl: Vec<_> = lines.iter().filter(|l| l["stage"] == "rl#1").collect();
    assert_eq!(rl.len(), 12);
    for l in &rl {
        for key in [
            "step",
            "version",
            "loss",
            "grad_norm",
            "effective_tokens_per_s",
            "gradient_tokens_per_s",
            "raw_tokens_per_s",
            "token_accept_rate",
            "stale_drop_rate",
            "env_drop_rate",
            "group_dup_rate",
            "policy_lag_hist",
            "ratio_mean",
            "ratio_min",
            "ratio_max",
            "zero_lag_tokens",
            "zero_lag_mismatch_tokens",
            "reward_mean.sort",
            "learner_share.tool",
            "sync_bytes",
            "sync_encoding",
        ]
        .into_iter()
        .chain(MISMATCH_KEYS)
        {
            assert!(l.get(key).is_some(), "metrics line lacks {key}: {l}");
        }
        assert_eq!(l["mismatch.lag0.abs_diff_max"], 0.0, "{l}");
    }
    // The lines hold each step's tokens; summary.json their sum.
    let lag0: u64 = rl
        .iter()
        .map(|l| l["mismatch.lag0.tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(s["mismatch.lag0.tokens"], lag0);
    // The trace is Chrome trace JSON with the four kinds of span.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for cat in ["rollout", "environment", "learner", "weight sync"] {
        let n = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == cat)
            .count();
        assert!(n > 0, "no {cat} span in trace.json");
    }
    // `sluice eval` reads the run's own config for the task and prints both modes.
    let ck = out.join("final.safetensors");
    let text = run_ok(&[
        "eval",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--task",
        "tool",
        "--samples",
        "4",
        "--show",
        "1",
    ]);
    assert!(
        text.contains("greedy") && text.contains("sampled"),
        "{text}"
    );
    assert!(
        text.contains("<call>") || text.contains("<eot>"),
        "a transcript: {text}"
    );
    let o = sluice(&[
        "eval",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--task",
        "nosuch",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nosuch"));
    let o = sluice(&["eval", "--checkpoint", "no/such/file", "--task", "tool"]);
    assert_eq!(o.status.code(), Some(2));
    // A checkpoint folder of the run works too: its learner.safetensors is evaluated.
    let stage_end = out.join("checkpoints").join("000-end");
    let text = run_ok(&[
        "eval",
        "--checkpoint",
        stage_end.to_str().unwrap(),
        "--task",
        "sort",
        "--samples",
        "4",
    ]);
    assert!(
        text.contains("000-end on 4 distinct held-out problems") && text.contains("greedy"),
        "{text}"
    );
    // A folder that is not a checkpoint names what it lacks.
    let o = sluice(&[
        "eval",
        "--checkpoint",
        out.to_str().unwrap(),
        "--task",
        "sort",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("without learner.safetensors"));
    // The resolved config loads back.
    run_ok(&[
        "train",
        "--config",
        out.join("config.toml").to_str().unwrap(),
        "--out",
        dir.join("again").to_str().unwrap(),
        "--set",
        "run.replay=true",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn replay_pair(device: &str, cfg: &Path, dir: &Path) {
    let run = |name: &str, seed: &str| {
        let out = dir.join(name);
        let text = run_ok(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--device",
            device,
            "--seed",
            seed,
            "--set",
            "run.replay=true",
            "--out",
            out.to_str().unwrap(),
        ]);
        // Rates per virtual second are labelled so: the progress lines and the end table.
        assert!(text.contains("(virtual clock)"), "{device}: {text}");
        assert!(
            text.contains("per second of the virtual clock"),
            "{device}: {text}"
        );
        out
    };
    let a = run("a", "5");
    let b = run("b", "5");
    let c = run("c", "6");
    let (ma, mb) = (metrics_without_wall(&a), metrics_without_wall(&b));
    assert!(ma.len() >= 10);
    assert_eq!(
        ma, mb,
        "{device}: two replays of one seed wrote different metrics"
    );
    let (sa, sb, sc) = (summary(&a), summary(&b), summary(&c));
    assert_eq!(sa["clock"], "virtual");
    assert!(ma
        .iter()
        .filter(|l| l.get("clock").is_some())
        .all(|l| l["clock"] == "virtual"));
    assert_eq!(sa["final_weights_sha256"], sb["final_weights_sha256"]);
    assert_ne!(
        sa["final_weights_sha256"], sc["final_weights_sha256"],
        "{device}: another seed gave the same weights"
    );
}

#[test]
fn replay_runs_are_bit_reproducible_on_cpu() {
    let dir = scratch("replay-cpu");
    let cfg = short_config(&dir);
    replay_pair("cpu", &cfg, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes dir/emu.toml, the config of the emu runs: the tiny model of the gradient tests and the
/// raw-id tasks, a few steps of each stage. `model_extra` and `recall_extra` are lines added to
/// the `[model]` and `[tasks.recall]` sections.
fn tiny_emu_config(dir: &Path, model_extra: &str, recall_extra: &str) -> PathBuf {
    let text = format!(
        r#"
[model]
config = "configs/model/tiny.toml"
{model_extra}
[[stage]]
kind = "sft"
steps = 4
tasks = ["recall", "lookup"]
[[stage]]
kind = "rl"
steps = 6
tasks = ["recall", "lookup"]
[optim]
sft_batch = 8
[rollout]
max_new_tokens = 4
eval_problems = 4
[buffer]
group_size = 4
groups_per_step = 2
[tasks.recall]
kind = "recall"
items = 3
{recall_extra}
[tasks.lookup]
kind = "lookup"
"#
    );
    let path = dir.join("emu.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn replay_runs_are_bit_reproducible_on_emu() {
    // Every op runs through the emulated CUDA kernels: the tiny model of the gradient tests
    // and the raw-id tasks, a few steps of each stage.
    let dir = scratch("replay-emu");
    let cfg = tiny_emu_config(
        &dir,
        "",
        "faults = { crash = 0.05, timeout = 0.0, garbage = 0.05 }",
    );
    replay_pair("emu", &cfg, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_configs_name_the_key_exit_2_and_leave_no_folder() {
    let dir = scratch("bad");
    let cfg = short_config(&dir);
    let missing_task = dir.join("missing.toml");
    std::fs::write(
        &missing_task,
        "[[stage]]\nkind = \"rl\"\nsteps = 3\ntasks = [\"nosuch\"]\n",
    )
    .unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--set".into(), "buffer.nosuch=1".into()],
            "buffer.nosuch",
        ),
        (
            vec!["--set".into(), "buffer.tau=\"three\"".into()],
            "buffer.tau",
        ),
        (vec!["--set".into(), "buffer.tau=-1".into()], "buffer.tau"),
        (
            vec!["--set".into(), "buffer.group_size=0".into()],
            "buffer.group_size",
        ),
        (vec!["--set".into(), "buffer.eta=-1".into()], "buffer.eta"),
        (
            vec!["--config".into(), missing_task.to_str().unwrap().into()],
            "stage[0].tasks",
        ),
        (vec!["--device".into(), "gpu".into()], "run.device"),
        (
            vec!["--set".into(), "model.precision=\"fp16\"".into()],
            "model.precision",
        ),
        (
            vec!["--set".into(), "rollout.num_blocks=64".into()],
            "rollout.num_blocks",
        ),
        // A KV pool that holds not one block.
        (
            vec!["--set".into(), "rollout.kv_bytes=1".into()],
            "rollout.kv_bytes",
        ),
        // Zero advantages: an RL stage would train nothing.
        (
            vec!["--set".into(), "buffer.group_size=1".into()],
            "buffer.group_size",
        ),
        // Shorter than any engine step: every replica would be lost at every step.
        (
            vec!["--set".into(), "rollout.heartbeat_timeout_s=0.001".into()],
            "rollout.heartbeat_timeout_s",
        ),
        // Dynamic sampling with groups of one: every group would be dropped (the message
        // names buffer.group_size too).
        (
            vec![
                "--set".into(),
                "buffer.dynamic_sampling=true".into(),
                "--set".into(),
                "buffer.group_size=1".into(),
            ],
            "buffer.dynamic_sampling",
        ),
        (
            vec!["--set".into(), "buffer.dynamic_sampling_max_drops=0".into()],
            "buffer.dynamic_sampling_max_drops",
        ),
        (
            vec!["--set".into(), "loss.aggregation=\"sequence\"".into()],
            "loss.aggregation",
        ),
        (
            vec!["--set".into(), "loss.eps_low_neg=1.5".into()],
            "loss.eps_low_neg",
        ),
        // Decoupled PPO needs the PPO surrogate (the default mode is dis).
        (
            vec!["--set".into(), "loss.decoupled=true".into()],
            "loss.decoupled",
        ),
        // The regularizers (issue 28 item 7).
        (
            vec!["--set".into(), "loss.kl_estimator=\"k2\"".into()],
            "loss.kl_estimator",
        ),
        (
            vec!["--set".into(), "loss.kl_in=\"advantage\"".into()],
            "loss.kl_in",
        ),
        (
            vec!["--set".into(), "loss.kl_coef=-0.5".into()],
            "loss.kl_coef",
        ),
        (
            vec!["--set".into(), "loss.entropy_coef=-1".into()],
            "loss.entropy_coef",
        ),
        // A reference without a KL term (the message names loss.kl_coef too), and one that
        // is not a file.
        (
            vec![
                "--set".into(),
                "loss.kl_reference=\"configs/tiny.toml\"".into(),
            ],
            "loss.kl_coef",
        ),
        (
            vec![
                "--set".into(),
                "loss.kl_coef=0.1".into(),
                "--set".into(),
                "loss.kl_reference=\"no/such.safetensors\"".into(),
            ],
            "loss.kl_reference",
        ),
        // More minibatches than a learner step has groups.
        (
            vec!["--set".into(), "optim.minibatches=999".into()],
            "optim.minibatches",
        ),
        (
            vec!["--set".into(), "optim.epochs=0".into()],
            "optim.epochs",
        ),
    ];
    for (i, (args, key)) in cases.into_iter().enumerate() {
        let out = dir.join(format!("run{i}"));
        let mut full = vec!["train".to_string()];
        if !args.contains(&"--config".to_string()) {
            full.push("--config".into());
            full.push(cfg.to_str().unwrap().into());
        }
        full.extend(args.clone());
        full.push("--out".into());
        full.push(out.to_str().unwrap().into());
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let o = sluice(&refs);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(key),
            "{args:?}: the error does not name {key}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{args:?}: one clear line: {err}");
        assert!(!out.exists(), "{args:?}: a run folder was created");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The rollout strategies and objectives of issue 28 on the virtual clock, on the same replayed
/// run: off (the defaults), and with every async-compatible switch on together (dynamic
/// sampling, 2 minibatches x 2 epochs, four clip bounds, the prompt mean, decoupled PPO, the
/// entropy bonus, the KL to the reference in the loss), twice; over-sampling, sync-only, has
/// the next test. Off, groups whose rewards are all equal reach the learner (counted); on, they are dropped and re-sampled: none is trained (the cap of 32 drops per
/// learner step is never reached here); the 12 learner steps are 48 optimizer steps; the
/// lag-0 tokens still match the rollout bit for bit; and the two runs are the same run.
#[test]
fn issue_28_switches_together_keep_zero_mismatch_and_replay() {
    let dir = scratch("issue28-switches");
    let cfg = short_config(&dir);
    let switches = [
        "buffer.dynamic_sampling=true",
        "optim.minibatches=2",
        "optim.epochs=2",
        "loss.four_bounds=true",
        "loss.eps_low_neg=0.1",
        "loss.eps_high_neg=0.1",
        "loss.aggregation=\"prompt\"",
        "loss.mode=\"ppo\"",
        "loss.decoupled=true",
        "loss.entropy_coef=0.01",
        "loss.kl_coef=0.1",
    ];
    let run =
        |name: &str, on: bool| replayed_run(&dir, &cfg, name, if on { &switches[..] } else { &[] });
    let (off_dir, on_dir, again_dir) = (run("off", false), run("on", true), run("again", true));
    let (off, on) = (summary(&off_dir), summary(&on_dir));
    let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k}: {s}"));
    assert_eq!(n(&off, "zero_signal_groups_dropped"), 0, "{off}");
    assert!(n(&off, "zero_signal_groups_trained") > 0, "{off}");
    assert_eq!(n(&off, "optimizer_steps"), 12, "{off}");
    assert!(n(&on, "zero_signal_groups_dropped") > 0, "{on}");
    assert_eq!(n(&on, "zero_signal_groups_trained"), 0, "{on}");
    assert_eq!(on["learner_steps"], 12);
    assert_eq!(n(&on, "optimizer_steps"), 48, "{on}");
    assert_zero_mismatch(&on, 200, "issue 28 switches");
    // The entropy is logged with or without its bonus; the KL only with a reference, and the
    // first step's tokens were sampled by the reference's weights: KL exactly 0 there.
    let f = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k}: {s}"));
    assert!(f(&off, "entropy_mean") > 0.0 && f(&on, "entropy_mean") > 0.0);
    assert_eq!(f(&off, "kl_ref_mean"), 0.0, "no reference off");
    assert!(f(&on, "kl_ref_mean") > 0.0, "{on}");
    let first = metrics_without_wall(&on_dir)
        .into_iter()
        .find(|l| l.get("kl_ref_window").is_some())
        .expect("an RL metrics line");
    assert_eq!(first["kl_ref_window"], 0.0, "{first}");
    assert_eq!(
        metrics_without_wall(&on_dir),
        metrics_without_wall(&again_dir),
        "two replays with the switches on wrote different metrics"
    );
    assert_eq!(
        on["final_weights_sha256"],
        summary(&again_dir)["final_weights_sha256"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `sluice train --config CFG --set run.replay=true --set S... --out DIR/NAME`; returns the run
/// folder.
fn replayed_run(dir: &Path, cfg: &Path, name: &str, sets: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut args = vec![
        "train".to_string(),
        "--config".into(),
        cfg.to_str().unwrap().into(),
        "--set".into(),
        "run.replay=true".into(),
        "--out".into(),
        out.to_str().unwrap().into(),
    ];
    for set in sets {
        args.push("--set".into());
        args.push(set.to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_ok(&args);
    out
}

/// Over-sampling with partial rollout (issue 28 item 2) in sync mode, with every other issue-28
/// switch on (the entropy bonus and the KL to the reference included), twice on the virtual
/// clock: groups are aborted and resumed across a weight
/// version, the lag-0 tokens match the rollout bit for bit, and the two runs are the same run.
#[test]
fn over_sampling_with_the_issue_28_switches_keeps_zero_mismatch_and_replay() {
    let dir = scratch("issue28-over-sampling");
    let cfg = short_config(&dir);
    let switches = [
        "run.mode=\"sync\"",
        "rollout.over_sampling=1.5",
        "rollout.partial_rollout=true",
        "buffer.dynamic_sampling=true",
        "optim.minibatches=2",
        "loss.four_bounds=true",
        "loss.aggregation=\"prompt\"",
        "loss.mode=\"ppo\"",
        "loss.decoupled=true",
        "loss.entropy_coef=0.01",
        "loss.kl_coef=0.1",
    ];
    let run = |name: &str| replayed_run(&dir, &cfg, name, &switches);
    let (a_dir, b_dir) = (run("a"), run("b"));
    let a = summary(&a_dir);
    let os = &a["over_sampling"];
    let n = |k: &str| os[k].as_u64().unwrap_or_else(|| panic!("{k}: {os}"));
    assert!(n("groups_aborted") > 0, "{os}");
    assert!(n("groups_resumed") > 0, "{os}");
    assert!(n("resumed_tokens") > 0, "{os}");
    assert_eq!(n("discarded_tokens"), 0, "{os}");
    assert!(os["trained_mean_length"].as_f64().unwrap() > 0.0, "{os}");
    assert_eq!(a["learner_steps"], 12);
    assert_zero_mismatch(&a, 200, "over-sampling with partial rollout");
    assert_eq!(
        metrics_without_wall(&a_dir),
        metrics_without_wall(&b_dir),
        "two replays with over-sampling wrote different metrics"
    );
    assert_eq!(
        a["final_weights_sha256"],
        summary(&b_dir)["final_weights_sha256"]
    );
    assert_eq!(a["over_sampling"], summary(&b_dir)["over_sampling"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn print_defaults_is_configs_default_toml() {
    let out = run_ok(&["config", "--print-defaults"]);
    let file = std::fs::read_to_string(root().join("configs/default.toml")).unwrap();
    assert_eq!(out, file);
}

/// The last line of metrics.jsonl.
fn last_line(dir: &Path) -> serde_json::Value {
    metrics_without_wall(dir).pop().expect("a metrics line")
}

#[test]
fn every_sync_path_trains_the_same_weights_in_a_replay() {
    // Two replicas; the per-byte sync charges at 0 so the three paths cost the same on the
    // virtual clock: the runs must end on the same weights, so every replica ran on exactly
    // the learner's weights whichever way they travelled.
    let dir = scratch("sync-paths");
    let cfg = short_config(&dir);
    let run = |path: &str| {
        let out = dir.join(path);
        run_ok(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--set",
            "run.replay=true",
            "--set",
            "rollout.replicas=2",
            "--set",
            &format!("sync.path={path}"),
            "--set",
            "cost.sync_encode_byte_us=0",
            "--set",
            "cost.sync_transfer_byte_us=0",
            "--set",
            "cost.sync_apply_byte_us=0",
            "--set",
            "cost.sync_write_byte_us=0",
        ]);
        out
    };
    let base = run("inprocess");
    for path in ["delta", "disk"] {
        let out = run(path);
        assert_eq!(
            summary(&out)["final_weights_sha256"],
            summary(&base)["final_weights_sha256"],
            "sync.path={path}"
        );
        let lines = metrics_without_wall(&out);
        assert_eq!(lines.len(), metrics_without_wall(&base).len());
        for l in lines.iter().filter(|l| l["stage"] != "sft#0") {
            let enc = l["sync_encoding"].as_str().unwrap_or("");
            let want = if path == "delta" { "delta:" } else { "disk" };
            assert!(enc.starts_with(want), "{path}: sync_encoding {enc:?}");
            assert!(l["sync_bytes"].as_u64().unwrap() > 0);
        }
        // Each of these replays compares 2,413 zero-lag tokens.
        assert_zero_mismatch(&summary(&out), 1000, &format!("sync.path={path}"));
    }
    // The disk path published into the run folder: the pointer and the last versions.
    let sync = dir.join("disk").join("sync");
    assert!(sync.join("weights.version").is_file());
    let files = std::fs::read_dir(&sync)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count();
    assert_eq!(files, 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_replica_killed_mid_run_is_restarted_and_the_run_completes() {
    let dir = scratch("fail-drill");
    let cfg = short_config(&dir);
    for kind in ["die", "hang"] {
        let out = dir.join(kind);
        run_ok(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--set",
            "run.replay=true",
            "--set",
            "rollout.replicas=2",
            "--set",
            "sync.path=delta",
            "--set",
            &format!("rollout.fail_kind={kind}"),
            "--set",
            "rollout.fail_replica=1",
            "--set",
            "rollout.fail_at_step=20",
            "--set",
            "rollout.heartbeat_timeout_s=1.0",
        ]);
        let last = last_line(&out);
        assert_eq!(last["replicas_lost"], 1, "{kind}");
        assert_eq!(last["replica_restarts"], 1, "{kind}");
        assert!(last["trajectories_lost"].as_u64().unwrap() > 0, "{kind}");
        let s = summary(&out);
        assert_eq!(s["learner_steps"], 12, "{kind}: the 12 RL steps");
        // Each drill's replay compares 3,264 zero-lag tokens.
        assert_zero_mismatch(&s, 1000, kind);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// configs/tiny.toml without its supervised warm-up: its RL stage alone, `steps` steps.
fn rl_only_config(dir: &Path, steps: u64) -> PathBuf {
    let text = std::fs::read_to_string(short_config(dir))
        .unwrap()
        .replace(
            "[[stage]]\nkind = \"sft\"\nsteps = 150\ntasks = [\"sort\", \"tool\"]\n\n",
            "",
        )
        .replace("steps = 12", &format!("steps = {steps}"));
    assert!(
        !text.contains("\"sft\""),
        "the warm-up stage is still there"
    );
    let p = dir.join("rl-only.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_heartbeat_shorter_than_an_engine_step_stops_with_exit_2() {
    // Above the config's floor, but on the virtual clock every engine step costs 5 s: every
    // replica is lost at every step. The run must stop (not restart replicas for ever) with
    // an error naming the key.
    let dir = scratch("heartbeat");
    let cfg = rl_only_config(&dir, 4);
    let out = dir.join("run");
    let o = sluice(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--set",
        "run.replay=true",
        "--set",
        "rollout.replicas=2",
        "--set",
        "rollout.heartbeat_timeout_s=1.0",
        "--set",
        "cost.engine_step_us=5000000",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("rollout.heartbeat_timeout_s"), "{err}");
    assert!(err.contains("lost 6 times"), "3 losses per replica: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// (With the KL to the reference on, which a resume must read back.)
#[test]
fn a_resumed_replay_run_ends_with_the_same_weights() {
    let dir = scratch("resume");
    let cfg = short_config(&dir);
    let full = dir.join("full");
    let args = |out: &Path| {
        vec![
            "train".to_string(),
            "--config".into(),
            cfg.to_str().unwrap().into(),
            "--set".into(),
            "run.replay=true".into(),
            "--set".into(),
            "run.checkpoint_every=4".into(),
            // With the KL to the stage's initial weights: a resumed run reads that reference
            // back from its checkpoint (its own initial weights are the checkpoint's).
            "--set".into(),
            "loss.kl_coef=0.1".into(),
            "--out".into(),
            out.to_str().unwrap().into(),
        ]
    };
    let a = args(&full);
    run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(full
        .join("checkpoints/001-000000004/reference.safetensors")
        .is_file());
    let mut cks: Vec<String> = std::fs::read_dir(full.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    cks.sort();
    // Stage ends (sft, rl) and the RL barriers at learner steps 4 and 8.
    assert_eq!(
        cks,
        ["000-end", "001-000000004", "001-000000008", "001-end"],
        "checkpoints"
    );
    // The state a run killed right after its step-4 checkpoint leaves behind: later
    // checkpoints and the final files never written, a half-written checkpoint folder.
    let cut = dir.join("cut");
    let status = Command::new("cp")
        .args(["-r", full.to_str().unwrap(), cut.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    for gone in ["001-000000008", "001-end"] {
        std::fs::remove_dir_all(cut.join("checkpoints").join(gone)).unwrap();
    }
    for f in ["summary.json", "trace.json", "final.safetensors"] {
        std::fs::remove_file(cut.join(f)).unwrap();
    }
    let half = cut.join("checkpoints/.tmp-001-000000008");
    std::fs::create_dir_all(&half).unwrap();
    std::fs::write(half.join("learner.safetensors"), b"partial").unwrap();
    let text = run_ok(&["train", "--resume", cut.to_str().unwrap()]);
    assert!(text.contains("resumed from"), "{text}");
    assert!(text.contains("001-000000004"), "{text}");
    assert_eq!(
        summary(&cut)["final_weights_sha256"],
        summary(&full)["final_weights_sha256"],
        "the resumed run ended with other weights"
    );
    assert_eq!(metrics_without_wall(&cut), metrics_without_wall(&full));
    // Resuming a run with bad options is refused.
    let o = sluice(&["train", "--resume", cut.to_str().unwrap(), "--seed", "3"]);
    assert_eq!(o.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--set model.precision=bf16`: the learner computes from the bf16 compute copy (refreshed
/// after every optimizer step), publishes that copy, and the engines run on it with a bf16 KV
/// cache; every zero-lag token's learner logp equals its behavior logp bit for bit, whichever
/// way the weights travel (in-process, delta, disk). On cpu with the shortened configs/tiny.toml
/// (two replicas, replay) and on emu with the tiny model. The f32 run of the same config ends
/// on other weights (bf16 really rounds), and the resolved config records the precision.
#[test]
fn bf16_runs_have_zero_mismatch_on_cpu_and_emu() {
    let dir = scratch("bf16");
    let cfg = short_config(&dir);
    let run = |name: &str, sets: &[&str]| {
        let out = dir.join(name);
        let mut args = vec![
            "train".to_string(),
            "--config".into(),
            cfg.to_str().unwrap().into(),
            "--out".into(),
            out.to_str().unwrap().into(),
            "--set".into(),
            "run.replay=true".into(),
            "--set".into(),
            "rollout.replicas=2".into(),
        ];
        for s in sets {
            args.push("--set".into());
            args.push(s.to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let text = run_ok(&args);
        (out, text)
    };
    let (f32_out, text) = run("f32", &["model.precision=f32"]);
    assert!(text.contains("on cpu in f32"), "{text}");
    for path in ["inprocess", "delta", "disk"] {
        let (out, text) = run(
            &format!("bf16-{path}"),
            &["model.precision=bf16", &format!("sync.path={path}")],
        );
        assert!(text.contains("on cpu in bf16"), "{text}");
        let s = summary(&out);
        assert_eq!(s["zero_lag_mismatch_tokens"], 0, "bf16 {path}");
        let zero_lag = s["zero_lag_tokens"].as_u64().unwrap();
        assert!(
            zero_lag >= 100,
            "bf16 {path}: only {zero_lag} zero-lag tokens"
        );
        assert_ne!(
            s["final_weights_sha256"],
            summary(&f32_out)["final_weights_sha256"],
            "bf16 {path} trained the f32 weights"
        );
        let resolved = std::fs::read_to_string(out.join("config.toml")).unwrap();
        assert!(
            resolved.contains("precision = \"bf16\""),
            "config.toml: {resolved}"
        );
    }
    // `sluice eval` takes the run's precision from its config.toml, or --precision.
    let ck = dir.join("bf16-inprocess").join("final.safetensors");
    for (flag, want) in [(None, "bf16"), (Some("f32"), "f32")] {
        let mut args = vec![
            "eval",
            "--checkpoint",
            ck.to_str().unwrap(),
            "--task",
            "sort",
            "--samples",
            "4",
        ];
        if let Some(p) = flag {
            args.extend(["--precision", p]);
        }
        let text = run_ok(&args);
        assert!(text.contains(&format!("), {want}:")), "{text}");
    }

    let emu_cfg = tiny_emu_config(&dir, "precision = \"bf16\"", "");
    let out = dir.join("emu");
    let text = run_ok(&[
        "train",
        "--config",
        emu_cfg.to_str().unwrap(),
        "--device",
        "emu",
        "--set",
        "run.replay=true",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(text.contains("on emu in bf16"), "{text}");
    let s = summary(&out);
    assert_eq!(s["zero_lag_mismatch_tokens"], 0, "emu bf16");
    assert!(
        s["zero_lag_tokens"].as_u64().unwrap() >= 20,
        "emu bf16: {s}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
