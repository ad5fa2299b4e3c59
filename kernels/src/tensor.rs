//! Tensors: a shape, a dtype and storage on one device.
//!
//! Storage is host memory on `cpu`, guarded host memory from the emulator's allocator on `emu`
//! (so launches can be bounds-checked), and device memory on `cuda`.

use crate::device::{Backend, Device};
use crate::dtype::{DType, Element};
use crate::emu::EmuBuffer;
use crate::error::{Error, Result};
use crate::ops::gemm_small::PackedB;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use std::sync::{Arc, OnceLock};

mod pool;
pub use pool::{cached as pool_cached, release as pool_release, PoolScope, RecycleScope};

/// Host bytes, viewable as the tensor's element type: 8-byte aligned words (any dtype), or an
/// f32 vector adopted without a copy by [`Tensor::from_f32_vec`] (F32 tensors only, so every
/// typed view of it is an `f32` view, 4-byte aligned).
enum HostBuffer {
    Words { words: Vec<u64>, bytes: usize },
    F32(Vec<f32>),
}

impl HostBuffer {
    fn filled(bytes: usize, byte: u8) -> Self {
        let n = bytes.div_ceil(8);
        let words = if byte == 0 {
            // Zeroed allocation: fresh pages come zeroed from the OS, so nothing is written.
            vec![0u64; n]
        } else {
            let word = u64::from_ne_bytes([byte; 8]);
            let mut words: Vec<u64> = Vec::with_capacity(n);
            par_chunks(&mut words.spare_capacity_mut()[..n], |_, d| {
                d.iter_mut().for_each(|w| {
                    w.write(word);
                })
            });
            // SAFETY: every one of the first n words was written just above.
            unsafe { words.set_len(n) };
            words
        };
        HostBuffer::Words { words, bytes }
    }
    /// A buffer holding a copy of `bytes` (one copy into fresh memory, no fill pass first).
    fn from_bytes(bytes: &[u8]) -> Self {
        let n = bytes.len().div_ceil(8);
        let mut words: Vec<u64> = Vec::with_capacity(n);
        par_chunks(&mut words.spare_capacity_mut()[..n], |start, d| {
            let src =
                &bytes[(start * 8).min(bytes.len())..((start + d.len()) * 8).min(bytes.len())];
            // SAFETY: `d` is d.len() * 8 writable bytes, at least src.len() (only the last
            // chunk is shorter, by less than 8 bytes, which are zeroed); a fresh allocation, so
            // no overlap; byte writes need no alignment.
            unsafe {
                let p = d.as_mut_ptr() as *mut u8;
                std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len());
                std::ptr::write_bytes(p.add(src.len()), 0, d.len() * 8 - src.len());
            }
        });
        // SAFETY: every byte of the first n words was written just above.
        unsafe { words.set_len(n) };
        HostBuffer::Words {
            words,
            bytes: bytes.len(),
        }
    }
    fn as_bytes(&self) -> &[u8] {
        match self {
            HostBuffer::Words { words, bytes } => &bytemuck::cast_slice(words)[..*bytes],
            HostBuffer::F32(v) => bytemuck::cast_slice(v),
        }
    }
    fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuffer::Words { words, bytes } => &mut bytemuck::cast_slice_mut(words)[..*bytes],
            HostBuffer::F32(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

/// Host copies and fills of at least this many bytes are split over rayon's threads: the model's
/// CPU step copies tensors in and out of the ops, and a lone memcpy would leave the other cores
/// idle.
const PAR_BYTES: usize = 1 << 20;

/// Calls `f(first index, chunk)` on chunks of `data` of about 256 KiB, in parallel when `data`
/// is at least [`PAR_BYTES`] long, else on the whole slice at once.
fn par_chunks<T: Send>(data: &mut [T], f: impl Fn(usize, &mut [T]) + Sync + Send) {
    use rayon::prelude::*;
    let size = std::mem::size_of::<T>().max(1);
    if data.len() * size < PAR_BYTES {
        f(0, data);
        return;
    }
    let chunk = (PAR_BYTES / 4 / size).max(1);
    data.par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(i, c)| f(i * chunk, c));
}

