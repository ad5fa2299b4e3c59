//! What the HTTP handlers send the engine thread ([`Command`]) and what it answers: a turn's
//! request and where its answer goes, an abort's outcome, the counters and health report.

use super::api::{ApiError, SamplingFields, StreamLine, TurnResult};
use super::lane::JoinImage;
use super::openai::ChatMessage;
use super::weights::{Installed, WeightUpdate};
use serde::Serialize;
use sluice_runtime::engine::StopConfig;
use sluice_runtime::remote::wire::{JoinAnswer, StepAnswer, StepRequest};
use sluice_runtime::trajectory::TokenId;
use tokio::sync::{mpsc, oneshot};

/// What a turn feeds the engine.
#[derive(Clone, Debug)]
pub enum TurnInput {
    /// Ids: a new session's prompt, or the tokens appended to an open one.
    Tokens(Vec<TokenId>),
    /// A chat history, rendered through the tokenizer's chat template (see [`super::openai`]).
    Chat(Vec<ChatMessage>),
}

/// One turn of generation.
#[derive(Clone, Debug)]
pub struct TurnRequest {
    /// Names the endpoint in errors.
    pub endpoint: &'static str,
    pub session_id: Option<String>,
    pub input: TurnInput,
    pub max_new_tokens: Option<u32>,
    pub sampling: SamplingFields,
    /// None: the session's (for a new one, no stop ids).
    pub stop: Option<StopConfig>,
}

/// Where a turn's answer goes.
pub enum Reply {
    Once(oneshot::Sender<Result<TurnResult, ApiError>>),
    /// `started` answers whether the turn was accepted (a bad request is a 4xx, not a line);
    /// then one line per step with new tokens, the last with the finish reason.
    Stream {
        started: oneshot::Sender<Result<(), ApiError>>,
        lines: mpsc::UnboundedSender<StreamLine>,
    },
}

impl Reply {
    pub(super) fn reject(self, e: ApiError) {
        // A closed channel means the client left; there is no one to tell.
        match self {
            Reply::Once(tx) => drop(tx.send(Err(e))),
            Reply::Stream { started, .. } => drop(started.send(Err(e))),
        }
    }
}

/// What `/abort` did.
#[derive(Clone, Debug, Serialize)]
pub struct Aborted {
    pub session_id: String,
    /// A turn was in flight (its request was answered with finish reason `abort`).
    pub was_generating: bool,
    /// Tokens the session held (their blocks are free now).
    pub tokens_freed: usize,
}

/// Counters since the server started (`GET /health`).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Counters {
    pub turns_started: u64,
    pub turns_finished: u64,
    pub generated_tokens: u64,
    pub aborted: u64,
    /// Chat turns whose history had to be encoded again from text (not trainable).
    pub reencoded_turns: u64,
    pub weight_installs: u64,
    pub delta_installs: u64,
    /// Requests answered with a 4xx (counted where the answer is made, on the HTTP side).
    pub rejected: u64,
    /// Engine steps that failed (every turn in flight was answered 500 and dropped).
    pub engine_errors: u64,
    /// `/lane/join`s and `/lane/step`s served.
    pub lane_joins: u64,
    pub lane_steps: u64,
}

/// `GET /health` and `GET /version`.
#[derive(Clone, Debug, Serialize)]
pub struct Health {
    pub status: &'static str,
    /// This process's nonce, or while a trainer drives it the lane token of its join: a
    /// trainer that sees another one knows its sequences are gone.
    pub instance: String,
    /// A trainer drives the engine (`/lane/join`); the session endpoints are off.
    pub driven: bool,
    pub version: u64,
    /// blake3 of the weight image held (a delta's base).
    pub blake3: String,
    pub sessions: usize,
    pub generating: usize,
    pub kv_blocks: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_cached: usize,
    pub counters: Counters,
}

pub enum Command {
    Turn(TurnRequest, Reply),
    Abort(String, oneshot::Sender<Result<Aborted, ApiError>>),
    Weights(WeightUpdate, oneshot::Sender<Result<Installed, ApiError>>),
    Health(oneshot::Sender<Health>),
    LaneJoin(JoinImage, oneshot::Sender<Result<JoinAnswer, ApiError>>),
    LaneStep(StepRequest, oneshot::Sender<Result<StepAnswer, ApiError>>),
}
