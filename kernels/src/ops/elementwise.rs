//! Elementwise and row ops without tensor cores: the residual add and the row softmax (with its
//! backward). Kernels in kernels/cuda/elementwise.cu.
//!
//! - `residual_add`: y = a + b over tensors of any (equal) shape.
//! - `softmax`: y[t,:] = softmax(x[t,:]) over rows of x[T,n]: m = max_j x[j],
//!   e[j] = exp(x[j] - m), y[j] = e[j] / sum_j e[j]. Rows need a finite maximum.
//! - `softmax_backward`: dx = y * (dy - sum_j dy[j] * y[j]) from the forward output y.
//! - `transpose`: y[C,R] = x[R,C]^T (F32 or BF16; the output keeps the input's dtype and bits).
//!   The model's backward uses it for the GEMM forms dX = dY W and dW = dY^T X, because the
//!   gemm family computes only the linear-layer form A B^T.
//!
//! Inputs are F32 or BF16 (all float inputs of one call share the dtype); math and outputs are
//! f32 (the transpose, a copy, keeps the dtype). Every op is deterministic and the row ops are
//! batch-invariant (a row's reduction order depends only on n). The CPU references sum each row
//! in the device block reduction's order ([`super::block_reduce`]) with the host `expf`, so they
//! give the emulated kernels' bits.
//!
//! This file also holds the small helpers the model-op families (rmsnorm, rope, swiglu,
//! embedding, elementwise) share: dtype checks, host copies, output allocation.

use super::block_reduce::{block_max, block_sum};
use crate::device::Backend;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;

/// Threads per block of every model-op kernel with a block reduction (fixed: the reduction
/// order, and so the bits, must not depend on anything but the row length).
pub(crate) const ROW_THREADS: u32 = super::block_reduce::BLOCK_THREADS as u32;
/// Threads per block of the grid-stride elementwise kernels.
pub(crate) const EW_THREADS: u32 = 256;
/// Upper bound on grid-stride blocks (enough to fill an H200; more only adds launch overhead).
pub(crate) const EW_MAX_BLOCKS: usize = 8192;
/// The transpose kernel's square tile and the rows of it each thread row handles in turn
/// (elementwise.cu's TILE and TILE_ROWS: a block is TILE x TILE_ROWS threads).
const TRANSPOSE_TILE: usize = 32;
const TRANSPOSE_TILE_ROWS: u32 = 8;

/// The shared float dtype of an op's float inputs: each must be F32 or BF16, and all the same
/// as the first. The error names the offending tensor.
pub(crate) fn float_dtype(tensors: &[(&str, &Tensor)]) -> Result<DType> {
    let mut dtype = None;
    for (name, t) in tensors {
        let dt = t.dtype();
        if !dt.is_float() {
            return Err(Error::DType {
                tensor: name.to_string(),
                expected: "F32 or BF16".into(),
                got: dt.to_string(),
            });
        }
        match dtype {
            None => dtype = Some(dt),
            Some(first) if first != dt => {
                return Err(Error::DType {
                    tensor: name.to_string(),
                    expected: format!(
                        "{first} (the dtype of `{}`; an op's float inputs share one dtype)",
                        tensors[0].0
                    ),
                    got: dt.to_string(),
                })
            }
            Some(_) => {}
        }
    }
    dtype.ok_or_else(|| Error::Invalid("no float inputs".into()))
}

/// Picks the kernel variant for the inputs' dtype.
pub(crate) fn by_dtype(
    dtype: DType,
    f32_kernel: &'static str,
    bf16_kernel: &'static str,
) -> &'static str {
    if dtype == DType::BF16 {
        bf16_kernel
    } else {
        f32_kernel
    }
}

/// Grid size of a grid-stride elementwise kernel over `n` items.
pub(crate) fn ew_blocks(n: usize) -> u32 {
    blocks_for(
        n.min(EW_MAX_BLOCKS * EW_THREADS as usize),
        EW_THREADS as usize,
    )
}

/// Checks that a slice has `expected` elements; names it otherwise.
pub(crate) fn check_len(name: &str, data: &[f32], expected: usize, shape: &str) -> Result<()> {
    if data.len() != expected {
        return Err(Error::Invalid(format!(
            "`{name}` has {} elements; expected {expected} ({shape})",
            data.len()
        )));
    }
    Ok(())
}

