//! Rotary position embedding on x[T,H,D] (q or k) with positions[T] I32 (kernels in
//! kernels/cuda/rope.cu).
//!
//! Convention: the half-split (GPT-NeoX) pairing. For each head vector, element i and element
//! i + D/2 (i < D/2) are rotated together by angle = positions[t] * inv_freq[i]:
//! y[i] = x[i] cos - x[i+D/2] sin,  y[i+D/2] = x[i+D/2] cos + x[i] sin.
//!
//! inv_freq[i] = theta^(-2i/D), computed by [`rope_inv_freq`] in f64 and rounded to f32 once on
//! the host; every device gets that table, so the angle `(positions[t] as f32) * inv_freq[i]`
//! (one f32 multiply) is the same float everywhere. cos and sin are the full-range f32
//! functions of each device (within an ulp or two of each other). theta defaults to 10000.
//!
//! Positions restart per sequence in a packed varlen batch; the caller passes them (any i32 is
//! accepted: a rotation by any angle is well defined). The backward is the rotation by -angle.
//! Inputs F32 or BF16; math and outputs f32. Elementwise per pair: batch-invariant.

use super::elementwise::{
    as_i32, by_dtype, ew_blocks, float_dtype, host_tensor, EW_THREADS, FLOAT,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;

/// The default base of the rotary frequencies.
pub const DEFAULT_THETA: f32 = 10000.0;

fn check_theta(theta: f32) -> Result<()> {
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::param(
            "theta",
            format!("{theta} must be finite and > 0"),
        ));
    }
    Ok(())
}

fn check_dim(name: &str, dim: usize) -> Result<()> {
    if !dim.is_multiple_of(2) {
        return Err(Error::Invalid(format!(
            "`{name}`: head dim D = {dim} must be even (pairs i and i + D/2 are rotated together)"
        )));
    }
    Ok(())
}

/// inv_freq[i] = theta^(-2i/D) for i < D/2, computed in f64 and rounded to f32.
pub fn rope_inv_freq(dim: usize, theta: f32) -> Result<Vec<f32>> {
    check_theta(theta)?;
    check_dim("x", dim)?;
    Ok((0..dim / 2)
        .map(|i| (theta as f64).powf(-2.0 * i as f64 / dim as f64) as f32)
        .collect())
}

/// Half head dimensions up to this keep a row's cos/sin on the stack (larger on the heap).
const STACK_HALF: usize = 128;
/// Positions below this have their cos/sin rows kept per thread (see [`cos_sin`]).
const CACHED_POSITIONS: i32 = 1 << 16;

/// The kept cos/sin rows of one (theta bits, inv_freq length): positions 0.. computed so far,
/// `[pos][i]` = (cos, sin) of pos * inv_freq[i].
type CosSinTable = (u32, usize, Vec<(f32, f32)>);

