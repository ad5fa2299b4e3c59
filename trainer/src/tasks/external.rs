//! `external` and `http`: a task whose environment lives outside sluice -- a program sluice
//! starts (any language) or a server at a URL -- speaking the JSON messages of docs/runtime.md
//! ("External environments"): `problem`, `step` and `demonstration`.
//!
//! This is the token gateway. Text crosses the boundary here and only here: a prompt or an
//! observation the environment writes as text is encoded once with the run's tokenizer
//! ([`TextTokenizer`]: the character one, or a BPE); a turn goes out as the ids the engine sampled and their decoded text, and
//! what the learner trains on stays those ids (they are never re-encoded). The chat
//! conventions are the built-in text tasks': a model turn stops at `<eot>` (the EOS) or at
//! `</call>` (a tool call).
//!
//! Calls. The orchestrator plans a call ([`Task::prefetch`]: the request is sent then, so the
//! calls of many sessions are in flight together) and takes its reply when its latency timer
//! is due ([`Task::call`]). Each request carries a session id (`TASK/GROUP#MEMBER`, one per
//! trajectory), the turn, the attempt and a request id. A crash or a hang is a transient fault
//! that the orchestrator retries within the task's `retries` (then the trajectory ends as
//! `environment`, never trained); a malformed reply is named (which message, which field,
//! which session) on stderr and counted as `malformed` in the run's `env_faults`.
//!
//! Record and replay: every reply (or failure) is written to the run folder's
//! `environments.jsonl` ([`record`]); with `--replay-env RUN_DIR` the task answers from that
//! record and starts no environment; a call the record lacks stops the run with exit code 2,
//! naming its key.
//!
//! [`TextTokenizer`]: super::text::TextTokenizer

use super::template;
use super::text::TextTokenizer;
use serde_json::{json, Map, Value};
use sluice_kernels::testing::Rng;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::env::external::http::HttpLink;
use sluice_runtime::env::external::process::ProcessLink;
use sluice_runtime::env::external::record::{self, Entry, Recorder, ReplayBook, ReplayKey};
use sluice_runtime::env::external::{Link, LinkError};
use sluice_runtime::env::faults::{CallFault, CallKey};
use sluice_runtime::env::{CallError, Demonstration, Problem, Reply, Split, Task, TaskError};
use sluice_runtime::trajectory::{ArtifactVersions, TerminalReason, TokenId};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bumped when the messages change.
pub const PROTOCOL: &str = "sluice-env-1";

/// Failures of one kind named on stderr before the rest are only counted.
const NAMED_PER_KIND: u64 = 5;

/// Where the environment is.
#[derive(Clone, Debug, PartialEq)]
pub enum Endpoint {
    /// A program and its arguments (kind `external`).
    Process { program: String, args: Vec<String> },
    /// A server (kind `http`).
    Http { url: String },
}

