//! The run's clock and its timer queue (DESIGN 6.7).
//!
//! Everything in the RL system is scheduled against one [`Clock`]: the wall clock, or a
//! virtual clock (replay mode) on which environment latencies are timers and compute is charged
//! by a stated [`CostModel`]. On the virtual clock nothing depends on thread timing: the next
//! event is always the earliest one in the queue (ties broken by the order events were
//! scheduled), so a run with a seed replays bit for bit.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// A point on the run clock: microseconds since the run started.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Micros(pub u64);

impl Micros {
    pub fn from_ms(ms: f64) -> Micros {
        Micros((ms.max(0.0) * 1000.0).round() as u64)
    }

    pub fn from_secs(s: f64) -> Micros {
        Micros((s.max(0.0) * 1e6).round() as u64)
    }

    pub fn secs(self) -> f64 {
        self.0 as f64 / 1e6
    }

    pub fn plus(self, d: Micros) -> Micros {
        Micros(self.0.saturating_add(d.0))
    }

    pub fn since(self, earlier: Micros) -> Micros {
        Micros(self.0.saturating_sub(earlier.0))
    }
}

/// Which clock a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockMode {
    /// Real time; compute takes what it takes, on worker threads.
    Wall,
    /// Simulated time: compute runs inline and is charged by the cost model.
    Virtual,
}

impl ClockMode {
    /// `wall` or `virtual`: the label every rate per second carries (on the virtual clock a
    /// rate is per virtual second).
    pub fn as_str(self) -> &'static str {
        match self {
            ClockMode::Wall => "wall",
            ClockMode::Virtual => "virtual",
        }
    }
}

/// The run clock.
#[derive(Debug)]
pub struct Clock {
    mode: ClockMode,
    start: Instant,
    /// Wall mode: time already elapsed before this process (a resumed run).
    offset: Micros,
    virtual_now: Micros,
}

impl Clock {
    /// A clock starting at `start` (0 for a new run, the saved time for a resumed one).
    pub fn new(mode: ClockMode, start: Micros) -> Clock {
        Clock {
            mode,
            start: Instant::now(),
            offset: start,
            virtual_now: start,
        }
    }

    pub fn mode(&self) -> ClockMode {
        self.mode
    }

    pub fn is_virtual(&self) -> bool {
        self.mode == ClockMode::Virtual
    }

    pub fn now(&self) -> Micros {
        match self.mode {
            ClockMode::Virtual => self.virtual_now,
            ClockMode::Wall => self
                .offset
                .plus(Micros(self.start.elapsed().as_micros() as u64)),
        }
    }

    /// Moves the virtual clock forward to `t` (never back); a no-op on the wall clock.
    pub fn advance_to(&mut self, t: Micros) {
        if self.mode == ClockMode::Virtual && t > self.virtual_now {
            self.virtual_now = t;
        }
    }

    /// How long until `t` on the wall clock (zero when past; zero on the virtual clock).
    pub fn wait_until(&self, t: Micros) -> Duration {
        match self.mode {
            ClockMode::Virtual => Duration::ZERO,
            ClockMode::Wall => Duration::from_micros(t.since(self.now()).0),
        }
    }
}

