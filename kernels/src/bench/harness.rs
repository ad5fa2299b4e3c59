//! The one timing harness of `sluice bench`, on every device.
//!
//! - cuda: a CUDA event pair around the launches of one sample and nothing else. Inputs are
//!   built by the case's `prepare` before any timing; outputs come from the storage pool
//!   ([`RecycleScope`]) filled by the warm-up runs, so the timed runs allocate nothing and
//!   poison nothing (the count of fresh allocations in the timed loop is reported and must be
//!   0). The host waits for the end event after it is recorded, outside the pair.
//! - cpu and emu: the wall clock around the same loop, with the device synchronised before the
//!   clock stops; a row says `wall` so it is never read as a GPU timing.
//!
//! Short ops (a single run under [`TimingConfig::min_sample_s`], about 50 us) are timed as a
//! batch of runs per sample, the sample's time divided by the batch: one event pair around a
//! 5 us kernel would measure the launch latency and the event resolution (0.5 us), not the
//! kernel. With `cold_l2` a scratch buffer larger than the L2 is overwritten before each sample,
//! outside the timed interval, and the batch is 1 (a batch's later runs would find the L2 warm).
//! Nothing is validated here: correctness belongs to the tests.

use super::{BenchCase, BenchRun};
use crate::counters::{self, Counts};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{RecycleScope, Tensor};
use std::time::Instant;

/// How one case is timed.
#[derive(Clone, Debug)]
pub struct TimingConfig {
    /// Untimed runs first (at least 1: they fill the storage pool and load the modules).
    pub warmup: usize,
    /// Timed samples; the row reports their median, min and max.
    pub samples: usize,
    /// A run shorter than this is repeated within one sample (see the module documentation).
    pub min_sample_s: f64,
    /// The most runs one sample may batch.
    pub max_batch: usize,
    /// Bytes of scratch overwritten before each sample (the cold-L2 mode); None: warm L2.
    pub cold_l2_bytes: Option<usize>,
}

impl Default for TimingConfig {
    fn default() -> Self {
        TimingConfig {
            warmup: 2,
            samples: 10,
            min_sample_s: 50e-6,
            max_batch: 1000,
            cold_l2_bytes: None,
        }
    }
}

impl TimingConfig {
    /// Rejects settings that would time nothing, naming the setting.
    pub fn validate(&self) -> Result<()> {
        if self.samples == 0 {
            return Err(Error::Invalid(
                "--samples must be at least 1 (the median of no samples is undefined)".into(),
            ));
        }
        if self.warmup == 0 {
            return Err(Error::Invalid(
                "--warmup must be at least 1 (the first run loads modules and fills the output pool)"
                    .into(),
            ));
        }
        if self.max_batch == 0 {
            return Err(Error::Invalid("the batch limit must be at least 1".into()));
        }
        if !(self.min_sample_s.is_finite() && self.min_sample_s >= 0.0) {
            return Err(Error::Invalid(format!(
                "the minimum sample time must be a non-negative number of seconds, not {}",
                self.min_sample_s
            )));
        }
        Ok(())
    }
}

/// The clock a timing was taken with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// CUDA events on the op's stream.
    CudaEvents,
    /// The host's monotonic clock around the run and a device synchronisation.
    Wall,
}

impl Clock {
    pub fn name(self) -> &'static str {
        match self {
            Clock::CudaEvents => "cuda-events",
            Clock::Wall => "wall",
        }
    }
}

/// One case's timing.
#[derive(Clone, Debug)]
pub struct Timing {
    pub clock: Clock,
    /// Per run (a batched sample's time divided by its batch), in seconds.
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    pub samples: usize,
    /// Runs per sample.
    pub batch: usize,
    pub cold_l2: bool,
    /// What one warm run did besides its kernels' work: launches, host syncs, fresh storage
    /// allocations (after the warm-up, so pool hits are not counted).
    pub per_run: Counts,
    /// Fresh storage allocations over the whole timed loop (0 is the contract).
    pub timed_allocs: u64,
}

/// Starts and stops one sample's clock.
enum Timer {
    Wall {
        start: Option<Instant>,
    },
    Events {
        start: cudarc::driver::CudaEvent,
        end: cudarc::driver::CudaEvent,
    },
}

impl Timer {
    fn for_backend(backend: &Backend) -> Result<Timer> {
        match backend {
            Backend::Cuda(c) => {
                let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                Ok(Timer::Events {
                    start: c.context().new_event(flags)?,
                    end: c.context().new_event(flags)?,
                })
            }
            _ => Ok(Timer::Wall { start: None }),
        }
    }

    fn clock(&self) -> Clock {
        match self {
            Timer::Wall { .. } => Clock::Wall,
            Timer::Events { .. } => Clock::CudaEvents,
        }
    }

    fn start(&mut self, backend: &Backend) -> Result<()> {
        match self {
            Timer::Wall { start } => *start = Some(Instant::now()),
            Timer::Events { start, .. } => {
                if let Some(c) = backend.cuda() {
                    start.record(c.stream())?;
                }
            }
        }
        Ok(())
    }