/// `src` copied into a fresh vector (in parallel when large; no fill pass first).
fn par_to_vec<T: Element>(src: &[T]) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(src.len());
    par_chunks(&mut v.spare_capacity_mut()[..src.len()], |start, d| {
        let n = d.len();
        for (o, &x) in d.iter_mut().zip(&src[start..start + n]) {
            o.write(x);
        }
    });
    // SAFETY: every one of the first src.len() elements was written just above.
    unsafe { v.set_len(src.len()) };
    v
}

/// `dst.copy_from_slice(src)`, in parallel when large.
fn par_copy(dst: &mut [u8], src: &[u8]) {
    par_chunks(dst, |start, d| {
        let n = d.len();
        d.copy_from_slice(&src[start..start + n]);
    });
}

enum Storage {
    Host(HostBuffer),
    Emu(EmuBuffer),
    Cuda(CudaSlice<u8>, Arc<CudaStream>),
}

/// A dense row-major tensor on one device.
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: Storage,
    /// The CPU GEMM's packed copy of this tensor as a right-hand operand, built on first use by
    /// [`Tensor::packed_rhs`] and dropped by every method that changes the contents or the
    /// shape (only host F32 tensors ever get one).
    packed: OnceLock<Arc<PackedB>>,
}

/// The byte pattern that poisons fresh outputs: all-ones is NaN in f32 and bf16 and -1 in i32,
/// so a kernel that fails to write an output is caught by any comparison.
pub const POISON_BYTE: u8 = 0xff;

/// `v`, counted as one fresh storage allocation.
fn counted<T>(v: T) -> T {
    crate::counters::storage_alloc();
    v
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// How fresh storage is initialised.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fill {
    Byte(u8),
    /// Not at all: whatever the allocator (or the cache) hands out.
    Uninit,
}

impl Tensor {
    /// An op's output: every byte [`POISON_BYTE`] while the debug switch is on
    /// ([`crate::debug`]: in every test), so an element the op fails to write is caught;
    /// uninitialised (no memset) when it is off. Read only what has been written.
    pub fn poisoned(backend: &Backend, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let fill = if crate::debug::enabled() {
            Fill::Byte(POISON_BYTE)
        } else {
            Fill::Uninit
        };
        Self::filled(backend, shape, dtype, fill)
    }

    /// A tensor whose every byte is [`POISON_BYTE`], whatever the debug switch says.
    pub fn poison_filled(backend: &Backend, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::filled(backend, shape, dtype, Fill::Byte(POISON_BYTE))
    }

    /// A tensor of zeros.
    pub fn zeros(backend: &Backend, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::filled(backend, shape, dtype, Fill::Byte(0))
    }

