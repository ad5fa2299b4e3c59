//! The engine thread of `sluice serve`: the one owner of the [`Engine`]. HTTP handlers send it
//! [`Command`]s through a channel; it applies them between steps, steps while any sequence has
//! work (blocking on the channel when none does), streams each step's new tokens, and answers
//! each turn when the engine reports its end.
//!
//! A *session* is one engine trajectory submitted multi-turn: after a turn it pauses with its
//! K/V kept, and the next request for the same session id appends its tokens (`observe`) and
//! resumes. A request without a session id gets a one-turn session that is finished (its
//! blocks freed) when the turn ends. `/abort` finishes a session in any phase.

use super::api::{ApiError, FinishReason, StreamLine, Tokens, TurnResult};
use super::commands::{Aborted, Command, Counters, Health, Reply, TurnInput, TurnRequest};
use super::lane::LaneState;
use super::openai::{self, ChatMessage};
use super::weights::{self, HeldImage};
use sluice_runtime::engine::{Engine, EngineError, Event, Request, SeqHandle, StopConfig};
use sluice_runtime::trajectory::{SamplingParams, TerminalReason};
use std::collections::{BTreeSet, HashMap};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use tokio::sync::oneshot;

use crate::tasks::text::TextTokenizer;

/// A turn as it starts (before its reply is attached).
struct TurnStart {
    /// Index of the turn's first generated token in the trajectory.
    start: usize,
    prompt_tokens: usize,
    reencoded: bool,
    /// Chat: the history this turn answers (recorded with the reply when it ends).
    history: Option<Vec<ChatMessage>>,
}

struct Turn {
    reply: Reply,
    /// Tokens up to here have been streamed (from the turn's start).
    streamed: usize,
    started: TurnStart,
}

struct Session {
    handle: SeqHandle,
    sampling: SamplingParams,
    stop: StopConfig,
    /// Named by the client: kept open between turns.
    keep: bool,
    turn: Option<Turn>,
    /// Chat: the messages the session's tokens hold, the last reply included.
    chat: Option<Vec<ChatMessage>>,
}

/// The engine and every session (see the module docs).
pub struct EngineThread {
    engine: Engine,
    tok: Arc<TextTokenizer>,
    defaults: SamplingParams,
    held: HeldImage,
    sessions: HashMap<String, Session>,
    /// Sessions streaming a turn (their new tokens are sent after every step).
    streaming: BTreeSet<String>,
    counters: Counters,
    next_anonymous: u64,
    /// Whether a trainer drives the engine (`/lane/...`, see [`super::lane`]).
    lane: LaneState,
}

/// An engine error answered to a request: the request's fault (a 400) or the server's.
fn engine_error(endpoint: &str, e: EngineError) -> ApiError {
    match e {
        EngineError::Invalid(m) | EngineError::Capacity(m) | EngineError::Observation(m) => {
            ApiError::bad_request(format!("{endpoint}: {m}"))
        }
        e => ApiError::internal(format!("{endpoint}: {e}")),
    }
}

impl EngineThread {
    pub fn new(
        engine: Engine,
        tok: Arc<TextTokenizer>,
        defaults: SamplingParams,
        held: HeldImage,
        lane: LaneState,
    ) -> EngineThread {
        EngineThread {
            engine,
            tok,
            defaults,
            held,
            sessions: HashMap::new(),
            streaming: BTreeSet::new(),
            counters: Counters::default(),
            next_anonymous: 0,
            lane,
        }
    }

