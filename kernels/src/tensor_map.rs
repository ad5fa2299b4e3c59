//! Tensor maps: the descriptors a Hopper tensor copy (`cp.async.bulk.tensor`, the TMA engine)
//! reads its source through, passed to a kernel as a `const __grid_constant__ CUtensorMap`
//! parameter ([`crate::launch::Launch::arg_tensor_map`]).
//!
//! A map describes a tensor of rank 1 to 5 in global memory (sizes in elements, byte strides of
//! the outer dimensions), the box one copy moves, and the shared-memory swizzle the box lands in
//! (kernels/cuda/common/hopper.cuh). On cuda the driver encodes it (`cuTensorMapEncodeTiled`:
//! tile mode, no interleave, out-of-bounds elements filled with zeros, L2 promotion of 128
//! bytes); on emu sluice writes its own layout, which only the emulator reads
//! (kernels/emu/async.cpp, `tensor_copy_g2s`, documented there word by word).
//!
//! Both devices check the same rules first, so a map that one refuses the other refuses too,
//! with the same message: the driver's rules (sizes, 16-byte strides and address, boxes of at
//! most 256 elements whose rows are multiples of 16 bytes) and two of sluice's: a swizzled box's
//! row is exactly the swizzle span (the layout the emulator models and the wgmma operands use),
//! and the map stays inside the tensor's storage (a map past it would let the copy engine read
//! another allocation).

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::marker::PhantomData;

/// The shared-memory layout a tensor copy writes its box in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swizzle {
    /// Rows one after the other.
    None,
    /// 16-byte chunks XOR-permuted within 32-, 64- or 128-byte spans (the PTX ISA's swizzle
    /// modes): chunk c of a row lands at chunk c ^ ((address / 128) % (span / 16)).
    B32,
    B64,
    B128,
}

impl Swizzle {
    /// The span in bytes (0 for none).
    pub fn span(self) -> usize {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }
    /// The mode number shared by the driver's enum and the emulator (0, 1, 2, 3).
    fn code(self) -> u64 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 1,
            Swizzle::B64 => 2,
            Swizzle::B128 => 3,
        }
    }
}

/// The emulator's tag in word 0 of its maps ("SLUICETM"); see kernels/emu/async.cpp.
const EMU_MAGIC: u64 = 0x534c_5549_4345_544d;

/// An encoded tensor map over one tensor's storage; it borrows the tensor, which must outlive
/// every launch that reads through it.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub struct TensorMap<'t> {
    words: [u64; 16],
    _tensor: PhantomData<&'t Tensor>,
}

impl std::fmt::Debug for TensorMap<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TensorMap { .. }")
    }
}

/// What a tiled tensor map covers: the tensor's dimensions (innermost first, in elements), the
/// byte strides of dimensions 1.. (dimension 0 is contiguous), the box, and the swizzle.
#[derive(Clone, Debug)]
pub struct TiledMap<'a> {
    pub dims: &'a [u64],
    pub strides: &'a [u64],
    pub boxes: &'a [u32],
    pub swizzle: Swizzle,
}

