//! The f32 -> bf16 compute copy of the arena (round to nearest even).

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::ops::elementwise::{ew_blocks, EW_THREADS};
use crate::tensor::Tensor;
use half::bf16;
use rayon::prelude::*;

/// `bf16(src)` elementwise, rounding to nearest even.
pub fn cast_bf16_reference(src: &[f32]) -> Vec<bf16> {
    src.par_iter().map(|&x| bf16::from_f32(x)).collect()
}

/// [`cast_bf16_reference`] into an existing slice of the same length (rayon, no allocation).
pub fn cast_bf16_reference_into(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::shape(
            "dst",
            format!("[{}] (the length of `src`)", src.len()),
            &[dst.len()],
        ));
    }
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| {
            for (d, &x) in d.iter_mut().zip(s) {
                *d = bf16::from_f32(x);
            }
        });
    Ok(())
}

/// Writes `bf16(src)` into `dst` (same shape; F32 -> BF16), one launch on emu/cuda.
pub fn cast_bf16_into(backend: &Backend, src: &Tensor, dst: &mut Tensor) -> Result<()> {
    src.expect_dtype("src", DType::F32)?;
    dst.expect_dtype("dst", DType::BF16)?;
    if dst.shape() != src.shape() {
        return Err(Error::shape(
            "dst",
            format!("{:?} (the shape of `src`)", src.shape()),
            dst.shape(),
        ));
    }
    if let Backend::Cpu = backend {
        return cast_bf16_reference_into(src.host_slice()?, dst.host_slice_mut::<bf16>()?);
    }
    let n = src.numel();
    if n == 0 {
        return Ok(());
    }
    backend.launch(
        &Launch::new(
            "optim_cast_bf16_f32",
            [ew_blocks(n), 1, 1],
            [EW_THREADS, 1, 1],
        )
        .arg_tensor(src)
        .arg_tensor(dst)
        .arg_i64(n as i64),
    )
}
