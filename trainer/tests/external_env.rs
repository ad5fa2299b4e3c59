//! External environments (trainer/src/tasks/external.rs, runtime/src/env/external): the
//! JSON-lines protocol round trip with replies out of order, a crashing, a hung and a garbled
//! environment process, the Python port of the tool task against the built-in one (process
//! and HTTP), and record/replay of a training run. Every test needs `python3` on PATH and
//! fails, saying so, without it.

mod support;

use sluice_kernels::testing::Rng;
use sluice_runtime::env::faults::{CallFault, CallKey};
use sluice_runtime::env::{CallError, Problem, Reply, Split, Task};
use sluice_runtime::trajectory::{TerminalReason, TokenId};
use sluice_trainer::tasks::external::{Endpoint, EnvIo, ExternalTask};
use sluice_trainer::tasks::{self, export, tokenizer, TaskOptions};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use support::*;

/// `python3`, or a failure that says these tests need it.
fn python3() -> &'static str {
    let ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "python3 is not on PATH: the external-environment tests run the Python examples \
         (examples/*/env.py, tests/envs/faulty.py); install Python 3"
    );
    "python3"
}

fn faulty(args: &[&str], timeout: Duration) -> ExternalTask {
    let script = root().join("trainer/tests/envs/faulty.py");
    let mut a = vec![script.to_str().unwrap().to_string()];
    a.extend(args.iter().map(|s| s.to_string()));
    ExternalTask::new(
        "faulty",
        Endpoint::Process {
            program: python3().into(),
            args: a,
        },
        64,
        EnvIo {
            timeout,
            retries: 1,
            ..EnvIo::default()
        },
    )
    .unwrap()
}

fn ids(text: &str) -> Vec<TokenId> {
    tokenizer::encode(text).unwrap()
}

fn key(session: &str, turn: u32) -> CallKey<'_> {
    CallKey {
        session,
        turn,
        attempt: 0,
    }
}

fn problem(spec: &str) -> Problem {
    Problem {
        id: format!("faulty:{spec}"),
        prompt: ids("<bos><user>a<eot><assistant>"),
        spec: spec.into(),
    }
}

#[test]
fn protocol_round_trip_with_replies_out_of_order() {
    let t = faulty(&["batch", "4"], Duration::from_secs(20));
    // Problems: text encoded once at the gateway.
    let p = t.problem(&mut Rng::new(3), Split::Train);
    assert_eq!(
        tokenizer::render(&p.prompt),
        format!("<bos><user>{}<eot><assistant>", p.spec)
    );
    assert_eq!(p.id, format!("faulty:{}", p.spec));
    // Four sessions in flight at once; the environment answers them in reverse order, and
    // each observation holds the length of its own turn's text.
    let turns = [
        "<call>1</call>",
        "<call>12</call>",
        "<call>123</call>",
        "yes<eot>",
    ];
    let sessions: Vec<String> = (0..4).map(|i| format!("s/{i}#0")).collect();
    for (s, text) in sessions.iter().zip(turns) {
        t.prefetch(key(s, 0), &p, &ids(text));
    }
    for (s, text) in sessions.iter().zip(turns) {
        let r = t.call(key(s, 0), &p, &ids(text)).unwrap();
        let want = if text.ends_with("</call>") {
            Reply::Observe(ids(&format!("<observation>{}<eot><assistant>", text.len())))
        } else {
            Reply::End {
                reward: 1.0,
                reason: TerminalReason::Success,
            }
        };
        assert_eq!(r, want, "session {s}");
    }
    // A session name used again for another turn (a group restarted after a lost replica)
    // gets the reply to what it sends now, not to the request sent ahead under that name.
    let t1 = faulty(&["batch", "1"], Duration::from_secs(20));
    t1.prefetch(key("r#0", 0), &p, &ids("<call>1</call>"));
    let r = t1
        .call(key("r#0", 0), &p, &ids("<call>1234</call>"))
        .unwrap();
    assert_eq!(r, Reply::Observe(ids("<observation>17<eot><assistant>")));
    // The demonstration continues the prompt; only the model's segment is trained on.
    let d = t.demonstration(&p, &mut Rng::new(1)).unwrap();
    assert_eq!(&d.tokens[..p.prompt.len()], &p.prompt[..]);
    assert_eq!(d.loss_mask.iter().filter(|&&m| m).count(), 2);
    assert_eq!(t.restarts(), 0);
}

