//! The grouped forms a grouped layer's backward needs, reading every operand in place:
//! - [`gemm_nn`] and [`gemm_grouped_nn`]: rows `offsets[g]..offsets[g+1]` of A [T,K] times `b_stack[g]` stored
//!   [K,N] (C = A · B, not A · B^T): the activation gradient d(out) · W_g of a layer whose
//!   weight is [out,in], with no transposed copy of the weights;
//! - [`gemm_segment_tn`]: out[g] = P_g^T · Q_g over the row segments of P [T,p] and Q [T,q]:
//!   the weight gradient of every group in one launch, K = the segment's rows (ragged).
//!
//! Kernels (kernels/cuda/gemm.cu): `gemm_f32_nn` / `gemm_bf16_mma_nn` (the grouped GEMM's loops
//! with B staged from [K,N] rows; the bf16 one reads them with ldmatrix .trans) and
//! `gemm_f32_segment_tn` / `gemm_bf16_mma_segment_tn` (a 64x64 SIMT or 128x128 mma.sync tile of
//! out[g] per block, blockIdx.z = g, walking the segment's rows from its first). On the Hopper
//! path (`SLUICE_GEMM_PATH=wgmma`) BF16 takes `gemm_bf16_wgmma_nn` and
//! `gemm_bf16_wgmma_segment_tn` (kernels/cuda/gemm_hopper.cu: the same pipeline with MN-major
//! wgmma operands read where they are stored) when the stored rows are multiples of 16 bytes
//! (N % 8 and K % 8 for the NN form, P % 8 and Q % 8 for the segment form: weight dimensions,
//! never the row count).
//!
//! Bits: the same values reach the same instructions in the same order as the [N,K] form on B
//! transposed (`gemm_grouped`) and as `gemm` on each segment's transposed rows, so the results
//! have their bits; the tests compare them bit for bit. On emu the wgmma forms give the same
//! bits too (the emulated wgmma adds its products in ascending k, as the emulated mma does);
//! on a GPU the two instruction families may round differently, which is why the path is
//! chosen per device and never per shape.
//!
//! Determinism: no split over K, no atomics. Weight gradients sum over rows, so they depend on
//! the segment's rows by definition; each element is one chain over them in ascending order.

