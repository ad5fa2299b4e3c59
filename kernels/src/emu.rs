// TEMPORARY stand-in written by the lead so the skeleton compiles; the emu helper replaces this
// whole file. The rest of the crate uses exactly this API:
//   EmuBuffer::alloc(bytes) -> Result<EmuBuffer, String>
//   EmuBuffer::as_ptr(&self) -> *const u8, as_bytes(&self) -> &[u8], as_bytes_mut(&mut self) -> &mut [u8]
//   emu_launch(kernel, grid, block, shared_bytes, params: &mut [*mut c_void], seed) -> Result<(), String>
//   emu_kernel_names() -> Vec<String>
use std::ffi::c_void;

pub struct EmuBuffer {
    data: Vec<u8>,
}

impl EmuBuffer {
    pub fn alloc(bytes: usize) -> Result<EmuBuffer, String> {
        Ok(EmuBuffer {
            data: vec![0; bytes],
        })
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }
}

pub fn emu_launch(
    kernel: &str,
    _grid: [u32; 3],
    _block: [u32; 3],
    _shared_bytes: usize,
    _params: &mut [*mut c_void],
    _seed: u64,
) -> Result<(), String> {
    Err(format!("emulator not built yet (kernel {kernel})"))
}

pub fn emu_kernel_names() -> Vec<String> {
    Vec::new()
}
