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
//!   ([`gemm_reference_into`]), rayon over the matrices. The Frobenius norm is
//!   [`ns_sum_of_squares`]: f32, in the device's order (a fixed partition of each matrix into
//!   chunks, FMA chains per lane, the block reductions' order), so the norm's bits are the
//!   device's; the combines use the device's formulas (fmaf(beta, E, alpha P)). Where every
//!   product's K is at most 256 (one chunk of the CPU GEMM: one ascending FMA chain, as the
//!   kernels) cpu and emu give the same bits (kernels/tests/newton_schulz_bits.rs).
//! - `emu` / `cuda`: kernels/cuda/newton_schulz.cu, a sequence of launches each covering all `n`
//!   matrices: two normalise launches (sums of squares of fixed chunks, many blocks per matrix;
//!   then a scale launch that adds each matrix's partials in a fixed order; no atomics), then
//!   three batched strided matmul launches per step (A = X X^T; Bm = c A A + b A;
//!   X' = Bm X + a X). All arithmetic after the load is f32 (true f32 FMA, no tensor cores), for
//!   BF16 inputs too: they are widened exactly on load and X stays f32 between steps.
//!
//! The bf16 path ([`newton_schulz_bf16`], or [`newton_schulz_with_precision`] with
//! [`NsPrecision::Bf16`]): X is kept in f32 between steps (the master copy) and every product
//! takes bf16 operands (round-to-nearest-even of the f32 values) with f32 accumulation, through
//! the gemm family's batched bf16 GEMM with an epilogue ([`gemm_batched_epilogue`]:
//! `gemm_bf16_mma_epilogue`, mma.sync tensor cores, on emu/cuda), which also does the
//! elementwise work between the products: A = X X^T = gemm(Xb, Xb), written in f32 and as Ab;
//! A A = gemm(Ab, Ab) (A is symmetric), combined into Bb = bf16(fmaf(b, A, c AA)); X' = B X + a X
//! = fmaf(a, X, gemm(Bb, XTb)) in f32, written with its bf16 rounding Xb' and bf16 transpose
//! XTb'. Launches per call: 2 + 3 x steps. The normalisation is the f32 one; its scale launch
//! also writes Xb and XTb. On `cpu` it is [`newton_schulz_bf16_reference`]: the same rounding
//! points, bf16 values widened exactly into the f32 [`gemm_reference_into`].

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::block_reduce::{block_sum, reduce_lanes, BLOCK_THREADS};
use crate::ops::gemm::{gemm_reference_into, gemm_strided_into};
use crate::ops::gemm_epilogue::{gemm_batched_epilogue, GemmEpilogue};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;

/// The quintic's coefficients (a, b, c).
pub const NS_COEFFS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);
/// Added to the Frobenius norm before dividing.
pub const NS_EPS: f32 = 1e-7;
/// The default number of steps.
pub const DEFAULT_STEPS: usize = 5;
/// The largest number of steps accepted.
pub const MAX_STEPS: usize = 100;

/// The arithmetic of the iteration's products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsPrecision {
    /// True f32 everywhere (the SIMT f32 matmul on emu/cuda).
    F32,
    /// bf16 operands (rounded from the f32 master copy of X) with f32 accumulation, on the
    /// bf16 tensor-core GEMM on emu/cuda.
    Bf16,
}

impl NsPrecision {
    /// The default for a device: bf16 on `cuda` (tensor cores), f32 on `cpu` and `emu`.
    pub fn default_for(backend: &Backend) -> NsPrecision {
        match backend {
            Backend::Cuda(_) => NsPrecision::Bf16,
            _ => NsPrecision::F32,
        }
    }

    /// `f32` or `bf16`; the error names `param`.
    pub fn parse(param: &str, text: &str) -> Result<NsPrecision> {
        match text.trim() {
            "f32" => Ok(NsPrecision::F32),
            "bf16" => Ok(NsPrecision::Bf16),
            other => Err(Error::param(
                param,
                format!("`{other}` is not a Newton-Schulz precision; use `f32` or `bf16`"),
            )),
        }
    }

