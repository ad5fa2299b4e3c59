//! `newton_schulz`: the quintic Newton-Schulz orthogonalisation of Muon (DESIGN.md section 3.7),
//! batched over `n` matrices of one shape: g[n,r,c] (F32 or BF16) -> x[n,r,c] F32.
//!
//! Per matrix: X0 = G / (||G||_F + 1e-7), transposed first when r > c (the iteration works on
//! the wide orientation, rows <= cols), then `steps` times
//! X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315),
//! and the result is transposed back. A zero matrix gives zeros (the 1e-7 keeps the division
//! finite).
//!
//! Devices:
//! - `cpu`: [`newton_schulz_reference`], f32 on the gemm family's CPU reference
//!   ([`gemm_reference_into`]), rayon over the matrices. The Frobenius norm sums the squares in
//!   f64 in ascending element order (fixed; deterministic).
//! - `emu` / `cuda`: kernels/cuda/newton_schulz.cu, a sequence of launches each covering all `n`
//!   matrices: one normalise launch (per-matrix fixed-order block reduction, no atomics), then
//!   three batched strided matmul launches per step (A = X X^T; Bm = c A A + b A;
//!   X' = Bm X + a X). All arithmetic after the load is f32 (true f32 FMA, no tensor cores), for
//!   BF16 inputs too: they are widened exactly on load and X stays f32 between steps. A
//!   bf16 tensor-core variant is future work (docs/perf/newton_schulz.md).

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::gemm::gemm_reference_into;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// The quintic's coefficients (a, b, c).
pub const NS_COEFFS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);
/// Added to the Frobenius norm before dividing.
pub const NS_EPS: f32 = 1e-7;
/// The default number of steps.
pub const DEFAULT_STEPS: usize = 5;
/// The largest number of steps accepted.
pub const MAX_STEPS: usize = 100;

// ---------------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------------

/// Newton-Schulz over `g` [n,r,c] (f32), `steps` steps; returns x [n,r,c] f32.
///
/// # Panics
/// If `g.len() != n * r * c` (a caller bug: [`newton_schulz`] validates user input first).
pub fn newton_schulz_reference(g: &[f32], n: usize, r: usize, c: usize, steps: usize) -> Vec<f32> {
    assert_eq!(
        g.len(),
        n * r * c,
        "newton_schulz_reference: g must hold n*r*c elements"
    );
    let size = r * c;
    let mut out = vec![0.0f32; n * size];
    if size == 0 {
        return out;
    }
    out.par_chunks_mut(size)
        .zip(g.par_chunks(size))
        .for_each(|(o, gm)| one_matrix(gm, o, r, c, steps));
    out
}

/// `x` [rows,cols] -> [cols,rows].
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = x[i * cols + j];
        }
    }
    t
}

fn one_matrix(g: &[f32], out: &mut [f32], r: usize, c: usize, steps: usize) {
    let (a, b, cc) = NS_COEFFS;
    let ss: f64 = g.iter().map(|&v| v as f64 * v as f64).sum();
    let denom = (ss.sqrt() as f32) + NS_EPS;
    let transposed = r > c;
    let (rr, cw) = if transposed { (c, r) } else { (r, c) };
    let mut x: Vec<f32> = g.iter().map(|&v| v / denom).collect();
    if transposed {
        x = transpose(&x, r, c);
    }
    let mut am = vec![0.0f32; rr * rr];
    let mut a2 = vec![0.0f32; rr * rr];
    let mut bx = vec![0.0f32; rr * cw];
    for _ in 0..steps {
        // A = X X^T; A^2 = A A^T (A is symmetric); BX = Bm (X^T)^T with Bm = b A + c A^2.
        gemm_reference_into(&x, &x, &mut am, rr, rr, cw);
        gemm_reference_into(&am, &am, &mut a2, rr, rr, rr);
        for (p, &q) in a2.iter_mut().zip(&am) {
            *p = cc * *p + b * q;
        }
        let xt = transpose(&x, rr, cw);
        gemm_reference_into(&a2, &xt, &mut bx, rr, cw, rr);
        for (xv, &bv) in x.iter_mut().zip(&bx) {
            *xv = bv + a * *xv;
        }
    }
    if transposed {
        out.copy_from_slice(&transpose(&x, rr, cw));
    } else {
        out.copy_from_slice(&x);
    }
}

// ---------------------------------------------------------------------------------------------
// Device entry point
// ---------------------------------------------------------------------------------------------

/// Threads per block of every kernel; the matmul's tile edge (newton_schulz.cu has the same
/// numbers).
const THREADS: u32 = 256;
const TILE: usize = 16;

fn check_steps(steps: usize) -> Result<()> {
    if steps == 0 || steps > MAX_STEPS {
        return Err(Error::param(
            "steps",
            format!("{steps} is out of range; it must be 1..={MAX_STEPS}"),
        ));
    }
    Ok(())
}