    fn filled(backend: &Backend, shape: &[usize], dtype: DType, fill: Fill) -> Result<Tensor> {
        let bytes = numel(shape) * dtype.size_bytes();
        let kind = match backend {
            Backend::Cpu => pool::Kind::Host,
            Backend::Emu(_) => pool::Kind::Emu,
            Backend::Cuda(c) => pool::Kind::Cuda(Arc::as_ptr(c.stream()) as usize),
        };
        if let Some(storage) = pool::take(kind, bytes) {
            let mut t = Tensor {
                shape: shape.to_vec(),
                dtype,
                storage,
                packed: OnceLock::new(),
            };
            // A recycled buffer is filled like a fresh one: poisoned in debug, zeros re-zeroed.
            if let Fill::Byte(b) = fill {
                t.fill_byte(b)?;
            }
            return Ok(t);
        }
        crate::counters::storage_alloc();
        let storage = match backend {
            Backend::Cpu => Storage::Host(HostBuffer::filled(
                bytes,
                match fill {
                    Fill::Byte(b) => b,
                    // Zeroed pages from the OS cost no pass over the memory.
                    Fill::Uninit => 0,
                },
            )),
            Backend::Emu(_) => {
                let mut buf = EmuBuffer::alloc(bytes).map_err(Error::Device)?;
                // Profile mode (emu::profile::LazyAlloc): fresh memory stays untouched zero
                // pages, so the doc shapes' outputs cost no memory until a sampled block writes.
                if let (Fill::Byte(b), false) = (fill, crate::emu::profile::lazy_alloc()) {
                    buf.as_bytes_mut().fill(b);
                }
                Storage::Emu(buf)
            }
            Backend::Cuda(c) => {
                let stream = c.stream().clone();
                let mut storage =
                    Storage::Cuda(cuda_alloc(&stream, pool::bucket(kind, bytes))?, stream);
                if let Fill::Byte(b) = fill {
                    memset_cuda(&mut storage, b)?;
                }
                storage
            }
        };
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype,
            storage,
            packed: OnceLock::new(),
        })
    }

    /// Sets every byte to `byte` (on cuda a device memset ordered on the tensor's stream).
    /// `sluice bench` flushes the L2 cache with it; the pool re-zeroes recycled buffers.
    pub fn fill_byte(&mut self, byte: u8) -> Result<()> {
        self.packed = OnceLock::new();
        match &mut self.storage {
            Storage::Host(h) => h.as_bytes_mut().fill(byte),
            Storage::Emu(e) => e.as_bytes_mut().fill(byte),
            s @ Storage::Cuda(..) => memset_cuda(s, byte)?,
        }
        Ok(())
    }

    /// Uploads raw little-endian bytes as a tensor of `dtype`.
    pub fn from_bytes(
        backend: &Backend,
        shape: &[usize],
        dtype: DType,
        bytes: &[u8],
    ) -> Result<Tensor> {
        let expected = numel(shape) * dtype.size_bytes();
        if bytes.len() != expected {
            return Err(Error::Invalid(format!(
                "{} bytes given for a {dtype} tensor of shape {shape:?}, which needs {expected}",
                bytes.len()
            )));
        }
        if let Backend::Cpu = backend {
            // One copy into fresh host memory (the poison fill would be overwritten at once).
            crate::counters::storage_alloc();
            return Ok(Tensor {
                shape: shape.to_vec(),
                dtype,
                storage: Storage::Host(HostBuffer::from_bytes(bytes)),
                packed: OnceLock::new(),
            });
        }
        // Every byte is written at once: nothing to poison.
        let mut t = Self::filled(backend, shape, dtype, Fill::Uninit)?;
        t.write_bytes(bytes)?;
        Ok(t)
    }

    /// Uploads a slice as a tensor of shape `shape`.
    pub fn from_slice<T: Element>(
        backend: &Backend,
        shape: &[usize],
        data: &[T],
    ) -> Result<Tensor> {
        if data.len() != numel(shape) {
            return Err(Error::Invalid(format!(
                "{} elements given for a tensor of shape {shape:?} ({} elements)",
                data.len(),
                numel(shape)
            )));
        }
        Self::from_bytes(backend, shape, T::DTYPE, bytemuck::cast_slice(data))
    }

    /// An F32 tensor holding `data`: on `cpu` the vector is adopted as the tensor's storage
    /// (no copy), elsewhere it is uploaded. What an op's CPU path returns its result through.
    pub fn from_f32_vec(backend: &Backend, shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
        if data.len() != numel(shape) {
            return Err(Error::Invalid(format!(
                "{} elements given for a tensor of shape {shape:?} ({} elements)",
                data.len(),
                numel(shape)
            )));
        }
        match backend {
            // The CPU reference allocated `data`: counted as this tensor's allocation.
            Backend::Cpu => Ok(Tensor {
                shape: shape.to_vec(),
                dtype: DType::F32,
                storage: Storage::Host(HostBuffer::F32(counted(data))),
                packed: OnceLock::new(),
            }),
            _ => Self::from_slice(backend, shape, &data),
        }
    }

    /// The elements as f32 without a copy when they are F32 in host memory (cpu, emu), else a
    /// downloaded (BF16: widened) copy. What an op's CPU path reads its inputs through.
    #[track_caller]
    pub fn f32_data(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        match self.host_slice::<f32>() {
            Ok(s) => {
                // Emu memory is device memory: a download, counted as on cuda.
                if let Storage::Emu(_) = self.storage {
                    crate::counters::download(std::panic::Location::caller());
                }
                Ok(std::borrow::Cow::Borrowed(s))
            }
            Err(_) => Ok(std::borrow::Cow::Owned(self.to_f32_vec()?)),
        }
    }

    /// Uploads f32 values as `dtype` (F32 or BF16, rounding to nearest even).
    pub fn from_f32_as(
        backend: &Backend,
        shape: &[usize],
        dtype: DType,
        data: &[f32],
    ) -> Result<Tensor> {
        match dtype {
            DType::F32 => Self::from_slice(backend, shape, data),
            DType::BF16 => {
                let v: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
                Self::from_slice(backend, shape, &v)
            }
            other => Err(Error::Invalid(format!(
                "cannot make a {other} tensor from f32 values"
            ))),
        }
    }

    fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.packed = OnceLock::new();
        match &mut self.storage {
            Storage::Host(h) => h.as_bytes_mut().copy_from_slice(bytes),
            Storage::Emu(e) => e.as_bytes_mut().copy_from_slice(bytes),
            Storage::Cuda(slice, stream) => {
                if !bytes.is_empty() {
                    let mut view = slice.slice_mut(0..bytes.len());
                    stream.memcpy_htod(bytes, &mut view)?;
                }
            }
        }
        Ok(())
    }

    /// Downloads the raw bytes.
    #[track_caller]
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        match &self.storage {
            Storage::Host(h) => Ok(h.as_bytes().to_vec()),
            Storage::Emu(e) => {
                crate::counters::download(std::panic::Location::caller());
                Ok(e.as_bytes().to_vec())
            }
            Storage::Cuda(slice, stream) => {
                crate::counters::download(std::panic::Location::caller());
                let mut all = stream.clone_dtoh(slice)?;
                all.truncate(self.len_bytes());
                Ok(all)
            }
        }
    }

    /// Downloads several tensors with one wait of the host: on cuda they are gathered into one
    /// staging buffer by device copies, then copied down once (one host sync counted, however
    /// many tensors); on emu and cpu a host copy each (one sync counted on emu). How a step
    /// brings back its small results (sampled tokens and log-probs, the loss and its
    /// counters) in one round trip. The tensors must all live on one device.
    #[track_caller]
    pub fn download_many(tensors: &[&Tensor]) -> Result<Vec<Vec<u8>>> {
        let caller = std::panic::Location::caller();
        let Some(first) = tensors.first() else {
            return Ok(Vec::new());
        };
        match &first.storage {
            Storage::Host(_) | Storage::Emu(_) => {
                let mut out = Vec::with_capacity(tensors.len());
                let mut device = false;
                for t in tensors {
                    out.push(match &t.storage {
                        Storage::Host(h) => h.as_bytes().to_vec(),
                        Storage::Emu(e) => {
                            device = true;
                            e.as_bytes().to_vec()
                        }
                        Storage::Cuda(..) => return Err(mixed_download()),
                    });
                }
                if device {
                    crate::counters::download(caller);
                }
                Ok(out)
            }
            Storage::Cuda(_, stream) => {
                let total: usize = tensors.iter().map(|t| t.len_bytes()).sum();
                let mut staging = cuda_alloc(stream, total)?;
                let mut at = 0;
                for t in tensors {
                    let Storage::Cuda(src, _) = &t.storage else {
                        return Err(mixed_download());
                    };
                    let n = t.len_bytes();
                    if n > 0 {
                        stream.memcpy_dtod(&src.slice(0..n), &mut staging.slice_mut(at..at + n))?;
                    }
                    at += n;
                }
                crate::counters::download(caller);
                let all = stream.clone_dtoh(&staging)?;
                let mut out = Vec::with_capacity(tensors.len());
                let mut at = 0;
                for t in tensors {
                    out.push(all[at..at + t.len_bytes()].to_vec());
                    at += t.len_bytes();
                }
                Ok(out)
            }
        }
    }

    /// Downloads the elements; the dtype must match `T`.
    #[track_caller]
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.expect_dtype("tensor", T::DTYPE)?;
        if let Ok(host) = self.host_slice::<T>() {
            // Emu memory is device memory: a download, counted as on cuda.
            if let Storage::Emu(_) = self.storage {
                crate::counters::download(std::panic::Location::caller());
            }
            return Ok(par_to_vec(host));
        }
        let bytes = self.to_bytes()?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Downloads a float tensor as f32 (BF16 widened exactly).
    #[track_caller]
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        match self.dtype {
            DType::F32 => self.to_vec::<f32>(),
            DType::BF16 => Ok(self.to_vec::<bf16>()?.iter().map(|x| x.to_f32()).collect()),
            other => Err(Error::DType {
                tensor: "tensor".into(),
                expected: "F32 or BF16".into(),
                got: other.to_string(),
            }),
        }
    }

    /// A copy of this tensor on another backend (or converted to another float dtype).
    #[track_caller]
    pub fn to_backend(&self, backend: &Backend) -> Result<Tensor> {
        Tensor::from_bytes(backend, &self.shape, self.dtype, &self.to_bytes()?)
    }

    /// A copy converted between F32 and BF16 (round to nearest even), on the same backend.
    #[track_caller]
    pub fn cast(&self, backend: &Backend, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return self.to_backend(backend);
        }
        Tensor::from_f32_as(backend, &self.shape, dtype, &self.to_f32_vec()?)
    }

    /// A new tensor of `shape` holding elements `elem_offset .. elem_offset + numel(shape)` of
    /// this one (row-major, flattened), same dtype, on the same device: a slice copy in host
    /// memory on cpu and emu, a device-to-device copy on the tensor's stream on cuda. `backend`
    /// must be the device the tensor lives on. This is how a named view of a parameter arena
    /// becomes a tensor an op can take.
    pub fn copy_range(
        &self,
        backend: &Backend,
        elem_offset: usize,
        shape: &[usize],
    ) -> Result<Tensor> {
        self.expect_on(backend, "copy_range: the source tensor")?;
        let range = self.byte_range("copy_range", elem_offset, numel(shape))?;
        let n = range.len();
        let storage = match &self.storage {
            Storage::Host(h) => match pool::take(pool::Kind::Host, n) {
                Some(Storage::Host(mut dst)) => {
                    par_copy(dst.as_bytes_mut(), &h.as_bytes()[range]);
                    Storage::Host(dst)
                }
                _ => Storage::Host(counted(HostBuffer::from_bytes(&h.as_bytes()[range]))),
            },
            Storage::Emu(e) => {
                let mut buf = match pool::take(pool::Kind::Emu, n) {
                    Some(Storage::Emu(b)) => b,
                    _ => counted(EmuBuffer::alloc(n).map_err(Error::Device)?),
                };
                buf.as_bytes_mut().copy_from_slice(&e.as_bytes()[range]);
                Storage::Emu(buf)
            }
            Storage::Cuda(slice, stream) => {
                let kind = pool::Kind::Cuda(Arc::as_ptr(stream) as usize);
                let mut dst = match pool::take(kind, n) {
                    Some(Storage::Cuda(d, _)) => d,
                    // Every byte the tensor exposes (n of them) is written by the copy below.
                    _ => counted(cuda_alloc(stream, pool::bucket(kind, n))?),
                };
                if n > 0 {
                    stream.memcpy_dtod(&slice.slice(range), &mut dst.slice_mut(0..n))?;
                }
                Storage::Cuda(dst, stream.clone())
            }
        };
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype: self.dtype,
            storage,
            packed: OnceLock::new(),
        })
    }

    /// Overwrites elements `elem_offset .. elem_offset + src.numel()` of this tensor
    /// (row-major, flattened) with the elements of `src`, which must have the same dtype and
    /// live on the same device (a host copy on cpu and emu, a device-to-device copy on this
    /// tensor's stream on cuda). The inverse of [`Tensor::copy_range`]: how a gradient tensor is
    /// written into its view of the gradient arena.
    pub fn write_range(&mut self, elem_offset: usize, src: &Tensor) -> Result<()> {
        if src.dtype != self.dtype {
            return Err(Error::DType {
                tensor: "src".into(),
                expected: format!("{} (the dtype of the destination)", self.dtype),
                got: src.dtype.to_string(),
            });
        }
        let range = self.byte_range("write_range", elem_offset, src.numel())?;
        self.packed = OnceLock::new();
        match (&mut self.storage, &src.storage) {
            (Storage::Host(d), Storage::Host(s)) => {
                par_copy(&mut d.as_bytes_mut()[range], s.as_bytes())
            }
            (Storage::Emu(d), Storage::Emu(s)) => {
                par_copy(&mut d.as_bytes_mut()[range], s.as_bytes())
            }
            (Storage::Cuda(d, stream), Storage::Cuda(s, _)) => {
                if !range.is_empty() {
                    let n = range.len();
                    stream.memcpy_dtod(&s.slice(0..n), &mut d.slice_mut(range))?;
                }
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "write_range: `src` lives on {}, the destination on {}; copy it with \
                     to_backend first",
                    src.device_kind(),
                    self.device_kind()
                )))
            }
        }
        Ok(())
    }

    /// Fails unless the tensor's storage is on `backend`'s device (naming `what`).
    fn expect_on(&self, backend: &Backend, what: &str) -> Result<()> {
        let same = matches!(
            (&self.storage, backend),
            (Storage::Host(_), Backend::Cpu)
                | (Storage::Emu(_), Backend::Emu(_))
                | (Storage::Cuda(..), Backend::Cuda(_))
        );
        if !same {
            return Err(Error::Invalid(format!(
                "{what} lives on {}, not on {}",
                self.device_kind(),
                backend.device()
            )));
        }
        Ok(())
    }

    /// The byte range of elements `offset .. offset + count`, or an error naming `op`, the
    /// range and the tensor's size.
    fn byte_range(&self, op: &str, offset: usize, count: usize) -> Result<std::ops::Range<usize>> {
        let end = offset.checked_add(count);
        match end {
            Some(end) if end <= self.numel() => {
                let size = self.dtype.size_bytes();
                Ok(offset * size..end * size)
            }
            _ => Err(Error::Invalid(format!(
                "{op}: elements {offset}..{offset}+{count} are out of bounds of a tensor of \
                 shape {:?} ({} elements)",
                self.shape,
                self.numel()
            ))),
        }
    }

    /// This host F32 or BF16 tensor, viewed as `groups` stacked `[n, k]` matrices, packed as
    /// the right-hand operand of the CPU small-row GEMM ([`crate::ops::gemm_small`]; BF16
    /// values widened to f32 exactly). Packed on the first call and kept with the tensor
    /// (weights are multiplied many times); any change to the contents or shape drops it. A
    /// request with other dimensions than the kept copy's is packed afresh and not kept. `None`
    /// off the host or for other dtypes.
    pub fn packed_rhs(&self, groups: usize, n: usize, k: usize) -> Option<Arc<PackedB>> {
        let Storage::Host(h) = &self.storage else {
            return None;
        };
        if groups * n * k != self.numel() {
            return None;
        }
        let pack = || -> PackedB {
            match self.dtype {
                DType::BF16 => {
                    let v: &[half::bf16] = bytemuck::cast_slice(h.as_bytes());
                    let wide: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                    PackedB::new(&wide, groups, n, k)
                }
                _ => PackedB::new(bytemuck::cast_slice(h.as_bytes()), groups, n, k),
            }
        };
        if !matches!(self.dtype, DType::F32 | DType::BF16) {
            return None;
        }
        let kept = self.packed.get_or_init(|| Arc::new(pack()));
        if (kept.groups, kept.n, kept.k) == (groups, n, k) {
            Some(kept.clone())
        } else {
            Some(Arc::new(pack()))
        }
    }

    /// The elements in host memory (cpu and emu storage only).
    pub fn host_slice<T: Element>(&self) -> Result<&[T]> {
        self.expect_dtype("tensor", T::DTYPE)?;
        let bytes = match &self.storage {
            Storage::Host(h) => h.as_bytes(),
            Storage::Emu(e) => e.as_bytes(),
            Storage::Cuda(..) => return Err(not_host()),
        };
        Ok(bytemuck::cast_slice(bytes))
    }

    /// The elements in host memory, mutable (cpu and emu storage only).
    pub fn host_slice_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        self.expect_dtype("tensor", T::DTYPE)?;
        self.packed = OnceLock::new();
        let bytes = match &mut self.storage {
            Storage::Host(h) => h.as_bytes_mut(),
            Storage::Emu(e) => e.as_bytes_mut(),
            Storage::Cuda(..) => return Err(not_host()),
        };
        Ok(bytemuck::cast_slice_mut(bytes))
    }

    /// The address a kernel sees: a device pointer on cuda, the guarded host address on emu.
    pub(crate) fn kernel_address(&self) -> Result<u64> {
        match &self.storage {
            Storage::Host(_) => Err(Error::Invalid(
                "a cpu tensor was passed to a kernel launch; upload it to the launch's device"
                    .into(),
            )),
            Storage::Emu(e) => Ok(e.as_ptr() as u64),
            Storage::Cuda(slice, stream) => {
                let (ptr, _sync) = slice.device_ptr(stream);
                Ok(ptr)
            }
        }
    }

    /// The device this tensor's storage lives on.
    pub fn device_kind(&self) -> &'static str {
        match self.storage {
            Storage::Host(_) => "cpu",
            Storage::Emu(_) => "emu",
            Storage::Cuda(..) => "cuda",
        }
    }

    pub fn is_on(&self, device: Device) -> bool {
        matches!(
            (&self.storage, device),
            (Storage::Host(_), Device::Cpu)
                | (Storage::Emu(_), Device::Emu)
                | (Storage::Cuda(..), Device::Cuda(_))
        )
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    pub fn len_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// The same storage viewed with another shape of the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            return Err(Error::Invalid(format!(
                "cannot reshape {:?} to {shape:?}: element counts differ",
                self.shape
            )));
        }
        self.shape = shape.to_vec();
        self.packed = OnceLock::new();
        Ok(self)
    }

    /// Checks the dtype, naming the tensor in the error.
    pub fn expect_dtype(&self, name: &str, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(Error::DType {
                tensor: name.to_string(),
                expected: dtype.to_string(),
                got: self.dtype.to_string(),
            });
        }
        Ok(())
    }

    /// Checks the rank, naming the tensor and the expected shape (like `[M,K]`) in the error.
    pub fn expect_rank(&self, name: &str, rank: usize, expected: &str) -> Result<()> {
        if self.shape.len() != rank {
            return Err(Error::shape(name, expected, &self.shape));
        }
        Ok(())
    }
}

