//! NVML sampled while each bench row runs: SM and memory clocks (min and max), power and
//! temperature (max) and the union of the throttle reasons seen, so a slow row can be told
//! apart from a throttled GPU. A background thread polls every 20 ms between `start` and
//! `finish`; NVML calls never touch the CUDA stream, so the sampling does not enter the timing.

use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Why telemetry is unavailable on this machine, or None where NVML answers.
pub fn unavailable() -> Option<String> {
    if !crate::cuda::driver_present() {
        return Some("NVML unavailable: no NVIDIA driver on this machine".into());
    }
    match nvml_wrapper::Nvml::init() {
        Ok(_) => None,
        Err(e) => Some(format!("NVML unavailable: {e}")),
    }
}

#[derive(Default)]
struct Extremes {
    samples: u64,
    sm_mhz: Option<(u32, u32)>,
    mem_mhz: Option<(u32, u32)>,
    power_mw_max: Option<u32>,
    temp_c_max: Option<u32>,
    throttle_bits: u64,
}

fn widen(r: &mut Option<(u32, u32)>, v: u32) {
    *r = Some(r.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))));
}

/// A running sampler of GPU `index`.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<Extremes, String>>,
}

impl Sampler {
    /// Starts sampling; an error string where NVML cannot be opened.
    pub fn start(index: u32) -> Result<Sampler, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
            let nvml = nvml_wrapper::Nvml::init().map_err(|e| e.to_string())?;
            let d = nvml.device_by_index(index).map_err(|e| e.to_string())?;
            let mut x = Extremes::default();
            loop {
                if let Ok(v) = d.clock_info(Clock::SM) {
                    widen(&mut x.sm_mhz, v);
                }
                if let Ok(v) = d.clock_info(Clock::Memory) {
                    widen(&mut x.mem_mhz, v);
                }
                if let Ok(p) = d.power_usage() {
                    x.power_mw_max = Some(x.power_mw_max.map_or(p, |m| m.max(p)));
                }
                if let Ok(t) = d.temperature(TemperatureSensor::Gpu) {
                    x.temp_c_max = Some(x.temp_c_max.map_or(t, |m| m.max(t)));
                }
                if let Ok(r) = d.current_throttle_reasons() {
                    x.throttle_bits |= r.bits();
                }
                x.samples += 1;
                // Checked after a sample, so even the shortest row has one.
                if flag.load(Ordering::Relaxed) {
                    return Ok(x);
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        });
        Ok(Sampler { stop, handle })
    }

    /// Stops sampling and returns the row's telemetry as JSON.
    pub fn finish(self) -> Result<Value, String> {
        self.stop.store(true, Ordering::Relaxed);
        let x = self
            .handle
            .join()
            .map_err(|_| "the NVML sampler thread panicked".to_string())??;
        let reasons =
            nvml_wrapper::bitmasks::device::ThrottleReasons::from_bits_truncate(x.throttle_bits);
        Ok(json!({
            "samples": x.samples,
            "sm_mhz_min": x.sm_mhz.map(|r| r.0), "sm_mhz_max": x.sm_mhz.map(|r| r.1),
            "mem_mhz_min": x.mem_mhz.map(|r| r.0), "mem_mhz_max": x.mem_mhz.map(|r| r.1),
            "power_w_max": x.power_mw_max.map(|p| p as f64 / 1000.0),
            "temp_c_max": x.temp_c_max,
            "throttle_reasons": format!("{reasons:?}"),
        }))
    }
}