/// Newton-Schulz over `g` [n,r,c] (F32 or BF16), `steps` in 1..=100 (5 by default in the
/// runner). Returns x [n,r,c] F32 on the same device.
pub fn newton_schulz(backend: &Backend, g: &Tensor, steps: usize) -> Result<Tensor> {
    g.expect_rank("g", 3, "[n,r,c]")?;
    if !g.dtype().is_float() {
        return Err(Error::DType {
            tensor: "g".into(),
            expected: "F32 or BF16".into(),
            got: g.dtype().to_string(),
        });
    }
    check_steps(steps)?;
    let (n, r, c) = (g.shape()[0], g.shape()[1], g.shape()[2]);
    if let Backend::Cpu = backend {
        let x = newton_schulz_reference(&g.to_f32_vec()?, n, r, c, steps);
        return Tensor::from_slice(backend, &[n, r, c], &x);
    }
    let out = Tensor::poisoned(backend, &[n, r, c], DType::F32)?;
    if n * r * c == 0 {
        return Ok(out);
    }
    if r.max(c) > i32::MAX as usize || n > 65535 || r.min(c).div_ceil(TILE) > 65535 {
        return Err(Error::shape(
            "g",
            "[n,r,c] with n <= 65535, min(r,c) <= 1048560 and r, c within 32-bit indices",
            g.shape(),
        ));
    }
    let (a, b, cc) = NS_COEFFS;
    let transposed = r > c;
    let (rr, cw) = if transposed { (c, r) } else { (r, c) };
    let mut x = Tensor::poisoned(backend, &[n, rr, cw], DType::F32)?;
    let mut x_next = Tensor::poisoned(backend, &[n, rr, cw], DType::F32)?;
    let am = Tensor::poisoned(backend, &[n, rr, rr], DType::F32)?;
    let bm = Tensor::poisoned(backend, &[n, rr, rr], DType::F32)?;

    let normalize = match g.dtype() {
        DType::BF16 => "newton_schulz_normalize_bf16",
        _ => "newton_schulz_normalize_f32",
    };
    backend.launch(
        &Launch::new(normalize, [n as u32, 1, 1], [THREADS, 1, 1])
            .arg_tensor(g)
            .arg_tensor(&x)
            .arg_i32(r as i32)
            .arg_i32(c as i32)
            .arg_i32(transposed as i32),
    )?;

    let (xs, as_) = ((rr * cw) as i64, (rr * rr) as i64);
    // Strides (batch, row, col) of X [rr,cw], X^T (as the right operand of X X^T), A and Bm.
    let x_str = [xs, cw as i64, 1];
    let xt_str = [xs, 1, cw as i64];
    let sq_str = [as_, rr as i64, 1];
    // The output's strides when the last step writes it (transposed back when needed).
    let out_str = if transposed {
        [xs, 1, rr as i64]
    } else {
        x_str
    };
    for step in 0..steps {
        let last = step + 1 == steps;
        // A = X X^T
        matmul(
            backend,
            (&x, x_str),
            (&x, xt_str),
            (&x, x_str),
            (&am, sq_str),
            (rr, rr, cw),
            1.0,
            0.0,
        )?;
        // Bm = c (A A) + b A
        matmul(
            backend,
            (&am, sq_str),
            (&am, sq_str),
            (&am, sq_str),
            (&bm, sq_str),
            (rr, rr, rr),
            cc,
            b,
        )?;
        // X' = Bm X + a X
        let dest = if last { &out } else { &x_next };
        matmul(
            backend,
            (&bm, sq_str),
            (&x, x_str),
            (&x, x_str),
            (dest, if last { out_str } else { x_str }),
            (rr, cw, rr),
            1.0,
            a,
        )?;
        if !last {
            std::mem::swap(&mut x, &mut x_next);
        }
    }
    Ok(out)
}

type Operand<'t> = (&'t Tensor, [i64; 3]);

/// One launch of `newton_schulz_matmul_f32`: dst = alpha * lhs rhs + beta * e, batched over the
/// leading dimension; `mnk` = (rows, cols, inner).
#[allow(clippy::too_many_arguments)]
fn matmul(
    backend: &Backend,
    lhs: Operand<'_>,
    rhs: Operand<'_>,
    e: Operand<'_>,
    dst: Operand<'_>,
    mnk: (usize, usize, usize),
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let (m, nn, k) = mnk;
    let batch = dst.0.shape()[0] as u32;
    let mut launch = Launch::new(
        "newton_schulz_matmul_f32",
        [blocks_for(nn, TILE), blocks_for(m, TILE), batch],
        [THREADS, 1, 1],
    )
    .arg_tensor(lhs.0)
    .arg_tensor(rhs.0)
    .arg_tensor(e.0)
    .arg_tensor(dst.0)
    .arg_i32(m as i32)
    .arg_i32(nn as i32)
    .arg_i32(k as i32);
    for s in [lhs.1, rhs.1, e.1, dst.1] {
        for v in s {
            launch = launch.arg_i64(v);
        }
    }
    backend.launch(&launch.arg_f32(alpha).arg_f32(beta))
}

// ---------------------------------------------------------------------------------------------
// `sluice kernel newton_schulz`
// ---------------------------------------------------------------------------------------------

fn run_spec(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let steps = call.param_usize("steps")?;
    let x = newton_schulz(backend, call.tensor("g")?, steps)?;
    Ok(vec![("x", x)])
}

/// The kernel runner's `newton_schulz` row (DESIGN.md section 7).
pub static SPEC: OpSpec = OpSpec {
    name: "newton_schulz",
    summary: "Muon's quintic Newton-Schulz orthogonalisation of each of n matrices \
              (X0 = G/(||G||_F+1e-7), transposed when r > c); f32 arithmetic on every device \
              (BF16 inputs widened on load)",
    inputs: &[TensorSpec {
        name: "g",
        shape: "[n,r,c]",
        dtypes: "F32|BF16",
    }],
    params: &[ParamSpec {
        name: "steps",
        default: Some("5"),
        help: "iterations, 1..=100",
    }],
    outputs: &[TensorSpec {
        name: "x",
        shape: "[n,r,c]",
        dtypes: "F32",
    }],
    run: run_spec,
};
