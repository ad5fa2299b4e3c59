//! The global squared norm of an arena (gradient clipping): f64 per chunk on cpu, fixed-order
//! f32 block sums on emu/cuda.

use super::THREADS;
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Elements per block of the squared-norm partials (256 threads x 32 elements).
pub const NORM_CHUNK: usize = 8192;

/// The squared norm of `x` in f64: each [`NORM_CHUNK`] summed in ascending order, then the
/// chunk sums in ascending order (rayon over chunks; the order is fixed).
pub fn sq_norm_reference(x: &[f32]) -> f64 {
    #[cfg(feature = "planted-faults")]
    if let Some(planted) = crate::planted::sq_norm(x) {
        return planted;
    }
    let partials: Vec<f64> = x
        .par_chunks(NORM_CHUNK)
        .map(|c| c.iter().map(|&v| v as f64 * v as f64).sum::<f64>())
        .collect();
    partials.iter().sum()
}

/// The squared global norm of a 1-D F32 tensor, as f64 (cpu: f64 accumulation; emu/cuda: two
/// launches with f32 fixed-order block sums, then a 4-byte download). The download is the
/// result the caller asked for, so it is counted as the caller's (`#[track_caller]`,
/// [`crate::counters`]), not as a copy the op makes on its own.
#[track_caller]
pub fn sq_norm(backend: &Backend, x: &Tensor) -> Result<f64> {
    x.expect_dtype("x", DType::F32)?;
    x.expect_rank("x", 1, "[n]")?;
    let n = x.numel();
    if let Backend::Cpu = backend {
        return Ok(sq_norm_reference(x.host_slice::<f32>()?));
    }
    if n == 0 {
        return Ok(0.0);
    }
    let nb = n.div_ceil(NORM_CHUNK);
    if nb > i32::MAX as usize {
        return Err(Error::shape("x", "[n] with n < 2^31 * 8192", x.shape()));
    }
    let partials = Tensor::poisoned(backend, &[nb], DType::F32)?;
    let out = Tensor::poisoned(backend, &[1], DType::F32)?;
    // Block b reads x[b*chunk .. min((b+1)*chunk, n)) and writes partials[b] only.
    backend.launch(
        &Launch::new(
            "optim_sq_norm_partials_f32",
            [nb as u32, 1, 1],
            [THREADS, 1, 1],
        )
        .arg_tensor(x)
        .arg_tensor(&partials)
        .arg_i64(n as i64)
        .arg_i64(NORM_CHUNK as i64),
    )?;
    // One block reads all nb partials and writes out[0].
    backend.launch(
        &Launch::new("optim_sum_partials_f32", [1, 1, 1], [THREADS, 1, 1])
            .arg_tensor(&partials)
            .arg_tensor(&out)
            .arg_i64(nb as i64),
    )?;
    Ok(out.to_vec::<f32>()?[0] as f64)
}
