//! One launch path for `emu` and `cuda`: the same grid/block computation and the same argument
//! marshalling (the cuLaunchKernel convention: an array of pointers, one per argument value), so
//! a launch bug shows up under the emulator on a machine without a GPU.

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::tensor_map::TensorMap;
use std::ffi::c_void;

/// One kernel argument, by value, exactly as the kernel's C signature takes it.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg {
    /// A pointer parameter (`T*`): the tensor's address on the launch's device.
    Pointer(u64),
    I32(i32),
    U32(u32),
    F32(f32),
    I64(i64),
    U64(u64),
    /// A `const __grid_constant__ CUtensorMap` parameter: index into the launch's maps.
    TensorMap(usize),
}

impl KernelArg {
    /// The argument's bytes in an 8-byte slot (little-endian, so a 4-byte argument sits at the
    /// slot's start, where the callee reads it).
    fn slot(self) -> u64 {
        match self {
            KernelArg::Pointer(p) | KernelArg::U64(p) => p,
            KernelArg::I64(v) => v as u64,
            KernelArg::I32(v) => v as u32 as u64,
            KernelArg::U32(v) => v as u64,
            KernelArg::F32(v) => v.to_bits() as u64,
            // Passed by address (Backend::launch), not through a slot.
            KernelArg::TensorMap(_) => 0,
        }
    }
}

/// A kernel launch: name, grid, block, dynamic shared memory and arguments.
#[derive(Debug)]
pub struct Launch<'t> {
    pub kernel: &'static str,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    args: Vec<KernelArg>,
    tensors: Vec<&'t Tensor>,
    maps: Vec<&'t TensorMap<'t>>,
}

impl<'t> Launch<'t> {
    pub fn new(kernel: &'static str, grid: [u32; 3], block: [u32; 3]) -> Self {
        Launch {
            kernel,
            grid,
            block,
            shared_bytes: 0,
            args: Vec::new(),
            tensors: Vec::new(),
            maps: Vec::new(),
        }
    }

    pub fn shared_bytes(mut self, bytes: u32) -> Self {
        self.shared_bytes = bytes;
        self
    }

    /// A tensor argument. The kernel may write through it: outputs are passed the same way
    /// (kernels own their outputs during the launch; the borrow keeps the storage alive).
    pub fn arg_tensor(mut self, t: &'t Tensor) -> Self {
        self.tensors.push(t);
        // Placeholder address, resolved against the backend in `marshal`.
        self.args
            .push(KernelArg::Pointer(self.tensors.len() as u64 - 1));
        self
    }
    pub fn arg_i32(mut self, v: i32) -> Self {
        self.args.push(KernelArg::I32(v));
        self
    }
    pub fn arg_u32(mut self, v: u32) -> Self {
        self.args.push(KernelArg::U32(v));
        self
    }
    pub fn arg_f32(mut self, v: f32) -> Self {
        self.args.push(KernelArg::F32(v));
        self
    }
    pub fn arg_i64(mut self, v: i64) -> Self {
        self.args.push(KernelArg::I64(v));
        self
    }
    pub fn arg_u64(mut self, v: u64) -> Self {
        self.args.push(KernelArg::U64(v));
        self
    }
    /// A tensor-map argument (a `const __grid_constant__ CUtensorMap` parameter): the kernel
    /// receives the map's 128 bytes; the map borrows its tensor for the launch.
    pub fn arg_tensor_map(mut self, map: &'t TensorMap<'t>) -> Self {
        self.maps.push(map);
        self.args.push(KernelArg::TensorMap(self.maps.len() - 1));
        self
    }