impl Endpoint {
    fn describe(&self) -> String {
        match self {
            Endpoint::Process { program, args } => std::iter::once(program.as_str())
                .chain(args.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(" "),
            Endpoint::Http { url } => url.clone(),
        }
    }
}

/// What a run gives its external tasks: the call timeout, where replies are recorded, and a
/// record to answer from instead of the environment.
#[derive(Clone, Default)]
pub struct EnvIo {
    pub timeout: Duration,
    /// Retries of a call that crashed or timed out, for the calls the task makes itself
    /// (problems, demonstrations, evaluation turns); the orchestrator retries training turns
    /// within the same budget.
    pub retries: u32,
    pub recorder: Option<Arc<Recorder>>,
    pub replay: Option<Arc<ReplayBook>>,
}

struct Pending {
    id: u64,
    request: Value,
    key: ReplayKey,
    sent: Instant,
}

/// An environment outside the process (see the module docs).
pub struct ExternalTask {
    name: String,
    kind: &'static str,
    endpoint: String,
    /// None when replaying.
    link: Option<Box<dyn Link>>,
    io: EnvIo,
    vocab: usize,
    tok: Arc<TextTokenizer>,
    next_id: AtomicU64,
    /// Step requests sent ahead by `prefetch`, by (session, turn, attempt).
    pending: Mutex<HashMap<(String, u32, u32), Pending>>,
    named: Mutex<BTreeMap<&'static str, u64>>,
}

impl ExternalTask {
    /// A task reaching `endpoint` for a model of `vocab` ids; nothing is started until the
    /// first request.
    pub fn new(
        name: &str,
        endpoint: Endpoint,
        vocab: usize,
        io: EnvIo,
    ) -> Result<ExternalTask, String> {
        if io.timeout.is_zero() {
            return Err(format!("task {name}: the call timeout must be positive"));
        }
        let kind = match endpoint {
            Endpoint::Process { .. } => "external",
            Endpoint::Http { .. } => "http",
        };
        let link: Option<Box<dyn Link>> = match (&io.replay, &endpoint) {
            (Some(_), _) => None,
            (None, Endpoint::Process { program, args }) => {
                if program.is_empty() {
                    return Err(format!(
                        "task {name}: kind external needs a command (the program to start)"
                    ));
                }
                Some(Box::new(ProcessLink::new(program, args)))
            }
            (None, Endpoint::Http { url }) => Some(Box::new(
                HttpLink::new(url, io.timeout).map_err(|e| format!("task {name}: {e}"))?,
            )),
        };
        Ok(ExternalTask {
            name: name.to_string(),
            kind,
            endpoint: endpoint.describe(),
            link,
            io,
            vocab,
            tok: TextTokenizer::char(),
            next_id: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            named: Mutex::new(BTreeMap::new()),
        })
    }

    /// The same task on another tokenizer (the character one by default).
    pub fn with_tokenizer(mut self, tok: Arc<TextTokenizer>) -> ExternalTask {
        self.tok = tok;
        self
    }

    /// Restarts of the environment process after crashes and hangs.
    pub fn restarts(&self) -> u64 {
        self.link.as_ref().map_or(0, |l| l.restarts())
    }

    /// Builds a request (`id` added) and its replay key.
    fn request(
        &self,
        message: &str,
        session: &str,
        turn: u32,
        mut body: Map<String, Value>,
    ) -> Pending {
        body.insert("type".into(), json!(message));
        let mut request = Value::Object(body);
        let key = ReplayKey {
            session: session.to_string(),
            turn,
            hash: record::request_hash(&request),
        };
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        request["id"] = json!(id);
        Pending {
            id,
            request,
            key,
            sent: Instant::now(),
        }
    }

    fn start(&self, p: &Pending) {
        if let Some(link) = &self.link {
            link.send(p.id, &p.request);
        }
    }

    /// The reply to a started request, recorded; a replay miss ends the process (exit 2).
    fn finish(&self, p: Pending) -> Result<Value, LinkError> {
        let message = p.request["type"].as_str().unwrap_or("?").to_string();
        let reply = match (&self.link, &self.io.replay) {
            (Some(link), _) => link.wait(p.id, self.io.timeout),
            (None, Some(book)) => match book.get(&p.key) {
                Some(r) => r.clone(),
                None => {
                    // The Task trait has no way to stop a run from a call (problem() cannot
                    // fail), and a replay must never invent a reply: this is the CLI's exit.
                    eprintln!(
                        "error: --replay-env {}: the record holds no reply to the {message} \
                         request of task {} with key {}; a replay never invents one",
                        book.dir().display(),
                        self.name,
                        p.key
                    );
                    std::process::exit(2);
                }
            },
            (None, None) => Err(LinkError::Crash("no environment and no record".into())),
        };
        if let Some(rec) = &self.io.recorder {
            rec.write(&Entry {
                task: &self.name,
                message: &message,
                key: &p.key,
                request: &p.request,
                reply: &reply,
                latency_ms: p.sent.elapsed().as_secs_f64() * 1e3,
            });
        }
        reply
    }

    /// Sends one request and waits for its reply.
    fn exchange(&self, p: Pending) -> Result<Value, LinkError> {
        self.start(&p);
        self.finish(p)
    }