/// Compute charged on the virtual clock. Each figure is a stated model, not a measurement of
/// this run (defaults: measured on the 2-core development machine for the small model on cpu,
/// docs/perf/async.md; the weight-sync figures per byte from the sync bench, docs/perf/sync.md);
/// on the wall clock the compute takes its real time instead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Fixed cost of one engine step (scheduling, launches).
    pub engine_step_us: f64,
    /// Per prefilled token.
    pub prefill_token_us: f64,
    /// Per sequence in a decode batch.
    pub decode_seq_us: f64,
    /// Per token of a learner step (forward + backward).
    pub train_token_us: f64,
    /// Fixed cost of one optimizer step.
    pub optim_step_us: f64,
    /// One weight publication to one replica.
    pub publish_us: f64,
    /// Delta path, learner side: per byte of the image, per delta encoded (scan, shuffle,
    /// zstd, checksum).
    pub sync_encode_byte_us: f64,
    /// Delta and disk paths, per byte that reaches a replica (the delta or image it is sent,
    /// the file it reads).
    pub sync_transfer_byte_us: f64,
    /// Delta and disk paths, replica side: per byte of the image installed (decode or parse,
    /// blake3 verification, the copy into the engine).
    pub sync_apply_byte_us: f64,
    /// Disk path, learner side: per byte of the file written (serialise, write, fsync).
    pub sync_write_byte_us: f64,
    /// Starting a fresh engine for a lost replica, before its full sync.
    pub replica_restart_us: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            engine_step_us: 400.0,
            prefill_token_us: 60.0,
            decode_seq_us: 120.0,
            train_token_us: 200.0,
            optim_step_us: 90_000.0,
            publish_us: 2_000.0,
            sync_encode_byte_us: SYNC_ENCODE_BYTE_US,
            sync_transfer_byte_us: SYNC_TRANSFER_BYTE_US,
            sync_apply_byte_us: SYNC_APPLY_BYTE_US,
            sync_write_byte_us: SYNC_WRITE_BYTE_US,
            replica_restart_us: 500_000.0,
        }
    }
}

// Per-byte defaults (microseconds per byte; trainer/src/defaults.toml states the same figures)
// from the sync bench on the 2-vCPU development machine (docs/perf/sync.md): delta encode of a
// dense f32 update at about 200 MiB/s, install (decode, verify, copy) at about 450 MiB/s, an
// in-memory copy at about 5 GiB/s for the transfer, and a checkpoint write (serialise, write,
// fsync, rename, pointer) at about 256 MiB/s.
const SYNC_ENCODE_BYTE_US: f64 = 0.00477;
const SYNC_APPLY_BYTE_US: f64 = 0.00212;
const SYNC_TRANSFER_BYTE_US: f64 = 0.000186;
const SYNC_WRITE_BYTE_US: f64 = 0.00373;

impl CostModel {
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("engine_step_us", self.engine_step_us),
            ("prefill_token_us", self.prefill_token_us),
            ("decode_seq_us", self.decode_seq_us),
            ("train_token_us", self.train_token_us),
            ("optim_step_us", self.optim_step_us),
            ("publish_us", self.publish_us),
            ("sync_encode_byte_us", self.sync_encode_byte_us),
            ("sync_transfer_byte_us", self.sync_transfer_byte_us),
            ("sync_apply_byte_us", self.sync_apply_byte_us),
            ("sync_write_byte_us", self.sync_write_byte_us),
            ("replica_restart_us", self.replica_restart_us),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("cost.{name} = {v} must be a number >= 0"));
            }
        }
        Ok(())
    }

    /// One engine step that prefilled `prefill` tokens and decoded `decode` sequences.
    pub fn engine_step(&self, prefill: u64, decode: u64) -> Micros {
        Micros(
            (self.engine_step_us
                + self.prefill_token_us * prefill as f64
                + self.decode_seq_us * decode as f64)
                .round() as u64,
        )
    }

    /// One learner step over `tokens` tokens.
    pub fn learner_step(&self, tokens: u64) -> Micros {
        Micros((self.optim_step_us + self.train_token_us * tokens as f64).round() as u64)
    }

    pub fn publish(&self) -> Micros {
        Micros(self.publish_us.round() as u64)
    }

    /// Learner side of one delta publication: `deltas` encodes of an `image`-byte image.
    pub fn sync_encode(&self, image: u64, deltas: u64) -> Micros {
        Micros((self.sync_encode_byte_us * image as f64 * deltas as f64).round() as u64)
    }

    /// Learner side of one disk publication: writing a `file`-byte file.
    pub fn sync_write(&self, file: u64) -> Micros {
        Micros((self.sync_write_byte_us * file as f64).round() as u64)
    }

    /// Replica side of one install: `sent` bytes arrive, an `image`-byte image is applied and
    /// verified.
    pub fn sync_install(&self, sent: u64, image: u64) -> Micros {
        Micros(
            (self.sync_transfer_byte_us * sent as f64 + self.sync_apply_byte_us * image as f64)
                .round() as u64,
        )
    }

    pub fn replica_restart(&self) -> Micros {
        Micros(self.replica_restart_us.round() as u64)
    }
}

