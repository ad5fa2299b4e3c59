//! The `http` transport: each request is `POST`ed as a JSON body to the environment's URL
//! (plain `http://host:port/path`, HTTP/1.1, one connection per request, `Connection:
//! close`); the reply is the response's JSON body (status 200, with a `Content-Length` or a
//! body that ends with the connection). Requests run on threads of their own, so many are in
//! flight at once. sluice does not own the server: a refused connection or a 5xx is a crash
//! (retried within the task's budget), a 4xx or a body that is not a JSON object is malformed.

use super::{reply_id, Link, LinkError};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Table {
    inflight: HashSet<u64>,
    done: HashMap<u64, Result<Value, LinkError>>,
    stray: u64,
}

#[derive(Default)]
struct Shared {
    table: Mutex<Table>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An environment server at a URL (see the module docs).
pub struct HttpLink {
    url: String,
    host: String,
    port: u16,
    path: String,
    /// The socket timeout of one request (the call's timeout).
    timeout: Duration,
    shared: Arc<Shared>,
}

impl HttpLink {
    /// Checks the URL's form (`http://host[:port][/path]`); nothing is contacted yet.
    pub fn new(url: &str, timeout: Duration) -> Result<HttpLink, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("url {url:?}: only plain http://host:port/path URLs are supported")
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].to_string()),
            None => (rest, "/".to_string()),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse::<u16>()
                    .map_err(|_| format!("url {url:?}: port {p:?} is not a number below 65536"))?,
            ),
            None => (authority.to_string(), 80),
        };
        if host.is_empty() {
            return Err(format!("url {url:?} has no host"));
        }
        Ok(HttpLink {
            url: url.to_string(),
            host,
            port,
            path,
            timeout,
            shared: Arc::new(Shared::default()),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

/// One POST: the reply's JSON object, or why there is none.
fn post(
    host: &str,
    port: u16,
    path: &str,
    url: &str,
    body: &str,
    timeout: Duration,
) -> Result<Value, LinkError> {
    let crash = |e: String| LinkError::Crash(format!("environment server {url}: {e}"));
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| crash(format!("cannot resolve {host}: {e}")))?
        .next()
        .ok_or_else(|| crash(format!("{host} has no address")))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| crash(format!("cannot connect: {e}")))?;
    let io = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            LinkError::Timeout(format!(
                "environment server {url}: no reply within {} s",
                timeout.as_secs_f64()
            ))
        } else {
            crash(e.to_string())
        }
    };
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).map_err(io)?;
    s.write_all(body.as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io)?;
    let malformed = |m: String| LinkError::Malformed(format!("environment server {url}: {m}"));
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| malformed("the response has no header end".into()))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let body = &raw[split + 4..];
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| malformed(format!("no status in {:?}", head.lines().next())))?;
    let lower = head.to_ascii_lowercase();
    if lower.contains("transfer-encoding: chunked") {
        return Err(malformed(
            "chunked responses are not supported (send a Content-Length)".into(),
        ));
    }
    let text = String::from_utf8_lossy(body);
    if (500..600).contains(&status) {
        return Err(crash(format!("HTTP {status}: {}", text.trim())));
    }
    if status != 200 {
        return Err(malformed(format!("HTTP {status}: {}", text.trim())));
    }
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| malformed(format!("the body is not JSON ({e}): {:?}", text.trim())))?;
    if !v.is_object() {
        return Err(malformed("the body is not a JSON object".into()));
    }
    Ok(v)
}

impl Link for HttpLink {
    fn send(&self, id: u64, request: &Value) {
        self.shared.lock().inflight.insert(id);
        let body = request.to_string();
        let (host, port, path, url, timeout) = (
            self.host.clone(),
            self.port,
            self.path.clone(),
            self.url.clone(),
            self.timeout,
        );
        let shared = Arc::clone(&self.shared);
        std::thread::spawn(move || {
            let mut r = post(&host, port, &path, &url, &body, timeout);
            // The connection ties the reply to its request; an `id`, if given, must agree.
            if let Ok(v) = &r {
                if reply_id(v).is_some_and(|got| got != id)
                    || v.get("id").is_some_and(|x| !x.is_u64())
                {
                    r = Err(LinkError::Malformed(format!(
                        "environment server {url}: the reply to request {id} carries id {}",
                        v["id"]
                    )));
                }
            }
            let mut t = shared.lock();
            if t.inflight.remove(&id) {
                t.done.insert(id, r);
            } else {
                t.stray += 1;
            }
            shared.cv.notify_all();
        });
    }

    fn wait(&self, id: u64, timeout: Duration) -> Result<Value, LinkError> {
        let deadline = Instant::now() + timeout;
        let mut t = self.shared.lock();
        loop {
            if let Some(r) = t.done.remove(&id) {
                return r;
            }
            if !t.inflight.contains(&id) {
                return Err(LinkError::Crash(format!(
                    "request {id} was never sent to {}",
                    self.url
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                t.inflight.remove(&id);
                return Err(LinkError::Timeout(format!(
                    "environment server {}: no reply to request {id} within {} s",
                    self.url,
                    timeout.as_secs_f64()
                )));
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
        t.inflight.remove(&id);
        t.done.remove(&id);
    }

    fn stray_replies(&self) -> u64 {
        self.shared.lock().stray
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_before_anything_is_contacted() {
        let t = Duration::from_secs(1);
        let l = HttpLink::new("http://127.0.0.1:8000/env", t).unwrap();
        assert_eq!(
            (l.host.as_str(), l.port, l.path.as_str()),
            ("127.0.0.1", 8000, "/env")
        );
        let l = HttpLink::new("http://localhost", t).unwrap();
        assert_eq!((l.port, l.path.as_str()), (80, "/"));
        for (bad, what) in [
            ("https://x/", "only plain http://"),
            ("http://x:http/", "port \"http\""),
            ("http://:80/", "no host"),
        ] {
            let e = HttpLink::new(bad, t).err().unwrap();
            assert!(e.contains(what), "{bad}: {e}");
        }
    }
}