thread_local! {
    /// Per thread: one table per (theta, head dim) seen.
    static COS_SIN: std::cell::RefCell<Vec<CosSinTable>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `out[i] = (cos(pos * inv_freq[i]), sin(pos * inv_freq[i]))` in f32 (the angle rounded to f32
/// first, as the kernels do). Rows of positions 0..2^16 are computed once per thread and kept:
/// the same positions come back for q and k, in every layer and every decode step, and the
/// values are those of the direct computation, so the cache changes no bits.
fn cos_sin(pos: i32, theta: f32, inv_freq: &[f32], out: &mut [(f32, f32)]) {
    let direct = |out: &mut [(f32, f32)]| {
        for (o, &f) in out.iter_mut().zip(inv_freq) {
            let angle = pos as f32 * f;
            *o = (angle.cos(), angle.sin());
        }
    };
    if !(0..CACHED_POSITIONS).contains(&pos) {
        return direct(out);
    }
    let half = inv_freq.len();
    COS_SIN.with(|cell| {
        let mut tables = cell.borrow_mut();
        let key = (theta.to_bits(), half);
        let i = match tables.iter().position(|(t, h, _)| (*t, *h) == key) {
            Some(i) => i,
            None => {
                tables.push((key.0, key.1, Vec::new()));
                tables.len() - 1
            }
        };
        let table = &mut tables[i].2;
        let p = pos as usize;
        while table.len() < (p + 1) * half {
            let q = (table.len() / half) as f32;
            table.extend(inv_freq.iter().map(|&f| {
                let angle = q * f;
                (angle.cos(), angle.sin())
            }));
        }
        out.copy_from_slice(&table[p * half..(p + 1) * half]);
    });
}

fn rotate_reference(
    x: &[f32],
    positions: &[i32],
    t: usize,
    h: usize,
    dim: usize,
    theta: f32,
    sign: f32,
) -> Result<Vec<f32>> {
    if x.len() != t * h * dim {
        return Err(Error::Invalid(format!(
            "`x` has {} elements; expected {} ([T,H,D] = [{t},{h},{dim}])",
            x.len(),
            t * h * dim
        )));
    }
    if positions.len() != t {
        return Err(Error::Invalid(format!(
            "`positions` has {} elements; expected T = {t}",
            positions.len()
        )));
    }
    let inv_freq = rope_inv_freq(dim, theta)?;
    let mut y = vec![0.0f32; x.len()];
    if dim == 0 || h == 0 {
        return Ok(y);
    }
    let half = dim / 2;
    par::rows_mut(&mut y, h * dim, 4 * h * dim + 40 * half, |row, yt| {
        let (xt, pos) = (&x[row * h * dim..(row + 1) * h * dim], positions[row]);
        // cos/sin once per (t, i), shared by the heads (as the kernel does).
        let mut stack = [(0.0f32, 0.0f32); STACK_HALF];
        let mut heap = Vec::new();
        let cs: &mut [(f32, f32)] = if half <= STACK_HALF {
            &mut stack[..half]
        } else {
            heap.resize(half, (0.0, 0.0));
            &mut heap
        };
        cos_sin(pos, theta, &inv_freq, cs);
        for (yh, xh) in yt.chunks_mut(dim).zip(xt.chunks(dim)) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let s = sign * s;
                let (x1, x2) = (xh[i], xh[i + half]);
                yh[i] = x1 * c - x2 * s;
                yh[i + half] = x2 * c + x1 * s;
            }
        }
    });
    Ok(y)
}

/// RoPE forward of x[t, h, dim] at `positions[t]`.
pub fn rope_reference(
    x: &[f32],
    positions: &[i32],
    t: usize,
    h: usize,
    dim: usize,
    theta: f32,
) -> Result<Vec<f32>> {
    rotate_reference(x, positions, t, h, dim, theta, 1.0)
}

/// RoPE backward: dx = dy rotated by -angle.
pub fn rope_backward_reference(
    dy: &[f32],
    positions: &[i32],
    t: usize,
    h: usize,
    dim: usize,
    theta: f32,
) -> Result<Vec<f32>> {
    rotate_reference(dy, positions, t, h, dim, theta, -1.0)
}

fn rotate(
    backend: &Backend,
    name: &str,
    x: &Tensor,
    positions: &Tensor,
    theta: f32,
    sign: f32,
) -> Result<Tensor> {
    let dtype = float_dtype(&[(name, x)])?;
    x.expect_rank(name, 3, "[T,H,D]")?;
    let (t, h, dim) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    check_dim(name, dim)?;
    check_theta(theta)?;
    positions.expect_dtype("positions", DType::I32)?;
    if positions.shape() != [t] {
        return Err(Error::shape(
            "positions",
            format!("[{t}] ([T], T = the first dimension of {name}[T,H,D])"),
            positions.shape(),
        ));
    }
    if let Backend::Cpu = backend {
        let y = rotate_reference(
            &x.f32_data()?,
            &positions.to_vec::<i32>()?,
            t,
            h,
            dim,
            theta,
            sign,
        )?;
        return host_tensor(backend, x.shape(), y);
    }
    let y = Tensor::poisoned(backend, x.shape(), DType::F32)?;
    let items = t * (dim / 2);
    if items == 0 || h == 0 {
        return Ok(y);
    }
    let inv_freq = Tensor::from_slice(backend, &[dim / 2], &rope_inv_freq(dim, theta)?)?;
    // Grid-stride over the T*D/2 (position, frequency) items; each thread reads and writes
    // its pair (i, i + D/2) in every head of its row only.
    backend.launch(
        &Launch::new(
            by_dtype(dtype, "rope_f32", "rope_bf16"),
            [ew_blocks(items), 1, 1],
            [EW_THREADS, 1, 1],
        )
        .arg_tensor(x)
        .arg_tensor(positions)
        .arg_tensor(&inv_freq)
        .arg_tensor(&y)
        .arg_i32(as_i32(name, "T", t)?)
        .arg_i32(as_i32(name, "H", h)?)
        .arg_i32(as_i32(name, "D", dim)?)
        .arg_f32(sign),
    )?;
    Ok(y)
}