#[test]
fn a_crashed_process_fails_its_calls_in_flight_and_is_restarted() {
    let t = faulty(&["batch", "3"], Duration::from_secs(20));
    let p = problem("a");
    t.prefetch(key("b#0", 0), &p, &ids("<call>1</call>"));
    t.prefetch(key("c#0", 0), &p, &ids("<call>2</call>"));
    // The third request completes the batch, and kills the process before any reply.
    let r = t.call(key("a#0", 0), &p, &ids("crash<eot>"));
    assert!(
        matches!(r, Err(CallError::Fault(CallFault::Crash, _))),
        "{r:?}"
    );
    for (s, text) in [("b#0", "<call>1</call>"), ("c#0", "<call>2</call>")] {
        let r = t.call(key(s, 0), &p, &ids(text));
        match r {
            Err(CallError::Fault(CallFault::Crash, m)) => {
                assert!(m.contains("exited") && m.contains("calls in flight"), "{m}")
            }
            r => panic!("session {s}: {r:?}"),
        }
    }
    // The next call starts a fresh process (batch of 3 again: fill it).
    t.prefetch(key("d#0", 0), &p, &ids("yes<eot>"));
    t.prefetch(key("e#0", 0), &p, &ids("no<eot>"));
    let r = t.call(key("f#0", 0), &p, &ids("yes<eot>")).unwrap();
    assert_eq!(
        r,
        Reply::End {
            reward: 1.0,
            reason: TerminalReason::Success
        }
    );
    assert_eq!(t.restarts(), 1);
}

#[test]
fn a_hung_process_times_out_and_is_restarted() {
    let t = faulty(&["batch", "2"], Duration::from_millis(700));
    let p = problem("a");
    t.prefetch(key("b#0", 0), &p, &ids("<call>1</call>"));
    let r = t.call(key("a#0", 0), &p, &ids("hang<eot>"));
    match r {
        Err(CallError::Fault(CallFault::Timeout, m)) => {
            assert!(m.contains("hung") && m.contains("2 calls in flight"), "{m}")
        }
        r => panic!("{r:?}"),
    }
    let r = t.call(key("b#0", 0), &p, &ids("<call>1</call>"));
    assert!(
        matches!(r, Err(CallError::Fault(CallFault::Timeout, _))),
        "{r:?}"
    );
    t.prefetch(key("c#0", 0), &p, &ids("no<eot>"));
    let r = t.call(key("d#0", 0), &p, &ids("<call>12</call>")).unwrap();
    assert_eq!(r, Reply::Observe(ids("<observation>15<eot><assistant>")));
    assert_eq!(t.restarts(), 1);
}

#[test]
fn malformed_replies_are_named_and_not_retried() {
    let t = faulty(&["batch", "1"], Duration::from_secs(20));
    let p = problem("a");
    let cases = [
        ("badreason<eot>", "field end.reason"),
        ("noreward<eot>", "field end.reward"),
        (
            "nofield<eot>",
            "none of \"observation\", \"end\" or \"error\"",
        ),
        ("badids<eot>", "field observation.ids[0] = 9999"),
        ("badtext<eot>", "field observation.text"),
        ("both<eot>", "both \"observation\" and \"end\""),
        ("garbage<eot>", "not a JSON object"),
    ];
    for (i, (text, what)) in cases.iter().enumerate() {
        let s = format!("m/{i}#1");
        match t.call(key(&s, 2), &p, &ids(text)) {
            Err(e @ CallError::Malformed(_)) => {
                // The orchestrator counts it under this name and does not retry it.
                assert_eq!(e.kind(), "malformed");
                let m = e.to_string();
                assert!(m.contains(what), "{text}: {m}");
                // Which message and which session: the framing error has no session to name.
                if *text != "garbage<eot>" {
                    assert!(
                        m.contains(&format!("step reply to session {s}, turn 2")),
                        "{m}"
                    );
                }
            }
            r => panic!("{text}: {r:?}"),
        }
    }
    // The garbled line dropped the process; the next call gets a fresh one.
    assert_eq!(
        t.call(key("ok#0", 0), &p, &ids("yes<eot>")).unwrap(),
        Reply::End {
            reward: 1.0,
            reason: TerminalReason::Success
        }
    );
    assert_eq!(t.restarts(), 1);
}

