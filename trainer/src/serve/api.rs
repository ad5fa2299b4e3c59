//! The JSON of `sluice serve`'s token endpoints, and its errors: every bad request is a 4xx
//! with `{"error": "..."}` naming the problem, and the server keeps serving.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use sluice_runtime::engine::{StopConfig, StopReason};
use sluice_runtime::trajectory::TokenId;

/// An error answered to one request: its status and a message that names the problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
        }
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::CONFLICT,
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
        }
    }

    pub fn is_client_error(&self) -> bool {
        self.status.is_client_error()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message });
        (self.status, axum::Json(body)).into_response()
    }
}

/// Parses a JSON body, naming the endpoint in the error (malformed JSON, a missing or unknown
/// field, a value of the wrong type).
pub fn parse_body<T: serde::de::DeserializeOwned>(
    endpoint: &str,
    body: &[u8],
) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("{endpoint}: malformed request body: {e}")))
}

/// Sampling parameters a request may set; unset ones take the config's `[rollout]` values
/// (and `run.seed`) for a new session. A session's parameters are fixed by its first request.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
}

/// `POST /generate`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    /// A new session: its prompt. An open session: the tokens appended after what it holds
    /// (an observation), then generation resumes with the session's K/V.
    pub prompt: Vec<TokenId>,
    /// Names a session that stays open between turns (its K/V kept for the next request)
    /// until `/abort`. Absent: a one-turn request whose blocks are freed when it ends. The
    /// sampler's random stream is keyed by the session id.
    pub session_id: Option<String>,
    pub max_new_tokens: Option<u32>,
    #[serde(default)]
    pub sampling: SamplingFields,
    /// Ends the turn when sampled (kept in the output).
    pub eos: Option<TokenId>,
    /// Token sequences that end the turn when generated (kept in the output).
    pub stop: Option<Vec<Vec<TokenId>>>,
    /// One JSON line per engine step with the step's new tokens; the last carries the finish
    /// reason.
    #[serde(default)]
    pub stream: bool,
}

impl GenerateBody {
    /// The stop ids given (None when neither field is: a new session then has none, an
    /// open one keeps its own).
    pub fn stop_config(&self) -> Option<StopConfig> {
        if self.eos.is_none() && self.stop.is_none() {
            return None;
        }
        Some(StopConfig {
            eos: self.eos,
            stop_sequences: self.stop.clone().unwrap_or_default(),
        })
    }
}

/// `POST /abort`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortBody {
    pub session_id: String,
}

/// Why a turn ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The end-of-sequence id was sampled.
    Eos,
    /// A stop sequence was generated.
    StopSequence,
    /// `max_new_tokens` reached.
    Length,
    /// The sequence alone outgrew the KV pool.
    Capacity,
    /// `/abort` ended the session.
    Abort,
}

impl From<StopReason> for FinishReason {
    fn from(r: StopReason) -> Self {
        match r {
            StopReason::Eos => FinishReason::Eos,
            StopReason::StopSequence => FinishReason::StopSequence,
            StopReason::MaxNewTokens => FinishReason::Length,
            StopReason::Capacity => FinishReason::Capacity,
        }
    }
}

/// Tokens sampled (a whole turn, or one step's new tokens when streaming): ids, behavior
/// log-probs as f32 and as their IEEE bits (so a client compares bits without trusting any
/// float printing), and the weight version that sampled each.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Tokens {
    pub ids: Vec<TokenId>,
    pub logprobs: Vec<f32>,
    pub logprob_bits: Vec<u32>,
    pub versions: Vec<u64>,
}

impl Tokens {
    pub fn push(&mut self, id: TokenId, logprob: f32, version: u64) {
        self.ids.push(id);
        self.logprobs.push(logprob);
        self.logprob_bits.push(logprob.to_bits());
        self.versions.push(version);
    }

    pub fn extend(&mut self, other: &Tokens) {
        self.ids.extend_from_slice(&other.ids);
        self.logprobs.extend_from_slice(&other.logprobs);
        self.logprob_bits.extend_from_slice(&other.logprob_bits);
        self.versions.extend_from_slice(&other.versions);
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// The result of one turn (the `/generate` answer, and the last streamed line).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TurnResult {
    pub session_id: String,
    #[serde(flatten)]
    pub tokens: Tokens,
    pub finish_reason: FinishReason,
    /// Tokens this request fed the engine (the prompt, or the observation appended).
    pub prompt_tokens: usize,
    /// Tokens the session holds after the turn (prompts, observations, generated).
    pub session_tokens: usize,
    /// Chat only: the history did not match the session's recorded ids and was encoded
    /// again from text; such a turn is not trainable (docs/runtime.md, "Rollout servers").
    pub reencoded: bool,
}

/// One streamed line.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StreamLine {
    /// A step's new tokens.
    Step(Tokens),
    /// The last line: the step's new tokens and the turn's totals.
    Done {
        #[serde(flatten)]
        step: Tokens,
        finish_reason: FinishReason,
        session_id: String,
        prompt_tokens: usize,
        session_tokens: usize,
        reencoded: bool,
    },
    /// The turn failed inside the engine (the last line).
    Error { error: String },
}
