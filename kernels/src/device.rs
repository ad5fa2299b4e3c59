//! Devices (`cpu`, `emu`, `cuda[:N]`) and the opened form of each, the [`Backend`].

use crate::cuda::CudaBackend;
use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// Where an op runs (DESIGN.md section 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The Rust reference ops, rayon-parallel, f32. The oracle of every kernel.
    #[default]
    Cpu,
    /// The CUDA sources compiled for the host by kernels/emu: tests every kernel without a GPU.
    Emu,
    /// An NVIDIA GPU by ordinal, through the embedded PTX.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::Invalid(format!(
                "unknown device `{s}`; expected `cpu`, `emu`, `cuda` or `cuda:N` (N a GPU ordinal)"
            ))
        };
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "emu" => Ok(Device::Emu),
            "cuda" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Emu => f.write_str("emu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The emulator as a device: device memory is host memory with guard zones; `seed` shuffles
/// the order in which a block's threads run between barriers.
#[derive(Clone, Debug)]
pub struct EmuBackend {
    pub seed: u64,
}

/// An opened device. Cheap to share by reference; ops take `&Backend`.
pub enum Backend {
    Cpu,
    Emu(EmuBackend),
    Cuda(CudaBackend),
}

impl Backend {
    /// Opens a device. For `emu` the schedule seed comes from `SLUICE_EMU_SEED` (default 0).
    /// For `cuda` a missing driver or GPU is an error that names `--device cpu`.
    pub fn open(device: Device) -> Result<Backend> {
        match device {
            Device::Cpu => Ok(Backend::Cpu),
            Device::Emu => {
                let seed = match std::env::var("SLUICE_EMU_SEED") {
                    Ok(s) => s.trim().parse().map_err(|_| {
                        Error::Invalid(format!("SLUICE_EMU_SEED=`{s}` is not an unsigned integer"))
                    })?,
                    Err(_) => 0,
                };
                Ok(Backend::emu_with_seed(seed))
            }
            Device::Cuda(ordinal) => Ok(Backend::Cuda(CudaBackend::open(ordinal)?)),
        }
    }

    /// The emulator with an explicit schedule seed (tests compare two seeds bit for bit).
    pub fn emu_with_seed(seed: u64) -> Backend {
        Backend::Emu(EmuBackend { seed })
    }

    pub fn device(&self) -> Device {
        match self {
            Backend::Cpu => Device::Cpu,
            Backend::Emu(_) => Device::Emu,
            Backend::Cuda(c) => Device::Cuda(c.ordinal()),
        }
    }

    /// Waits until all work queued on the device has finished (a no-op off CUDA).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Backend::Cuda(c) => {
                crate::counters::host_sync();
                c.synchronize()
            }
            _ => Ok(()),
        }
    }

    pub fn cuda(&self) -> Option<&CudaBackend> {
        match self {
            Backend::Cuda(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Backend({})", self.device())
    }
}

/// Opens the first CUDA device for a test, or says why not. With `SLUICE_REQUIRE_CUDA=1` a
/// missing GPU is a failure (scripts/gpu-check sets it, so a GPU run cannot pass by skipping).
pub fn cuda_for_tests(test: &str) -> Option<Backend> {
    match Backend::open(Device::Cuda(0)) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("SLUICE_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("{test}: SLUICE_REQUIRE_CUDA=1 but no CUDA device: {e}");
            }
            println!("{test}: skipped, no CUDA device ({e})");
            None
        }
    }
}