    /// Names a failure on stderr (the first few of each kind).
    fn name_failure(&self, kind: &'static str, message: &str) {
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        let n = named.entry(kind).or_default();
        *n += 1;
        if *n <= NAMED_PER_KIND {
            eprintln!(
                "sluice: task {} ({}): {kind}: {message}",
                self.name, self.endpoint
            );
            if *n == NAMED_PER_KIND {
                eprintln!(
                    "sluice: task {}: further {kind} failures are counted only (metrics: \
                     env_faults.{kind}; every one is in {})",
                    self.name,
                    record::FILE
                );
            }
        }
    }

    /// Token ids from `obj.field`: exactly one of `text` (encoded here, once) or `ids`.
    fn tokens(&self, obj: &Value, field: &str, ctx: &str) -> Result<Vec<TokenId>, String> {
        let v = obj
            .get(field)
            .ok_or_else(|| format!("{ctx}: no \"{field}\" field"))?;
        let (text, ids) = (v.get("text"), v.get("ids"));
        match (text, ids) {
            (Some(t), None) => {
                let t = t
                    .as_str()
                    .ok_or_else(|| format!("{ctx}: field {field}.text is not a string"))?;
                self.tok
                    .encode(t)
                    .map_err(|e| format!("{ctx}: field {field}.text: {e}"))
            }
            (None, Some(ids)) => {
                let arr = ids
                    .as_array()
                    .ok_or_else(|| format!("{ctx}: field {field}.ids is not an array"))?;
                arr.iter()
                    .enumerate()
                    .map(|(i, x)| {
                        x.as_u64()
                            .filter(|&id| (id as usize) < self.vocab)
                            .map(|id| id as TokenId)
                            .ok_or_else(|| {
                                format!(
                                    "{ctx}: field {field}.ids[{i}] = {x} is not a token id below \
                                     the vocabulary size {}",
                                    self.vocab
                                )
                            })
                    })
                    .collect()
            }
            _ => Err(format!(
                "{ctx}: field {field} must hold exactly one of \"text\" or \"ids\""
            )),
        }
    }

    /// The step reply `v` as a [`Reply`].
    fn parse_step(&self, v: &Value, ctx: &str) -> Result<Reply, CallError> {
        let malformed = |m: String| CallError::Malformed(m);
        let o = v
            .as_object()
            .ok_or_else(|| malformed(format!("{ctx}: the reply is not an object")))?;
        if let Some(e) = o.get("error") {
            let text = e.as_str().map_or_else(|| e.to_string(), str::to_string);
            return Err(CallError::Task(TaskError(format!(
                "{ctx}: the environment reports an error: {text}"
            ))));
        }
        match (o.get("observation"), o.get("end")) {
            (Some(_), None) => {
                let ids = self.tokens(v, "observation", ctx).map_err(malformed)?;
                if ids.is_empty() {
                    return Err(malformed(format!("{ctx}: field observation is empty")));
                }
                Ok(Reply::Observe(ids))
            }
            (None, Some(end)) => {
                let reward = end
                    .get("reward")
                    .and_then(Value::as_f64)
                    .filter(|r| r.is_finite())
                    .ok_or_else(|| {
                        malformed(format!(
                            "{ctx}: field end.reward is {} (a finite number is needed)",
                            end.get("reward").map_or("missing".into(), Value::to_string)
                        ))
                    })?;
                let reason = match end.get("reason").and_then(Value::as_str) {
                    Some("success") => TerminalReason::Success,
                    Some("failure") => TerminalReason::Failure,
                    Some("budget") => TerminalReason::Budget,
                    Some("environment") => TerminalReason::Environment,
                    other => {
                        return Err(malformed(format!(
                            "{ctx}: field end.reason is {} (one of \"success\", \"failure\", \
                             \"budget\", \"environment\" is needed)",
                            other.map_or("missing".into(), |s| format!("{s:?}"))
                        )))
                    }
                };
                Ok(Reply::End {
                    reward: reward as f32,
                    reason,
                })
            }
            (Some(_), Some(_)) => Err(malformed(format!(
                "{ctx}: the reply has both \"observation\" and \"end\""
            ))),
            (None, None) => Err(malformed(format!(
                "{ctx}: the reply has none of \"observation\", \"end\" or \"error\""
            ))),
        }
    }