impl<'t> TensorMap<'t> {
    /// Encodes a tiled map over `tensor` (bf16 or f32) for `backend`'s device. `name` names the
    /// tensor in errors.
    pub fn tiled(
        backend: &Backend,
        tensor: &'t Tensor,
        name: &str,
        map: &TiledMap<'_>,
    ) -> Result<TensorMap<'t>> {
        let bad = |why: String| Error::Invalid(format!("tensor map over `{name}`: {why}"));
        let elem = match tensor.dtype() {
            DType::BF16 | DType::F32 => tensor.dtype().size_bytes() as u64,
            other => {
                return Err(bad(format!(
                    "element type {} (tensor copies here move BF16 or F32)",
                    other.name()
                )))
            }
        };
        let rank = map.dims.len();
        if !(1..=5).contains(&rank) || map.boxes.len() != rank || map.strides.len() + 1 != rank {
            return Err(bad(format!(
                "rank {rank} with {} box sizes and {} strides (rank 1 to 5, one box size per \
                 dimension, one stride per dimension after the first)",
                map.boxes.len(),
                map.strides.len()
            )));
        }
        for (i, &d) in map.dims.iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return Err(bad(format!("dimension {i} has {d} elements (1 to 2^32)")));
            }
        }
        for (i, &s) in map.strides.iter().enumerate() {
            if s == 0 || !s.is_multiple_of(16) || s >= 1 << 40 {
                return Err(bad(format!(
                    "the stride of dimension {} is {s} bytes (a multiple of 16 below 2^40)",
                    i + 1
                )));
            }
        }
        for (i, &b) in map.boxes.iter().enumerate() {
            if b == 0 || b > 256 {
                return Err(bad(format!(
                    "the box has {b} elements in dimension {i} (1 to 256)"
                )));
            }
        }
        let row = map.boxes[0] as u64 * elem;
        if !row.is_multiple_of(16) {
            return Err(bad(format!("a box row of {row} bytes (a multiple of 16)")));
        }
        let span = map.swizzle.span() as u64;
        if span != 0 && row != span {
            return Err(bad(format!(
                "a box row of {row} bytes with the {span}-byte swizzle (sluice's swizzled boxes \
                 have rows of exactly the swizzle span)"
            )));
        }
        // The farthest byte the map can address must lie inside the storage.
        let storage = (tensor.numel() * tensor.dtype().size_bytes()) as u64;
        let last = (map.dims[0] - 1) * elem
            + map
                .strides
                .iter()
                .zip(&map.dims[1..])
                .map(|(s, d)| s * (d - 1))
                .sum::<u64>()
            + elem;
        if last > storage {
            return Err(bad(format!(
                "the map reaches byte {last} of a tensor of {storage} bytes"
            )));
        }
        if matches!(backend, Backend::Cpu) {
            return Err(bad(
                "the cpu device has no tensor copies (they are a cuda and emu feature)".into(),
            ));
        }
        let address = tensor.kernel_address()?;
        if !address.is_multiple_of(16) {
            return Err(bad(format!(
                "the tensor's address {address:#x} is not 16-byte aligned"
            )));
        }
        let words = match backend {
            Backend::Cpu => unreachable!("refused above"),
            Backend::Emu(_) => emu_words(address, elem, map),
            Backend::Cuda(_) => cuda_words(address, tensor.dtype(), map).map_err(bad)?,
        };
        Ok(TensorMap {
            words,
            _tensor: PhantomData,
        })
    }

    /// The address of the map's 128 bytes: what `params[i]` points at for a `CUtensorMap`
    /// parameter in a raw launch (the cuLaunchKernel convention).
    pub fn as_param(&self) -> *const std::ffi::c_void {
        self.words.as_ptr().cast()
    }
}

/// The emulator's layout (kernels/emu/async.cpp, `tensor_copy_g2s`).
fn emu_words(address: u64, elem: u64, map: &TiledMap<'_>) -> [u64; 16] {
    let mut w = [0u64; 16];
    w[0] = EMU_MAGIC;
    w[1] = address;
    w[2] = map.dims.len() as u64 | elem << 8 | map.swizzle.code() << 16;
    for (i, &d) in map.dims.iter().enumerate() {
        w[3 + i] = d;
    }
    for (i, &s) in map.strides.iter().enumerate() {
        w[8 + i] = s;
    }
    for (i, &b) in map.boxes.iter().enumerate() {
        if i < 4 {
            w[12] |= (b as u64) << (16 * i);
        } else {
            w[13] = b as u64;
        }
    }
    w
}

/// The driver's encoding.
fn cuda_words(
    address: u64,
    dtype: DType,
    map: &TiledMap<'_>,
) -> std::result::Result<[u64; 16], String> {
    use cudarc::driver::sys;
    let data_type = match dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    };
    let swizzle = match map.swizzle {
        Swizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        Swizzle::B32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        Swizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        Swizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let element_strides = [1u32; 5];
    let mut out = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array holds at least `rank` entries (checked by the caller); the driver only
    // writes `out` and reads the arrays; the address is a live device allocation of the tensor.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut out,
            data_type,
            map.dims.len() as u32,
            address as *mut std::ffi::c_void,
            map.dims.as_ptr(),
            map.strides.as_ptr(),
            map.boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuTensorMapEncodeTiled refused it: {status:?}"));
    }
    Ok(out.opaque)
}
