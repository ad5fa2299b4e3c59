//! Environments outside the process (DESIGN 6.4): the transports that carry the JSON-lines
//! protocol of docs/runtime.md ("External environments") to a program sluice starts
//! ([`process::ProcessLink`]) or to an HTTP server ([`http::HttpLink`]), and the record of every
//! reply that lets a run be replayed without the environment ([`record`]).
//!
//! A transport moves one request (a JSON object with a numeric `id`) and waits for the reply
//! with the same `id`; requests of many sessions may be in flight at once and their replies
//! may come back in any order. What the messages mean (problems, steps, demonstrations) and
//! the text-to-ids gateway live with the task that uses them (the trainer's `external` kind).

pub mod http;
pub mod process;
pub mod record;

use serde_json::Value;
use std::fmt;
use std::time::Duration;

/// Why a request got no usable reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkError {
    /// The environment is gone (its process exited, its server refused the connection or
    /// answered 5xx). The process kind starts a fresh process for the next request.
    Crash(String),
    /// No reply within the call's timeout: the environment is taken as hung (the process
    /// kind kills it, and its other calls in flight fail the same way).
    Timeout(String),
    /// A reply that breaks the framing (a line that is not a JSON object with an id, an HTTP
    /// 4xx or a body that is not JSON).
    Malformed(String),
}

impl fmt::Display for LinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkError::Crash(m) => write!(f, "crash: {m}"),
            LinkError::Timeout(m) => write!(f, "timeout: {m}"),
            LinkError::Malformed(m) => write!(f, "malformed: {m}"),
        }
    }
}

impl std::error::Error for LinkError {}

impl LinkError {
    /// `crash`, `timeout` or `malformed`.
    pub fn kind(&self) -> &'static str {
        match self {
            LinkError::Crash(_) => "crash",
            LinkError::Timeout(_) => "timeout",
            LinkError::Malformed(_) => "malformed",
        }
    }

    pub fn message(&self) -> &str {
        match self {
            LinkError::Crash(m) | LinkError::Timeout(m) | LinkError::Malformed(m) => m,
        }
    }
}

/// One way to reach an environment.
pub trait Link: Send + Sync {
    /// Sends `request` (a JSON object whose `id` is `id`) without waiting for the reply.
    fn send(&self, id: u64, request: &Value);

    /// The reply to request `id` (a JSON object), waiting at most `timeout` from now.
    fn wait(&self, id: u64, timeout: Duration) -> Result<Value, LinkError>;

    /// Forgets request `id` (its session ended elsewhere): a reply that still comes is
    /// dropped.
    fn forget(&self, id: u64);

    /// How many times the environment was started again after a crash or a hang.
    fn restarts(&self) -> u64 {
        0
    }

    /// Replies that named no request in flight (an unknown or repeated id).
    fn stray_replies(&self) -> u64 {
        0
    }
}

/// The `id` of a reply, if it has one.
pub fn reply_id(v: &Value) -> Option<u64> {
    v.as_object()?.get("id")?.as_u64()
}
