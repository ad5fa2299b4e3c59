//! `rollout.servers` over loopback: `sluice train` drives `sluice serve` processes as its
//! replicas (runtime/src/remote, trainer/src/serve/lane.rs), with the Python port of the tool
//! task as an external environment process.
//!
//! - two servers: the run completes, both serve units of work, and the learner's log-probs
//!   equal the servers' bit for bit at zero lag (zero mismatch across the process boundary);
//! - one server exits mid-run (the `SLUICE_SERVE_EXIT_AFTER_LANE_STEPS` test hook): the run
//!   completes, the lost server's trajectories end as `environment` and none is trained, and
//!   the server restarted on the same port rejoins after a full sync and takes work again.
//!
//! - the server restarted with another precision answers the join with a refusal: the run
//!   stops with an error naming the server, instead of polling it for ever.
//!
//! All need `python3` (the environment process); without it they print why and pass.

mod support;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use support::*;

fn have_python() -> bool {
    let ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: python3 is not on PATH (the environment is examples/tool/env.py)");
    }
    ok
}

/// A tiny run: RL only (no warm-up) on the mini model, the tool task's Python port, weights
/// by delta; the servers serve the same config.
fn write_config(dir: &Path, steps: u64, heartbeat_s: f64) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "fleet"
checkpoint_every = 0

[model]
config = "configs/model/mini.toml"

[[stage]]
kind = "rl"
steps = {steps}
tasks = ["tool_py"]

[rollout]
eval_problems = 0
max_turns = 2
max_new_tokens = 6
heartbeat_timeout_s = {heartbeat_s:.1}
kv_bytes = 4194304

[buffer]
group_size = 4
groups_per_step = 2

[sync]
path = "delta"

[baselines]
ablation = false
rft = false

[tasks.tool_py]
kind = "external"
command = "python3"
args = ["examples/tool/env.py", "--digits", "1", "--min-digits", "1"]
target_share = 1.0
concurrency = 16
timeout_s = 20.0
retries = 1
latency = {{ dist = "none", median_ms = 0.0, p99_ms = 0.0 }}
faults = {{ crash = 0.0, timeout = 0.0, garbage = 0.0 }}
"#
    );
    let p = dir.join("fleet.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// A running `sluice serve`; killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(config: &Path, listen: &str, exit_after: Option<u64>) -> Server {
        Server::start_with(config, listen, exit_after, &[])
    }

    /// `sets`: `--set` arguments of the server.
    fn start_with(config: &Path, listen: &str, exit_after: Option<u64>, sets: &[&str]) -> Server {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--listen",
            listen,
        ]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        cmd.env("SLUICE_DEBUG", "1")
            .current_dir(root())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(n) = exit_after {
            cmd.env("SLUICE_SERVE_EXIT_AFTER_LANE_STEPS", n.to_string());
        }
        let mut child = cmd.spawn().expect("start sluice serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first line {line:?}"))
            .to_string();
        Server { child, url }
    }

    fn port(&self) -> &str {
        self.url.rsplit(':').next().unwrap()
    }

    fn health(&self) -> Value {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = agent.get(format!("{}/health", self.url)).call().unwrap();
        serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn train(config: &Path, out: &Path, servers: &[&Server]) -> Command {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{}\"", s.url)).collect();
    let mut cmd = Command::new(BIN);
    cmd.args([
        "train",
        "--config",
        config.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--set",
        &format!("rollout.servers=[{}]", list.join(", ")),
    ])
    .env("SLUICE_DEBUG", "1")
    .current_dir(root());
    cmd
}

/// The RL metrics lines of a run.
fn rl_lines(out: &Path) -> Vec<Value> {
    metrics_without_wall(out)
        .into_iter()
        .filter(|l| l["stage"].as_str().is_some_and(|s| s.starts_with("rl#")))
        .collect()
}