/// Timers ordered by (due time, scheduling order): deterministic among equal times.
#[derive(Debug)]
pub struct Timers<T> {
    heap: BinaryHeap<Reverse<(Micros, u64, Slot<T>)>>,
    next_seq: u64,
}

/// Holds a timer's payload; compares equal to every other (the heap orders by time and seq).
#[derive(Debug)]
struct Slot<T>(T);

impl<T> PartialEq for Slot<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<T> Eq for Slot<T> {}
impl<T> PartialOrd for Slot<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Slot<T> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl<T> Default for Timers<T> {
    fn default() -> Self {
        Timers {
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }
}

impl<T> Timers<T> {
    pub fn push(&mut self, at: Micros, item: T) {
        self.heap.push(Reverse((at, self.next_seq, Slot(item))));
        self.next_seq += 1;
    }

    /// The earliest due time.
    pub fn next_due(&self) -> Option<Micros> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Removes and returns the earliest timer if it is due at or before `now`.
    pub fn pop_due(&mut self, now: Micros) -> Option<(Micros, T)> {
        if self.next_due()? > now {
            return None;
        }
        self.heap.pop().map(|Reverse((t, _, Slot(x)))| (t, x))
    }

    /// Removes and returns the earliest timer, due or not.
    pub fn pop(&mut self) -> Option<(Micros, T)> {
        self.heap.pop().map(|Reverse((t, _, Slot(x)))| (t, x))
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Every pending timer in due order (for saving run state).
    pub fn drain_sorted(&mut self) -> Vec<(Micros, T)> {
        let mut out = Vec::with_capacity(self.heap.len());
        while let Some(x) = self.pop() {
            out.push(x);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_pop_in_time_then_insertion_order() {
        let mut t = Timers::default();
        t.push(Micros(30), "c");
        t.push(Micros(10), "a");
        t.push(Micros(30), "d");
        t.push(Micros(10), "b");
        assert_eq!(t.pop_due(Micros(5)), None);
        let order: Vec<_> = std::iter::from_fn(|| t.pop()).map(|(_, x)| x).collect();
        assert_eq!(order, ["a", "b", "c", "d"]);
    }

    #[test]
    fn virtual_clock_only_moves_forward() {
        let mut c = Clock::new(ClockMode::Virtual, Micros(5));
        assert_eq!(c.now(), Micros(5));
        c.advance_to(Micros(100));
        c.advance_to(Micros(50));
        assert_eq!(c.now(), Micros(100));
        assert_eq!(c.wait_until(Micros(1_000_000)), Duration::ZERO);
    }

    #[test]
    fn cost_model_charges_what_it_states() {
        let m = CostModel {
            engine_step_us: 10.0,
            prefill_token_us: 1.0,
            decode_seq_us: 2.0,
            train_token_us: 3.0,
            optim_step_us: 100.0,
            publish_us: 7.0,
            sync_encode_byte_us: 0.5,
            sync_transfer_byte_us: 0.25,
            sync_apply_byte_us: 0.125,
            sync_write_byte_us: 2.0,
            replica_restart_us: 1000.0,
        };
        assert_eq!(m.engine_step(5, 4), Micros(23));
        assert_eq!(m.learner_step(10), Micros(130));
        assert_eq!(m.publish(), Micros(7));
        assert_eq!(m.sync_encode(100, 3), Micros(150));
        assert_eq!(m.sync_write(100), Micros(200));
        assert_eq!(m.sync_install(40, 80), Micros(20));
        assert_eq!(m.replica_restart(), Micros(1000));
        assert!(CostModel {
            decode_seq_us: -1.0,
            ..m
        }
        .validate()
        .unwrap_err()
        .contains("decode_seq_us"));
    }
}
