//! The `external` transport: a program sluice starts, one JSON object per line on its stdin
//! (requests) and its stdout (replies); its stderr is passed through.
//!
//! Requests of many sessions are written without waiting; a reader thread files each reply
//! under its `id`, so replies may come in any order. A process that exits (or closes its
//! stdout) fails its calls in flight as crashes; one that leaves a call unanswered past the
//! call's timeout is taken as hung, killed, and its calls in flight fail as timeouts; a line
//! that is not a JSON object with an id breaks the framing (later lines cannot be trusted to
//! belong to anyone), so the process is dropped the same way and its calls fail as malformed.
//! Each time, the next request starts a fresh process ([`Link::restarts`] counts them).

use super::{reply_id, Link, LinkError};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Table {
    /// The generation of the process that is alive, if one is.
    live: Option<u64>,
    /// Request id -> the generation of the process it was sent to.
    inflight: HashMap<u64, u64>,
    done: HashMap<u64, Result<Value, LinkError>>,
    forgotten: HashSet<u64>,
    stray: u64,
}

impl Table {
    /// Fails every call in flight on generation `gen` with `make(count)`; returns how many.
    fn fail_generation(&mut self, gen: u64, make: impl Fn(usize) -> LinkError) -> usize {
        let ids: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, &g)| g == gen)
            .map(|(&id, _)| id)
            .collect();
        let n = ids.len();
        for id in ids {
            self.inflight.remove(&id);
            self.done.insert(id, Err(make(n)));
        }
        if self.live == Some(gen) {
            self.live = None;
        }
        n
    }
}

#[derive(Default)]
struct Shared {
    table: Mutex<Table>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A poisoned lock only means another thread panicked while holding it; the table
        // stays consistent (every change is a single insert or remove).
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Running {
    gen: u64,
    child: Child,
    tx: Sender<String>,
}

/// A program speaking the protocol on stdin/stdout (see the module docs).
pub struct ProcessLink {
    program: String,
    args: Vec<String>,
    shared: Arc<Shared>,
    running: Mutex<Option<Running>>,
    spawned: AtomicU64,
}

impl ProcessLink {
    /// The process is started by the first request, not here.
    pub fn new(program: &str, args: &[String]) -> ProcessLink {
        ProcessLink {
            program: program.to_string(),
            args: args.to_vec(),
            shared: Arc::new(Shared::default()),
            running: Mutex::new(None),
            spawned: AtomicU64::new(0),
        }
    }

    /// The command line, for messages.
    pub fn command_line(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn lock_running(&self) -> MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live process's generation and request channel, starting one if none is alive.
    fn ensure(&self) -> Result<(u64, Sender<String>), LinkError> {
        let mut running = self.lock_running();
        let live = self.shared.lock().live;
        if let Some(r) = running.as_ref() {
            if live == Some(r.gen) {
                return Ok((r.gen, r.tx.clone()));
            }
        }
        if let Some(mut old) = running.take() {
            kill(&mut old.child);
        }
        let gen = self.spawned.fetch_add(1, Ordering::SeqCst) + 1;
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                LinkError::Crash(format!(
                    "cannot start the environment `{}`: {e}",
                    self.command_line()
                ))
            })?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            kill(&mut child);
            return Err(LinkError::Crash(format!(
                "the environment `{}` started without pipes",
                self.command_line()
            )));
        };
        let (tx, rx) = channel::<String>();
        // A writer thread, so a process that stops reading never blocks the caller.
        std::thread::spawn(move || {
            for line in rx {
                if stdin.write_all(line.as_bytes()).is_err() || stdin.flush().is_err() {
                    break;
                }
            }
        });
        let shared = Arc::clone(&self.shared);
        let what = format!("`{}` (pid {})", self.command_line(), child.id());
        std::thread::spawn(move || read_replies(stdout, gen, &shared, &what));
        self.shared.lock().live = Some(gen);
        *running = Some(Running {
            gen,
            child,
            tx: tx.clone(),
        });
        Ok((gen, tx))
    }

    /// Kills generation `gen` if it is still the running process.
    fn kill_generation(&self, gen: u64) {
        let mut running = self.lock_running();
        if running.as_ref().is_some_and(|r| r.gen == gen) {
            if let Some(mut r) = running.take() {
                kill(&mut r.child);
            }
        }
    }
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The reader thread of generation `gen`: files replies until the process's stdout ends or a
/// line breaks the framing.
fn read_replies(stdout: ChildStdout, gen: u64, shared: &Shared, what: &str) {
    let reader = BufReader::new(stdout);
    let mut failure = None;
    for (n, line) in reader.lines().enumerate() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                failure = Some(LinkError::Malformed(format!(
                    "the environment {what} wrote line {} that is not UTF-8: {e}",
                    n + 1
                )));
                break;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Option<Value> = serde_json::from_str(&line).ok();
        let Some((id, v)) = parsed.and_then(|v| reply_id(&v).map(|id| (id, v))) else {
            let shown: String = line.chars().take(120).collect();
            failure = Some(LinkError::Malformed(format!(
                "the environment {what} wrote line {} that is not a JSON object with a \
                 numeric \"id\": {shown:?}",
                n + 1
            )));
            break;
        };
        let mut t = shared.lock();
        if t.inflight.remove(&id).is_some() {
            t.done.insert(id, Ok(v));
            shared.cv.notify_all();
        } else if !t.forgotten.remove(&id) {
            t.stray += 1;
        }
    }
    let mut t = shared.lock();
    t.fail_generation(gen, |n| match &failure {
        Some(LinkError::Malformed(m)) => LinkError::Malformed(format!(
            "{m}; the process is dropped with {n} calls in flight"
        )),
        _ => LinkError::Crash(format!(
            "the environment {what} exited (or closed its stdout) with {n} calls in flight"
        )),
    });
    shared.cv.notify_all();
}

