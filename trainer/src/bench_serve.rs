//! `sluice bench-serve`: the cost of serving a rollout engine over HTTP (docs/perf/serve.md).
//!
//! One run, side by side, on the same config and weights:
//! - in process: B sessions submitted to an [`Engine`] at once, stepped until idle;
//! - over loopback: one `sluice serve` child process (this executable), B client threads each
//!   sending one `/generate` for its session at once (keep-alive connections);
//!
//! for each B, tokens/s on the wall clock (best of `reps`). Both sides sample the same ids for
//! the same session ids (the sampler is keyed by session and position, every op is batch
//! invariant), and the bench checks that they did, log-prob bits included.
//!
//! Then, on a fresh server, its resident memory (VmRSS of the child, /proc/PID/status) before
//! and after opening `idle` sessions that stay open (one short turn each, K/V kept): the
//! growth beyond the bytes of the KV blocks they hold is what a session costs on the server.

use crate::serve::{prepare, ServeOptions};
use crate::train_cmd::TrainError;
use serde_json::{json, Value};
use sluice_model::infer::KvCache;
use sluice_runtime::engine::{Engine, Event, Request};
use sluice_runtime::trajectory::TokenId;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

pub struct BenchServeOptions {
    pub serve: ServeOptions,
    /// Concurrent sessions per measurement.
    pub batches: Vec<usize>,
    /// Prompt tokens and generated tokens per session.
    pub prompt: usize,
    pub tokens: u32,
    pub reps: usize,
    /// Idle sessions for the memory measurement.
    pub idle: usize,
}

/// One measured B.
#[derive(Clone, Debug)]
pub struct Row {
    pub batch: usize,
    pub in_process_tokens_per_s: f64,
    pub http_tokens_per_s: f64,
    /// The server's tokens and log-prob bits equal the in-process engine's.
    pub identical: bool,
}

fn run_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Run(e.to_string())
}

fn prompt_of(session: usize, n: usize, vocab: usize) -> Vec<TokenId> {
    (0..n)
        .map(|i| ((session * 31 + i * 7) % vocab) as TokenId)
        .collect()
}

fn session_id(batch: usize, s: usize) -> String {
    format!("bench-{batch}-{s}")
}

type Generated = Vec<(Vec<TokenId>, Vec<u32>)>;

/// B sessions in process: tokens/s and what each generated (ids, log-prob bits).
fn in_process(
    engine: &mut Engine,
    o: &BenchServeOptions,
    batch: usize,
) -> Result<(f64, Generated), TrainError> {
    let vocab = engine.model_config().vocab;
    let start = Instant::now();
    for s in 0..batch {
        let mut r = Request::new(
            &session_id(batch, s),
            prompt_of(s, o.prompt, vocab),
            o.tokens,
        );
        r.sampling.seed = 0;
        engine.submit(r).map_err(run_err)?;
    }
    let mut out = vec![(Vec::new(), Vec::new()); batch];
    let mut tokens = 0usize;
    while engine.has_work() {
        for e in engine.step().map_err(run_err)? {
            if let Event::Finished { sample, .. } = e {
                let s: usize = sample
                    .session_id
                    .rsplit('-')
                    .next()
                    .and_then(|x| x.parse().ok())
                    .ok_or_else(|| run_err("bad session id"))?;
                let p = sample.prompt_len;
                tokens += sample.tokens.len() - p;
                out[s] = (
                    sample.tokens[p..].to_vec(),
                    sample.behavior_logp[p..]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect(),
                );
            }
        }
    }
    Ok((tokens as f64 / start.elapsed().as_secs_f64(), out))
}

/// A `sluice serve` child; killed when dropped.
struct ServerProcess {
    child: Child,
    url: String,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(o: &ServeOptions) -> Result<ServerProcess, TrainError> {
    let exe = std::env::current_exe().map_err(run_err)?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve");
    if let Some(c) = &o.config {
        cmd.arg("--config").arg(c);
    }
    if let Some(w) = &o.weights {
        cmd.arg("--weights").arg(w);
    }
    for s in &o.sets {
        cmd.args(["--set", s]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(run_err)?;
    let mut line = String::new();
    let stdout = child.stdout.take().ok_or_else(|| run_err("no stdout"))?;
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(run_err)?;
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .ok_or_else(|| run_err(format!("sluice serve said {line:?}")))?
        .to_string();
    Ok(ServerProcess { child, url })
}

fn post(agent: &ureq::Agent, url: &str, body: &Value) -> Result<Value, TrainError> {
    let mut r = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body.to_string().as_bytes())
        .map_err(run_err)?;
    let text = r.body_mut().read_to_string().map_err(run_err)?;
    if r.status().as_u16() != 200 {
        return Err(run_err(format!("{url}: {} {text}", r.status())));
    }
    serde_json::from_str(&text).map_err(run_err)
}

/// B client threads, one `/generate` each, all at once.
fn over_http(
    agent: &ureq::Agent,
    url: &str,
    o: &BenchServeOptions,
    vocab: usize,
    batch: usize,
) -> Result<(f64, Generated), TrainError> {
    // The client threads start together once all exist (spawning them is not HTTP's cost);
    // the clock starts when the first of them starts.
    let ready = std::sync::Barrier::new(batch);
    let answers: Vec<(Instant, Result<Value, TrainError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..batch)
            .map(|s| {
                let body = json!({
                    "prompt": prompt_of(s, o.prompt, vocab),
                    "session_id": session_id(batch, s),
                    "max_new_tokens": o.tokens,
                    "sampling": {"seed": 0, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
                });
                let url = format!("{url}/generate");
                let ready = &ready;
                scope.spawn(move || {
                    ready.wait();
                    (Instant::now(), post(agent, &url, &body))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| (Instant::now(), Err(run_err("client thread"))))
            })
            .collect()
    });
    let secs = answers
        .iter()
        .map(|(t, _)| *t)
        .min()
        .map_or(0.0, |t| t.elapsed().as_secs_f64());
    let mut out = Vec::with_capacity(batch);
    let mut tokens = 0;
    for (s, (_, a)) in answers.into_iter().enumerate() {
        let a = a?;
        let ids: Vec<TokenId> = serde_json::from_value(a["ids"].clone()).map_err(run_err)?;
        let bits: Vec<u32> = serde_json::from_value(a["logprob_bits"].clone()).map_err(run_err)?;
        tokens += ids.len();
        out.push((ids, bits));
        // Close the session so the next rep starts from the same state.
        post(
            agent,
            &format!("{url}/abort"),
            &json!({"session_id": session_id(batch, s)}),
        )?;
    }
    Ok((tokens as f64 / secs, out))
}

fn vm_rss_kib(pid: u32) -> Result<u64, TrainError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(run_err)?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| run_err("no VmRSS in /proc/PID/status"))
}