/// RoPE forward on any device: x[T,H,D] (F32 or BF16), positions[T] I32 -> y[T,H,D] F32.
pub fn rope(backend: &Backend, x: &Tensor, positions: &Tensor, theta: f32) -> Result<Tensor> {
    rotate(backend, "x", x, positions, theta, 1.0)
}

/// RoPE backward on any device: dy[T,H,D] rotated by -angle -> dx[T,H,D] F32.
pub fn rope_backward(
    backend: &Backend,
    dy: &Tensor,
    positions: &Tensor,
    theta: f32,
) -> Result<Tensor> {
    rotate(backend, "dy", dy, positions, theta, -1.0)
}

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let theta = call.param_f32("theta")?;
    Ok(vec![(
        "y",
        rope(backend, call.tensor("x")?, call.tensor("positions")?, theta)?,
    )])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let theta = call.param_f32("theta")?;
    Ok(vec![(
        "dx",
        rope_backward(
            backend,
            call.tensor("dy")?,
            call.tensor("positions")?,
            theta,
        )?,
    )])
}

const THETA_PARAM: ParamSpec = ParamSpec {
    name: "theta",
    default: Some("10000"),
    help: "base of the rotary frequencies: inv_freq[i] = theta^(-2i/D)",
};

/// `sluice kernel rope`.
pub static SPEC: OpSpec = OpSpec {
    name: "rope",
    summary: "rotary embedding of x[T,H,D] at positions[T], half-split pairs (i, i+D/2)",
    inputs: &[
        TensorSpec {
            name: "x",
            shape: "[T,H,D]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "positions",
            shape: "[T]",
            dtypes: "I32",
        },
    ],
    params: &[THETA_PARAM],
    outputs: &[TensorSpec {
        name: "y",
        shape: "[T,H,D]",
        dtypes: "F32",
    }],
    run: run_forward,
};

/// `sluice kernel rope_backward`.
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "rope_backward",
    summary: "gradient of rope: dy[T,H,D] rotated by -angle",
    inputs: &[
        TensorSpec {
            name: "dy",
            shape: "[T,H,D]",
            dtypes: FLOAT,
        },
        TensorSpec {
            name: "positions",
            shape: "[T]",
            dtypes: "I32",
        },
    ],
    params: &[THETA_PARAM],
    outputs: &[TensorSpec {
        name: "dx",
        shape: "[T,H,D]",
        dtypes: "F32",
    }],
    run: run_backward,
};

#[cfg(test)]
mod cos_sin_cache {
    use super::*;

    /// The kept cos/sin rows are the direct computation's bits, for cached positions (first and
    /// later calls, in any order) and for positions outside the cache (negative, >= 2^16).
    #[test]
    fn kept_rows_equal_direct_computation_bit_for_bit() {
        let inv = rope_inv_freq(34, 10000.0).unwrap();
        for pos in [17, 0, 5, 17, 300, -3, 70_000, 299] {
            let mut got = vec![(f32::NAN, f32::NAN); inv.len()];
            cos_sin(pos, 10000.0, &inv, &mut got);
            for (i, &(c, s)) in got.iter().enumerate() {
                let angle = pos as f32 * inv[i];
                assert_eq!(c.to_bits(), angle.cos().to_bits(), "cos, pos {pos}, i {i}");
                assert_eq!(s.to_bits(), angle.sin().to_bits(), "sin, pos {pos}, i {i}");
            }
        }
    }
}