    /// Checks the configuration against CUDA's limits, so both devices reject the same launches.
    fn validate(&self, device: &str) -> Result<()> {
        let fail = |message: String| Error::Launch {
            kernel: self.kernel.to_string(),
            device: device.to_string(),
            message,
        };
        let threads: u64 = self.block.iter().map(|&b| b as u64).product();
        if self.grid.contains(&0) || self.block.contains(&0) {
            return Err(fail(format!(
                "empty launch: grid {:?}, block {:?}",
                self.grid, self.block
            )));
        }
        if threads > 1024 || self.block[2] > 64 {
            return Err(fail(format!(
                "block {:?} exceeds CUDA's limits (1024 threads, z <= 64)",
                self.block
            )));
        }
        if self.grid[1] > 65535 || self.grid[2] > 65535 {
            return Err(fail(format!(
                "grid {:?} exceeds CUDA's limits (y, z <= 65535)",
                self.grid
            )));
        }
        Ok(())
    }

    /// The argument values with tensor addresses resolved for the device they live on.
    fn resolve(&self, backend: &Backend) -> Result<Vec<u64>> {
        let device = backend.device();
        self.args
            .iter()
            .map(|a| match *a {
                KernelArg::Pointer(i) => {
                    let t = self.tensors[i as usize];
                    if !t.is_on(device) {
                        return Err(Error::Launch {
                            kernel: self.kernel.to_string(),
                            device: device.to_string(),
                            message: format!(
                                "argument tensor {t:?} lives on {}, not on the launch's device",
                                t.device_kind()
                            ),
                        });
                    }
                    t.kernel_address()
                }
                other => Ok(other.slot()),
            })
            .collect()
    }
}

impl Backend {
    /// Launches a kernel of kernels/cuda on this device (cuda or emu).
    pub fn launch(&self, launch: &Launch<'_>) -> Result<()> {
        let device = self.device().to_string();
        launch.validate(&device)?;
        crate::counters::launch();
        let mut slots = launch.resolve(self)?;
        // The cuLaunchKernel convention: params[i] points at the i-th argument's value.
        // A tensor map is passed as the address of its 128 bytes.
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .zip(&launch.args)
            .map(|(s, a)| match a {
                KernelArg::TensorMap(i) => launch.maps[*i].as_param().cast_mut(),
                _ => s as *mut u64 as *mut c_void,
            })
            .collect();
        match self {
            Backend::Cpu => Err(Error::Launch {
                kernel: launch.kernel.to_string(),
                device,
                message: "the cpu device runs the Rust references, not kernels".into(),
            }),
            Backend::Emu(emu) => crate::emu::emu_launch(
                launch.kernel,
                launch.grid,
                launch.block,
                launch.shared_bytes as usize,
                &mut params,
                emu.seed,
            )
            .map_err(|message| Error::Launch {
                kernel: launch.kernel.to_string(),
                device,
                message,
            }),
            Backend::Cuda(cuda) => {
                // On an Nsight timeline, each launch under its kernel's name (a no-op without a tool).
                let _range = crate::nvtx::range(launch.kernel);
                let function = cuda.function(launch.kernel)?;
                if launch.shared_bytes > 48 * 1024 {
                    function
                        .set_attribute(
                            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            launch.shared_bytes as i32,
                        )
                        .map_err(|e| Error::Launch {
                            kernel: launch.kernel.to_string(),
                            device: device.clone(),
                            message: format!("cannot allow {} bytes of shared memory: {e}", launch.shared_bytes),
                        })?;
                }
                let g = launch.grid;
                let b = launch.block;
                // SAFETY: params holds one pointer per kernel parameter, each to an 8-byte slot
                // holding the value with the size the kernel's signature declares, or to a
                // tensor map's 128 bytes (the op module that builds the Launch is written
                // against that signature); the slots, the maps
                // and the tensors outlive the call, and the launch is ordered on the stream that
                // every tensor of this backend was allocated and copied on.
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        function.cu_function(),
                        (g[0], g[1], g[2]),
                        (b[0], b[1], b[2]),
                        launch.shared_bytes,
                        cuda.stream().cu_stream(),
                        &mut params,
                    )
                }
                .map_err(|e| Error::Launch {
                    kernel: launch.kernel.to_string(),
                    device,
                    message: e.to_string(),
                })
            }
        }
    }
}

/// The grid that covers `n` items with `per_block` items per block.
pub fn blocks_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}
