//! `sluice serve` over loopback: the `sluice` binary started as a server (port from the OS, its
//! address read from the first stdout line), driven with a real HTTP client.
//!
//! - zero mismatch across the process boundary: the server's ids, log-prob bits and versions
//!   equal an in-process engine's on the same config, weights and seeds (several sessions in
//!   flight at once, and a second turn on a kept session);
//! - streaming gives the tokens of the non-streaming answer;
//! - abort ends a turn mid-generation (reason `abort`, blocks freed);
//! - every kind of bad request is a 4xx naming the problem, and the server keeps serving;
//! - weights: a full checkpoint, then a verified delta (later tokens carry the new version),
//!   a delta for another base refused with nothing installed, a checkpoint by path;
//! - chat: a second turn reuses the session's ids; an edited history is re-encoded and flagged;
//! - the lane endpoints a trainer drives the server with ([`lane`]): a unit of work computes
//!   what an in-process engine computes, bad lane requests are 4xx.

mod lane;
mod support;

use serde_json::{json, Value};
use sluice_model::{Model, ModelConfig};
use sluice_runtime::engine::{Engine, Event, Request};
use sluice_runtime::sync::delta::{self, EncodeParams, Image};
use sluice_runtime::sync::lane::arena_bytes;
use sluice_runtime::sync::ContentHash;
use sluice_runtime::trajectory::{TerminalReason, TokenId, WeightVersion};
use sluice_trainer::serve::{prepare, ServeOptions};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use support::{root, scratch, BIN};

/// A pool of 128 blocks of 16 slots of the mini model in f32 (8 KiB a block): 2,048 tokens,
/// so a longer prompt is "longer than the context".
const SETS: [&str; 2] = ["rollout.kv_bytes=1048576", "rollout.max_new_tokens=8"];
const CONTEXT: usize = 2048;

fn config() -> PathBuf {
    root().join("configs/tiny.toml")
}

/// A running `sluice serve`; killed when dropped.
struct Server {
    child: Child,
    url: String,
    agent: ureq::Agent,
}

impl Server {
    fn start(weights: &Path) -> Server {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--config")
            .arg(config())
            .arg("--weights")
            .arg(weights);
        for s in SETS {
            cmd.args(["--set", s]);
        }
        let mut child = cmd
            .env("SLUICE_DEBUG", "1")
            .current_dir(root())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sluice serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first line {line:?}"))
            .to_string();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        Server { child, url, agent }
    }

    fn send(&self, path: &str, content_type: &str, body: &[u8]) -> (u16, Value) {
        let mut r = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("content-type", content_type)
            .send(body)
            .unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(path, "application/json", body.to_string().as_bytes())
    }

    fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body);
        assert_eq!(status, 200, "{path} {body}: {v}");
        v
    }

    fn get(&self, path: &str) -> Value {
        let mut r = self
            .agent
            .get(format!("{}{path}", self.url))
            .call()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
        serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
    }

    /// The lines of a streamed `/generate`, read one at a time (`each` sees each as it comes).
    fn stream(&self, body: &Value, mut each: impl FnMut(&Value)) -> Vec<Value> {
        let r = self
            .agent
            .post(format!("{}/generate", self.url))
            .header("content-type", "application/json")
            .send(body.to_string().as_bytes())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mut lines = Vec::new();
        for l in BufReader::new(r.into_body().into_reader()).lines() {
            let v: Value = serde_json::from_str(&l.unwrap()).unwrap();
            each(&v);
            lines.push(v);
        }
        lines
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A mini-model checkpoint initialised from `seed`, in `dir`.
fn checkpoint(dir: &Path, seed: u64) -> (PathBuf, Model) {
    let mut mc = ModelConfig::from_file(&root().join("configs/model/mini.toml")).unwrap();
    mc.seed = seed;
    let m = Model::new(mc, &sluice_kernels::Backend::Cpu).unwrap();
    let path = dir.join(format!("seed{seed}.safetensors"));
    m.save(&path).unwrap();
    (path, m)
}

/// An in-process engine on the server's config and `weights` at `version`.
fn engine(weights: &Path, version: u64) -> Engine {
    prepare(&ServeOptions {
        config: Some(config()),
        sets: SETS.iter().map(|s| s.to_string()).collect(),
        weights: Some(weights.to_path_buf()),
        weights_version: version,
        listen: None,
    })
    .unwrap()
    .engine()
    .unwrap()
}

fn ids(v: &Value) -> Vec<TokenId> {
    serde_json::from_value(v["ids"].clone()).unwrap()
}

fn u64s(v: &Value, key: &str) -> Vec<u64> {
    serde_json::from_value(v[key].clone()).unwrap()
}

fn bits(x: &[f32]) -> Vec<u64> {
    x.iter().map(|v| v.to_bits() as u64).collect()
}

/// Runs `engine` until the turn of `h` ends; returns its generated tokens' (ids, bits,
/// versions) from position `from`.
fn turn(
    engine: &mut Engine,
    h: sluice_runtime::engine::SeqHandle,
    from: usize,
) -> (Vec<TokenId>, Vec<u64>, Vec<u64>) {
    while engine.has_work() {
        for e in engine.step().unwrap() {
            assert!(matches!(e, Event::TurnEnded { .. }), "{e:?}");
        }
    }
    let v = engine.trajectory(h).unwrap();
    (
        v.tokens[from..].to_vec(),
        bits(&v.behavior_logp[from..]),
        v.versions[from..].iter().map(|w| w.0).collect(),
    )
}

fn request(session: &str, prompt: Vec<TokenId>, max_new: u32, seed: u64, temp: f32) -> Request {
    let mut r = Request::new(session, prompt, max_new);
    r.instance_id = session.to_string();
    r.multi_turn = true;
    r.sampling.seed = seed;
    r.sampling.temperature = temp;
    r
}

#[test]
fn zero_mismatch_across_the_process_boundary() {
    let dir = scratch("serve-zero");
    let (weights, _) = checkpoint(&dir, 7);
    let server = Server::start(&weights);
    let jobs: Vec<(String, Vec<TokenId>, u32, u64, f32)> = (0..4)
        .map(|i| {
            let prompt = (0..3 + 2 * i)
                .map(|t| (t * 7 + i) as TokenId % 64)
                .collect();
            (
                format!("zm-{i}"),
                prompt,
                6 + i as u32,
                11 + i as u64,
                [1.0, 0.7, 0.0, 1.3][i],
            )
        })
        .collect();
    // All four in flight at once (continuous batching on the server).
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(id, p, n, seed, temp)| {
                let server = &server;
                s.spawn(move || {
                    server.ok(
                        "/generate",
                        &json!({"session_id": id, "prompt": p, "max_new_tokens": n,
                                "sampling": {"seed": seed, "temperature": temp}}),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The second turn of session zm-0: an observation appended to its kept K/V.
    let obs: Vec<TokenId> = vec![5, 9, 13];
    let second = server.ok(
        "/generate",
        &json!({"session_id": "zm-0", "prompt": obs, "max_new_tokens": 5}),
    );
    let mut eng = engine(&weights, 0);
    for ((id, p, n, seed, temp), a) in jobs.iter().zip(&answers) {
        let h = eng
            .submit(request(id, p.clone(), *n, *seed, *temp))
            .unwrap()[0];
        let (t, b, v) = turn(&mut eng, h, p.len());
        assert_eq!(ids(a), t, "{id}: ids");
        assert_eq!(u64s(a, "logprob_bits"), b, "{id}: log-prob bits");
        assert_eq!(u64s(a, "versions"), v, "{id}: versions");
        assert_eq!(t.len(), *n as usize, "{id}: no stop ids, so max_new_tokens");
        // The f32 values printed agree with the bits.
        let printed: Vec<f32> = serde_json::from_value(a["logprobs"].clone()).unwrap();
        assert_eq!(bits(&printed), b, "{id}: printed log-probs");
        if id == "zm-0" {
            let from = p.len() + t.len() + obs.len();
            eng.observe(h, &obs, 5).unwrap();
            let (t2, b2, _) = turn(&mut eng, h, from);
            assert_eq!(ids(&second), t2, "second turn ids");
            assert_eq!(u64s(&second, "logprob_bits"), b2, "second turn bits");
            assert_eq!(second["session_tokens"], from + 5);
        }
        eng.finish(h, 0.0, TerminalReason::Budget).unwrap();
    }
}

#[test]
fn streaming_abort_and_bad_requests() {
    let dir = scratch("serve-stream");
    let (weights, _) = checkpoint(&dir, 3);
    let server = Server::start(&weights);
    // (b) Streaming gives the non-streaming tokens: the same session id (the sampler's key)
    // opened, closed, and opened again streaming.
    let body = json!({"session_id": "st", "prompt": [1, 3, 20, 21], "max_new_tokens": 7,
                      "sampling": {"seed": 5}});
    let whole = server.ok("/generate", &body);
    assert_eq!(
        server.ok("/abort", &json!({"session_id": "st"}))["was_generating"],
        false
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let lines = server.stream(&streamed, |_| {});
    assert!(lines.len() >= 2, "one line per step: {lines:?}");
    let mut got = Vec::new();
    let mut got_bits = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l.get("finish_reason").is_some(), i + 1 == lines.len());
        got.extend(ids(l));
        got_bits.extend(u64s(l, "logprob_bits"));
    }
    assert_eq!(got, ids(&whole));
    assert_eq!(got_bits, u64s(&whole, "logprob_bits"));
    assert_eq!(lines.last().unwrap()["finish_reason"], "length");
    server.ok("/abort", &json!({"session_id": "st"}));

    // (c) Abort mid-generation: the turn ends now with reason abort, its blocks are freed,
    // and a second request on the busy session meanwhile is a 409.
    let long = json!({"session_id": "long", "prompt": [1, 2, 3], "max_new_tokens": 1500,
                      "stream": true});
    let mut aborted = None;
    let mut busy = None;
    let lines = server.stream(&long, |_| {
        if aborted.is_none() {
            busy = Some(server.post("/generate", &json!({"session_id": "long", "prompt": [4]})));
            aborted = Some(server.ok("/abort", &json!({"session_id": "long"})));
        }
    });
    let last = lines.last().unwrap();
    assert_eq!(last["finish_reason"], "abort");
    let n: usize = lines.iter().map(|l| ids(l).len()).sum();
    assert!(n < 1500, "aborted after {n} tokens");
    assert_eq!(last["session_tokens"], 3 + n);
    let aborted = aborted.unwrap();
    assert_eq!(aborted["was_generating"], true);
    assert_eq!(aborted["tokens_freed"], 3 + n);
    let (status, v) = busy.unwrap();
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("is generating"),
        "{v}"
    );
    let h = server.get("/health");
    assert_eq!(h["sessions"], 0);
    assert_eq!(
        h["kv_blocks_used"], 0,
        "the aborted session's blocks are free"
    );
    assert_eq!(h["counters"]["aborted"], 3);

    // (d) Every bad request: its status and a message naming the problem; the server still
    // answers /health after each.
    let long_prompt: Vec<u32> = vec![5; CONTEXT + 1];
    let cases: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        (
            "/generate",
            "application/json",
            b"{\"prompt\": [1, 2".to_vec(),
            400,
            "malformed",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": [1], "temp": 1}"#.to_vec(),
            400,
            "unknown field `temp`",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": [1, 64]}"#.to_vec(),
            400,
            "prompt[1] = 64 is outside the model's vocabulary",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": []}"#.to_vec(),
            400,
            "prompt is empty",
        ),
        (
            "/generate",
            "application/json",
            json!({"prompt": long_prompt}).to_string().into_bytes(),
            400,
            "longer than the KV pool",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": [1], "sampling": {"top_p": 1.5}}"#.to_vec(),
            400,
            "top_p",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": [1], "sampling": {"temperature": -1}}"#.to_vec(),
            400,
            "temperature",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": [1], "max_new_tokens": 0}"#.to_vec(),
            400,
            "max_new_tokens must be >= 1",
        ),
        (
            "/generate",
            "application/json",
            br#"{"prompt": [1], "eos": 99}"#.to_vec(),
            400,
            "stop.eos[0] = 99",
        ),
        (
            "/abort",
            "application/json",
            br#"{"session_id": "nobody"}"#.to_vec(),
            404,
            "no session \"nobody\"",
        ),
        (
            "/v1/chat/completions",
            "application/json",
            br#"{"messages": [{"role": "robot", "content": "hi"}]}"#.to_vec(),
            400,
            "role \"robot\"",
        ),
        (
            "/v1/completions",
            "application/json",
            br#"{"prompt": "hi", "stream": true}"#.to_vec(),
            400,
            "stream",
        ),
        (
            "/weights",
            "application/octet-stream",
            b"not a checkpoint".to_vec(),
            400,
            "give its version",
        ),
        (
            "/weights?version=1",
            "application/octet-stream",
            b"not a checkpoint".to_vec(),
            400,
            "/weights: the uploaded body",
        ),
        (
            "/weights",
            "application/json",
            br#"{"path": "/no/such/file", "version": 1}"#.to_vec(),
            400,
            "cannot read /no/such/file",
        ),
        (
            "/weights?v=1",
            "application/octet-stream",
            b"x".to_vec(),
            400,
            "the parameters are version=N and blake3=HEX",
        ),
        (
            "/health",
            "application/json",
            b"{}".to_vec(),
            405,
            "/health does not take POST",
        ),
        (
            "/nowhere",
            "application/json",
            b"{}".to_vec(),
            404,
            "no endpoint /nowhere",
        ),
    ];
    for (path, ct, body, status, needle) in &cases {
        let (got, v) = server.send(path, ct, body);
        assert_eq!(
            got,
            *status,
            "{path} {}: {v}",
            String::from_utf8_lossy(&body[..body.len().min(60)])
        );
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{path}: no error field: {v}"));
        assert!(
            msg.contains(needle),
            "{path}: {msg:?} does not name {needle:?}"
        );
        assert_eq!(server.get("/health")["status"], "ok");
    }
    // A body over the limit: answered 413 from its Content-Length, before it is sent (a raw
    // socket, since a client that insists on sending the body may meet a closed connection).
    {
        use std::io::{Read, Write};
        let addr = server.url.strip_prefix("http://").unwrap();
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        write!(
            sock,
            "POST /generate HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            17 << 20
        )
        .unwrap();
        // The answer's head and its JSON body (the server may keep the socket open).
        sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let answer = loop {
            let n = sock.read(&mut buf).unwrap();
            assert!(
                n > 0,
                "connection closed: {}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got).to_string();
            if text.contains("\r\n\r\n") && text.trim_end().ends_with('}') {
                break text;
            }
        };
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("within 16777216 bytes"), "{answer}");
        assert_eq!(server.get("/health")["status"], "ok");
    }
    let h = server.get("/health");
    assert_eq!(
        h["counters"]["rejected"],
        cases.len() as u64 + 2,
        "the 409 and the 413 above count too"
    );
    assert_eq!(h["sessions"], 0);
    assert_eq!(
        h["version"], 0,
        "no bad /weights request installed anything"
    );
}

#[test]
fn weights_full_then_delta_and_a_wrong_base_refused() {
    let dir = scratch("serve-weights");
    let (w0, m0) = checkpoint(&dir, 1);
    let (w1, m1) = checkpoint(&dir, 2);
    let (w3, _) = checkpoint(&dir, 4);
    let server = Server::start(&w0);
    // A full checkpoint uploaded at version 1: the server then samples what an in-process
    // engine on those weights samples.
    let bytes = std::fs::read(&w1).unwrap();
    let (s, v) = server.send("/weights?version=1", "application/octet-stream", &bytes);
    assert_eq!(
        (s, v["version"].clone(), v["delta"].clone()),
        (200, json!(1), json!(false)),
        "{v}"
    );
    let t1 = server.ok(
        "/generate",
        &json!({"session_id": "w", "prompt": [1, 4, 9], "max_new_tokens": 4}),
    );
    assert_eq!(u64s(&t1, "versions"), vec![1; 4]);
    let mut eng = engine(&w1, 1);
    let h = eng.submit(request("w", vec![1, 4, 9], 4, 0, 1.0)).unwrap()[0];
    let (t, b, _) = turn(&mut eng, h, 3);
    assert_eq!((ids(&t1), u64s(&t1, "logprob_bits")), (t, b));
    // A delta from version 1's image to version 2's: the kept session's later tokens carry
    // version 2, its earlier ones keep 1.
    let image = |m: &Model| arena_bytes(m.compute_weights()).unwrap();
    let mut mc2 = m1.config.clone();
    mc2.seed = 3;
    let m2 = Model::new(mc2, &sluice_kernels::Backend::Cpu).unwrap();
    let (i0, i1, i2) = (image(&m0), image(&m1), image(&m2));
    let params = EncodeParams {
        chunk_size: 4096,
        ..EncodeParams::default()
    };
    let d12 = delta::encode(
        &params,
        Image::new(WeightVersion(1), &i1),
        Image::new(WeightVersion(2), &i2),
    )
    .unwrap();
    let (s, v) = server.send("/weights", "application/octet-stream", &d12.bytes);
    assert_eq!(
        (s, v["version"].clone(), v["delta"].clone()),
        (200, json!(2), json!(true)),
        "{v}"
    );
    assert_eq!(v["blake3"], ContentHash::of(&i2).to_hex());
    let t2 = server.ok(
        "/generate",
        &json!({"session_id": "w", "prompt": [7], "max_new_tokens": 3}),
    );
    assert_eq!(u64s(&t2, "versions"), vec![2; 3]);
    // A delta made for another base: version 0 (the server holds 2), then version 2's number
    // on version 0's bytes. Both refused, nothing installed.
    let d03 = delta::encode(
        &params,
        Image::new(WeightVersion(0), &i0),
        Image::new(WeightVersion(3), &i2),
    )
    .unwrap();
    let (s, v) = server.send("/weights", "application/octet-stream", &d03.bytes);
    assert_eq!(s, 409, "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(
        msg.contains("applies to v0") && msg.contains("holds v2"),
        "{msg}"
    );
    let forged = delta::encode(
        &params,
        Image::new(WeightVersion(2), &i0),
        Image::new(WeightVersion(3), &i1),
    )
    .unwrap();
    let (s, v) = server.send("/weights", "application/octet-stream", &forged.bytes);
    assert_eq!(s, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("another base"), "{v}");
    let ver = server.get("/version");
    assert_eq!(
        ver,
        json!({"version": 2, "blake3": ContentHash::of(&i2).to_hex()})
    );
    // An older version is refused too; a checkpoint named by path (a shared filesystem) works.
    let (s, _) = server.post("/weights", &json!({"path": w3, "version": 1}));
    assert_eq!(s, 409);
    let v = server.ok("/weights", &json!({"path": w3, "version": 3}));
    assert_eq!(v["version"], 3);
    let h = server.get("/health");
    assert_eq!(
        (
            h["counters"]["weight_installs"].clone(),
            h["counters"]["delta_installs"].clone()
        ),
        (json!(3), json!(1))
    );
    // The session's tokens after the swap sample at version 3.
    let t3 = server.ok(
        "/generate",
        &json!({"session_id": "w", "prompt": [8], "max_new_tokens": 2}),
    );
    assert_eq!(u64s(&t3, "versions"), vec![3; 2]);
}

#[test]
fn chat_reuses_the_sessions_ids_and_flags_an_edited_history() {
    let dir = scratch("serve-chat");
    let (weights, _) = checkpoint(&dir, 5);
    let server = Server::start(&weights);
    let user = json!({"role": "user", "content": "12+3"});
    let r1 = server.ok(
        "/v1/chat/completions",
        &json!({"session_id": "c", "messages": [user], "max_tokens": 6, "model": "any"}),
    );
    assert_eq!(r1["reencoded"], false);
    let reply = r1["choices"][0]["message"].clone();
    assert_eq!(reply["role"], "assistant");
    // <bos><user>12+3<eot><assistant> is 8 character ids.
    assert_eq!(r1["usage"]["prompt_tokens"], 8);
    let total1 = r1["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(total1, 8 + ids(&r1["choices"][0]).len() as u64);
    // Turn 2: the history as returned plus a new user message. Only the new message is
    // appended (<eot> closing the cut reply, <user>ok<eot>, <assistant>): 6 ids.
    let next = json!({"role": "user", "content": "ok"});
    let r2 = server.ok(
        "/v1/chat/completions",
        &json!({"session_id": "c", "messages": [user, reply, next], "max_tokens": 4}),
    );
    assert_eq!(r2["reencoded"], false);
    let closes = r1["choices"][0]["finish_reason"] == "length";
    let appended = 5 + closes as u64;
    assert_eq!(r2["usage"]["prompt_tokens"], appended);
    let gen2 = ids(&r2["choices"][0]).len() as u64;
    assert_eq!(r2["usage"]["total_tokens"], total1 + appended + gen2);
    // Turn 3: the client edited the first reply. The history is encoded again from its text
    // into a new trajectory, flagged and counted.
    let edited = json!({"role": "assistant", "content": "15"});
    let r2_reply = r2["choices"][0]["message"].clone();
    let r3 = server.ok(
        "/v1/chat/completions",
        &json!({"session_id": "c", "messages": [user, edited, next, r2_reply.clone(), {"role": "user", "content": "?"}],
                "max_tokens": 3}),
    );
    assert_eq!(r3["reencoded"], true);
    let prompt3 = r3["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        r3["usage"]["total_tokens"].as_u64().unwrap(),
        prompt3 + ids(&r3["choices"][0]).len() as u64
    );
    let h = server.get("/health");
    assert_eq!(h["counters"]["reencoded_turns"], 1);
    assert_eq!(h["sessions"], 1, "the chat session is kept open");
    // A bad history for the open session is refused and leaves the session as it was.
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"session_id": "c", "messages": [{"role": "robot", "content": "x"}]}),
    );
    assert_eq!(status, 400, "{v}");
    let h = server.get("/health");
    assert_eq!(
        (
            h["sessions"].clone(),
            h["counters"]["reencoded_turns"].clone()
        ),
        (json!(1), json!(1))
    );
    // Ids appended to the chat session through /generate: the recorded messages no longer
    // describe its ids, so the next chat turn, even with the history as returned, is
    // encoded again and flagged.
    // (After the re-encode, the new trajectory's history is reused as before.)
    let r3_reply = r3["choices"][0]["message"].clone();
    let mut history = vec![
        user.clone(),
        edited,
        next,
        r2_reply,
        json!({"role": "user", "content": "?"}),
        r3_reply,
    ];
    history.push(json!({"role": "user", "content": "1"}));
    let r3b = server.ok(
        "/v1/chat/completions",
        &json!({"session_id": "c", "messages": history, "max_tokens": 2}),
    );
    assert_eq!(r3b["reencoded"], false);
    history.push(r3b["choices"][0]["message"].clone());
    history.push(json!({"role": "user", "content": "2"}));
    server.ok(
        "/generate",
        &json!({"session_id": "c", "prompt": [5], "max_new_tokens": 1}),
    );
    let r4 = server.ok(
        "/v1/chat/completions",
        &json!({"session_id": "c", "messages": history, "max_tokens": 2}),
    );
    assert_eq!(r4["reencoded"], true);
    assert_eq!(server.get("/health")["counters"]["reencoded_turns"], 2);
    // Completions: text in, text and ids out; one turn, nothing kept.
    let c = server.ok(
        "/v1/completions",
        &json!({"prompt": "<bos><user>7*8<eot><assistant>", "max_tokens": 3}),
    );
    assert_eq!(
        ids(&c["choices"][0]).len(),
        c["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    assert_eq!(server.get("/health")["sessions"], 1);
}