/// What the idle-session measurement found.
#[derive(Clone, Debug)]
pub struct IdleMemory {
    pub sessions: usize,
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    pub kv_blocks_used: u64,
    pub kv_block_bytes: u64,
}

impl IdleMemory {
    /// Resident growth beyond the K/V blocks the sessions hold, in MiB.
    pub fn beyond_kv_mib(&self) -> f64 {
        let growth = (self.rss_after_kib.saturating_sub(self.rss_before_kib) * 1024) as f64;
        (growth - (self.kv_blocks_used * self.kv_block_bytes) as f64) / (1024.0 * 1024.0)
    }
}

/// Runs the bench; the report goes to `out`.
pub fn run(
    o: &BenchServeOptions,
    out: &mut dyn Write,
) -> Result<(Vec<Row>, IdleMemory), TrainError> {
    let served = prepare(&o.serve)?;
    let vocab = served.model.config.vocab;
    let block_bytes = KvCache::block_bytes(
        &served.model.config,
        served.engine_config.precision.dtype(),
        served.engine_config.block_size,
    ) as u64;
    let server = start_server(&o.serve)?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_idle_connections(256)
        .max_idle_connections_per_host(256)
        .build()
        .into();
    let mut rows = Vec::new();
    for &b in &o.batches {
        let mut engine = served.engine()?;
        let (mut best_in, mut best_http) = (0.0f64, 0.0f64);
        let mut identical = true;
        for _ in 0..o.reps.max(1) {
            let (tps, a) = in_process(&mut engine, o, b)?;
            let (htps, h) = over_http(&agent, &server.url, o, vocab, b)?;
            identical &= a == h;
            best_in = best_in.max(tps);
            best_http = best_http.max(htps);
        }
        let _ = writeln!(
            out,
            "B = {b:>3}: in process {best_in:>9.0} tokens/s, over HTTP {best_http:>9.0} tokens/s \
             ({:.1}% of in process), identical ids and log-prob bits: {identical}",
            100.0 * best_http / best_in
        );
        rows.push(Row {
            batch: b,
            in_process_tokens_per_s: best_in,
            http_tokens_per_s: best_http,
            identical,
        });
    }
    drop(server);
    // Idle sessions, on a fresh server (the batches above left K/V pages resident that the
    // idle sessions' blocks would reuse): one 1-token turn each, then left open.
    let server = start_server(&o.serve)?;
    let pid = server.child.id();
    let rss_before_kib = vm_rss_kib(pid)?;
    let url = format!("{}/generate", server.url);
    for s in 0..o.idle {
        post(
            &agent,
            &url,
            &json!({"prompt": prompt_of(s, o.prompt, vocab), "session_id": format!("idle-{s}"),
                    "max_new_tokens": 1}),
        )?;
    }
    let rss_after_kib = vm_rss_kib(pid)?;
    let h: Value = {
        let mut r = agent
            .get(format!("{}/health", server.url))
            .call()
            .map_err(run_err)?;
        serde_json::from_str(&r.body_mut().read_to_string().map_err(run_err)?).map_err(run_err)?
    };
    let idle = IdleMemory {
        sessions: h["sessions"].as_u64().unwrap_or(0) as usize,
        rss_before_kib,
        rss_after_kib,
        kv_blocks_used: h["kv_blocks_used"].as_u64().unwrap_or(0),
        kv_block_bytes: block_bytes,
    };
    let _ = writeln!(
        out,
        "{} idle sessions: server VmRSS {} -> {} KiB, {} KV blocks held ({:.2} MiB); beyond \
         the KV blocks {:.2} MiB",
        idle.sessions,
        idle.rss_before_kib,
        idle.rss_after_kib,
        idle.kv_blocks_used,
        (idle.kv_blocks_used * idle.kv_block_bytes) as f64 / (1024.0 * 1024.0),
        idle.beyond_kv_mib()
    );
    Ok((rows, idle))
}
