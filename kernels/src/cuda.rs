//! The CUDA device: context, one stream, PTX modules loaded lazily from the embedded table.
//!
//! cudarc is used with dynamic loading, so nothing here links libcuda at build time; every
//! driver call is preceded by a check that the library exists, because cudarc panics otherwise.

use crate::error::{Error, Result};
use crate::kernel_table::{family_of, KernelFamily};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Which PTX a GPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtxArch {
    /// compute_90a: Hopper (H100/H200) with wgmma and TMA. Loads only on sm_90 exactly.
    Sm90a,
    /// compute_80: Ampere and later through the driver's JIT (mma.sync).
    Sm80,
}

/// An opened GPU.
pub struct CudaBackend {
    ordinal: usize,
    name: String,
    compute_capability: (i32, i32),
    arch: PtxArch,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

const NO_DRIVER: &str = "no CUDA driver found (libcuda is not loadable); \
run on a machine with an NVIDIA driver, or use `--device cpu` (or `--device emu` to run the CUDA \
kernels on the CPU)";

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; loads nothing into the process on failure.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl CudaBackend {
    pub fn open(ordinal: usize) -> Result<CudaBackend> {
        if !driver_present() {
            return Err(Error::Device(NO_DRIVER.to_string()));
        }
        let count = CudaContext::device_count().map_err(|e| {
            Error::Device(format!(
                "the CUDA driver could not count devices ({e}); use `--device cpu`"
            ))
        })?;
        if ordinal >= count as usize {
            return Err(Error::Device(format!(
                "cuda:{ordinal} does not exist: this machine has {count} CUDA device(s); \
                 use `--device cpu` to run without a GPU"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let compute_capability = ctx.compute_capability()?;
        let arch = match compute_capability {
            (9, 0) => PtxArch::Sm90a,
            (major, _) if major >= 8 => PtxArch::Sm80,
            (major, minor) => {
                return Err(Error::Device(format!(
                    "cuda:{ordinal} has compute capability {major}.{minor}; sluice needs 8.0 or \
                     newer; use `--device cpu`"
                )))
            }
        };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let stream = ctx.default_stream();
        Ok(CudaBackend {
            ordinal,
            name,
            compute_capability,
            arch,
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn arch(&self) -> PtxArch {
        self.arch
    }
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// The number of streaming multiprocessors (the size of a persistent grid).
    pub fn sm_count(&self) -> Result<usize> {
        let n = self.ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        Ok(n.max(1) as usize)
    }

    fn module(&self, family: &'static KernelFamily) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().map_err(|_| poisoned())?;
        if let Some(m) = modules.get(family.family) {
            return Ok(m.clone());
        }
        let (ptx, arch_name) = match self.arch {
            PtxArch::Sm90a => (family.ptx_sm90a, "compute_90a"),
            PtxArch::Sm80 => (family.ptx_sm80, "compute_80"),
        };
        let ptx = ptx.ok_or_else(|| {
            Error::Device(format!(
                "no {arch_name} PTX embedded for kernel family `{}`; run scripts/build-ptx and rebuild",
                family.family
            ))
        })?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| {
                Error::Cuda(format!(
                    "loading {arch_name} PTX of `{}` failed: {e}",
                    family.family
                ))
            })?;
        modules.insert(family.family, module.clone());
        Ok(module)
    }

    /// The function of a kernel, by name, loading its family's module on first use.
    pub fn function(&self, kernel: &str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().map_err(|_| poisoned())?.get(kernel) {
            return Ok(f.clone());
        }
        let family = family_of(kernel).ok_or_else(|| Error::Launch {
            kernel: kernel.to_string(),
            device: format!("cuda:{}", self.ordinal),
            message: "no such kernel in kernels/cuda".to_string(),
        })?;
        let function = self.module(family)?.load_function(kernel)?;
        self.functions
            .lock()
            .map_err(|_| poisoned())?
            .insert(kernel.to_string(), function.clone());
        Ok(function)
    }
}

fn poisoned() -> Error {
    Error::Device("a CUDA module cache lock was poisoned by an earlier panic".to_string())
}

/// The NVIDIA driver's version through NVML (e.g. `580.65.06`); an error where there is no
/// driver. Part of the numerics class of `sluice determinism` on `cuda`.
pub fn driver_version() -> std::result::Result<String, String> {
    if !driver_present() {
        return Err("no NVIDIA driver on this machine".to_string());
    }
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))?;
    nvml.sys_driver_version().map_err(|e| e.to_string())
}

/// GPU telemetry through NVML; an error (not a failure) where there is no driver.
pub fn nvml_summary() -> std::result::Result<String, String> {
    if !driver_present() {
        return Err("NVML unavailable: no NVIDIA driver on this machine".to_string());
    }
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))?;
    let count = nvml.device_count().map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for i in 0..count {
        let d = nvml.device_by_index(i).map_err(|e| e.to_string())?;
        let name = d.name().unwrap_or_default();
        let temp = d
            .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
            .map(|t| format!("{t} C"))
            .unwrap_or_else(|_| "?".into());
        let power = d
            .power_usage()
            .map(|p| format!("{:.0} W", p as f64 / 1000.0))
            .unwrap_or_else(|_| "?".into());
        let clock = d
            .clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM)
            .map(|c| format!("{c} MHz"))
            .unwrap_or_else(|_| "?".into());
        out.push(format!(
            "gpu {i}: {name}, {temp}, {power}, SM clock {clock}"
        ));
    }
    Ok(out.join("\n"))
}
