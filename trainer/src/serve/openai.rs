//! OpenAI-style `/v1/completions` and `/v1/chat/completions` for text agents: text goes
//! through the configured tokenizer, and every answer also carries the ids, their behavior
//! log-probs (as f32 and as bits) and weight versions.
//!
//! The chat template is the built-in tasks': `<bos>`, then each message as its role token
//! (`<system>`, `<user>`, `<assistant>`, `<observation>` for role `tool`), its content and
//! `<eot>`; then `<assistant>` opens the reply, which ends at `<eot>`.
//!
//! Chat sessions (`"session_id"` in the body) keep the ids the engine holds. A request whose
//! messages begin with exactly the messages the session has seen (each reply as this server
//! returned it) reuses those ids: only the new messages are encoded and appended, and the
//! sampled ids of earlier replies are never re-encoded (a BPE round trip of decoded text can
//! give other ids than were sampled). The comparison is on the messages' text, because
//! comparing a fresh encoding of the history with the recorded ids would differ exactly where a
//! re-encode is unsafe. Any other history (edited, reordered, or assistant text this server did
//! not sample) is encoded again from its text in a new trajectory; that turn is flagged
//! `"reencoded": true`, counted in `/health`, and is not trainable: its context holds ids the
//! policy did not sample.

use super::api::{ApiError, FinishReason, SamplingFields, TurnResult};
use super::commands::{TurnInput, TurnRequest};
use super::{AppState, JsonBody};
use crate::tasks::text::TextTokenizer;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sluice_runtime::engine::StopConfig;
use sluice_runtime::trajectory::TokenId;
use std::sync::Arc;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// The id of a role's token.
fn role_token(tok: &TextTokenizer, role: &str) -> Result<TokenId, String> {
    let s = tok.specials();
    let special = match role {
        "user" => return Ok(s.user),
        "assistant" => return Ok(s.assistant),
        "tool" => return Ok(s.observation),
        "system" => "<system>",
        other => {
            return Err(format!(
                "message role {other:?} is not one of system, user, assistant, tool"
            ))
        }
    };
    match tok.encode(special).as_deref() {
        Ok([id]) => Ok(*id),
        _ => Err(format!(
            "role {role:?}: the tokenizer has no {special} token ({})",
            tok.version()
        )),
    }
}

/// `messages` in the chat template, without `<bos>` or the opening of the reply.
fn render_messages(tok: &TextTokenizer, messages: &[ChatMessage]) -> Result<Vec<TokenId>, String> {
    let eot = tok.specials().eot;
    let mut ids = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        ids.push(role_token(tok, &m.role).map_err(|e| format!("messages[{i}]: {e}"))?);
        ids.extend(
            tok.encode(&m.content)
                .map_err(|e| format!("messages[{i}].content: {e}"))?,
        );
        ids.push(eot);
    }
    Ok(ids)
}

/// A whole conversation as a prompt: `<bos>`, the messages, `<assistant>`.
pub fn render_prompt(
    tok: &TextTokenizer,
    messages: &[ChatMessage],
) -> Result<Vec<TokenId>, String> {
    if messages.is_empty() {
        return Err("messages is empty; a chat needs at least one message".into());
    }
    let s = tok.specials();
    let mut ids = vec![s.bos];
    ids.extend(render_messages(tok, messages)?);
    ids.push(s.assistant);
    Ok(ids)
}

/// The ids to append to a session holding `recorded` (its tokens ending in `<eot>` when
/// `closed`) for the history `messages`; None when `messages` does not begin with `recorded`
/// or adds nothing (the history must be encoded again).
pub fn continuation(
    tok: &TextTokenizer,
    recorded: &[ChatMessage],
    messages: &[ChatMessage],
    closed: bool,
) -> Option<Result<Vec<TokenId>, String>> {
    if recorded.is_empty() || messages.len() <= recorded.len() || !messages.starts_with(recorded) {
        return None;
    }
    let s = tok.specials();
    // A reply cut by max_new_tokens has no <eot>: close it as the template would.
    let mut ids = if closed { Vec::new() } else { vec![s.eot] };
    Some(render_messages(tok, &messages[recorded.len()..]).map(|m| {
        ids.extend(m);
        ids.push(s.assistant);
        ids
    }))
}

/// A reply's text: its ids without the closing `<eot>`, specials written `<name>`.
pub fn reply_text(tok: &TextTokenizer, ids: &[TokenId]) -> String {
    let body = ids.strip_suffix(&[tok.specials().eot]).unwrap_or(ids);
    tok.render(body)
}

