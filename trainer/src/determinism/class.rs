//! The numerics class of a machine and device: everything that may change an op's bits
//! without a change to sluice's source. Goldens are kept per class (tests/golden/<key>/), since
//! the same commit may rightly give other bits on another class.
//!
//! - the architecture, and the CPU features the CPU references dispatch on (the AVX2/FMA and
//!   AVX-512 kernels of gemm_small, gemm_chain, attention and row_reduce, and matrixmultiply's
//!   own AVX/FMA/AVX-512 selection): one product may take a different kernel on another CPU;
//! - the C library's libm (Rust's `exp`, `ln`, `powf` call it): glibc versions differ in the
//!   last bit of some results;
//! - the Rust compiler (code generation and `std`'s float routines);
//! - the device; on `emu`, the host C++ compiler that built the emulated kernels (and any
//!   extra flags); on `cuda`, the GPU (name and compute capability) and the driver (its JIT
//!   compiles the PTX).
//!
//! What is not in it, and why: the thread count and the emulator's schedule seed (results must
//! not depend on them: the probes check that), the OS and the CPU's model name (recorded per
//! machine, not part of the class: no op's bits depend on them beyond the features above).

use serde::{Deserialize, Serialize};
use sluice_kernels::{Backend, Device};

/// See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    /// The class as one word that can name a folder: what goldens are keyed by.
    pub key: String,
    pub arch: String,
    pub cpu_features: Vec<String>,
    pub libm: String,
    pub compiler: String,
    pub device: String,
    /// emu: the C++ compiler of the emulated kernels (and extra flags, if any).
    pub emu_compiler: Option<String>,
    /// cuda: the GPU's name and compute capability.
    pub gpu: Option<String>,
    /// cuda: the driver's version.
    pub driver: Option<String>,
}

/// What a record says about the machine beyond the class (shown by `diff`, never compared as
/// numerics).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    pub hostname: String,
    pub os: String,
    pub cpu_model: String,
    pub cores: usize,
}

