//! The record of an external environment's replies (the run folder's `environments.jsonl`)
//! and the replay that answers from it (`sluice train --replay-env RUN_DIR`).
//!
//! One JSON object per line and per request, in the order the replies were taken:
//!
//! ```text
//! {"task":"tool","message":"step","session":"tool/3#1","turn":0,"hash":"9f2c...",
//!  "request":{...},"reply":{...},"latency_ms":0.41}
//! ```
//!
//! `hash` is blake3 of the request as sent, less its `id` (request ids follow the order in
//! which calls happen; everything else in a request is what the call is), cut to 32 hex
//! digits. A failed call is recorded with `"error":{"kind":"crash|timeout|malformed",
//! "message":...}` in place of `reply`, so a replay fails it the same way. Problem and
//! demonstration requests have no session: their `session` is `-` and their `turn` 0.
//!
//! A replay looks a call up by (session, turn, hash) and never invents a reply: a call the
//! record does not hold is a [`ReplayBook::get`] miss, which the caller must treat as fatal.
//! The key holds everything that decides a call, so a replay is exact when the run asks the
//! same calls, as a run on the virtual clock does; a wall-clock run's interleaving (which
//! group got which session number) is not in the record, so replaying it may miss.

use super::LinkError;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The record's file name inside a run folder.
pub const FILE: &str = "environments.jsonl";

/// The session of requests that belong to none (problems, demonstrations).
pub const NO_SESSION: &str = "-";

/// blake3 of `request` without its `id`, as 32 hex digits.
pub fn request_hash(request: &Value) -> String {
    let mut r = request.clone();
    if let Some(o) = r.as_object_mut() {
        o.remove("id");
    }
    let h = blake3::hash(r.to_string().as_bytes());
    h.to_hex()[..32].to_string()
}

/// What a replay is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReplayKey {
    pub session: String,
    pub turn: u32,
    pub hash: String,
}

impl std::fmt::Display for ReplayKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "(session {:?}, turn {}, request hash {})",
            self.session, self.turn, self.hash
        )
    }
}

/// One recorded call.
pub struct Entry<'a> {
    pub task: &'a str,
    pub message: &'a str,
    pub key: &'a ReplayKey,
    pub request: &'a Value,
    pub reply: &'a Result<Value, LinkError>,
    pub latency_ms: f64,
}

/// Appends recorded calls to a file (shared by every external task of a run). Until
/// [`Recorder::open`] nothing is written: a task made outside a run records nothing.
#[derive(Default)]
pub struct Recorder {
    file: Mutex<Option<(PathBuf, File)>>,
    failed: Mutex<Option<String>>,
}

impl Recorder {
    /// Starts a fresh record at `path`, or continues the one there (`append`).
    pub fn open(&self, path: &Path, append: bool) -> Result<(), String> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        *self.file.lock().unwrap_or_else(|e| e.into_inner()) = Some((path.to_path_buf(), f));
        Ok(())
    }

    pub fn write(&self, e: &Entry<'_>) {
        let mut v = json!({
            "task": e.task,
            "message": e.message,
            "session": e.key.session,
            "turn": e.key.turn,
            "hash": e.key.hash,
            "request": e.request,
            "latency_ms": e.latency_ms,
        });
        match e.reply {
            Ok(r) => v["reply"] = r.clone(),
            Err(err) => v["error"] = json!({"kind": err.kind(), "message": err.message()}),
        }
        let mut g = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((path, f)) = g.as_mut() {
            // One write per line, so a run that stops mid-way leaves whole lines.
            if let Err(err) = f.write_all(format!("{v}\n").as_bytes()) {
                let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
                failed.get_or_insert_with(|| format!("{}: {err}", path.display()));
            }
        }
    }

    /// The first write that failed, if one did (the run reports it).
    pub fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The replies of a record, by key.
#[derive(Debug, Default)]
pub struct ReplayBook {
    dir: PathBuf,
    entries: HashMap<ReplayKey, Result<Value, LinkError>>,
}

