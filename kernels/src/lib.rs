//! sluice-kernels: devices, tensors and every op of sluice.
//!
//! Each op family has one CUDA source (`kernels/cuda/<family>.cu`, compiled to the embedded PTX
//! in `ptx/` and, for the emulator, to host code), one CPU reference and one Rust entry point in
//! `ops/<family>.rs` that runs the reference on `cpu` and launches the kernel on `emu` and
//! `cuda` through the shared launch code in [`launch`].

pub mod bench;
pub mod bench_cases;
pub mod counters;
pub mod cuda;
pub mod debug;
pub mod device;
pub mod dtype;
pub mod emu;
pub mod error;
pub mod io;
pub mod kernel_table;
pub mod launch;
pub mod nvtx;
pub mod ops;
pub mod par;
#[cfg(feature = "planted-faults")]
pub mod planted;
pub mod profiler;
pub mod runner;
pub mod tensor;
pub mod tensor_map;
pub mod testing;

pub use device::{Backend, Device};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use tensor::Tensor;
