//! RMSNorm over rows of x[T,d] with a scale w[d] (kernels in kernels/cuda/rmsnorm.cu):
//!
//! y[t,j] = x[t,j] * r[t] * w[j],   r[t] = 1 / sqrt(mean_j x[t,j]^2 + eps),   eps = 1e-6 by default.
//!
//! Backward, with g[j] = dy[t,j] * w[j]:
//! dx[t,j] = r * g[j] - x[t,j] * (sum_k g[k] * x[t,k]) * r^3 / d,
//! dw[j] = sum_t dy[t,j] * x[t,j] * r[t].
//!
//! dw is a reduction over T, done without atomics: fixed chunks of [`DW_CHUNK_ROWS`] rows each
//! give a partial (rows added in ascending order), then the partials are added in ascending
//! chunk order. The CPU reference uses the same chunking. dx and y are batch-invariant.
//! r is `1 / sqrt(..)` (correctly rounded on every device), not an approximate rsqrt.
//! The row sums (of x^2, and of dy * w * x in the backward) are taken in the device block
//! reduction's order ([`super::block_reduce`]), so the cpu reference and the kernels under the
//! emulator give the same bits.
//! Inputs F32 or BF16 (shared by all float inputs of a call); math and outputs f32.

use super::block_reduce::block_sum;
use super::elementwise::{
    as_i32, by_dtype, check_len, expect_shape, float_dtype, host_tensor, rows_cols, FLOAT,
    ROW_THREADS,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;

/// The default epsilon inside the square root.
pub const DEFAULT_EPS: f32 = 1e-6;
/// Rows per dw partial sum (kernels/cuda/rmsnorm.cu's DW_CHUNK_ROWS).
pub const DW_CHUNK_ROWS: usize = 64;

fn check_eps(eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::param(
            "eps",
            format!("{eps} must be finite and >= 0"),
        ));
    }
    Ok(())
}