impl Link for ProcessLink {
    fn send(&self, id: u64, request: &Value) {
        let line = format!("{request}\n");
        match self.ensure() {
            Ok((gen, tx)) => {
                {
                    let mut t = self.shared.lock();
                    if t.live != Some(gen) {
                        // The reader already saw this process end (and failed its calls):
                        // this one would wait for a reply that cannot come.
                        t.done.insert(
                            id,
                            Err(LinkError::Crash(format!(
                                "the environment `{}` ended as the request was sent",
                                self.command_line()
                            ))),
                        );
                        drop(t);
                        self.shared.cv.notify_all();
                        return;
                    }
                    t.inflight.insert(id, gen);
                }
                if tx.send(line).is_err() {
                    // The writer ended: the process is going; the reader fails the call.
                    let mut t = self.shared.lock();
                    if t.inflight.remove(&id).is_some() {
                        t.done.insert(
                            id,
                            Err(LinkError::Crash(format!(
                                "the environment `{}` stopped reading its stdin",
                                self.command_line()
                            ))),
                        );
                    }
                }
            }
            Err(e) => {
                self.shared.lock().done.insert(id, Err(e));
            }
        }
        self.shared.cv.notify_all();
    }

    fn wait(&self, id: u64, timeout: Duration) -> Result<Value, LinkError> {
        let deadline = Instant::now() + timeout;
        let mut t = self.shared.lock();
        loop {
            if let Some(r) = t.done.remove(&id) {
                return r;
            }
            let Some(&gen) = t.inflight.get(&id) else {
                return Err(LinkError::Crash(format!(
                    "request {id} was never sent to the environment `{}`",
                    self.command_line()
                )));
            };
            let now = Instant::now();
            if now >= deadline {
                let cmd = self.command_line();
                let secs = timeout.as_secs_f64();
                t.fail_generation(gen, |n| {
                    LinkError::Timeout(format!(
                        "no reply to request {id} within {secs} s: the environment `{cmd}` is \
                         taken as hung and restarted; {n} calls in flight end with it"
                    ))
                });
                let r = t.done.remove(&id);
                drop(t);
                self.kill_generation(gen);
                self.shared.cv.notify_all();
                return r.unwrap_or_else(|| {
                    Err(LinkError::Timeout(format!("no reply to request {id}")))
                });
            }
            t = self
                .shared
                .cv
                .wait_timeout(t, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn forget(&self, id: u64) {
        let mut t = self.shared.lock();
        if t.inflight.remove(&id).is_some() {
            t.forgotten.insert(id);
        }
        t.done.remove(&id);
    }

    fn restarts(&self) -> u64 {
        self.spawned.load(Ordering::SeqCst).saturating_sub(1)
    }

    fn stray_replies(&self) -> u64 {
        self.shared.lock().stray
    }
}

impl Drop for ProcessLink {
    fn drop(&mut self) {
        if let Some(mut r) = self.lock_running().take() {
            // Closing stdin lets a well-behaved environment exit at end of input.
            drop(r.tx);
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = r.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            kill(&mut r.child);
        }
    }
}