#[test]
fn two_servers_train_with_zero_mismatch_across_the_process_boundary() {
    if !have_python() {
        return;
    }
    let dir = scratch("fleet-two");
    let cfg = write_config(&dir, 10, 10.0);
    let a = Server::start(&cfg, "127.0.0.1:0", None);
    let b = Server::start(&cfg, "127.0.0.1:0", None);
    let out = dir.join("run");
    let o = train(&cfg, &out, &[&a, &b]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "train failed:\n{text}");
    let s = summary(&out);
    assert_eq!(s["learner_steps"].as_u64(), Some(10), "{s}");
    assert_zero_mismatch(&s, 40, "two servers");
    // Both servers ran units of work for the run, and hold the weights of the learner's last
    // publication but one (the last is made as the stage ends, when no unit of work follows).
    for (name, server) in [("a", &a), ("b", &b)] {
        let h = server.health();
        assert_eq!(h["driven"], true, "{name}: {h}");
        assert_eq!(h["counters"]["lane_joins"], 1, "{name}: {h}");
        assert!(
            h["counters"]["lane_steps"].as_u64().unwrap() > 0,
            "{name}: {h}"
        );
        assert!(h["version"].as_u64().unwrap() >= 9, "{name}: {h}");
        assert!(
            h["counters"]["delta_installs"].as_u64().unwrap() >= 8,
            "{name}: {h}"
        );
    }
    let last = rl_lines(&out).pop().unwrap();
    assert_eq!(last["replicas_lost"], 0, "{last}");
    // A driven server's session endpoints are off: a 409 naming the join.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent
        .post(format!("{}/generate", a.url))
        .header("content-type", "application/json")
        .send(r#"{"prompt": [1, 2]}"#.as_bytes())
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    assert!(r
        .body_mut()
        .read_to_string()
        .unwrap()
        .contains("/lane/join"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two servers and a `sluice train` against them (stdout and stderr piped); the second server
/// exits when its 41st unit of work arrives, mid-run, without answering it. Returns once it
/// has: the first server (alive while held), the dead one's port, and the run.
fn run_until_one_server_dies(cfg: &Path, out: &Path) -> (Server, String, Child) {
    let a = Server::start(cfg, "127.0.0.1:0", None);
    let mut b = Server::start(cfg, "127.0.0.1:0", Some(40));
    let port = b.port().to_string();
    let run = train(cfg, out, &[&a, &b])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = b.child.wait().unwrap();
    assert_eq!(status.code(), Some(3), "the test hook's exit status");
    (a, port, run)
}

#[test]
fn a_killed_server_is_lost_then_rejoins_after_a_full_sync() {
    if !have_python() {
        return;
    }
    let dir = scratch("fleet-kill");
    // The run waits for the loss to be found (the lost server's groups hold the backpressure
    // room), so the timeout sets the test's length; 3 s leaves the restarted process time to
    // start before the scheduler first polls it.
    let cfg = write_config(&dir, 24, 3.0);
    let out = dir.join("run");
    let (_a, port, run) = run_until_one_server_dies(&cfg, &out);
    // Restarted on the same port (a fresh process: other weights, no sequences).
    let restarted = Server::start(&cfg, &format!("127.0.0.1:{port}"), None);
    let o = run.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "train failed:\n{text}");
    let s = summary(&out);
    assert_eq!(s["learner_steps"].as_u64(), Some(24), "{s}");
    let last = rl_lines(&out).pop().unwrap();
    assert_eq!(last["replicas_lost"], 1, "{last}");
    assert_eq!(last["replica_restarts"], 1, "{last}");
    // What the lost server ran ended as `environment`, and none of it was trained.
    let lost = last["trajectories_lost"].as_u64().unwrap();
    assert!(lost >= 1, "{last}");
    let env_ended = s["trajectories_by_terminal"]["environment"]
        .as_u64()
        .unwrap_or(0);
    assert!(env_ended >= lost, "{s}");
    assert_eq!(s["env_trained_rate"].as_f64(), Some(0.0), "{s}");
    assert_zero_mismatch(&s, 40, "a server lost and restarted");
    // Named on the progress output, with why.
    assert!(
        text.contains("rollout server 1 lost (http://127.0.0.1:"),
        "{text}"
    );
    // The restarted process was joined once (the full sync of the newest image) and then ran
    // units of work of the run.
    let h = restarted.health();
    assert_eq!(h["counters"]["lane_joins"], 1, "{h}");
    assert!(h["counters"]["lane_steps"].as_u64().unwrap() > 0, "{h}");

    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_server_restarted_with_another_model_is_refused_by_name() {
    if !have_python() {
        return;
    }
    let dir = scratch("fleet-refused");
    let cfg = write_config(&dir, 24, 3.0);
    let out = dir.join("run");
    let (_a, port, run) = run_until_one_server_dies(&cfg, &out);
    // bf16: its image is half as long as the trainer's f32 one.
    let _other = Server::start_with(
        &cfg,
        &format!("127.0.0.1:{port}"),
        None,
        &["model.precision=bf16"],
    );
    let o = run.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the run should stop:\n{text}");
    assert!(
        text.contains("rollout.servers[1] refused to rejoin"),
        "{text}"
    );
    assert!(text.contains("another model or precision"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