    /// `"f32"` or `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            NsPrecision::F32 => "f32",
            NsPrecision::Bf16 => "bf16",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------------

/// Newton-Schulz over `g` [n,r,c] (f32), `steps` steps; returns x [n,r,c] f32.
///
/// # Panics
/// If `g.len() != n * r * c` (a caller bug: [`newton_schulz`] validates user input first).
pub fn newton_schulz_reference(g: &[f32], n: usize, r: usize, c: usize, steps: usize) -> Vec<f32> {
    per_matrix(g, n, r, c, |gm, o| one_matrix(gm, o, r, c, steps))
}

/// The bf16 path over `g` [n,r,c] (f32), `steps` steps; returns x [n,r,c] f32. The rounding
/// points are the device's: X is f32 between steps; each product's operands are rounded to bf16
/// (nearest-even) and widened exactly into the f32 [`gemm_reference_into`];
/// B = bf16(fma(b, A, c AA)) and X' = fma(a, X, BX), the device's combine formulas.
///
/// # Panics
/// If `g.len() != n * r * c` (a caller bug: [`newton_schulz_bf16`] validates user input first).
pub fn newton_schulz_bf16_reference(
    g: &[f32],
    n: usize,
    r: usize,
    c: usize,
    steps: usize,
) -> Vec<f32> {
    per_matrix(g, n, r, c, |gm, o| one_matrix_bf16(gm, o, r, c, steps))
}

/// Runs `one(g_i, out_i)` for each of the n matrices of `g` [n,r,c] in parallel.
///
/// # Panics
/// If `g.len() != n * r * c` (a caller bug: the device entry points validate user input first).
fn per_matrix(
    g: &[f32],
    n: usize,
    r: usize,
    c: usize,
    one: impl Fn(&[f32], &mut [f32]) + Sync,
) -> Vec<f32> {
    assert_eq!(
        g.len(),
        n * r * c,
        "newton_schulz reference: g must hold n*r*c elements"
    );
    let size = r * c;
    let mut out = vec![0.0f32; n * size];
    if size == 0 {
        return out;
    }
    let (rr, cw) = (r.min(c), r.max(c));
    let work = 4 * rr * rr * cw + 2 * rr * rr * rr;
    par::rows_mut(&mut out, size, work, |i, o| {
        one(&g[i * size..(i + 1) * size], o)
    });
    out
}

/// Writes the wide-orientation result `x` [rr,cw] to `out` in the input's orientation.
fn write_back(out: &mut [f32], x: &[f32], rr: usize, cw: usize, transposed: bool) {
    if transposed {
        out.copy_from_slice(&transpose(x, rr, cw));
    } else {
        out.copy_from_slice(x);
    }
}

/// `v` rounded to bf16 (nearest-even) and widened back (exact).
fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Elements one thread of the sum-of-squares pass loads at once (16 bytes of bf16; the same
/// groups for f32, so the order does not depend on the dtype).
const SQ_GROUP: usize = 8;
/// The smallest chunk of the sum-of-squares pass: 4 groups a thread.
const SQ_MIN_CHUNK: usize = SQ_GROUP * BLOCK_THREADS * 4;
/// The most chunks a matrix is cut into: one partial per lane of the combining block.
const SQ_MAX_PARTS: usize = BLOCK_THREADS;

/// The fixed partition of a matrix of `size` >= 1 elements for its sum of squares: (chunk,
/// parts), `parts` <= 256 chunks of `chunk` elements (a multiple of 8192; the last chunk may be
/// shorter). A function of `size` alone, so a matrix's norm never depends on n.
pub fn ns_sq_partition(size: usize) -> (usize, usize) {
    let units = size.div_ceil(SQ_MIN_CHUNK).max(1);
    let chunk = SQ_MIN_CHUNK * units.div_ceil(SQ_MAX_PARTS);
    (chunk, size.div_ceil(chunk).max(1))
}

/// ||g||_F^2 in f32 in the device's order (kernels/cuda/newton_schulz.cu,
/// `newton_schulz_sq_partials_*` then `newton_schulz_scale_*`): g is cut by [`ns_sq_partition`];
/// in each chunk lane t adds the squares of the 8-element groups t, t + 256, ... to +0 with one
/// FMA each in ascending order, the 256 lanes are added in `block_sum`'s order, and the
/// chunks' partials are added in `block_sum`'s order again (partial p in lane p).
pub fn ns_sum_of_squares(g: &[f32]) -> f32 {
    if g.is_empty() {
        return 0.0;
    }
    let (chunk, parts) = ns_sq_partition(g.len());
    let partials: Vec<f32> = g
        .chunks(chunk)
        .map(|part| reduce_lanes(fma::sq_lanes(part)))
        .collect();
    debug_assert_eq!(partials.len(), parts);
    block_sum(parts, |p| partials[p])
}

/// X0 = G / (||G||_F + 1e-7) in the wide orientation; returns (x, rows, cols, transposed).
fn normalized_wide(g: &[f32], r: usize, c: usize) -> (Vec<f32>, usize, usize, bool) {
    let denom = ns_sum_of_squares(g).sqrt() + NS_EPS;
    let transposed = r > c;
    let (rr, cw) = if transposed { (c, r) } else { (r, c) };
    let mut x: Vec<f32> = g.iter().map(|&v| v / denom).collect();
    if transposed {
        x = transpose(&x, r, c);
    }
    (x, rr, cw, transposed)
}

fn one_matrix_bf16(g: &[f32], out: &mut [f32], r: usize, c: usize, steps: usize) {
    let (a, b, cc) = NS_COEFFS;
    let (mut x, rr, cw, transposed) = normalized_wide(g, r, c);
    let mut am = vec![0.0f32; rr * rr];
    let mut a2 = vec![0.0f32; rr * rr];
    let mut bx = vec![0.0f32; rr * cw];
    for _ in 0..steps {
        let xb: Vec<f32> = x.iter().map(|&v| round_bf16(v)).collect();
        // A = Xb Xb^T; AA = Ab Ab^T; Bb = bf16(b A + c AA); BX = Bb (XTb)^T.
        gemm_reference_into(&xb, &xb, &mut am, rr, rr, cw);
        let ab: Vec<f32> = am.iter().map(|&v| round_bf16(v)).collect();
        gemm_reference_into(&ab, &ab, &mut a2, rr, rr, rr);
        fma::combine_into_p(&mut a2, &am, cc, b); // fmaf(b, A, c AA)
        let bb: Vec<f32> = a2.iter().map(|&v| round_bf16(v)).collect();
        // BX = Bb Xb, Xb read as the [rr, cw] row-major right operand (no transposed copy; the
        // bits of the product with the copy, see gemm_strided_into).
        gemm_strided_into(rr, cw, rr, (&bb, rr, 1), (&xb, cw, 1), &mut bx);
        fma::combine_into_e(&mut x, &bx, 1.0, a); // fmaf(a, X, BX)
    }
    write_back(out, &x, rr, cw, transposed);
}

/// The references' element loops, with FMA instructions where the CPU has them. `mul_add` is a
/// correctly rounded fused multiply-add on every path, so the bits are the same either way; but
/// without the `fma` feature (the default x86-64 target) each one is a libm call, measured ~13x
/// slower than the unfused loop (78 vs 6 ms for the 19.7M combines of a 48 x [128,512] call).
mod fma {
    use super::{BLOCK_THREADS, SQ_GROUP};

    /// Runs the `#[inline(always)]` body `$body` inside an `fma`-enabled wrapper when the CPU
    /// has FMA.
    macro_rules! dispatch {
        ($(#[$m:meta])* pub fn $name:ident($($a:ident: $t:ty),*) $(-> $r:ty)? = $body:ident) => {
            $(#[$m])*
            pub fn $name($($a: $t),*) $(-> $r)? {
                #[cfg(target_arch = "x86_64")]
                {
                    #[target_feature(enable = "fma")]
                    fn fast($($a: $t),*) $(-> $r)? {
                        $body($($a),*)
                    }
                    if std::is_x86_feature_detected!("fma") {
                        // SAFETY: `fast` needs only FMA instructions, and the CPU has them.
                        return unsafe { fast($($a),*) };
                    }
                }
                $body($($a),*)
            }
        };
    }

    dispatch! {
        /// The 256 lane sums of one chunk (see `ns_sum_of_squares`): lane t adds the squares
        /// of groups t, t + 256, ... to +0, one FMA each.
        pub fn sq_lanes(part: &[f32]) -> [f32; BLOCK_THREADS] = sq_lanes_body
    }
    dispatch! {
        /// p[i] = fmaf(beta, e[i], alpha * p[i]).
        pub fn combine_into_p(p: &mut [f32], e: &[f32], alpha: f32, beta: f32) = combine_p_body
    }
    dispatch! {
        /// e[i] = fmaf(beta, e[i], alpha * p[i]).
        pub fn combine_into_e(e: &mut [f32], p: &[f32], alpha: f32, beta: f32) = combine_e_body
    }

    #[inline(always)]
    fn sq_lanes_body(part: &[f32]) -> [f32; BLOCK_THREADS] {
        let mut lanes = [0.0f32; BLOCK_THREADS];
        for (gi, group) in part.chunks(SQ_GROUP).enumerate() {
            let lane = &mut lanes[gi % BLOCK_THREADS];
            for &v in group {
                *lane = v.mul_add(v, *lane);
            }
        }
        lanes
    }

    #[inline(always)]
    fn combine_p_body(p: &mut [f32], e: &[f32], alpha: f32, beta: f32) {
        for (pv, &ev) in p.iter_mut().zip(e) {
            *pv = beta.mul_add(ev, alpha * *pv);
        }
    }

    #[inline(always)]
    fn combine_e_body(e: &mut [f32], p: &[f32], alpha: f32, beta: f32) {
        for (ev, &pv) in e.iter_mut().zip(p) {
            *ev = beta.mul_add(*ev, alpha * pv);
        }
    }
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
    let (mut x, rr, cw, transposed) = normalized_wide(g, r, c);
    let mut am = vec![0.0f32; rr * rr];
    let mut a2 = vec![0.0f32; rr * rr];
    let mut bx = vec![0.0f32; rr * cw];
    for _ in 0..steps {
        // A = X X^T; A^2 = A A^T (A is symmetric); BX = Bm (X^T)^T with Bm = b A + c A^2.
        gemm_reference_into(&x, &x, &mut am, rr, rr, cw);
        gemm_reference_into(&am, &am, &mut a2, rr, rr, rr);
        // The device's combine formula, fmaf(beta, E, alpha * P).
        fma::combine_into_p(&mut a2, &am, cc, b);
        gemm_strided_into(rr, cw, rr, (&a2, rr, 1), (&x, cw, 1), &mut bx);
        fma::combine_into_e(&mut x, &bx, 1.0, a);
    }
    write_back(out, &x, rr, cw, transposed);
}

// ---------------------------------------------------------------------------------------------
// Device entry point
// ---------------------------------------------------------------------------------------------

/// Threads per block of every kernel; the matmul's tile edge; the scale kernel's tile edge
/// (newton_schulz.cu has the same numbers).
const THREADS: u32 = BLOCK_THREADS as u32;
const TILE: usize = 16;
const SCALE_TILE: usize = 64;

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
/// runner), in f32 on every device. Returns x [n,r,c] F32 on the same device.
pub fn newton_schulz(backend: &Backend, g: &Tensor, steps: usize) -> Result<Tensor> {
    newton_schulz_with_precision(backend, g, steps, NsPrecision::F32)
}

/// [`newton_schulz`] on the bf16 path: bf16 GEMM operands, f32 accumulation, X kept in f32
/// between steps (see the module docs).
pub fn newton_schulz_bf16(backend: &Backend, g: &Tensor, steps: usize) -> Result<Tensor> {
    newton_schulz_with_precision(backend, g, steps, NsPrecision::Bf16)
}

/// [`newton_schulz`] with the precision of the products chosen explicitly.
pub fn newton_schulz_with_precision(
    backend: &Backend,
    g: &Tensor,
    steps: usize,
    precision: NsPrecision,
) -> Result<Tensor> {
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
        let gf = g.to_f32_vec()?;
        let x = match precision {
            NsPrecision::F32 => newton_schulz_reference(&gf, n, r, c, steps),
            NsPrecision::Bf16 => newton_schulz_bf16_reference(&gf, n, r, c, steps),
        };
        return Tensor::from_slice(backend, &[n, r, c], &x);
    }
    let out = Tensor::poisoned(backend, &[n, r, c], DType::F32)?;
    if n * r * c == 0 {
        return Ok(out);
    }
    let scale_tiles = r.div_ceil(SCALE_TILE) * c.div_ceil(SCALE_TILE);
    if r.max(c) > i32::MAX as usize
        || n > 65535
        || r.min(c).div_ceil(TILE) > 65535
        || scale_tiles > i32::MAX as usize
    {
        return Err(Error::shape(
            "g",
            "[n,r,c] with n <= 65535, min(r,c) <= 1048560, r, c within 32-bit indices and \
             ceil(r/64) * ceil(c/64) < 2^31",
            g.shape(),
        ));
    }
    let transposed = r > c;
    let (rr, cw) = if transposed { (c, r) } else { (r, c) };
    let x = Tensor::poisoned(backend, &[n, rr, cw], DType::F32)?;
    match precision {
        NsPrecision::F32 => {
            // X0 in the wide orientation: G's layout, or its transpose.
            let outs = if transposed {
                [None, Some(&x), None, None]
            } else {
                [Some(&x), None, None, None]
            };
            normalize(backend, g, (n, r, c), outs)?;
            iterate_f32(backend, x, out, (n, rr, cw), transposed, steps)
        }
        NsPrecision::Bf16 => {
            let xb = Tensor::poisoned(backend, &[n, rr, cw], DType::BF16)?;
            let xtb = Tensor::poisoned(backend, &[n, cw, rr], DType::BF16)?;
            // X0 (f32), Xb = bf16(X0) and XTb = bf16(X0)^T, all from the scale launch.
            let outs = if transposed {
                [None, Some(&x), Some(&xtb), Some(&xb)]
            } else {
                [Some(&x), None, Some(&xb), Some(&xtb)]
            };
            normalize(backend, g, (n, r, c), outs)?;
            iterate_bf16(backend, x, out, (xb, xtb), (n, rr, cw), transposed, steps)
        }
    }
}

/// X0 = G / (||G||_F + 1e-7) for the n matrices of `g` [n,r,c] on emu/cuda: one
/// `newton_schulz_sq_partials_*` launch (the partials of [`ns_sq_partition`]) and one
/// `newton_schulz_scale_*` launch that adds them and writes the outputs given, in the order
/// [f32 [n,r,c], f32 [n,c,r], bf16 [n,r,c], bf16 [n,c,r]].
fn normalize(
    backend: &Backend,
    g: &Tensor,
    (n, r, c): (usize, usize, usize),
    outs: [Option<&Tensor>; 4],
) -> Result<()> {
    let size = r * c;
    let (chunk, parts) = ns_sq_partition(size);
    let partials = Tensor::poisoned(backend, &[n, parts], DType::F32)?;
    let (sq, scale) = match g.dtype() {
        DType::BF16 => ("newton_schulz_sq_partials_bf16", "newton_schulz_scale_bf16"),
        _ => ("newton_schulz_sq_partials_f32", "newton_schulz_scale_f32"),
    };
    backend.launch(
        &Launch::new(sq, [parts as u32, n as u32, 1], [THREADS, 1, 1])
            .arg_tensor(g)
            .arg_tensor(&partials)
            .arg_i64(size as i64)
            .arg_i64(chunk as i64)
            .arg_i32(parts as i32),
    )?;
    let tiles = r.div_ceil(SCALE_TILE) * c.div_ceil(SCALE_TILE);
    let mut launch = Launch::new(scale, [tiles as u32, n as u32, 1], [THREADS, 1, 1])
        .arg_tensor(g)
        .arg_tensor(&partials)
        .arg_i32(parts as i32);
    for o in outs {
        launch = match o {
            Some(t) => launch.arg_tensor(t),
            None => launch.arg_u64(0),
        };
    }
    backend.launch(&launch.arg_i32(r as i32).arg_i32(c as i32))
}

/// The bf16 path's steps on emu/cuda: `x` [n,rr,cw] is the normalised wide X0 (f32), `xb` and
/// `xtb` its bf16 rounding and that transposed; the result goes to `out` (transposed back when
/// `transposed`). Three launches of `gemm_bf16_mma_epilogue` per step, the elementwise work in
/// their epilogues:
///   A = gemm(Xb, Xb)            -> A (f32, the next product's E) and Ab = bf16(A)
///   Bb = bf16(fmaf(b, A, c AA)) with AA = gemm(Ab, Ab)
///   X' = fmaf(a, X, BX) with BX = gemm(Bb, XTb) -> X' (f32), Xb', XTb' (bf16); the last step
///                                  writes only the output, transposed back when needed.
/// XTb is read by the third product while its successor is written, so it is double-buffered
/// like X.
fn iterate_bf16(
    backend: &Backend,
    mut x: Tensor,
    mut out: Tensor,
    (mut xb, mut xtb): (Tensor, Tensor),
    (n, rr, cw): (usize, usize, usize),
    transposed: bool,
    steps: usize,
) -> Result<Tensor> {
    let (a, b, cc) = NS_COEFFS;
    let mut x_next = Tensor::poisoned(backend, &[n, rr, cw], DType::F32)?;
    let mut xtb_next = Tensor::poisoned(backend, &[n, cw, rr], DType::BF16)?;
    let mut am = Tensor::poisoned(backend, &[n, rr, rr], DType::F32)?;
    let mut ab = Tensor::poisoned(backend, &[n, rr, rr], DType::BF16)?;
    let mut bb = Tensor::poisoned(backend, &[n, rr, rr], DType::BF16)?;
    for step in 0..steps {
        let last = step + 1 == steps;
        // A = X X^T, and its bf16 rounding.
        let mut ep = GemmEpilogue::identity(&mut am);
        ep.c_b = Some(&mut ab);
        gemm_batched_epilogue(backend, &xb, &xb, ep)?;
        // A A (= A A^T: A is symmetric), combined with A and rounded.
        let mut ep = GemmEpilogue::scaled_plus(cc, b, &am);
        ep.c_b = Some(&mut bb);
        gemm_batched_epilogue(backend, &ab, &ab, ep)?;
        // B X, combined with X.
        let mut ep = GemmEpilogue::scaled_plus(1.0, a, &x);
        if last {
            if transposed {
                ep.c_t = Some(&mut out);
            } else {
                ep.c = Some(&mut out);
            }
            gemm_batched_epilogue(backend, &bb, &xtb, ep)?;
        } else {
            ep.c = Some(&mut x_next);
            ep.c_b = Some(&mut xb);
            ep.c_bt = Some(&mut xtb_next);
            gemm_batched_epilogue(backend, &bb, &xtb, ep)?;
            std::mem::swap(&mut x, &mut x_next);
            std::mem::swap(&mut xtb, &mut xtb_next);
        }
    }
    Ok(out)
}

/// The f32 path's steps on emu/cuda (see [`iterate_bf16`] for the arguments).
fn iterate_f32(
    backend: &Backend,
    mut x: Tensor,
    out: Tensor,
    (n, rr, cw): (usize, usize, usize),
    transposed: bool,
    steps: usize,
) -> Result<Tensor> {
    let (a, b, cc) = NS_COEFFS;
    let mut x_next = Tensor::poisoned(backend, &[n, rr, cw], DType::F32)?;
    let am = Tensor::poisoned(backend, &[n, rr, rr], DType::F32)?;
    let bm = Tensor::poisoned(backend, &[n, rr, rr], DType::F32)?;

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
    let precision = NsPrecision::parse("precision", call.param("precision")?)?;
    let x = newton_schulz_with_precision(backend, call.tensor("g")?, steps, precision)?;
    Ok(vec![("x", x)])
}

/// The kernel runner's `newton_schulz` row (DESIGN.md section 7).
pub static SPEC: OpSpec = OpSpec {
    name: "newton_schulz",
    summary: "Muon's quintic Newton-Schulz orthogonalisation of each of n matrices \
              (X0 = G/(||G||_F+1e-7), transposed when r > c); precision=f32: f32 arithmetic on \
              every device (BF16 inputs widened on load); precision=bf16: bf16 GEMM operands \
              with f32 accumulation, X kept in f32",
    inputs: &[TensorSpec {
        name: "g",
        shape: "[n,r,c]",
        dtypes: "F32|BF16",
    }],
    params: &[
        ParamSpec {
            name: "steps",
            default: Some("5"),
            help: "iterations, 1..=100",
        },
        ParamSpec {
            name: "precision",
            default: Some("f32"),
            help: "f32 (true f32 products) or bf16 (bf16 operands, f32 accumulation)",
        },
    ],
    outputs: &[TensorSpec {
        name: "x",
        shape: "[n,r,c]",
        dtypes: "F32",
    }],
    run: run_spec,
};