impl ReplayBook {
    /// Reads `dir/environments.jsonl`; a line that is not a record entry is an error naming
    /// the line.
    pub fn load(dir: &Path) -> Result<ReplayBook, String> {
        let path = dir.join(FILE);
        let f = File::open(&path)
            .map_err(|e| format!("--replay-env {}: cannot read {FILE}: {e}", dir.display()))?;
        let mut entries = HashMap::new();
        for (n, line) in BufReader::new(f).lines().enumerate() {
            let line = line.map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |what: &str| format!("{}:{}: {what}", path.display(), n + 1);
            let v: Value =
                serde_json::from_str(&line).map_err(|e| bad(&format!("not JSON: {e}")))?;
            let session = v["session"]
                .as_str()
                .ok_or_else(|| bad("no \"session\" string"))?;
            let turn = v["turn"]
                .as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| bad("no \"turn\" number"))?;
            let hash = v["hash"]
                .as_str()
                .ok_or_else(|| bad("no \"hash\" string"))?;
            let reply = if let Some(r) = v.get("reply") {
                Ok(r.clone())
            } else {
                let e = &v["error"];
                let msg = e["message"].as_str().unwrap_or("").to_string();
                match e["kind"].as_str() {
                    Some("crash") => Err(LinkError::Crash(msg)),
                    Some("timeout") => Err(LinkError::Timeout(msg)),
                    Some("malformed") => Err(LinkError::Malformed(msg)),
                    _ => return Err(bad("neither \"reply\" nor an \"error\" with a kind")),
                }
            };
            let key = ReplayKey {
                session: session.to_string(),
                turn,
                hash: hash.to_string(),
            };
            // The same call asked twice (an evaluation repeating an identical turn) was
            // answered the same way; the first answer stands.
            entries.entry(key).or_insert(reply);
        }
        Ok(ReplayBook {
            dir: dir.to_path_buf(),
            entries,
        })
    }

    /// The recorded reply of `key`; None is a miss.
    pub fn get(&self, key: &ReplayKey) -> Option<&Result<Value, LinkError>> {
        self.entries.get(key)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_ignores_the_request_id_only() {
        let a = json!({"type": "step", "id": 1, "session": "t/0#0", "turn": 0, "text": "1<eot>"});
        let mut b = a.clone();
        b["id"] = json!(99);
        assert_eq!(request_hash(&a), request_hash(&b));
        assert_eq!(request_hash(&a).len(), 32);
        b["text"] = json!("2<eot>");
        assert_ne!(request_hash(&a), request_hash(&b));
    }

    #[test]
    fn a_record_replays_replies_and_failures_and_names_a_bad_line() {
        let dir = std::env::temp_dir().join(format!("sluice-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rec = Recorder::default();
        rec.open(&dir.join(FILE), false).unwrap();
        let key = |turn: u32| ReplayKey {
            session: "t/0#0".into(),
            turn,
            hash: format!("h{turn}"),
        };
        let ok: Result<Value, LinkError> = Ok(json!({"end": {"reward": 1.0, "reason": "success"}}));
        let crash: Result<Value, LinkError> = Err(LinkError::Crash("gone".into()));
        for (turn, reply) in [(0, &ok), (1, &crash)] {
            rec.write(&Entry {
                task: "t",
                message: "step",
                key: &key(turn),
                request: &json!({"type": "step"}),
                reply,
                latency_ms: 1.5,
            });
        }
        assert_eq!(rec.failure(), None);
        let book = ReplayBook::load(&dir).unwrap();
        assert_eq!(book.len(), 2);
        assert_eq!(book.get(&key(0)), Some(&ok));
        assert_eq!(book.get(&key(1)), Some(&crash));
        assert_eq!(book.get(&key(2)), None);
        std::fs::write(dir.join(FILE), "{\"session\": \"s\", \"turn\": 0}\n").unwrap();
        let e = ReplayBook::load(&dir).unwrap_err();
        assert!(e.contains(":1:") && e.contains("hash"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