/// A row count or length as the `int` a kernel takes, or an error naming the tensor.
pub(crate) fn as_i32(name: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::Invalid(format!(
            "`{name}`: {what} = {v} exceeds the kernels' 32-bit index range"
        ))
    })
}

/// A CPU reference's result as a tensor: on `cpu` the vector becomes the tensor's storage (no
/// copy); elsewhere it is uploaded.
pub(crate) fn host_tensor(backend: &Backend, shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
    Tensor::from_f32_vec(backend, shape, data)
}

/// A rank-2 tensor's `[rows, cols]`, or an error naming it and the expected form.
pub(crate) fn rows_cols(name: &str, t: &Tensor, expected: &str) -> Result<(usize, usize)> {
    t.expect_rank(name, 2, expected)?;
    Ok((t.shape()[0], t.shape()[1]))
}

/// Fails unless `t` has exactly `shape`.
pub(crate) fn expect_shape(name: &str, t: &Tensor, shape: &[usize], why: &str) -> Result<()> {
    if t.shape() != shape {
        return Err(Error::shape(name, format!("{shape:?} ({why})"), t.shape()));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// CPU references (plain slices, f32 math in the kernels' operation order).

/// y = a + b elementwise.
pub fn residual_add_reference(a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
    check_len("b", b, a.len(), "the length of `a`")?;
    Ok(par::map_collect(a.len(), 1, |i| a[i] + b[i]))
}

/// Row softmax of x[rows, n] (max-subtracted; the sum in the device's block order).
pub fn softmax_reference(x: &[f32], rows: usize, n: usize) -> Result<Vec<f32>> {
    check_len("x", x, rows * n, "[T,n]")?;
    let mut y = vec![0.0f32; rows * n];
    if n == 0 {
        return Ok(y);
    }
    par::rows_mut(&mut y, n, 24 * n, |row, yr| {
        let xr = &x[row * n..(row + 1) * n];
        let m = block_max(n, |j| xr[j]);
        let sum = block_sum(n, |j| (xr[j] - m).exp());
        #[cfg(feature = "planted-faults")]
        let sum = crate::planted::softmax_sum(sum, n, |j| (xr[j] - m).exp());
        for (o, &v) in yr.iter_mut().zip(xr) {
            *o = (v - m).exp() / sum;
        }
    });
    Ok(y)
}

/// Softmax backward: dx = y * (dy - sum_j dy[j] * y[j]) per row of y[rows, n].
pub fn softmax_backward_reference(
    y: &[f32],
    dy: &[f32],
    rows: usize,
    n: usize,
) -> Result<Vec<f32>> {
    check_len("y", y, rows * n, "[T,n]")?;
    check_len("dy", dy, rows * n, "[T,n] like y")?;
    let mut dx = vec![0.0f32; rows * n];
    if n == 0 {
        return Ok(dx);
    }
    par::rows_mut(&mut dx, n, 3 * n, |row, o| {
        let (yr, dyr) = (&y[row * n..(row + 1) * n], &dy[row * n..(row + 1) * n]);
        let dot = block_sum(n, |j| dyr[j] * yr[j]);
        for ((o, &a), &b) in o.iter_mut().zip(yr).zip(dyr) {
            *o = a * (b - dot);
        }
    });
    Ok(dx)
}

/// The transpose y[cols, rows] of a row-major x[rows, cols], in 32 x 32 tiles (both the reads
/// and the writes stay within a few cache lines per tile), blocks of output rows in parallel.
pub fn transpose_reference<T: Element>(x: &[T], rows: usize, cols: usize) -> Result<Vec<T>> {
    if x.len() != rows * cols {
        return Err(Error::Invalid(format!(
            "`x` has {} elements; expected {} ([R,C] = [{rows},{cols}])",
            x.len(),
            rows * cols
        )));
    }
    const TILE: usize = 32;
    let mut y = vec![T::zeroed(); rows * cols];
    if rows == 0 || cols == 0 {
        return Ok(y);
    }
    // Each task owns TILE rows of y (= TILE columns of x).
    par::rows_mut(&mut y, TILE * rows, TILE * rows, |cb, out| {
        let c0 = cb * TILE;
        let cw = out.len() / rows;
        for r0 in (0..rows).step_by(TILE) {
            let r1 = (r0 + TILE).min(rows);
            for c in 0..cw {
                let dst = &mut out[c * rows + r0..c * rows + r1];
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = x[(r0 + i) * cols + c0 + c];
                }
            }
        }
    });
    Ok(y)
}

// ---------------------------------------------------------------------------------------------
// Device entry points.

/// y = a + b (any shape, equal shapes; F32 or BF16 inputs; F32 output).
pub fn residual_add(backend: &Backend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dtype = float_dtype(&[("a", a), ("b", b)])?;
    expect_shape("b", b, a.shape(), "the shape of `a`")?;
    let n = a.numel();
    match backend {
        Backend::Cpu => {
            let y = residual_add_reference(&a.f32_data()?, &b.f32_data()?)?;
            Tensor::from_f32_vec(backend, a.shape(), y)
        }
        _ => {
            let y = Tensor::poisoned(backend, a.shape(), DType::F32)?;
            if n > 0 {
                let kernel = by_dtype(dtype, "elementwise_add_f32", "elementwise_add_bf16");
                // SAFETY of the launch (see launch.rs): a, b, y each hold n elements of the
                // kernel's declared types; the kernel touches indices < n only.
                backend.launch(
                    &Launch::new(kernel, [ew_blocks(n), 1, 1], [EW_THREADS, 1, 1])
                        .arg_tensor(a)
                        .arg_tensor(b)
                        .arg_tensor(&y)
                        .arg_i64(n as i64),
                )?;
            }
            Ok(y)
        }
    }
}

/// Row softmax of x[T,n] (F32 or BF16) -> y[T,n] F32.
pub fn softmax(backend: &Backend, x: &Tensor) -> Result<Tensor> {
    let dtype = float_dtype(&[("x", x)])?;
    let (rows, n) = rows_cols("x", x, "[T,n]")?;
    match backend {
        Backend::Cpu => host_tensor(
            backend,
            x.shape(),
            softmax_reference(&x.f32_data()?, rows, n)?,
        ),
        _ => {
            let y = Tensor::poisoned(backend, x.shape(), DType::F32)?;
            if rows > 0 && n > 0 {
                let kernel = by_dtype(dtype, "elementwise_softmax_f32", "elementwise_softmax_bf16");
                // One block per row reads and writes row blockIdx.x only (n elements).
                backend.launch(
                    &Launch::new(
                        kernel,
                        [as_i32("x", "T", rows)? as u32, 1, 1],
                        [ROW_THREADS, 1, 1],
                    )
                    .arg_tensor(x)
                    .arg_tensor(&y)
                    .arg_i32(as_i32("x", "n", n)?),
                )?;
            }
            Ok(y)
        }
    }
}

/// Softmax backward from the forward output y[T,n] and dy[T,n] -> dx[T,n] F32.
pub fn softmax_backward(backend: &Backend, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dtype = float_dtype(&[("y", y), ("dy", dy)])?;
    let (rows, n) = rows_cols("y", y, "[T,n]")?;
    expect_shape("dy", dy, y.shape(), "[T,n], the shape of `y`")?;
    match backend {
        Backend::Cpu => host_tensor(
            backend,
            y.shape(),
            softmax_backward_reference(&y.f32_data()?, &dy.f32_data()?, rows, n)?,
        ),
        _ => {
            let dx = Tensor::poisoned(backend, y.shape(), DType::F32)?;
            if rows > 0 && n > 0 {
                let kernel = by_dtype(
                    dtype,
                    "elementwise_softmax_backward_f32",
                    "elementwise_softmax_backward_bf16",
                );
                backend.launch(
                    &Launch::new(
                        kernel,
                        [as_i32("y", "T", rows)? as u32, 1, 1],
                        [ROW_THREADS, 1, 1],
                    )
                    .arg_tensor(y)
                    .arg_tensor(dy)
                    .arg_tensor(&dx)
                    .arg_i32(as_i32("y", "n", n)?),
                )?;
            }
            Ok(dx)
        }
    }
}

/// The transpose of x[R,C] (F32 or BF16) -> y[C,R] of the same dtype (exact: a copy).
pub fn transpose(backend: &Backend, x: &Tensor) -> Result<Tensor> {
    let dtype = float_dtype(&[("x", x)])?;
    let (rows, cols) = rows_cols("x", x, "[R,C]")?;
    if let Backend::Cpu = backend {
        return match dtype {
            DType::BF16 => Tensor::from_slice(
                backend,
                &[cols, rows],
                &transpose_reference(&x.to_vec::<bf16>()?, rows, cols)?,
            ),
            _ => Tensor::from_f32_vec(
                backend,
                &[cols, rows],
                transpose_reference(&x.f32_data()?, rows, cols)?,
            ),
        };
    }
    let y = Tensor::poisoned(backend, &[cols, rows], dtype)?;
    if rows > 0 && cols > 0 {
        let row_tiles = as_i32("x", "R / 32", rows.div_ceil(TRANSPOSE_TILE))?;
        let col_tiles = cols.div_ceil(TRANSPOSE_TILE);
        if col_tiles > 65535 {
            return Err(Error::shape(
                "x",
                format!(
                    "[R,C] with C <= {} (the grid's y limit)",
                    65535 * TRANSPOSE_TILE
                ),
                x.shape(),
            ));
        }
        // Block (row tile, column tile) reads x[r][c] and writes y[c][r] for the r < R, c < C
        // of its 32x32 tile only; x and y hold R*C elements each.
        backend.launch(
            &Launch::new(
                by_dtype(
                    dtype,
                    "elementwise_transpose_f32",
                    "elementwise_transpose_bf16",
                ),
                [row_tiles as u32, col_tiles as u32, 1],
                [TRANSPOSE_TILE as u32, TRANSPOSE_TILE_ROWS, 1],
            )
            .arg_tensor(x)
            .arg_tensor(&y)
            .arg_i32(as_i32("x", "R", rows)?)
            .arg_i32(as_i32("x", "C", cols)?),
        )?;
    }
    Ok(y)
}

// ---------------------------------------------------------------------------------------------
// `sluice kernel` rows.

pub(crate) const FLOAT: &str = "F32|BF16";

fn run_residual_add(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    Ok(vec![(
        "y",
        residual_add(backend, call.tensor("a")?, call.tensor("b")?)?,
    )])
}

fn run_transpose(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    Ok(vec![("y", transpose(backend, call.tensor("x")?)?)])
}

fn run_softmax(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    Ok(vec![("y", softmax(backend, call.tensor("x")?)?)])
}

fn run_softmax_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    Ok(vec![(
        "dx",
        softmax_backward(backend, call.tensor("y")?, call.tensor("dy")?)?,
    )])
}