use super::{
    check_grid_y, check_offsets, check_path, dims_fit_i32, float_dtype, gemm_chain_into,
    gemm_grouped_with_path, GemmPath, F32_TILES, MMA_TILES,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::gemm_hopper;
use crate::tensor::Tensor;
use half::bf16;

/// The G+1 offsets on the host where they are there or the debug switch asks for a check
/// (empty otherwise: a device trusts them; the kernels clamp every offset into [0, T]).
fn host_offsets(offsets: &Tensor, rows: usize) -> Result<Vec<usize>> {
    offsets.expect_dtype("offsets", DType::I32)?;
    offsets.expect_rank("offsets", 1, "[G+1]")?;
    if offsets.shape()[0] == 0 {
        return Err(Error::shape(
            "offsets",
            "[G+1] with G >= 0",
            offsets.shape(),
        ));
    }
    if crate::debug::reads_back(offsets) {
        check_offsets(&offsets.to_vec::<i32>()?, Some(rows))
    } else {
        Ok(Vec::new())
    }
}

/// Names `tensor` in a dtype error of [`float_dtype`] about its second operand.
fn dtype_of(a: &Tensor, b: &Tensor, b_name: &str) -> Result<DType> {
    float_dtype(a, b).map_err(|e| match e {
        Error::DType { expected, got, .. } if b.dtype() != a.dtype() => Error::DType {
            tensor: b_name.into(),
            expected,
            got,
        },
        other => other,
    })
}

/// Grouped C = A · B: rows `offsets[g]..offsets[g+1]` of `a` [T,K] times `b_stack[g]` [K,N]
/// (row-major, as stored), for g in 0..G; `offsets` is I32 [G+1], 0 first, T last,
/// non-decreasing. C is [T,N] F32, with the bits of [`super::gemm_grouped`] on `b_stack`
/// transposed to [G,N,K]. Offsets are checked as `gemm_grouped` checks them.
pub fn gemm_grouped_nn(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
) -> Result<Tensor> {
    gemm_grouped_nn_with_path(backend, a, b_stack, offsets, GemmPath::from_env()?)
}

/// [`gemm_grouped_nn`] with the bf16 kernel chosen explicitly.
pub fn gemm_grouped_nn_with_path(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
    path: GemmPath,
) -> Result<Tensor> {
    a.expect_rank("a", 2, "[T,K]")?;
    let (rows, k) = (a.shape()[0], a.shape()[1]);
    // Checked on the host where they are there (or in debug mode); the kernels clamp them.
    host_offsets(offsets, rows)?;
    let groups = offsets.shape()[0] - 1;
    let bs = b_stack.shape();
    if bs.len() != 3 || bs[0] != groups || bs[1] != k {
        return Err(Error::shape(
            "b_stack",
            format!("[{groups},{k},N] (G from `offsets`, K from `a`)"),
            bs,
        ));
    }
    let n = bs[2];
    let dtype = dtype_of(a, b_stack, "b_stack")?;
    dims_fit_i32(&[("T", rows), ("N", n), ("K", k), ("G", groups)])?;
    if let Backend::Cpu = backend {
        // The [N,K] form's own CPU path on the transposed weights: the same bits by definition.
        let bt = transposed_stack(backend, b_stack, groups, k, n, dtype)?;
        return gemm_grouped_with_path(backend, a, &bt, offsets, GemmPath::Mma);
    }
    launch_nn(
        backend,
        dtype,
        a,
        b_stack,
        Some((offsets, groups)),
        rows,
        n,
        k,
        path,
    )
}

/// C[M,N] = A[M,K] · B[K,N] with B row-major as stored: [`super::gemm`] on B transposed,
/// with its bits, without the transposed copy.
pub fn gemm_nn(backend: &Backend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    gemm_nn_with_path(backend, a, b, GemmPath::from_env()?)
}

/// [`gemm_nn`] with the bf16 kernel chosen explicitly.
pub fn gemm_nn_with_path(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    path: GemmPath,
) -> Result<Tensor> {
    a.expect_rank("a", 2, "[M,K]")?;
    let (m, k) = (a.shape()[0], a.shape()[1]);
    if b.shape().len() != 2 || b.shape()[0] != k {
        return Err(Error::shape(
            "b",
            format!("[{k},N] (K from `a`)"),
            b.shape(),
        ));
    }
    let n = b.shape()[1];
    let dtype = dtype_of(a, b, "b")?;
    dims_fit_i32(&[("M", m), ("N", n), ("K", k)])?;
    if let Backend::Cpu = backend {
        let bt = transposed_stack(backend, b, 1, k, n, dtype)?.reshape(&[n, k])?;
        return super::gemm_with_path(backend, a, &bt, GemmPath::Mma);
    }
    launch_nn(backend, dtype, a, b, None, m, n, k, path)
}

/// `b` [G,K,N] (or [K,N] with G = 1) transposed to [G,N,K] on the host, in `dtype`.
fn transposed_stack(
    backend: &Backend,
    b: &Tensor,
    groups: usize,
    k: usize,
    n: usize,
    dtype: DType,
) -> Result<Tensor> {
    let src = b.f32_data()?;
    let mut bt = vec![0.0f32; src.len()];
    for g in 0..groups {
        let (s, d) = (&src[g * k * n..][..k * n], &mut bt[g * k * n..][..k * n]);
        for kk in 0..k {
            for j in 0..n {
                d[j * k + kk] = s[kk * n + j];
            }
        }
    }
    match dtype {
        DType::BF16 => {
            let v: Vec<bf16> = bt.iter().map(|&x| bf16::from_f32(x)).collect();
            Tensor::from_slice(backend, &[groups, n, k], &v)
        }
        _ => Tensor::from_f32_vec(backend, &[groups, n, k], bt),
    }
}

/// Launches `gemm_f32_nn` / `gemm_bf16_mma_nn` (or `gemm_bf16_wgmma_nn` on the Hopper path):
/// grouped over `offsets` (G groups), or one plain product (batched mode, one entry) when
/// `grouped` is None.
#[allow(clippy::too_many_arguments)]
fn launch_nn(
    backend: &Backend,
    dtype: DType,
    a: &Tensor,
    b: &Tensor,
    grouped: Option<(&Tensor, usize)>,
    rows: usize,
    n: usize,
    k: usize,
    path: GemmPath,
) -> Result<Tensor> {
    check_path(backend, dtype, path)?;
    let c = Tensor::poisoned(backend, &[rows, n], DType::F32)?;
    if rows * n == 0 {
        return Ok(c);
    }
    if dtype == DType::BF16 && path == GemmPath::Wgmma && gemm_hopper::takes_nn(k, n) {
        gemm_hopper::nn(backend, a, b, grouped, &c, rows, n, k)?;
        return Ok(c);
    }
    let (t, kernel) = match dtype {
        DType::F32 => (&F32_TILES, "gemm_f32_nn"),
        _ => (&MMA_TILES, "gemm_bf16_mma_nn"),
    };
    let groups = grouped.map_or(0, |(_, g)| g);
    // As gemm_grouped: ceil(T/BM) + G row tiles bound the segments' tiles; the surplus exits.
    let row_tiles = rows.div_ceil(t.block_m) + groups;
    if row_tiles > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "gemm_nn: {row_tiles} row tiles exceed the grid's x limit"
        )));
    }
    let grid = [row_tiles as u32, blocks_for(n, t.block_n), 1];
    check_grid_y(grid[1], n)?;
    let launch = Launch::new(kernel, grid, [t.threads, 1, 1])
        .arg_tensor(a)
        .arg_tensor(b)
        .arg_tensor(&c);
    let launch = match grouped {
        Some((offsets, _)) => launch.arg_tensor(offsets),
        None => launch.arg_u64(0), // offsets: null = batched mode, one entry
    };
    backend.launch(
        &launch
            .arg_i32(rows as i32)
            .arg_i32(n as i32)
            .arg_i32(k as i32)
            .arg_i32(groups as i32)
            .arg_i64(0)
            .arg_i64((k * n) as i64)
            .arg_i64(0),
    )?;
    Ok(c)
}