    /// Serves commands until every sender is gone. A driven engine steps only inside
    /// `/lane/step`.
    pub fn run(mut self, rx: Receiver<Command>) {
        loop {
            if !self.engine.has_work() || self.lane.driven() {
                match rx.recv() {
                    Ok(c) => self.handle(c),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            if self.engine.has_work() && !self.lane.driven() {
                self.step();
            }
        }
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Turn(req, reply) => {
                let started = self
                    .lane
                    .refuse_sessions(req.endpoint)
                    .and_then(|()| self.start_turn(req));
                match started {
                    Ok((id, start)) => self.attach(id, start, reply),
                    Err(e) => reply.reject(e),
                }
            }
            Command::Abort(id, tx) => {
                let r = self
                    .lane
                    .refuse_sessions("/abort")
                    .and_then(|()| self.abort(&id));
                let _ = tx.send(r);
            }
            Command::LaneJoin(image, tx) => {
                let open = self.sessions.len();
                let r = self
                    .lane
                    .join(&mut self.engine, &mut self.held, open, image);
                self.counters.lane_joins += r.is_ok() as u64;
                let _ = tx.send(r);
            }
            Command::LaneStep(req, tx) => {
                let r = self.lane.step(&mut self.engine, &self.held, req);
                self.counters.lane_steps = self.lane.steps();
                let _ = tx.send(r);
            }
            Command::Weights(update, tx) => {
                let r = weights::install(&mut self.engine, &mut self.held, update);
                if let Ok(i) = &r {
                    self.counters.weight_installs += 1;
                    self.counters.delta_installs += i.delta as u64;
                }
                let _ = tx.send(r);
            }
            Command::Health(tx) => {
                let _ = tx.send(self.health());
            }
        }
    }

    fn health(&self) -> Health {
        let kv = self.engine.stats().kv;
        Health {
            status: "ok",
            instance: self.lane.instance(),
            driven: self.lane.driven(),
            version: self.engine.version().0,
            blake3: self.held.hash.to_hex(),
            sessions: self.sessions.len(),
            generating: self.sessions.values().filter(|s| s.turn.is_some()).count(),
            kv_blocks: kv.num_blocks,
            kv_blocks_used: kv.blocks_used,
            kv_blocks_cached: kv.blocks_cached,
            counters: self.counters,
        }
    }

    fn anonymous_id(&mut self) -> String {
        loop {
            let id = format!("anonymous-{}", self.next_anonymous);
            self.next_anonymous += 1;
            if !self.sessions.contains_key(&id) {
                return id;
            }
        }
    }

    /// Validates and starts a turn; returns the session id and how the turn starts.
    fn start_turn(&mut self, req: TurnRequest) -> Result<(String, TurnStart), ApiError> {
        let ep = req.endpoint;
        let keep = req.session_id.is_some();
        let id = match req.session_id.clone() {
            Some(id) if id.is_empty() => {
                return Err(ApiError::bad_request(format!(
                    "{ep}: session_id is empty; name the session or leave the field out"
                )))
            }
            Some(id) => id,
            None => self.anonymous_id(),
        };
        if let Some(max) = req.max_new_tokens {
            if max == 0 {
                return Err(ApiError::bad_request(format!(
                    "{ep}: max_new_tokens must be >= 1"
                )));
            }
        }
        let Some(session) = self.sessions.get(&id) else {
            let base = self.defaults;
            return self.open_session(ep, id, keep, req, base, StopConfig::default());
        };
        if session.turn.is_some() {
            return Err(ApiError::conflict(format!(
                "{ep}: session {id:?} is generating a turn; wait for it to end or /abort it"
            )));
        }
        check_same_session_params(ep, &id, session, &req)?;
        let handle = session.handle;
        let max_new = req
            .max_new_tokens
            .unwrap_or(session.sampling.max_new_tokens);
        let (observation, history) = match req.input {
            TurnInput::Tokens(ids) => (ids, None),
            TurnInput::Chat(messages) => {
                let recorded = session.chat.as_deref().unwrap_or_default();
                let closed = self
                    .engine
                    .trajectory(handle)
                    .and_then(|v| v.tokens.last().copied())
                    == Some(self.tok.specials().eot);
                match openai::continuation(&self.tok, recorded, &messages, closed) {
                    Some(obs) => (
                        obs.map_err(|m| ApiError::bad_request(format!("{ep}: {m}")))?,
                        Some(messages),
                    ),
                    None => {
                        // The client's history is not what this session holds: start over
                        // from the text (flagged: its ids were not all sampled here), with the
                        // session's sampling; the old trajectory ends once the new one is in.
                        let (base, base_stop) = (session.sampling, session.stop.clone());
                        return self.open_session(
                            ep,
                            id,
                            keep,
                            TurnRequest {
                                input: TurnInput::Chat(messages),
                                ..req
                            },
                            base,
                            base_stop,
                        );
                    }
                }
            }
        };
        self.engine
            .observe(handle, &observation, max_new)
            .map_err(|e| engine_error(ep, e))?;
        if history.is_none() {
            // Ids appended outside the chat template: the recorded messages no longer
            // describe the session's ids, so a later chat turn is encoded again (flagged).
            if let Some(s) = self.sessions.get_mut(&id) {
                s.chat = None;
            }
        }
        let len = self.engine.trajectory(handle).map_or(0, |v| v.tokens.len());
        self.counters.turns_started += 1;
        Ok((
            id,
            TurnStart {
                start: len,
                prompt_tokens: observation.len(),
                reencoded: false,
                history,
            },
        ))
    }

    /// Submits a session's first turn: the request's sampling and stop ids over `base` and
    /// `base_stop`. A session already under this id (a chat history that had to be encoded
    /// again) is replaced only once the new trajectory is accepted.
    fn open_session(
        &mut self,
        ep: &'static str,
        id: String,
        keep: bool,
        req: TurnRequest,
        base: SamplingParams,
        base_stop: StopConfig,
    ) -> Result<(String, TurnStart), ApiError> {
        let mut sampling = base;
        let f = req.sampling;
        sampling.temperature = f.temperature.unwrap_or(sampling.temperature);
        sampling.top_k = f.top_k.unwrap_or(sampling.top_k);
        sampling.top_p = f.top_p.unwrap_or(sampling.top_p);
        sampling.seed = f.seed.unwrap_or(sampling.seed);
        sampling.max_new_tokens = req.max_new_tokens.unwrap_or(sampling.max_new_tokens);
        let (prompt, reencoded, history) = match req.input {
            TurnInput::Tokens(ids) => (ids, false, None),
            TurnInput::Chat(messages) => {
                let prompt = openai::render_prompt(&self.tok, &messages)
                    .map_err(|m| ApiError::bad_request(format!("{ep}: {m}")))?;
                // Assistant text in a history this server did not sample is re-encoded text.
                let reencoded = messages.iter().any(|m| m.role == "assistant");
                (prompt, reencoded, Some(messages))
            }
        };
        let stop = req.stop.unwrap_or(base_stop);
        let handles = self
            .engine
            .submit(Request {
                session_id: id.clone(),
                instance_id: id.clone(),
                task: "serve".into(),
                group_size: 1,
                prompt: prompt.clone(),
                sampling,
                stop: stop.clone(),
                multi_turn: true,
            })
            .map_err(|e| engine_error(ep, e))?;
        let chat = history.as_ref().map(|_| Vec::new());
        self.close(&id);
        self.sessions.insert(
            id.clone(),
            Session {
                handle: handles[0],
                sampling,
                stop,
                keep,
                turn: None,
                chat,
            },
        );
        self.counters.turns_started += 1;
        self.counters.reencoded_turns += reencoded as u64;
        Ok((
            id,
            TurnStart {
                start: prompt.len(),
                prompt_tokens: prompt.len(),
                reencoded,
                history,
            },
        ))
    }

    fn attach(&mut self, id: String, started: TurnStart, reply: Reply) {
        let reply = match reply {
            Reply::Stream { started: tx, lines } => {
                let _ = tx.send(Ok(()));
                self.streaming.insert(id.clone());
                Reply::Stream {
                    started: oneshot::channel().0,
                    lines,
                }
            }
            once => once,
        };
        if let Some(s) = self.sessions.get_mut(&id) {
            s.turn = Some(Turn {
                reply,
                streamed: started.start,
                started,
            });
        }
    }

    /// Finishes a session's trajectory and forgets it (its turn, if any, is dropped
    /// unanswered: callers answer it first). Returns the tokens it held.
    fn close(&mut self, id: &str) -> usize {
        self.streaming.remove(id);
        let Some(s) = self.sessions.remove(id) else {
            return 0;
        };
        let held = self
            .engine
            .trajectory(s.handle)
            .map_or(0, |v| v.tokens.len());
        if let Err(e) = self.engine.finish(s.handle, 0.0, TerminalReason::Failure) {
            eprintln!("sluice serve: closing session {id:?}: {e}");
        }
        held
    }

    /// The tokens of `handle` from `from` on.
    fn tokens_since(&self, handle: SeqHandle, from: usize) -> Tokens {
        let mut t = Tokens::default();
        if let Some(v) = self.engine.trajectory(handle) {
            for i in from..v.tokens.len() {
                t.push(v.tokens[i], v.behavior_logp[i], v.versions[i].0);
            }
        }
        t
    }

    /// Ends the turn of session `id` with `reason`: answers it, records a chat reply, and
    /// closes a one-turn session.
    fn end_turn(&mut self, id: &str, reason: FinishReason) {
        let Some(s) = self.sessions.get_mut(id) else {
            return;
        };
        let Some(turn) = s.turn.take() else {
            return;
        };
        let handle = s.handle;
        let keep = s.keep;
        self.streaming.remove(id);
        let all = self.tokens_since(handle, turn.started.start);
        let session_tokens = turn.started.start + all.ids.len();
        self.counters.turns_finished += 1;
        self.counters.generated_tokens += all.ids.len() as u64;
        if let Some(mut history) = turn.started.history.clone() {
            history.push(ChatMessage {
                role: "assistant".into(),
                content: openai::reply_text(&self.tok, &all.ids),
            });
            if let Some(s) = self.sessions.get_mut(id) {
                s.chat = Some(history);
            }
        }
        let result = TurnResult {
            session_id: id.to_string(),
            tokens: all,
            finish_reason: reason,
            prompt_tokens: turn.started.prompt_tokens,
            session_tokens,
            reencoded: turn.started.reencoded,
        };
        match turn.reply {
            Reply::Once(tx) => {
                let _ = tx.send(Ok(result));
            }
            Reply::Stream { lines, .. } => {
                let step = self.tokens_since(handle, turn.streamed);
                let _ = lines.send(StreamLine::Done {
                    step,
                    finish_reason: reason,
                    session_id: result.session_id,
                    prompt_tokens: result.prompt_tokens,
                    session_tokens: result.session_tokens,
                    reencoded: result.reencoded,
                });
            }
        }
        if !keep || reason == FinishReason::Abort {
            self.close(id);
        }
    }

    fn abort(&mut self, id: &str) -> Result<Aborted, ApiError> {
        let Some(s) = self.sessions.get(id) else {
            return Err(ApiError::not_found(format!(
                "/abort: no session {id:?} (it was never opened, or it ended)"
            )));
        };
        let was_generating = s.turn.is_some();
        let tokens_freed = self
            .engine
            .trajectory(s.handle)
            .map_or(0, |v| v.tokens.len());
        if was_generating {
            // Answers the turn with what it has, then closes the session.
            self.end_turn(id, FinishReason::Abort);
        } else {
            self.close(id);
        }
        self.counters.aborted += 1;
        Ok(Aborted {
            session_id: id.to_string(),
            was_generating,
            tokens_freed,
        })
    }

    /// One engine step: answers the turns that ended, then streams the others' new tokens.
    fn step(&mut self) {
        let events = match self.engine.step() {
            Ok(e) => e,
            Err(e) => return self.fail_all(&e.to_string()),
        };
        for e in events {
            match e {
                Event::TurnEnded {
                    session_id, reason, ..
                } => self.end_turn(&session_id, reason.into()),
                // Every session is submitted multi-turn, so no trajectory finishes by itself.
                Event::Finished { sample, .. } => {
                    eprintln!(
                        "sluice serve: session {:?} finished inside the engine",
                        sample.session_id
                    );
                }
            }
        }
        let ids: Vec<String> = self.streaming.iter().cloned().collect();
        for id in ids {
            let Some(s) = self.sessions.get(&id) else {
                continue;
            };
            let Some(turn) = &s.turn else { continue };
            let step = self.tokens_since(s.handle, turn.streamed);
            if step.is_empty() {
                continue;
            }
            let n = step.ids.len();
            let gone = match &turn.reply {
                Reply::Stream { lines, .. } => lines.send(StreamLine::Step(step)).is_err(),
                Reply::Once(_) => false,
            };
            if let Some(Session {
                turn: Some(turn), ..
            }) = self.sessions.get_mut(&id)
            {
                turn.streamed += n;
            }
            if gone {
                // The client left mid-stream: nobody reads this turn.
                self.close(&id);
            }
        }
    }

    /// An engine step failed: answer every turn in flight with the error and drop every
    /// session (their K/V may be inconsistent); the server keeps serving new requests.
    fn fail_all(&mut self, message: &str) {
        eprintln!("sluice serve: an engine step failed: {message}");
        self.counters.engine_errors += 1;
        for (_, s) in self.sessions.drain() {
            if let Some(t) = s.turn {
                let e = format!("the engine failed: {message}; the session was dropped");
                match t.reply {
                    Reply::Once(tx) => drop(tx.send(Err(ApiError::internal(e)))),
                    Reply::Stream { lines, .. } => drop(lines.send(StreamLine::Error { error: e })),
                }
            }
        }
        self.streaming.clear();
        if let Err(e) = self.engine.abort_all() {
            eprintln!("sluice serve: dropping every trajectory after the failure: {e}");
        }
    }
}

/// A session's sampling parameters and stop ids are fixed by its first request: a later one
/// may repeat them, not change them.
fn check_same_session_params(
    ep: &str,
    id: &str,
    s: &Session,
    req: &TurnRequest,
) -> Result<(), ApiError> {
    let f = req.sampling;
    let p = s.sampling;
    let differs = |name: &str, given: String, held: String| {
        Err(ApiError::bad_request(format!(
            "{ep}: session {id:?} samples with {name} = {held} (fixed by its first request); \
             this request asks for {given}"
        )))
    };
    if let Some(t) = f
        .temperature
        .filter(|t| t.to_bits() != p.temperature.to_bits())
    {
        return differs("temperature", t.to_string(), p.temperature.to_string());
    }
    if let Some(k) = f.top_k.filter(|&k| k != p.top_k) {
        return differs("top_k", k.to_string(), p.top_k.to_string());
    }
    if let Some(t) = f.top_p.filter(|t| t.to_bits() != p.top_p.to_bits()) {
        return differs("top_p", t.to_string(), p.top_p.to_string());
    }
    if let Some(seed) = f.seed.filter(|&x| x != p.seed) {
        return differs("seed", seed.to_string(), p.seed.to_string());
    }
    if let Some(stop) = req.stop.as_ref().filter(|&st| *st != s.stop) {
        return differs("stop ids", format!("{stop:?}"), format!("{:?}", s.stop));
    }
    Ok(())
}
