//! `/lane/join` and `/lane/step`: a trainer drives this server as one replica of its run
//! (`rollout.servers`, docs/runtime.md "Rollout servers").
//!
//! `POST /lane/join?version=N&blake3=HEX` with the engine's whole weight image as the body
//! builds a fresh engine on the image (length and blake3 checked; any version: the new driver
//! owns the server, and every sequence an earlier driver left is gone) and answers a lane
//! token. From then on the
//! server is *driven*: its engine steps only inside `/lane/step`, and the session endpoints
//! (`/generate`, `/abort`, `/v1/...`) answer 409 until the process restarts.
//!
//! `POST /lane/step` carries the token and a unit of work's commands (submit, observe,
//! finish); the engine thread applies them and takes one engine step with the same code an
//! in-process replica runs ([`sluice_runtime::remote::unit`]), and answers the results, the
//! events, the token counts and the version and blake3 it runs on. A token other than the
//! current one (the server restarted, or another trainer joined since) is a 409: the caller's
//! sequences are gone. A command the engine refuses is answered in its result slot, as in
//! process; a malformed body is a 400 and nothing is applied.
//!
//! Test hook: `SLUICE_SERVE_EXIT_AFTER_LANE_STEPS=N` makes the process exit (status 3) when
//! the (N+1)-th `/lane/step` arrives, without answering it: a server that dies mid-run.

use super::api::ApiError;
use super::weights::{self, HeldImage};
use sluice_runtime::engine::Engine;
use sluice_runtime::orchestrator::EngineCmd;
use sluice_runtime::remote::unit;
use sluice_runtime::remote::wire::{JoinAnswer, StepAnswer, StepRequest, WireEvent, WireResult};
use sluice_runtime::sync::ContentHash;
use sluice_runtime::trajectory::WeightVersion;

/// The environment variable of the test hook (see the module docs).
pub const EXIT_AFTER_ENV: &str = "SLUICE_SERVE_EXIT_AFTER_LANE_STEPS";

/// A join's image: the body of `/lane/join` and its query.
#[derive(Debug)]
pub struct JoinImage {
    pub bytes: Vec<u8>,
    pub version: WeightVersion,
    pub hash: ContentHash,
}

/// Whether a trainer drives the server, and which join.
#[derive(Debug)]
pub struct LaneState {
    /// This process's nonce (a restarted server has another).
    nonce: String,
    joins: u64,
    driven: bool,
    steps: u64,
    exit_after: Option<u64>,
}

impl LaneState {
    pub fn new(exit_after: Option<u64>) -> LaneState {
        // Time and process id: distinct across restarts of one server, which is all it is for.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        LaneState {
            nonce: format!("{:x}", t ^ ((std::process::id() as u64) << 40)),
            joins: 0,
            driven: false,
            steps: 0,
            exit_after,
        }
    }

    /// The token `/health` reports: the current join's, or the process's nonce.
    pub fn instance(&self) -> String {
        if self.driven {
            format!("{}.{}", self.nonce, self.joins)
        } else {
            self.nonce.clone()
        }
    }

    pub fn driven(&self) -> bool {
        self.driven
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The 409 of a session endpoint on a driven server.
    pub fn refuse_sessions(&self, endpoint: &str) -> Result<(), ApiError> {
        if self.driven {
            return Err(ApiError::conflict(format!(
                "{endpoint}: this server is driven by a trainer (POST /lane/join): its session \
                 endpoints are off until the process restarts"
            )));
        }
        Ok(())
    }

    /// `/lane/join` (see the module docs). `open_sessions`: sessions of the session endpoints.
    pub fn join(
        &mut self,
        engine: &mut Engine,
        held: &mut HeldImage,
        open_sessions: usize,
        image: JoinImage,
    ) -> Result<JoinAnswer, ApiError> {
        if open_sessions > 0 {
            return Err(ApiError::conflict(format!(
                "/lane/join: {open_sessions} session(s) of /generate or /v1 are open and a join \
                 would end them; /abort them or join another server"
            )));
        }
        let aborted =
            weights::restart_on_image(engine, held, image.bytes, image.version, image.hash)
                .map_err(|mut e| {
                    e.message = format!("/lane/join: {}", e.message);
                    e
                })?;
        self.joins += 1;
        self.driven = true;
        Ok(JoinAnswer {
            instance: self.instance(),
            version: held.version.0,
            blake3: held.hash.to_hex(),
            aborted,
        })
    }

    /// `/lane/step` (see the module docs).
    pub fn step(
        &mut self,
        engine: &mut Engine,
        held: &HeldImage,
        req: StepRequest,
    ) -> Result<StepAnswer, ApiError> {
        if !self.driven {
            return Err(ApiError::conflict(
                "/lane/step: no trainer has joined this server (POST /lane/join first)",
            ));
        }
        let instance = self.instance();
        if req.instance != instance {
            return Err(ApiError::conflict(format!(
                "/lane/step: lane token {:?} is not this server's {instance:?}: it restarted or \
                 another trainer joined since, and the sequences of that join are gone",
                req.instance
            )));
        }
        if self.exit_after.is_some_and(|n| self.steps >= n) {
            eprintln!(
                "sluice serve: test hook {EXIT_AFTER_ENV}: exiting after {} lane steps",
                self.steps
            );
            std::process::exit(3);
        }
        self.steps += 1;
        let cmds: Vec<EngineCmd> = req.cmds.into_iter().map(EngineCmd::from).collect();
        let results = unit::apply_commands(engine, cmds);
        let s = unit::step_once(engine);
        Ok(StepAnswer {
            instance,
            version: held.version.0,
            blake3: held.hash.to_hex(),
            results: results.into_iter().map(WireResult::from).collect(),
            events: s.events.into_iter().map(WireEvent::from).collect(),
            stepped: s.stepped,
            prefill_tokens: s.prefill_tokens,
            decode_tokens: s.decode_tokens,
            sampled_tokens: s.sampled_tokens,
            has_work: s.has_work,
            error: s.error,
        })
    }
}

/// `version=N&blake3=HEX` of a query string (both optional here; the callers say which they
/// need).
pub fn parse_query(
    endpoint: &str,
    query: Option<&str>,
) -> Result<(Option<u64>, Option<ContentHash>), ApiError> {
    let (mut version, mut hash) = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("version", v)) => {
                version = Some(v.parse().map_err(|_| {
                    ApiError::bad_request(format!(
                        "{endpoint}: version={v:?} is not a non-negative integer"
                    ))
                })?)
            }
            Some(("blake3", h)) => {
                hash = Some(ContentHash::from_hex(h).ok_or_else(|| {
                    ApiError::bad_request(format!("{endpoint}: blake3={h:?} is not 64 hex digits"))
                })?)
            }
            _ => {
                return Err(ApiError::bad_request(format!(
                    "{endpoint}: query {pair:?}: the parameters are version=N and blake3=HEX"
                )))
            }
        }
    }
    Ok((version, hash))
}