/// out[g] = P_g^T · Q_g for the row segments g (rows `offsets[g]..offsets[g+1]`) of `p` [T,P]
/// and `q` [T,Q]: out is [G,P,Q] F32; an empty segment gives zeros. `p` and `q` are both F32
/// or both BF16 (multiplied exactly, accumulated in f32). Every element is one FMA chain over
/// its segment's rows in ascending order on every device (the reference:
/// [`gemm_segment_tn_reference`]); for BF16 on emu that is the emulated mma's order, so cpu and
/// emu give the same bits. Offsets are checked as [`super::gemm_grouped`] checks them.
pub fn gemm_segment_tn(
    backend: &Backend,
    p: &Tensor,
    q: &Tensor,
    offsets: &Tensor,
) -> Result<Tensor> {
    gemm_segment_tn_with_path(backend, p, q, offsets, GemmPath::from_env()?)
}

/// [`gemm_segment_tn`] with the bf16 kernel chosen explicitly.
pub fn gemm_segment_tn_with_path(
    backend: &Backend,
    p: &Tensor,
    q: &Tensor,
    offsets: &Tensor,
    path: GemmPath,
) -> Result<Tensor> {
    p.expect_rank("p", 2, "[T,P]")?;
    let (rows, pc) = (p.shape()[0], p.shape()[1]);
    if q.shape().len() != 2 || q.shape()[0] != rows {
        return Err(Error::shape(
            "q",
            format!("[{rows},Q] (T from `p`)"),
            q.shape(),
        ));
    }
    let qc = q.shape()[1];
    let dtype = dtype_of(p, q, "q")?;
    let bounds = host_offsets(offsets, rows)?;
    let groups = offsets.shape()[0] - 1;
    dims_fit_i32(&[("T", rows), ("P", pc), ("Q", qc), ("G", groups)])?;
    if groups > 65535 {
        return Err(Error::Invalid(format!(
            "gemm_segment_tn: G = {groups} groups exceed the grid's z limit (65535)"
        )));
    }
    if let Backend::Cpu = backend {
        let out = gemm_segment_tn_reference(&p.f32_data()?, &q.f32_data()?, &bounds, pc, qc);
        return Tensor::from_f32_vec(backend, &[groups, pc, qc], out);
    }
    check_path(backend, dtype, path)?;
    let out = Tensor::poisoned(backend, &[groups, pc, qc], DType::F32)?;
    if groups * pc * qc == 0 {
        return Ok(out);
    }
    if dtype == DType::BF16 && path == GemmPath::Wgmma && gemm_hopper::takes_segment(pc, qc) {
        gemm_hopper::segment_tn(backend, p, q, offsets, &out, rows, pc, qc, groups)?;
        return Ok(out);
    }
    let (tile, kernel) = match dtype {
        DType::F32 => (64, "gemm_f32_segment_tn"),
        _ => (128, "gemm_bf16_mma_segment_tn"),
    };
    let grid = [blocks_for(qc, tile), blocks_for(pc, tile), groups as u32];
    check_grid_y(grid[1], pc)?;
    // Block (x, y, g) writes rows y*tile.. and columns x*tile.. of out[g] (clamped to P and Q),
    // reading rows offsets[g]..offsets[g+1] of p and q (clamped into [0, T]).
    backend.launch(
        &Launch::new(kernel, grid, [256, 1, 1])
            .arg_tensor(p)
            .arg_tensor(q)
            .arg_tensor(offsets)
            .arg_tensor(&out)
            .arg_i32(rows as i32)
            .arg_i32(pc as i32)
            .arg_i32(qc as i32),
    )?;
    Ok(out)
}

/// The CPU reference of [`gemm_segment_tn`]: `bounds` are the G+1 checked offsets; element
/// (g, i, j) = one FMA chain over rows `bounds[g]..bounds[g+1]` ascending of p[r,i] * q[r,j].
pub fn gemm_segment_tn_reference(
    p: &[f32],
    q: &[f32],
    bounds: &[usize],
    pc: usize,
    qc: usize,
) -> Vec<f32> {
    let groups = bounds.len().saturating_sub(1);
    let mut out = vec![0.0f32; groups * pc * qc];
    for g in 0..groups {
        let (r0, r1) = (bounds[g], bounds[g + 1]);
        let n = r1 - r0;
        if n == 0 {
            continue;
        }
        // The segment's rows transposed ([P,n] and [Q,n]), so the chain over K = n is the
        // gemm family's chain (gemm_chain_into sums A[i,:] . B[j,:] with one fmaf per k).
        let mut pt = vec![0.0f32; pc * n];
        let mut qt = vec![0.0f32; qc * n];
        for r in 0..n {
            for i in 0..pc {
                pt[i * n + r] = p[(r0 + r) * pc + i];
            }
            for j in 0..qc {
                qt[j * n + r] = q[(r0 + r) * qc + j];
            }
        }
        gemm_chain_into(&pt, &qt, &mut out[g * pc * qc..][..pc * qc], pc, qc, n);
    }
    out
}
