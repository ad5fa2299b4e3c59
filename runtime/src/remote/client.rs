//! The trainer's side of one `sluice serve` process driven as a replica: join it (a full sync
//! of the image every replica of the stage holds), deliver each publication (`POST /weights`:
//! the verified delta, or the full image after a refusal), run units of work (`POST
//! /lane/step`) and answer heartbeats (`GET /health`).
//!
//! Errors come in two kinds. [`ClientError::Lost`]: the server did not answer (connection
//! refused or reset, a timeout) or it is another process than the one joined (it restarted and
//! its sequences are gone); the lane goes silent and heartbeats declare the replica lost, like
//! an in-process replica that died. [`ClientError::Protocol`]: the server answered and refused
//! what it was sent in a way a retry cannot heal (another model, a malformed request): the
//! stage stops with the server's message.

use super::wire::{JoinAnswer, StepAnswer, StepRequest, WireCmd};
use crate::orchestrator::EngineCmd;
use crate::sync::lane::SyncReport;
use crate::sync::{ContentHash, Payload, Publication};
use crate::trajectory::WeightVersion;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The most bytes of an answer read (a unit of work's samples are far smaller).
const MAX_ANSWER_BYTES: u64 = 1 << 30;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// No answer, or another server process than the one joined.
    Lost(String),
    /// An answer the lane cannot go on from.
    Protocol(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Lost(m) | ClientError::Protocol(m) => f.write_str(m),
        }
    }
}

/// One rollout server as a replica.
pub struct ServerClient {
    url: String,
    agent: ureq::Agent,
    /// The server process joined last (None: not joined).
    instance: Option<String>,
    version: Option<WeightVersion>,
    hash: Option<ContentHash>,
    /// Why the server was found lost last (read by the scheduler when it declares the loss:
    /// the lane itself just goes silent).
    lost_because: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for ServerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerClient({}, {:?})", self.url, self.instance)
    }
}

/// A server's answer: status and body.
struct Answer {
    status: u16,
    body: String,
}

impl Answer {
    /// The `error` of a JSON error answer, or the body.
    fn message(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v.get("error")?.as_str().map(str::to_string))
            .unwrap_or_else(|| self.body.clone())
    }
}

impl ServerClient {
    /// A client of `url` (`http://host:port`); every request gives up after `timeout` (the
    /// heartbeat timeout: a unit of work longer than it is a lost replica anyway).
    pub fn new(url: &str, timeout: Duration) -> ServerClient {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            // A host that is down must not hold the scheduler (a rejoin runs on its thread).
            .timeout_connect(Some(timeout.min(Duration::from_secs(2))))
            .build()
            .into();
        ServerClient {
            url: url.trim_end_matches('/').to_string(),
            agent,
            instance: None,
            version: None,
            hash: None,
            lost_because: Arc::default(),
        }
    }