/// The body fields both endpoints read; others OpenAI clients send (`model`, `user`, ...) are
/// ignored.
#[derive(Debug, Deserialize)]
struct OpenAiBody {
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    n: Option<u32>,
    session_id: Option<String>,
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::StopSequence => "stop",
        FinishReason::Length | FinishReason::Capacity => "length",
        FinishReason::Abort => "abort",
    }
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Parses the body and runs the turn; returns the result and the body.
async fn run(
    state: &AppState,
    ep: &'static str,
    body: &[u8],
    chat: bool,
) -> Result<TurnResult, ApiError> {
    let b: OpenAiBody = super::api::parse_body(ep, body)?;
    if b.stream {
        return Err(ApiError::bad_request(format!(
            "{ep}: \"stream\": true is not supported here; POST /generate streams token ids"
        )));
    }
    if b.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(format!(
            "{ep}: n must be 1 (one choice per request)"
        )));
    }
    let input = if chat {
        let Some(messages) = b.messages else {
            return Err(ApiError::bad_request(format!(
                "{ep}: missing field `messages`"
            )));
        };
        TurnInput::Chat(messages)
    } else {
        if b.session_id.is_some() {
            return Err(ApiError::bad_request(format!(
                "{ep}: session_id is for /v1/chat/completions; completions are one turn"
            )));
        }
        let Some(prompt) = b.prompt else {
            return Err(ApiError::bad_request(format!(
                "{ep}: missing field `prompt`"
            )));
        };
        TurnInput::Tokens(
            state
                .tok
                .encode(&prompt)
                .map_err(|e| ApiError::bad_request(format!("{ep}: prompt: {e}")))?,
        )
    };
    let req = TurnRequest {
        endpoint: ep,
        session_id: b.session_id,
        input,
        max_new_tokens: b.max_tokens,
        sampling: SamplingFields {
            temperature: b.temperature,
            top_k: b.top_k,
            top_p: b.top_p,
            seed: b.seed,
        },
        stop: Some(StopConfig {
            eos: Some(state.tok.specials().eot),
            stop_sequences: Vec::new(),
        }),
    };
    state.turn(req).await
}

/// The sluice fields of a choice: ids, log-probs (and bits), versions.
fn token_fields(tok: &TextTokenizer, r: &TurnResult) -> (Value, Value) {
    let pieces: Vec<String> = r.tokens.ids.iter().map(|&t| tok.render(&[t])).collect();
    let logprobs = json!({
        "tokens": pieces,
        "token_logprobs": r.tokens.logprobs,
    });
    let ids = json!({
        "ids": r.tokens.ids,
        "logprob_bits": r.tokens.logprob_bits,
        "versions": r.tokens.versions,
    });
    (logprobs, ids)
}

fn usage(r: &TurnResult) -> Value {
    json!({
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.tokens.ids.len(),
        "total_tokens": r.session_tokens,
    })
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let ep = "/v1/completions";
    let r = match run(&state, ep, &body, false).await {
        Ok(r) => r,
        Err(e) => return state.reject(e),
    };
    let (logprobs, ids) = token_fields(&state.tok, &r);
    let choice = merge(
        json!({
            "index": 0,
            "text": state.tok.render(&r.tokens.ids),
            "finish_reason": finish_reason(r.finish_reason),
            "logprobs": logprobs,
        }),
        ids,
    );
    Json(json!({
        "id": format!("cmpl-{}", r.session_id),
        "object": "text_completion",
        "created": now_s(),
        "model": state.model_name,
        "choices": [choice],
        "usage": usage(&r),
        "session_id": r.session_id,
        "reencoded": r.reencoded,
    }))
    .into_response()
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Response {
    let ep = "/v1/chat/completions";
    let r = match run(&state, ep, &body, true).await {
        Ok(r) => r,
        Err(e) => return state.reject(e),
    };
    let (logprobs, ids) = token_fields(&state.tok, &r);
    let content: Vec<Value> = logprobs["tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .zip(&r.tokens.logprobs)
        .map(|(t, lp)| json!({ "token": t, "logprob": lp }))
        .collect();
    let choice = merge(
        json!({
            "index": 0,
            "message": { "role": "assistant", "content": reply_text(&state.tok, &r.tokens.ids) },
            "finish_reason": finish_reason(r.finish_reason),
            "logprobs": { "content": content },
        }),
        ids,
    );
    Json(json!({
        "id": format!("chatcmpl-{}", r.session_id),
        "object": "chat.completion",
        "created": now_s(),
        "model": state.model_name,
        "choices": [choice],
        "usage": usage(&r),
        "session_id": r.session_id,
        "reencoded": r.reencoded,
    }))
    .into_response()
}