    /// Seconds since `start`; waits for the device (after the end mark, on cuda).
    fn stop(&mut self, backend: &Backend) -> Result<f64> {
        match self {
            Timer::Wall { start } => {
                backend.synchronize()?;
                let t0 = start.take().ok_or_else(|| {
                    Error::Invalid("internal: timer stopped before it started".into())
                })?;
                Ok(t0.elapsed().as_secs_f64())
            }
            Timer::Events { start, end } => {
                if let Some(c) = backend.cuda() {
                    end.record(c.stream())?;
                }
                // elapsed_ms waits for both events: the host sync is after the end mark.
                Ok(f64::from(start.elapsed_ms(end)?) * 1e-3)
            }
        }
    }
}

/// The timed loop alone: `samples` samples of `batch` runs each, per-run seconds pushed into
/// `times` (whose capacity the caller reserved), `flush` run before each sample outside the
/// clock. Allocates nothing itself (a test with a counting allocator holds it to that).
fn timed_loop(
    backend: &Backend,
    timer: &mut Timer,
    run: &mut BenchRun,
    batch: usize,
    samples: usize,
    flush: &mut Option<Tensor>,
    times: &mut Vec<f64>,
) -> Result<()> {
    for _ in 0..samples {
        if let Some(scratch) = flush.as_mut() {
            scratch.fill_byte(0x5a)?;
            backend.synchronize()?;
        }
        timer.start(backend)?;
        for _ in 0..batch {
            run(backend)?;
        }
        let s = timer.stop(backend)?;
        times.push(s / batch as f64);
    }
    Ok(())
}

/// Times one prepared run (see the module documentation).
pub fn time_run(backend: &Backend, run: &mut BenchRun, cfg: &TimingConfig) -> Result<Timing> {
    cfg.validate()?;
    let scope = RecycleScope::enter()?;
    let mut timer = Timer::for_backend(backend)?;
    for _ in 0..cfg.warmup {
        run(backend)?;
    }
    backend.synchronize()?;
    // One more run, counted: what a warm run costs besides its kernels.
    let before = counters::snapshot();
    timer.start(backend)?;
    run(backend)?;
    let one = timer.stop(backend)?;
    let mut per_run = counters::snapshot().since(before);
    // The timer's own wait (wall clock) is the harness's, not the op's.
    if timer.clock() == Clock::Wall && matches!(backend, Backend::Cuda(_)) {
        per_run.host_syncs = per_run.host_syncs.saturating_sub(1);
    }
    let mut flush = match cfg.cold_l2_bytes {
        Some(bytes) => Some(Tensor::zeros(backend, &[bytes.max(1)], DType::U8)?),
        None => None,
    };
    let batch = if flush.is_some() || one >= cfg.min_sample_s || one <= 0.0 {
        1
    } else {
        ((cfg.min_sample_s / one).ceil() as usize).clamp(1, cfg.max_batch)
    };
    let mut times = Vec::with_capacity(cfg.samples);
    let before = counters::snapshot();
    timed_loop(
        backend,
        &mut timer,
        run,
        batch,
        cfg.samples,
        &mut flush,
        &mut times,
    )?;
    let timed = counters::snapshot().since(before);
    drop(flush);
    drop(scope);
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let median = if n % 2 == 1 {
        times[n / 2]
    } else {
        0.5 * (times[n / 2 - 1] + times[n / 2])
    };
    Ok(Timing {
        clock: timer.clock(),
        median_s: median,
        min_s: times[0],
        max_s: times[n - 1],
        samples: n,
        batch,
        cold_l2: cfg.cold_l2_bytes.is_some(),
        per_run,
        // The scratch tensor of the cold-L2 mode is made before the loop: not counted.
        timed_allocs: timed.storage_allocs,
    })
}

/// Prepares a case on `backend` (inputs built here, untimed) and times it.
pub fn time_case(case: &BenchCase, backend: &Backend, cfg: &TimingConfig) -> Result<Timing> {
    let mut run = (case.prepare)(backend)?;
    time_run(backend, &mut run, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_errors_that_name_them() {
        let bad = TimingConfig {
            samples: 0,
            ..TimingConfig::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("--samples"), "{e}");
        let bad = TimingConfig {
            warmup: 0,
            ..TimingConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("--warmup"));
    }

    /// A run far shorter than the minimum sample is batched; the median lies within min..max.
    #[test]
    fn short_runs_are_batched_and_summarised() {
        let mut n = 0u64;
        let mut run: BenchRun = Box::new(move |_| {
            n = std::hint::black_box(n + 1);
            Ok(())
        });
        let cfg = TimingConfig {
            samples: 5,
            min_sample_s: 1e-3,
            ..TimingConfig::default()
        };
        let t = time_run(&Backend::Cpu, &mut run, &cfg).unwrap();
        assert_eq!(t.clock, Clock::Wall);
        assert_eq!(t.samples, 5);
        assert!(t.batch > 1, "{t:?}");
        assert!(t.min_s <= t.median_s && t.median_s <= t.max_s, "{t:?}");
        assert_eq!(t.timed_allocs, 0);
    }

    /// Cold-L2 mode times one run per sample, with the flush outside the clock.
    #[test]
    fn cold_l2_mode_does_not_batch() {
        let mut run: BenchRun = Box::new(|_| Ok(()));
        let cfg = TimingConfig {
            samples: 3,
            cold_l2_bytes: Some(1 << 16),
            ..TimingConfig::default()
        };
        let t = time_run(&Backend::emu_with_seed(0), &mut run, &cfg).unwrap();
        assert_eq!((t.batch, t.cold_l2), (1, true));
    }
}