    /// Where the reason of the last [`ClientError::Lost`] is kept (shared: the scheduler keeps
    /// a handle while the client lives on the lane's thread).
    pub fn lost_because(&self) -> Arc<Mutex<Option<String>>> {
        self.lost_because.clone()
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The version the server runs on, as it last reported (None before the join).
    pub fn version(&self) -> Option<WeightVersion> {
        self.version
    }

    pub fn hash(&self) -> Option<ContentHash> {
        self.hash
    }

    fn lost(&self, what: &str, e: impl std::fmt::Display) -> ClientError {
        let m = format!("{} {what}: {e}", self.url);
        if let Ok(mut slot) = self.lost_because.lock() {
            *slot = Some(m.clone());
        }
        ClientError::Lost(m)
    }

    fn read(
        &self,
        what: &str,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Answer, ClientError> {
        let mut r = r.map_err(|e| self.lost(what, e))?;
        let status = r.status().as_u16();
        let body = r
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER_BYTES)
            .read_to_string()
            .map_err(|e| self.lost(what, e))?;
        Ok(Answer { status, body })
    }

    fn protocol(&self, what: &str, a: &Answer) -> ClientError {
        ClientError::Protocol(format!(
            "{} {what}: answered {}: {}",
            self.url,
            a.status,
            a.message()
        ))
    }

    /// `GET /health`: Ok when the joined process answers.
    pub fn health(&self) -> Result<(), ClientError> {
        let a = self.read(
            "GET /health",
            self.agent.get(format!("{}/health", self.url)).call(),
        )?;
        if a.status != 200 {
            return Err(self.lost("GET /health", format!("status {}", a.status)));
        }
        let instance = serde_json::from_str::<serde_json::Value>(&a.body)
            .ok()
            .and_then(|v| v.get("instance")?.as_str().map(str::to_string));
        match (&self.instance, instance) {
            (Some(joined), Some(now)) if *joined != now => Err(self.lost(
                "GET /health",
                format!("another process answers (instance {now}, joined {joined}): it restarted"),
            )),
            (_, None) => Err(ClientError::Protocol(format!(
                "{} GET /health: no instance in the answer; is it a sluice serve?",
                self.url
            ))),
            _ => Ok(()),
        }
    }

    /// `POST /lane/join`: the server ends whatever an earlier driver left, installs `full` (the
    /// whole image, hash checked) and is driven by this client from now on.
    pub fn join(&mut self, full: &Publication) -> Result<SyncReport, ClientError> {
        let Payload::Full(bytes) = &full.payload else {
            return Err(ClientError::Protocol(format!(
                "internal: a join needs the full image of {}, not a delta",
                full.version
            )));
        };
        let what = "POST /lane/join";
        let a = self.read(
            what,
            self.agent
                .post(format!(
                    "{}/lane/join?version={}&blake3={}",
                    self.url,
                    full.version.0,
                    full.hash.to_hex()
                ))
                .header("content-type", "application/octet-stream")
                .send(&bytes[..]),
        )?;
        if a.status != 200 {
            return Err(self.protocol(what, &a));
        }
        let j: JoinAnswer = serde_json::from_str(&a.body)
            .map_err(|e| ClientError::Protocol(format!("{} {what}: {e}", self.url)))?;
        self.check_weights(what, full, j.version, &j.blake3)?;
        self.instance = Some(j.instance);
        Ok(self.installed(full))
    }

    fn check_weights(
        &mut self,
        what: &str,
        p: &Publication,
        version: u64,
        blake3: &str,
    ) -> Result<(), ClientError> {
        let hash = ContentHash::from_hex(blake3);
        if version != p.version.0 || hash != Some(p.hash) {
            return Err(ClientError::Protocol(format!(
                "{} {what}: runs {} ({blake3}) after installing {} ({})",
                self.url,
                WeightVersion(version),
                p.version,
                p.hash.to_hex()
            )));
        }
        self.version = Some(p.version);
        self.hash = Some(p.hash);
        Ok(())
    }

    fn installed(&self, p: &Publication) -> SyncReport {
        SyncReport::Installed {
            version: p.version,
            hash: p.hash,
            sent_bytes: p.sync_bytes(),
            image_bytes: p.full_bytes,
            encoding: p.sync_encoding(),
        }
    }

    /// `POST /weights`: a delta (the server applies it to the image it holds and checks the
    /// result's blake3) or the full image. A refusal (another base, damaged bytes) is a
    /// [`SyncReport::Refused`]: the server runs what it ran.
    pub fn install(&mut self, p: &Publication) -> Result<SyncReport, ClientError> {
        let what = "POST /weights";
        let (url, bytes) = match &p.payload {
            Payload::Delta { bytes, .. } => (format!("{}/weights", self.url), bytes),
            Payload::Full(bytes) => (
                format!(
                    "{}/weights?version={}&blake3={}",
                    self.url,
                    p.version.0,
                    p.hash.to_hex()
                ),
                bytes,
            ),
        };
        let a = self.read(
            what,
            self.agent
                .post(url)
                .header("content-type", "application/octet-stream")
                .send(&bytes[..]),
        )?;
        match a.status {
            200 => {
                let v: serde_json::Value = serde_json::from_str(&a.body)
                    .map_err(|e| ClientError::Protocol(format!("{} {what}: {e}", self.url)))?;
                let version = v
                    .get("version")
                    .and_then(|x| x.as_u64())
                    .unwrap_or(u64::MAX);
                let blake3 = v.get("blake3").and_then(|x| x.as_str()).unwrap_or("");
                self.check_weights(what, p, version, blake3)?;
                Ok(self.installed(p))
            }
            400 | 409 => Ok(SyncReport::Refused {
                version: Some(p.version),
                reason: format!("{}: {}", self.url, a.message()),
            }),
            _ => Err(self.protocol(what, &a)),
        }
    }

    /// `POST /lane/step`: `cmds` in order, then one engine step (see `super::unit`).
    pub fn step(&mut self, cmds: Vec<EngineCmd>) -> Result<StepAnswer, ClientError> {
        let what = "POST /lane/step";
        let Some(instance) = self.instance.clone() else {
            return Err(ClientError::Protocol(format!(
                "internal: {} was not joined",
                self.url
            )));
        };
        let body = serde_json::to_vec(&StepRequest {
            instance: instance.clone(),
            cmds: cmds.into_iter().map(WireCmd::from).collect(),
        })
        .map_err(|e| ClientError::Protocol(format!("{what}: {e}")))?;
        let a = self.read(
            what,
            self.agent
                .post(format!("{}/lane/step", self.url))
                .header("content-type", "application/json")
                .send(&body[..]),
        )?;
        match a.status {
            200 => {}
            // Not joined, or joined by another driver since: its sequences are not ours.
            409 => return Err(self.lost(what, a.message())),
            _ => return Err(self.protocol(what, &a)),
        }
        let answer: StepAnswer = serde_json::from_str(&a.body)
            .map_err(|e| ClientError::Protocol(format!("{} {what}: {e}", self.url)))?;
        if answer.instance != instance {
            return Err(self.lost(what, "another process answered: it restarted"));
        }
        if Some(WeightVersion(answer.version)) != self.version
            || ContentHash::from_hex(&answer.blake3) != self.hash
        {
            return Err(ClientError::Protocol(format!(
                "{} {what}: runs v{} ({}), not the {:?} it installed last",
                self.url, answer.version, answer.blake3, self.version
            )));
        }
        Ok(answer)
    }
}