/// 1 / sqrt(mean of squares + eps) of one row (summed in the device's block order).
fn row_rstd(x: &[f32], eps: f32) -> f32 {
    let ss = block_sum(x.len(), |j| x[j] * x[j]);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// y = rmsnorm(x[t,d]) * w[d].
pub fn rmsnorm_reference(x: &[f32], w: &[f32], t: usize, d: usize, eps: f32) -> Result<Vec<f32>> {
    check_len("x", x, t * d, "[T,d]")?;
    check_len("w", w, d, "[d]")?;
    check_eps(eps)?;
    let mut y = vec![0.0f32; t * d];
    if d == 0 {
        return Ok(y);
    }
    par::rows_mut(&mut y, d, 3 * d, |row, yr| {
        let xr = &x[row * d..(row + 1) * d];
        let r = row_rstd(xr, eps);
        for ((o, &xv), &wv) in yr.iter_mut().zip(xr).zip(w) {
            *o = xv * r * wv;
        }
    });
    Ok(y)
}

/// (dx[t,d], dw[d]) of rmsnorm from x, w and dy.
pub fn rmsnorm_backward_reference(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    t: usize,
    d: usize,
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    check_len("x", x, t * d, "[T,d]")?;
    check_len("w", w, d, "[d]")?;
    check_len("dy", dy, t * d, "[T,d] like x")?;
    check_eps(eps)?;
    let mut dx = vec![0.0f32; t * d];
    if d == 0 {
        return Ok((dx, Vec::new()));
    }
    let mut rstd = vec![0.0f32; t];
    par::rows2_mut(&mut dx, d, &mut rstd, 1, 8 * d, |row, dxr, r_out| {
        let (xr, dyr) = (&x[row * d..(row + 1) * d], &dy[row * d..(row + 1) * d]);
        let r = row_rstd(xr, eps);
        let dot = block_sum(d, |j| dyr[j] * w[j] * xr[j]);
        let c = dot * r * r * r / d as f32;
        for (((o, &g), &wv), &xv) in dxr.iter_mut().zip(dyr).zip(w).zip(xr) {
            *o = r * (g * wv) - c * xv;
        }
        r_out[0] = r;
    });
    // dw: per-chunk partials (rows ascending), then the chunks in ascending order.
    let chunks = t.div_ceil(DW_CHUNK_ROWS);
    let mut partials = vec![0.0f32; chunks * d];
    par::rows_mut(&mut partials, d, 3 * d * DW_CHUNK_ROWS, |c, acc| {
        for row in c * DW_CHUNK_ROWS..((c + 1) * DW_CHUNK_ROWS).min(t) {
            let (xr, dyr) = (&x[row * d..(row + 1) * d], &dy[row * d..(row + 1) * d]);
            for ((a, &g), &xv) in acc.iter_mut().zip(dyr).zip(xr) {
                *a += g * xv * rstd[row];
            }
        }
    });
    let mut dw = vec![0.0f32; d];
    for p in partials.chunks(d) {
        for (o, v) in dw.iter_mut().zip(p) {
            *o += v;
        }
    }
    Ok((dx, dw))
}

fn check_inputs(x: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
    let (t, d) = rows_cols("x", x, "[T,d]")?;
    expect_shape("w", w, &[d], "[d], d = the last dimension of x[T,d]")?;
    Ok((t, d))
}

/// RMSNorm forward on any device: x[T,d], w[d] (F32 or BF16) -> y[T,d] F32.
pub fn rmsnorm(backend: &Backend, x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let dtype = float_dtype(&[("x", x), ("w", w)])?;
    let (t, d) = check_inputs(x, w)?;
    check_eps(eps)?;
    if let Backend::Cpu = backend {
        let y = rmsnorm_reference(&x.f32_data()?, &w.f32_data()?, t, d, eps)?;
        return host_tensor(backend, &[t, d], y);
    }
    let y = Tensor::poisoned(backend, &[t, d], DType::F32)?;
    if t > 0 && d > 0 {
        let kernel = by_dtype(dtype, "rmsnorm_forward_f32", "rmsnorm_forward_bf16");
        // One block per row; block b touches row b of x and y and all of w (d elements).
        backend.launch(
            &Launch::new(
                kernel,
                [as_i32("x", "T", t)? as u32, 1, 1],
                [ROW_THREADS, 1, 1],
            )
            .arg_tensor(x)
            .arg_tensor(w)
            .arg_tensor(&y)
            .arg_i32(as_i32("x", "d", d)?)
            .arg_f32(eps),
        )?;
    }
    Ok(y)
}

/// RMSNorm backward on any device: (dx[T,d], dw[d]), both F32.
pub fn rmsnorm_backward(
    backend: &Backend,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let dtype = float_dtype(&[("x", x), ("w", w), ("dy", dy)])?;
    let (t, d) = check_inputs(x, w)?;
    expect_shape("dy", dy, &[t, d], "[T,d], the shape of x")?;
    check_eps(eps)?;
    if let Backend::Cpu = backend {
        let (dx, dw) =
            rmsnorm_backward_reference(&x.f32_data()?, &w.f32_data()?, &dy.f32_data()?, t, d, eps)?;
        return Ok((
            host_tensor(backend, &[t, d], dx)?,
            host_tensor(backend, &[d], dw)?,
        ));
    }
    let dx = Tensor::poisoned(backend, &[t, d], DType::F32)?;
    if d == 0 {
        return Ok((dx, Tensor::poisoned(backend, &[0], DType::F32)?));
    }
    if t == 0 {
        return Ok((dx, Tensor::zeros(backend, &[d], DType::F32)?));
    }
    let rows = as_i32("x", "T", t)?;
    let cols = as_i32("x", "d", d)?;
    let chunks = t.div_ceil(DW_CHUNK_ROWS);
    let col_blocks = blocks_for(d, ROW_THREADS as usize);
    if col_blocks > 65535 {
        return Err(Error::shape("x", "[T,d] with d <= 16776960", x.shape()));
    }
    let rstd = Tensor::poisoned(backend, &[t], DType::F32)?;
    let partial = Tensor::poisoned(backend, &[chunks, d], DType::F32)?;
    let dw = Tensor::poisoned(backend, &[d], DType::F32)?;
    // 1. dx and r per row (one block per row).
    backend.launch(
        &Launch::new(
            by_dtype(dtype, "rmsnorm_backward_dx_f32", "rmsnorm_backward_dx_bf16"),
            [rows as u32, 1, 1],
            [ROW_THREADS, 1, 1],
        )
        .arg_tensor(x)
        .arg_tensor(w)
        .arg_tensor(dy)
        .arg_tensor(&dx)
        .arg_tensor(&rstd)
        .arg_i32(cols)
        .arg_f32(eps),
    )?;
    // 2. dw partials: block (chunk, column block); one writer per partial element.
    backend.launch(
        &Launch::new(
            by_dtype(
                dtype,
                "rmsnorm_backward_dw_partial_f32",
                "rmsnorm_backward_dw_partial_bf16",
            ),
            [chunks as u32, col_blocks, 1],
            [ROW_THREADS, 1, 1],
        )
        .arg_tensor(x)
        .arg_tensor(dy)
        .arg_tensor(&rstd)
        .arg_tensor(&partial)
        .arg_i32(rows)
        .arg_i32(cols),
    )?;
    // 3. dw = the partials summed in ascending chunk order.
    backend.launch(
        &Launch::new(
            "rmsnorm_backward_dw_reduce",
            [col_blocks, 1, 1],
            [ROW_THREADS, 1, 1],
        )
        .arg_tensor(&partial)
        .arg_tensor(&dw)
        .arg_i32(chunks as i32)
        .arg_i32(cols),
    )?;
    Ok((dx, dw))
}

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let eps = call.param_f32("eps")?;
    Ok(vec![(
        "y",
        rmsnorm(backend, call.tensor("x")?, call.tensor("w")?, eps)?,
    )])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let eps = call.param_f32("eps")?;
    let (dx, dw) = rmsnorm_backward(
        backend,
        call.tensor("x")?,
        call.tensor("w")?,
        call.tensor("dy")?,
        eps,
    )?;
    Ok(vec![("dx", dx), ("dw", dw)])
}

const EPS_PARAM: ParamSpec = ParamSpec {
    name: "eps",
    default: Some("1e-6"),
    help: "added to the mean of squares inside the square root",
};

/// `sluice kernel rmsnorm`.
pub static SPEC: OpSpec = OpSpec {
    name: "rmsnorm",
    summary: "y = x * rsqrt(mean(x^2) + eps) * w over rows of x[T,d]",
    inputs: &[
        TensorSpec {
            name: "x",
            shape: "[T,d]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "w",
            shape: "[d]",
            dtypes: FLOAT,
        },
    ],
    params: &[EPS_PARAM],
    outputs: &[TensorSpec {
        name: "y",
        shape: "[T,d]",
        dtypes: "F32",
    }],
    run: run_forward,
};

/// `sluice kernel rmsnorm_backward`.
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "rmsnorm_backward",
    summary: "dx and dw of rmsnorm from x, w and dy (dw summed in fixed 64-row chunks, no atomics)",
    inputs: &[
        TensorSpec {
            name: "x",
            shape: "[T,d]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "w",
            shape: "[d]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "dy",
            shape: "[T,d]",
            dtypes: FLOAT,
        },
    ],
    params: &[EPS_PARAM],
    outputs: &[
        TensorSpec {
            name: "dx",
            shape: "[T,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw",
            shape: "[d]",
            dtypes: "F32",
        },
    ],
    run: run_backward,
};