/// Responses to a tool problem `a*b` for turn `turn`: right and wrong answers, calls, and
/// malformed turns.
fn responses(spec: &str) -> Vec<(u32, String)> {
    let (a, b) = spec.split_once('*').unwrap();
    let (a, b): (i64, i64) = (a.parse().unwrap(), b.parse().unwrap());
    let p = a * b;
    vec![
        (0, format!("<call>{spec}</call>")),
        (1, format!("{p}<eot>")),
        (0, format!("{spec}={p}<eot>")),
        (0, format!("{}<eot>", p + 1)),
        (0, format!("{spec}={}<eot>", p + 10)),
        (1, format!("<call>{a}+{b}</call>")),
        (0, format!("{a}*{b}</call>")),
        (0, "<call>3//4</call>".into()),
        (0, "<call>(1+2</call>".into()),
        (0, "<call>7/0</call>".into()),
        (0, "<call>99999999999*99999999999</call>".into()),
        (0, "<call>1234567890123456789</call>".into()),
        (0, "<call>-(-9223372036854775807-1)</call>".into()),
        (0, "<call>-7%3+7/-2</call>".into()),
        (0, "<call> </call>".into()),
        (0, "<call>1<eot>2</call>".into()),
        (2, format!("x<call>{spec}</call>")),
        (3, format!("<call>{spec}</call>")),
        (0, format!("{p}")),
        (0, "<eot>".into()),
        (0, String::new()),
        (0, format!("{p}<call>")),
    ]
}

/// The built-in tool task of the default config and its held-out problems.
fn builtin_tool(n: usize) -> (std::sync::Arc<dyn Task>, Vec<Problem>) {
    builtin_tool_with(n, None)
}

/// The built-in tool task with configs/default.toml's operands and mix; `chains`: its
/// `chain_fraction` and `chain_call_fraction` (None: two operands only, as the Python port).
fn builtin_tool_with(
    n: usize,
    chains: Option<(f64, f64)>,
) -> (std::sync::Arc<dyn Task>, Vec<Problem>) {
    let opts = TaskOptions {
        digits: Some(2),
        min_digits: Some(1),
        tool_fraction: Some(0.4),
        chain_fraction: chains.map(|c| c.0),
        chain_call_fraction: chains.map(|c| c.1),
        ..TaskOptions::default()
    };
    let t = tasks::make("tool", "tool", 64, &opts).unwrap();
    let ps = export::problems(t.as_ref(), Split::HeldOut, n, 0);
    assert_eq!(ps.len(), n);
    (t, ps)
}

fn assert_same_rewards(builtin: &dyn Task, port: &ExternalTask, problems: &[Problem]) -> usize {
    let mut pairs = 0;
    for (i, p) in problems.iter().enumerate() {
        // The port sees only what crosses the boundary: the spec, the turn and the turn.
        let external = Problem {
            id: format!("tool_py:{}", p.spec),
            prompt: p.prompt.clone(),
            spec: p.spec.clone(),
        };
        for (j, (turn, text)) in responses(&p.spec).into_iter().enumerate() {
            let generated = ids(&text);
            let want = builtin.respond(p, turn, &generated).unwrap();
            let s = format!("eq/{i}#{j}");
            let got = port.call(key(&s, turn), &external, &generated).unwrap();
            assert_eq!(
                got, want,
                "problem {} turn {turn} response {text:?}",
                p.spec
            );
            pairs += 1;
        }
    }
    pairs
}

/// The Python port of the tool task (examples/tool/env.py) serving `problems` (written to
/// dir/held_out.jsonl by `sluice tasks export`'s line format) as its held-out problems.
fn tool_port(dir: &Path, problems: &[Problem], io: EnvIo) -> ExternalTask {
    let file = dir.join("held_out.jsonl");
    let lines: String = problems
        .iter()
        .map(|p| {
            export::line(&sluice_trainer::tasks::text::TextTokenizer::Char, p).to_string() + "\n"
        })
        .collect();
    std::fs::write(&file, lines).unwrap();
    ExternalTask::new(
        "tool_py",
        Endpoint::Process {
            program: python3().into(),
            args: vec![
                root().join("examples/tool/env.py").to_str().unwrap().into(),
                "--held-out".into(),
                file.to_str().unwrap().into(),
            ],
        },
        64,
        io,
    )
    .unwrap()
}