/// `sluice kernel residual_add`.
pub static RESIDUAL_ADD_SPEC: OpSpec = OpSpec {
    name: "residual_add",
    summary: "y = a + b elementwise (any shape; a and b share shape and dtype)",
    inputs: &[
        TensorSpec {
            name: "a",
            shape: "[...]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "b",
            shape: "[...] (as a)",
            dtypes: FLOAT,
        },
    ],
    params: &[],
    outputs: &[TensorSpec {
        name: "y",
        shape: "[...]",
        dtypes: "F32",
    }],
    run: run_residual_add,
};

/// `sluice kernel softmax`.
pub static SOFTMAX_SPEC: OpSpec = OpSpec {
    name: "softmax",
    summary: "row softmax of x[T,n], max-subtracted, fixed reduction order",
    inputs: &[TensorSpec {
        name: "x",
        shape: "[T,n]",
        dtypes: FLOAT,
    }],
    params: &[],
    outputs: &[TensorSpec {
        name: "y",
        shape: "[T,n]",
        dtypes: "F32",
    }],
    run: run_softmax,
};

/// `sluice kernel softmax_backward`.
pub static SOFTMAX_BACKWARD_SPEC: OpSpec = OpSpec {
    name: "softmax_backward",
    summary: "dx = y * (dy - rowsum(dy * y)) from the softmax output y",
    inputs: &[
        TensorSpec {
            name: "y",
            shape: "[T,n]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "dy",
            shape: "[T,n]",
            dtypes: FLOAT,
        },
    ],
    params: &[],
    outputs: &[TensorSpec {
        name: "dx",
        shape: "[T,n]",
        dtypes: "F32",
    }],
    run: run_softmax_backward,
};

/// `sluice kernel transpose`.
pub static TRANSPOSE_SPEC: OpSpec = OpSpec {
    name: "transpose",
    summary: "y[C,R] = x[R,C]^T, an exact copy (y keeps x's dtype and bits)",
    inputs: &[TensorSpec {
        name: "x",
        shape: "[R,C]",
        dtypes: FLOAT,
    }],
    params: &[],
    outputs: &[TensorSpec {
        name: "y",
        shape: "[C,R]",
        dtypes: "F32|BF16 (the dtype of x)",
    }],
    run: run_transpose,
};