fn mixed_download() -> Error {
    Error::Invalid("download_many: the tensors live on different devices".into())
}

fn not_host() -> Error {
    Error::Invalid("tensor lives in CUDA memory; download it with to_vec".into())
}

/// `bytes` (a cache bucket size, at least 1) of uninitialised device memory on `stream`; when
/// the device is out of memory, this thread's cache is freed and the allocation tried again.
fn cuda_alloc(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>> {
    // SAFETY: uninitialised device memory; every caller writes what its tensor exposes (a
    // memset, a copy, or the op that owns the output) on the same stream before reading it,
    // and the debug switch poisons op outputs to catch an op that does not.
    match unsafe { stream.alloc::<u8>(bytes.max(1)) } {
        Ok(s) => Ok(s),
        // SAFETY: as above.
        Err(_) if pool::release() > 0 => Ok(unsafe { stream.alloc::<u8>(bytes.max(1)) }?),
        Err(e) => Err(e.into()),
    }
}

/// A device memset of a whole CUDA allocation on its stream (a no-op for other storage).
fn memset_cuda(storage: &mut Storage, byte: u8) -> Result<()> {
    if let Storage::Cuda(slice, stream) = storage {
        let n = slice.len();
        let (ptr, _sync) = slice.device_ptr(stream);
        // SAFETY: `ptr` addresses the `n` bytes owned by `slice`, ordered on `stream`, which
        // every use of the tensor is ordered on too; a device memset, so no host upload.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, n, stream.cu_stream()) }?;
    }
    Ok(())
}

impl Drop for Tensor {
    /// Offers the storage to this thread's cache where a [`PoolScope`] is open on it (a buffer
    /// still in use by queued kernels is safe to hand out again: every use of it is ordered on
    /// the same stream).
    fn drop(&mut self) {
        if pool::active() {
            let storage = std::mem::replace(
                &mut self.storage,
                Storage::Host(HostBuffer::Words {
                    words: Vec::new(),
                    bytes: 0,
                }),
            );
            drop(pool::give(storage));
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {}, {})",
            self.shape,
            self.dtype,
            self.device_kind()
        )
    }
}

#[cfg(test)]
mod tests;
