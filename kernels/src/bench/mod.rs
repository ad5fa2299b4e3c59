//! `sluice bench`: time ops on a device and set them against the H200 roofline.
//!
//! Each case knows the bytes it must move and the FLOPs it must do (counted from the op's
//! math, not measured), so a timing becomes an achieved bandwidth or FLOP rate and a fraction
//! of what the machine can do at best.

use crate::device::Backend;
use crate::error::Result;

pub mod ceilings;
pub mod harness;
pub mod rows;
pub mod telemetry;

/// H200 copy bandwidth measured on the target machine (bytes/s; DESIGN 9.1).
pub const H200_COPY_BANDWIDTH: f64 = 4.3e12;
/// H200 dense bf16 GEMM throughput attained by cuBLAS on the target machine (FLOP/s).
pub const H200_BF16_FLOPS: f64 = 790e12;
/// H200 nominal HBM3e bandwidth (bytes/s): 4.8 TB/s on the data sheet.
pub const H200_NOMINAL_BANDWIDTH: f64 = 4.8e12;
/// H200 nominal dense bf16 tensor throughput (FLOP/s): 132 SMs x 1.83 GHz x 4096 FLOP/clock.
pub const H200_NOMINAL_BF16_FLOPS: f64 = 989e12;

/// A prepared run of one op: calling it once runs the op once on the given backend (the one
/// its inputs were prepared on).
pub type BenchRun = Box<dyn FnMut(&Backend) -> Result<()>>;

/// Builds a case's inputs on a backend and returns the run to time.
pub type BenchPrepare = Box<dyn Fn(&Backend) -> Result<BenchRun>>;

/// What part of the work a case times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
    /// A whole model step (train or decode): many ops, launches and host syncs counted.
    Step,
    /// A ceiling measured in the same run (copy bandwidth, cuBLAS GEMM).
    Ceiling,
}

impl Pass {
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::Step => "step",
            Pass::Ceiling => "ceiling",
        }
    }
}

/// One benchmark case.
pub struct BenchCase {
    pub op: &'static str,
    pub pass: Pass,
    /// The kernel path where an op has several (`mma` or `wgmma` for GEMMs), else `default`.
    pub path: &'static str,
    /// The correctness test that must pass in the same GPU run for the row to count as
    /// verified: `TEST_BINARY::NAME_FRAGMENT` (a libtest name containing the fragment), with
    /// `@wgmma` appended where it must pass with SLUICE_GEMM_PATH=wgmma.
    pub check: &'static str,
    /// Runs only on cuda (the cuBLAS ceiling); elsewhere its row says it was skipped and why.
    pub cuda_only: bool,
    /// The shape in words, e.g. `M=N=K=512 f32`.
    pub shape: String,
    /// Bytes the op must read and write at minimum.
    pub bytes: f64,
    /// Floating-point operations the op must do.
    pub flops: f64,
    /// Builds the inputs on a backend and returns the closure to time.
    pub prepare: BenchPrepare,
}

pub use harness::{time_case, time_run, Clock, Timing, TimingConfig};
pub use rows::{markdown_report, read_rows, Row, RowWriter, Verification};

/// Seconds as `1.234 s`, `1.234 ms` or `12.3 us`.
pub fn fmt_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}