    fn step_request(&self, key: &CallKey<'_>, problem: &Problem, generated: &[TokenId]) -> Pending {
        let mut body = Map::new();
        body.insert("session".into(), json!(key.session));
        body.insert("turn".into(), json!(key.turn));
        body.insert("attempt".into(), json!(key.attempt));
        body.insert("spec".into(), json!(problem.spec));
        body.insert("text".into(), json!(self.tok.render(generated)));
        body.insert("ids".into(), json!(generated));
        self.request("step", key.session, key.turn, body)
    }

    fn link_error(&self, e: LinkError) -> CallError {
        match e {
            LinkError::Crash(m) => CallError::Fault(CallFault::Crash, m),
            LinkError::Timeout(m) => CallError::Fault(CallFault::Timeout, m),
            LinkError::Malformed(m) => CallError::Malformed(m),
        }
    }

    /// A request outside any session (`problem`, `demonstration`), retried within the task's
    /// budget after a crash or a hang (the process restarts).
    fn sessionless(&self, message: &str, body: Map<String, Value>) -> Result<Value, String> {
        let mut last = String::new();
        for attempt in 0..=self.io.retries {
            let mut b = body.clone();
            b.insert("attempt".into(), json!(attempt));
            let p = self.request(message, record::NO_SESSION, 0, b);
            match self.exchange(p) {
                Ok(v) => {
                    if let Some(e) = v.get("error") {
                        return Err(format!("the environment reports an error: {e}"));
                    }
                    return Ok(v);
                }
                Err(e @ LinkError::Malformed(_)) => return Err(e.to_string()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    }
}

impl Task for ExternalTask {
    fn name(&self) -> &str {
        &self.name
    }

    fn multi_turn(&self) -> bool {
        true
    }

    fn problem(&self, rng: &mut Rng, split: Split) -> Problem {
        // 53 bits: exact in every JSON reader (JavaScript's numbers included).
        let seed = rng.next_u64() >> 11;
        let split_name = match split {
            Split::Train => "train",
            Split::HeldOut => "held_out",
        };
        let mut body = Map::new();
        body.insert("split".into(), json!(split_name));
        body.insert("seed".into(), json!(seed));
        let ctx = format!("problem reply (split {split_name}, seed {seed})");
        let got = self.sessionless("problem", body).and_then(|v| {
            let spec = v
                .get("spec")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("{ctx}: no \"spec\" string"))?
                .to_string();
            let prompt = self.tokens(&v, "prompt", &ctx)?;
            if prompt.is_empty() {
                return Err(format!("{ctx}: field prompt is empty"));
            }
            Ok((spec, prompt))
        });
        match got {
            Ok((spec, prompt)) => Problem {
                id: format!("{}:{spec}", self.name),
                prompt,
                spec,
            },
            Err(e) => {
                self.name_failure("problem", &e);
                // problem() cannot fail: an id outside every vocabulary makes the engine
                // refuse the prompt, so the group ends as `environment` (counted `submit`).
                Problem {
                    id: format!("{}:unavailable:{seed}", self.name),
                    prompt: vec![TokenId::MAX],
                    spec: String::new(),
                }
            }
        }
    }

    fn respond(
        &self,
        problem: &Problem,
        turn: u32,
        generated: &[TokenId],
    ) -> Result<Reply, TaskError> {
        // Evaluation calls outside the orchestrator: one session per problem, retried within
        // the task's budget.
        let session = format!("eval:{}", problem.id);
        let mut last = None;
        for attempt in 0..=self.io.retries {
            let key = CallKey {
                session: &session,
                turn,
                attempt,
            };
            match self.call(key, problem, generated) {
                Ok(r) => return Ok(r),
                Err(CallError::Fault(_, m)) => last = Some(m),
                Err(e) => return Err(TaskError(e.to_string())),
            }
        }
        Err(TaskError(last.unwrap_or_default()))
    }

    fn call(
        &self,
        key: CallKey<'_>,
        problem: &Problem,
        generated: &[TokenId],
    ) -> Result<Reply, CallError> {
        let ctx = format!(
            "step reply to session {}, turn {}, attempt {}",
            key.session, key.turn, key.attempt
        );
        let fresh = self.step_request(&key, problem, generated);
        let sent = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(key.session.to_string(), key.turn, key.attempt));
        let p = match sent {
            // The request sent ahead is this one (a session restarted after a lost replica
            // reuses its name for other turns).
            Some(p) if p.key == fresh.key => p,
            other => {
                if let (Some(old), Some(l)) = (other, &self.link) {
                    l.forget(old.id);
                }
                self.start(&fresh);
                fresh
            }
        };
        let r = self
            .finish(p)
            .map_err(|e| self.link_error(e))
            .and_then(|v| self.parse_step(&v, &ctx));
        if let Err(e) = &r {
            self.name_failure(e.kind(), &e.to_string());
        }
        r
    }

    fn prefetch(&self, key: CallKey<'_>, problem: &Problem, generated: &[TokenId]) {
        let k = (key.session.to_string(), key.turn, key.attempt);
        let p = self.step_request(&key, problem, generated);
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.get(&k).is_some_and(|old| old.key == p.key) {
            return;
        }
        // Calls whose group ended elsewhere (a lost replica) are never collected: drop the
        // old ones (a call dropped by mistake is only sent again).
        if pending.len() > 4096 {
            let cutoff = 4 * self.io.timeout;
            pending.retain(|_, p| {
                let keep = p.sent.elapsed() < cutoff;
                if !keep {
                    if let Some(l) = &self.link {
                        l.forget(p.id);
                    }
                }
                keep
            });
        }
        self.start(&p);
        if let (Some(old), Some(l)) = (pending.insert(k, p), &self.link) {
            l.forget(old.id);
        }
    }

    fn stop(&self) -> StopConfig {
        StopConfig {
            eos: Some(self.tok.specials().eot),
            stop_sequences: vec![vec![self.tok.specials().end_call]],
        }
    }

    fn versions(&self) -> ArtifactVersions {
        ArtifactVersions {
            template: template::VERSION.into(),
            tokenizer: self.tok.version(),
            environment: format!("{PROTOCOL}:{}:{}", self.kind, self.endpoint),
        }
    }

    fn demonstration(&self, problem: &Problem, rng: &mut Rng) -> Option<Demonstration> {
        // 53 bits: exact in every JSON reader (JavaScript's numbers included).
        let seed = rng.next_u64() >> 11;
        let mut body = Map::new();
        body.insert("spec".into(), json!(problem.spec));
        body.insert("seed".into(), json!(seed));
        let ctx = format!("demonstration reply (spec {:?}, seed {seed})", problem.spec);
        let got = self.sessionless("demonstration", body).and_then(|v| {
            let segs = match v.get("demonstration") {
                Some(Value::Null) => return Ok(None),
                Some(Value::Array(a)) => a.clone(),
                _ => {
                    return Err(format!(
                        "{ctx}: field demonstration is not an array or null"
                    ))
                }
            };
            // The segments continue the problem's prompt (as the problem reply encoded it).
            let mut d = Demonstration {
                tokens: problem.prompt.clone(),
                loss_mask: vec![false; problem.prompt.len()],
            };
            for (i, s) in segs.iter().enumerate() {
                let train = match s.get("role").and_then(Value::as_str) {
                    Some("model") => true,
                    Some("given") => false,
                    other => {
                        return Err(format!(
                            "{ctx}: field demonstration[{i}].role is {other:?} (\"given\" or \
                             \"model\" is needed)"
                        ))
                    }
                };
                let t = s.get("text").and_then(Value::as_str).ok_or_else(|| {
                    format!("{ctx}: field demonstration[{i}].text is not a string")
                })?;
                let ids = self
                    .tok
                    .encode(t)
                    .map_err(|e| format!("{ctx}: field demonstration[{i}].text: {e}"))?;
                d.loss_mask.extend(std::iter::repeat_n(train, ids.len()));
                d.tokens.extend(ids);
            }
            if !d.loss_mask.iter().any(|&m| m) {
                return Err(format!("{ctx}: no \"model\" segment (nothing to train on)"));
            }
            Ok(Some(d))
        });
        match got {
            Ok(d) => d,
            Err(e) => {
                self.name_failure("demonstration", &e);
                None
            }
        }
    }
}
