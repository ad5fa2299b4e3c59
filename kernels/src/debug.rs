//! The process-wide debug switch: checks that cost the device time or a host round trip.
//!
//! On (`debug::enabled()`):
//! - every fresh or recycled output of an op is poisoned ([`crate::tensor::POISON_BYTE`], NaN in
//!   f32 and bf16, -1 in i32), so an element a kernel forgets to write shows up in any
//!   comparison;
//! - ops copy their index inputs to the host and check them (grouped-GEMM offsets, attention
//!   cu_seqlens, paged block tables and context lengths, is_gate_loss token ids, the MoE
//!   backward's segment bounds against the caller's), returning the same named errors as ever.
//!
//! Off: outputs are allocated uninitialised (no memset launch; ops that need zeros still ask
//! for [`crate::Tensor::zeros`]) and no op copies device memory to the host; the index inputs
//! are checked where they are built instead (the packed batch, the block manager's tables, the
//! model's routing) or trusted, as DESIGN's callers build them.
//!
//! The switch is on unless something turns it off: every test of every crate runs checked
//! without doing anything. The `sluice` binary turns it off for its commands unless `--debug`
//! is given or `SLUICE_DEBUG=1` is set. `SLUICE_DEBUG=0|1` decides wherever it is set, before
//! any call to [`set`]; [`set`] decides after.

use std::sync::atomic::{AtomicU8, Ordering};

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNSET);

/// The value of `SLUICE_DEBUG` as a switch, if it is set to something meaningful.
pub fn from_env() -> Option<bool> {
    match std::env::var("SLUICE_DEBUG").ok()?.trim() {
        "1" | "true" | "on" => Some(true),
        "0" | "false" | "off" => Some(false),
        _ => None,
    }
}

/// Whether the debug checks run (see the module documentation).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = from_env().unwrap_or(true);
            // First reader decides; a concurrent `set` wins over the default.
            let _ = STATE.compare_exchange(
                UNSET,
                if on { ON } else { OFF },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            STATE.load(Ordering::Relaxed) == ON
        }
    }
}

/// Turns the checks on or off for the whole process.
pub fn set(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// What the `sluice` binary does at start: on with `--debug` or `SLUICE_DEBUG=1`, else off.
pub fn set_for_main(flag: bool) {
    set(flag || from_env() == Some(true));
}

/// Whether an op copies its index tensor `t` to the host to check it: always where `t` is in
/// host memory (the `cpu` device: no copy, no wait), on a device only in debug mode.
pub fn reads_back(t: &crate::Tensor) -> bool {
    t.device_kind() == "cpu" || enabled()
}