/// The CPU features the references and matrixmultiply dispatch on, that this CPU has.
fn cpu_features() -> Vec<String> {
    #[allow(unused_mut)]
    let mut found: Vec<&str> = Vec::new();
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        if std::is_x86_feature_detected!("avx") {
            found.push("avx");
        }
        if std::is_x86_feature_detected!("avx2") {
            found.push("avx2");
        }
        if std::is_x86_feature_detected!("fma") {
            found.push("fma");
        }
        if std::is_x86_feature_detected!("avx512f") {
            found.push("avx512f");
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            found.push("neon");
        }
    }
    found.into_iter().map(str::to_string).collect()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn libm() -> String {
    extern "C" {
        fn gnu_get_libc_version() -> *const std::ffi::c_char;
    }
    // SAFETY: glibc's gnu_get_libc_version takes no arguments and returns a pointer to a static,
    // NUL-terminated string that lives as long as the process; it is only read here.
    let version = unsafe { std::ffi::CStr::from_ptr(gnu_get_libc_version()) };
    format!("glibc {}", version.to_string_lossy())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn libm() -> String {
    let env = std::env::consts::OS;
    if cfg!(target_env = "musl") {
        "musl".to_string()
    } else {
        format!("the C library of {env}")
    }
}

/// The second whitespace-separated word that starts with a digit (`rustc 1.95.0 (...)` ->
/// `1.95.0`; `g++ (Ubuntu 13.3.0-6ubuntu2) 13.3.0` -> the last such word), for the key.
fn short_version(full: &str) -> String {
    let tool = full.split_whitespace().next().unwrap_or("?");
    let version = if tool == "rustc" {
        full.split_whitespace().nth(1)
    } else {
        full.split_whitespace()
            .rev()
            .find(|w| w.starts_with(|c: char| c.is_ascii_digit()))
    };
    format!("{tool}{}", version.unwrap_or(""))
}

/// Keeps letters, digits and `.`, `+`, `_`, `-`; anything else becomes `_`.
fn file_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || ".+_-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Class {
    /// The class of this machine for `backend` (opened on the device the record is for).
    pub fn detect(backend: &Backend) -> Class {
        let device = backend.device();
        let arch = std::env::consts::ARCH.to_string();
        let cpu_features = cpu_features();
        let libm = libm();
        let compiler = env!("SLUICE_RUSTC").to_string();
        let (mut emu_compiler, mut gpu, mut driver) = (None, None, None);
        let device_name = match device {
            Device::Cpu => "cpu".to_string(),
            Device::Emu => "emu".to_string(),
            Device::Cuda(_) => "cuda".to_string(),
        };
        let mut device_key = device_name.clone();
        match device {
            Device::Cpu => {}
            Device::Emu => {
                let flags = sluice_kernels::emu::EXTRA_FLAGS;
                let c = if flags.is_empty() {
                    sluice_kernels::emu::COMPILER.to_string()
                } else {
                    format!("{} with {flags}", sluice_kernels::emu::COMPILER)
                };
                device_key = format!("emu-{}", short_version(&c));
                if !flags.is_empty() {
                    let h = blake3::hash(flags.as_bytes()).to_hex();
                    device_key.push_str(&format!("-flags{}", &h[..8]));
                }
                emu_compiler = Some(c);
            }
            Device::Cuda(_) => {
                if let Some(c) = backend.cuda() {
                    let (maj, min) = c.compute_capability();
                    gpu = Some(format!("{} (sm_{maj}{min})", c.name()));
                    device_key = format!("cuda-sm{maj}{min}-{}", c.name());
                }
                let d = sluice_kernels::cuda::driver_version()
                    .unwrap_or_else(|e| format!("unknown ({e})"));
                device_key.push_str(&format!("-driver{d}"));
                driver = Some(d);
            }
        }
        let features = if cpu_features.is_empty() {
            "baseline".to_string()
        } else {
            cpu_features.join(".")
        };
        let key = file_safe(&format!(
            "{arch}-{features}-{}-{}-{device_key}",
            libm.replace(' ', ""),
            short_version(&compiler)
        ));
        Class {
            key,
            arch,
            cpu_features,
            libm,
            compiler,
            device: device_name,
            emu_compiler,
            gpu,
            driver,
        }
    }

    /// The fields in which `other` differs from this class, as `name: a vs b`.
    pub fn differences(&self, other: &Class) -> Vec<String> {
        let mut out = Vec::new();
        let mut cmp = |name: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{name}: {a} vs {b}"));
            }
        };
        let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".to_string());
        cmp("arch", self.arch.clone(), other.arch.clone());
        cmp(
            "cpu features",
            self.cpu_features.join(","),
            other.cpu_features.join(","),
        );
        cmp("libm", self.libm.clone(), other.libm.clone());
        cmp("compiler", self.compiler.clone(), other.compiler.clone());
        cmp("device", self.device.clone(), other.device.clone());
        cmp(
            "emu compiler",
            opt(&self.emu_compiler),
            opt(&other.emu_compiler),
        );
        cmp("gpu", opt(&self.gpu), opt(&other.gpu));
        cmp("driver", opt(&self.driver), opt(&other.driver));
        out
    }
}

impl Machine {
    pub fn detect() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let hostname = read("/proc/sys/kernel/hostname")
            .or_else(|| read("/etc/hostname"))
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "unknown".to_string());
        let cpu_model = read("/proc/cpuinfo")
            .and_then(|info| {
                info.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".to_string());
        Machine {
            hostname,
            os: std::env::consts::OS.to_string(),
            cpu_model,
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_short_file_safe_and_name_the_device() {
        let cpu = Class::detect(&Backend::Cpu);
        assert!(cpu.key.ends_with("-cpu"), "{}", cpu.key);
        assert!(cpu.key.contains(std::env::consts::ARCH), "{}", cpu.key);
        assert!(cpu.key.contains("rustc"), "{}", cpu.key);
        assert!(
            cpu.key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".+_-".contains(c)),
            "{}",
            cpu.key
        );
        let emu = Class::detect(&Backend::emu_with_seed(0));
        assert!(emu.key.contains("-emu-"), "{}", emu.key);
        assert!(emu.emu_compiler.is_some());
        assert_ne!(cpu.key, emu.key);
        let diff = cpu.differences(&emu);
        assert!(
            diff.iter().any(|d| d.starts_with("device: cpu vs emu")),
            "{diff:?}"
        );
        assert!(cpu.differences(&cpu).is_empty());
    }

    #[test]
    fn short_versions() {
        assert_eq!(
            short_version("rustc 1.95.0 (59807616e 2026-04-14)"),
            "rustc1.95.0"
        );
        assert_eq!(
            short_version("g++ (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0"),
            "g++13.3.0"
        );
    }
}