#[test]
fn the_python_port_of_tool_gives_the_builtin_rewards() {
    let (builtin, problems) = builtin_tool(64);
    // The port serves the built-in task's own held-out problems from the export.
    let dir = scratch("ext-port");
    let io = EnvIo {
        timeout: Duration::from_secs(20),
        retries: 1,
        ..EnvIo::default()
    };
    let port = tool_port(&dir, &problems, io);
    let pairs = assert_same_rewards(builtin.as_ref(), &port, &problems);
    assert_eq!(pairs, 64 * responses("1*1").len());
    // Its problems are the exported ones, prompt ids and all.
    let mut rng = Rng::new(9);
    for _ in 0..8 {
        let p = port.problem(&mut rng, Split::HeldOut);
        let q = problems
            .iter()
            .find(|q| q.spec == p.spec)
            .unwrap_or_else(|| panic!("{} is not an exported problem", p.spec));
        assert_eq!(p.prompt, q.prompt);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 27 item 6's third figure as a test: one Python environment process (the tool port)
/// with 256 sessions in flight at once (64 held-out problems x 4 responses, every request sent
/// before the first reply is read), each reply the built-in task's for its (problem, response).
#[test]
fn one_python_process_serves_256_sessions_in_flight() {
    let (builtin, problems) = builtin_tool(64);
    let dir = scratch("ext-256");
    let io = EnvIo {
        timeout: Duration::from_secs(60),
        retries: 0,
        ..EnvIo::default()
    };
    let port = tool_port(&dir, &problems, io);
    let mut calls = Vec::new();
    for (i, p) in problems.iter().enumerate() {
        let external = Problem {
            id: format!("tool_py:{}", p.spec),
            prompt: p.prompt.clone(),
            spec: p.spec.clone(),
        };
        for (j, (turn, text)) in responses(&p.spec).into_iter().take(4).enumerate() {
            let session = format!("many/{i}#{j}");
            let generated = ids(&text);
            port.prefetch(key(&session, turn), &external, &generated);
            calls.push((session, turn, external.clone(), generated, p));
        }
    }
    assert_eq!(calls.len(), 256);
    for (session, turn, external, generated, p) in &calls {
        let got = port.call(key(session, *turn), external, generated).unwrap();
        let want = builtin.respond(p, *turn, generated).unwrap();
        assert_eq!(got, want, "session {session}");
    }
    assert_eq!(port.restarts(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_http_kind_speaks_the_same_messages() {
    let mut server = Command::new(python3())
        .arg(root().join("examples/tool/env.py"))
        .args(["--http", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let url = first
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_string();
    let port = ExternalTask::new(
        "tool_py",
        Endpoint::Http { url },
        64,
        EnvIo {
            timeout: Duration::from_secs(20),
            retries: 1,
            ..EnvIo::default()
        },
    )
    .unwrap();
    let (builtin, problems) = builtin_tool(6);
    let pairs = assert_same_rewards(builtin.as_ref(), &port, &problems);
    assert_eq!(pairs, 6 * responses("1*1").len());
    let p = port.problem(&mut Rng::new(1), Split::Train);
    assert!(
        tokenizer::render(&p.prompt).starts_with("<bos><user>"),
        "{p:?}"
    );
    let _ = server.kill();
    let _ = server.wait();
    // A server that is gone is a crash (retried within the budget), named with its URL.
    let r = port.call(key("gone#0", 0), &problems[0], &ids("1<eot>"));
    assert!(
        matches!(r, Err(CallError::Fault(CallFault::Crash, ref m)) if m.contains("127.0.0.1")),
        "{r:?}"
    );
}

/// A training run of a few steps against `env` (mini model, no warm-up beyond a few steps).
fn run_config(dir: &Path, name: &str, args: &str, extra: &str) -> std::path::PathBuf {
    let text = format!(
        r#"
[run]
name = "{name}"
replay = true

[model]
config = "configs/model/mini.toml"

[[stage]]
kind = "sft"
steps = 4
tasks = ["env"]

[[stage]]
kind = "rl"
steps = 4
tasks = ["env"]

[rollout]
eval_problems = 4
max_turns = 2
max_new_tokens = 4

[buffer]
group_size = 4
groups_per_step = 2

[optim]
sft_batch = 8

[baselines]
ablation = false
rft = false

[tasks.env]
kind = "external"
command = "python3"
args = [{args}]
target_share = 1.0
concurrency = 16
timeout_s = 20.0
latency = {{ dist = "lognormal", median_ms = 20.0, p99_ms = 200.0 }}
faults = {{ crash = 0.0, timeout = 0.0, garbage = 0.0 }}
{extra}
"#
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn crashes_and_malformed_replies_end_as_environment_and_are_not_trained() {
    python3();
    let dir = scratch("ext-crash");
    let cfg = run_config(
        &dir,
        "crash",
        r#""trainer/tests/envs/faulty.py", "flaky""#,
        "retries = 0",
    );
    let out = dir.join("run");
    let text = run_ok(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let s = summary(&out);
    let faults = &s["env_faults"];
    assert!(faults["crash"].as_u64().unwrap_or(0) >= 1, "{s}");
    assert!(faults["malformed"].as_u64().unwrap_or(0) >= 1, "{s}");
    let env_ended = s["trajectories_by_terminal"]["environment"]
        .as_u64()
        .unwrap_or(0);
    assert!(env_ended >= 2, "{s}");
    // Every environment end was dropped by the environment gate, none trained.
    assert!(s["env_drop_rate"].as_f64().unwrap() > 0.0, "{s}");
    assert_eq!(s["env_trained_rate"].as_f64().unwrap(), 0.0, "{s}");
    // Named on stderr: which message, which field, which session.
    assert!(text.contains("field end.reason is \"won\""), "{text}");
    assert!(text.contains("step reply to session env/"), "{text}");
    // The run went on past the crashes (the process restarted): every RL step was taken.
    assert_eq!(s["learner_steps"].as_u64(), Some(4), "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_virtual_clock_run_replays_from_its_record_bit_for_bit() {
    python3();
    let dir = scratch("ext-replay");
    let cfg = run_config(
        &dir,
        "rec",
        r#""examples/tool/env.py", "--digits", "1""#,
        "retries = 1",
    );
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let mut args = vec![
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        run_ok(&args);
        out
    };
    let live = run("live", &[]);
    let rec = live.join("environments.jsonl");
    let lines = std::fs::read_to_string(&rec).unwrap();
    assert!(lines.lines().count() > 50, "{}", rec.display());
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    for k in ["session", "turn", "hash", "reply", "latency_ms"] {
        assert!(first.get(k).is_some(), "{k} missing: {first}");
    }
    // The replay starts no environment: a command that does not exist proves it.
    let replayed = run(
        "replayed",
        &[
            "--replay-env",
            live.to_str().unwrap(),
            "--set",
            "tasks.env.command=\"no-such-python\"",
        ],
    );
    assert_eq!(metrics_without_wall(&live), metrics_without_wall(&replayed));
    let (a, b) = (summary(&live), summary(&replayed));
    assert_eq!(a["final_weights_sha256"], b["final_weights_sha256"]);
    assert_eq!(a["trajectories_by_terminal"], b["trajectories_by_terminal"]);
    // Another seed asks other calls: the first is a miss, exit 2, its key named.
    let o = sluice(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        dir.join("miss").to_str().unwrap(),
        "--seed",
        "7",
        "--replay-env",
        live.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("holds no reply") && err.contains("request hash"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tasks_export_writes_the_problems_and_refuses_a_bad_split() {
    let text = run_ok(&["tasks", "export", "tool", "--n", "5"]);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5, "{text}");
    // The evaluation's first held-out problems of the default config (chained problems
    // among them), in its order.
    let (_, problems) = builtin_tool_with(5, Some((0.5, 0.25)));
    for (l, p) in lines.iter().zip(&problems) {
        assert_eq!(l["spec"], p.spec.as_str());
        assert_eq!(l["prompt"]["text"], tokenizer::render(&p.prompt).as_str());
    }
    let chained = problems.iter().filter(|p| p.spec.matches('*').count() == 2);
    assert!(chained.count() >= 1, "no chained problem among the first 5");
    let o = sluice(&["tasks", "export", "tool", "--split", "validation"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--split \"validation\""));
    let o = sluice(&["tasks", "export", "nope"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no task \"nope\""));
}
