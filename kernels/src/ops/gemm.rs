//! `gemm`: C[M,N] = A[M,K] · B[N,K]^T, the linear-layer form (DESIGN.md section 3.1), plus the
//! batched (strided) form `[batch,M,K] x [batch,N,K]` and the grouped form (row segments of A,
//! one weight matrix each: the MoE form).
//!
//! Numerics: F32 inputs compute in true f32 (never tf32) on every device; BF16 inputs are
//! multiplied exactly (a bf16 x bf16 product fits in f32) and accumulated in f32. The output is
//! always F32. On `cpu`, BF16 inputs run [`super::gemm_chain`]: one ascending FMA chain per
//! output over all of K, the order the emulated tensor-core path sums in, so cpu and emu give
//! the same bits for BF16 inputs at any K.
//!
//! Batch invariance: row i of C is bit-identical whatever M is and wherever the row sits. No
//! device splits K; every output element sums its K products in one fixed order that depends on
//! K only (see `gemm_reference_into` for the CPU's order and kernels/cuda/gemm.cu for the GPU's).
//!
//! Paths on `cuda` and `emu` (kernels/cuda/gemm.cu):
//! - `gemm_f32`: F32, tiled SIMT FMA, one thread per 4x4 outputs, K ascending one FMA at a time.
//! - `gemm_bf16_mma`: BF16, mma.sync m16n8k16 with ldmatrix (compute_80; the default on every GPU).
//! - `gemm_bf16_wgmma`: BF16, the Hopper pipeline (kernels/cuda/gemm_hopper.cu, launched by
//!   [`super::gemm_hopper`]: tensor-map copies, warp-specialised wgmma, persistent grid;
//!   compute_90a) for K % 8 == 0, `gemm_bf16_mma` for other K. Never run on a GPU yet, so it is
//!   used only when `SLUICE_GEMM_PATH=wgmma` is set (or [`GemmPath::Wgmma`] is asked for);
//!   scripts/gpu-check tests it so the first GPU run can verify it and decide the sm_90 default.
//!
//! The batched bf16 form with an epilogue (alpha, beta, E; f32 / bf16 outputs, as is or
//! transposed) is [`super::gemm_epilogue`].

pub use super::gemm_chain::{gemm_chain_into, gemm_chain_strided_into};
pub use super::gemm_small::{gemm_packed_into, PackedB};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::runner::{OpCall, OpOutputs, OpSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;

use super::gemm_hopper;

// ---------------------------------------------------------------------------------------------
// CPU reference
// ---------------------------------------------------------------------------------------------

/// C[m,n] = A[m,k] · B[n,k]^T in f32, written into `c` (overwritten, not accumulated).
///
/// Runs on the `matrixmultiply` crate (AVX2/FMA micro-kernels), row panels over rayon. It is
/// batch-invariant, which `kernels/tests/gemm.rs` checks bit for bit: each element of C is the
/// sum of K products taken in a fixed order that depends on K alone: K is cut into chunks of 256
/// (matrixmultiply's `kc`), each chunk accumulated from zero by one FMA per k in ascending order,
/// and the chunk sums added to C in ascending order. M only decides how rows are packed into
/// 8-row micro-panels; a partial panel is zero-padded and run through the same micro-kernel into
/// a scratch tile, so neither the number of rows nor a row's position changes its arithmetic.
/// Threads split rows and columns, never K.
///
/// # Panics
/// If a slice's length is not the one `m`, `n`, `k` give (a caller bug: the device entry points
/// validate user input before calling this).
pub fn gemm_reference_into(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    assert_eq!(a.len(), m * k, "gemm_reference: a must hold m*k elements");
    assert_eq!(b.len(), n * k, "gemm_reference: b must hold n*k elements");
    assert_eq!(c.len(), m * n, "gemm_reference: c must hold m*n elements");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    // Rows split into panels over the pool's threads, each panel one single-threaded sgemm: a
    // row's arithmetic does not depend on which panel it is in (see above), so this keeps batch
    // invariance, and it scales better than matrixmultiply's own pool (measured in
    // docs/perf/gemm.md). Panels are multiples of 8 rows (the micro-kernel's height) and small
    // products stay on the calling thread. B^T is the k x n view of row-major B[n,k] (row
    // stride 1, column stride k).
    gemm_strided_into(m, n, k, (a, k, 1), (b, 1, k), c);
}

/// The shared preamble of the strided CPU products: asserts that `c` holds m*n elements and
/// that every stride stays inside its slice, and settles the empty cases (nothing to do when
/// m or n is 0; C = 0 when k is 0). Returns whether a product remains to be computed.
///
/// # Panics
/// If `c` is not m*n long or a stride reaches past the end of a slice (a caller bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn strided_operands_checked(
    name: &str,
    m: usize,
    n: usize,
    k: usize,
    (a, rsa, csa): (&[f32], usize, usize),
    (b, rsb, csb): (&[f32], usize, usize),
    c: &mut [f32],
) -> bool {
    assert_eq!(c.len(), m * n, "{name}: c must hold m*n elements");
    if m == 0 || n == 0 {
        return false;
    }
    if k == 0 {
        c.fill(0.0);
        return false;
    }
    let last = |r: usize, rs: usize, cols: usize, cs: usize| (r - 1) * rs + (cols - 1) * cs;
    assert!(last(m, rsa, k, csa) < a.len(), "{name}: A out of bounds");
    assert!(last(k, rsb, n, csb) < b.len(), "{name}: B out of bounds");
    true
}

/// C[m,n] = A · B in f32 for operands given by strides: element (i, kk) of A at
/// `a[i * rsa + kk * csa]`, element (kk, j) of B at `b[kk * rsb + j * csb]`; C row-major,
/// overwritten. The same arithmetic as [`gemm_reference_into`] (matrixmultiply packs either
/// layout into the same panels, so a product computed from a transposed view has the bits of
/// the product of the transposed copy): what lets the MoE backward skip its transposes.
///
/// # Panics
/// If a stride reaches past the end of a slice (a caller bug).
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided_into(
    m: usize,
    n: usize,
    k: usize,
    (a, rsa, csa): (&[f32], usize, usize),
    (b, rsb, csb): (&[f32], usize, usize),
    c: &mut [f32],
) {
    if !strided_operands_checked(
        "gemm_strided_into",
        m,
        n,
        k,
        (a, rsa, csa),
        (b, rsb, csb),
        c,
    ) {
        return;
    }
    // Row panels over the pool as in gemm_reference_into (a row's bits do not depend on its
    // panel).
    let rows_per_panel = panel_rows(m, n, k);
    crate::par::chunks_mut(c, n * rows_per_panel, 1 << 30, |r0_panel, c_panel| {
        let r0 = r0_panel * rows_per_panel;
        let rows = c_panel.len() / n;
        // SAFETY: the asserts above bound every index matrixmultiply forms: A's rows r0..r0+rows
        // (< m) and columns < k through (rsa, csa), B's k x n window through (rsb, csb), and C's
        // panel (rows x n, row-major, a &mut slice aliasing neither input). beta = 0: C is not
        // read.
        unsafe {
            matrixmultiply::sgemm(
                rows,
                k,
                n,
                1.0,
                a.as_ptr().add(r0 * rsa),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                0.0,
                c_panel.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    });
}

/// Rows per thread panel of a product (multiples of 8; the whole of M when small).
fn panel_rows(m: usize, n: usize, k: usize) -> usize {
    let threads = crate::par::threads();
    let panels = if m * n * k < (1 << 21) {
        1
    } else {
        threads.min(m.div_ceil(8))
    };
    m.div_ceil(panels).div_ceil(8) * 8
}

/// Products with at most this many rows of A use the packed small-row GEMM
/// ([`gemm_packed_into`]; same bits as [`gemm_reference_into`]) when B is a host F32 tensor.
pub const SMALL_M: usize = 64;
/// ... and K at most this (longer K streams the packed panels from further out in the cache
/// than matrixmultiply's blocking does).
const SMALL_MAX_K: usize = 1024;

/// The longest K for which a BF16 product on `cpu` may take the small-row packed kernel
/// instead of [`gemm_chain_into`]: with K within one of its chunks
/// ([`super::gemm_small::KC`]), each output is one FMA chain from +0 over all of K, which is
/// exactly the chain's order, so the two give the same bits (and the packed copy of a weight is
/// kept on it, which matters at decode's few rows).
pub const BF16_PACKED_MAX_K: usize = super::gemm_small::KC;

/// The packed form of `b` (`groups` stacked [n, k] matrices) when a product with `m` rows of A
/// should take the small-row path: `b` a host F32 (or BF16) tensor, `m <= SMALL_M`,
/// `k <= SMALL_MAX_K`.
pub fn small_rows_rhs(
    b: &Tensor,
    groups: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Option<std::sync::Arc<PackedB>> {
    if m == 0 || m > SMALL_M || n == 0 || k == 0 || k > SMALL_MAX_K {
        return None;
    }
    b.packed_rhs(groups, n, k)
}

/// C[m,n] = A[m,k] · B[n,k]^T in f32. See [`gemm_reference_into`].
pub fn gemm_reference(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0.0; m * n];
    gemm_reference_into(a, b, &mut c, m, n, k);
    c
}

/// bf16 inputs widened to f32 exactly, then [`gemm_reference`] (f32 accumulation).
pub fn gemm_reference_bf16(a: &[bf16], b: &[bf16], m: usize, n: usize, k: usize) -> Vec<f32> {
    gemm_reference(&widen(a), &widen(b), m, n, k)
}

/// Batched: C[i] = A[i] · B[i]^T for i in 0..batch, with A [batch,m,k], B [batch,n,k] and C
/// [batch,m,n] contiguous.
pub fn gemm_batched_reference(
    a: &[f32],
    b: &[f32],
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    assert_eq!(
        b.len(),
        batch * n * k,
        "gemm_batched_reference: b must hold batch*n*k"
    );
    assert_eq!(
        a.len(),
        batch * m * k,
        "gemm_batched_reference: a must hold batch*m*k"
    );
    let mut c = vec![0.0; batch * m * n];
    if m * n == 0 {
        return c;
    }
    for i in 0..batch {
        gemm_reference_into(
            &a[i * m * k..(i + 1) * m * k],
            &b[i * n * k..(i + 1) * n * k],
            &mut c[i * m * n..(i + 1) * m * n],
            m,
            n,
            k,
        );
    }
    c
}

/// Grouped (the MoE form): rows `offsets[g]..offsets[g+1]` of A [T,k] are multiplied by
/// `b_stack[g]` [n,k]; C is [T,n] with T = offsets[G]. Segments may be empty.
///
/// # Panics
/// If `offsets` is not a non-decreasing list starting at 0, or a slice length disagrees with it
/// (the device entry point [`gemm_grouped`] validates user input first).
pub fn gemm_grouped_reference(
    a: &[f32],
    b_stack: &[f32],
    offsets: &[i32],
    n: usize,
    k: usize,
) -> Vec<f32> {
    let bounds =
        check_offsets(offsets, None).unwrap_or_else(|e| panic!("gemm_grouped_reference: {e}"));
    let groups = offsets.len() - 1;
    let rows = bounds.last().copied().unwrap_or(0);
    assert_eq!(a.len(), rows * k, "gemm_grouped_reference: a must hold T*k");
    assert_eq!(
        b_stack.len(),
        groups * n * k,
        "gemm_grouped_reference: b_stack must hold G*n*k"
    );
    let mut c = vec![0.0; rows * n];
    for g in 0..groups {
        let (r0, r1) = (bounds[g], bounds[g + 1]);
        if r1 == r0 {
            continue;
        }
        gemm_reference_into(
            &a[r0 * k..r1 * k],
            &b_stack[g * n * k..(g + 1) * n * k],
            &mut c[r0 * n..r1 * n],
            r1 - r0,
            n,
            k,
        );
    }
    c
}

/// The row bounds of each segment, after checking `offsets` (G+1 entries, 0 first, T last,
/// non-decreasing).
fn check_offsets(offsets: &[i32], rows: Option<usize>) -> Result<Vec<usize>> {
    let bad = |m: String| Error::Invalid(format!("tensor `offsets`: {m}"));
    if offsets.is_empty() {
        return Err(bad(
            "needs G+1 >= 1 entries (the start of each group, then T)".into(),
        ));
    }
    if offsets[0] != 0 {
        return Err(bad(format!("offsets[0] is {}; it must be 0", offsets[0])));
    }
    for (g, w) in offsets.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(bad(format!(
                "offsets[{}] = {} < offsets[{g}] = {}; offsets must be non-decreasing",
                g + 1,
                w[1],
                w[0]
            )));
        }
    }
    let last = *offsets.last().unwrap_or(&0) as usize;
    if rows.is_some_and(|rows| rows != last) {
        let rows = rows.unwrap_or(0);
        return Err(bad(format!(
            "offsets[G] is {last}, but `a` has {rows} rows; the segments must cover a exactly"
        )));
    }
    Ok(offsets.iter().map(|&o| o as usize).collect())
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

// ---------------------------------------------------------------------------------------------
// Device entry points
// ---------------------------------------------------------------------------------------------

/// Which bf16 kernel the `cuda` and `emu` devices use (F32 always uses `gemm_f32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// `gemm_bf16_mma`: mma.sync m16n8k16 (compute_80); the default on every GPU.
    Mma,
    /// `gemm_bf16_wgmma`: the Hopper pipeline (TMA, warp-specialised wgmma, persistent grid)
    /// where K % 8 == 0, else mma.sync. Opt-in until verified on a GPU.
    Wgmma,
}

impl GemmPath {
    /// The path `SLUICE_GEMM_PATH` asks for (`mma`, the default, or `wgmma`).
    pub fn from_env() -> Result<GemmPath> {
        match std::env::var("SLUICE_GEMM_PATH") {
            Err(_) => Ok(GemmPath::Mma),
            Ok(v) => match v.trim() {
                "" | "mma" => Ok(GemmPath::Mma),
                "wgmma" => Ok(GemmPath::Wgmma),
                other => Err(Error::param(
                    "SLUICE_GEMM_PATH",
                    format!("`{other}` is not a GEMM path; use `mma` (default) or `wgmma`"),
                )),
            },
        }
    }
}

/// Tile shapes of the kernels, shared by the grid computation and the kernels (gemm.cu has
/// the same numbers as `constexpr`s; a mismatch shows up in every emu test).
struct TileConfig {
    kernel: &'static str,
    block_m: usize,
    block_n: usize,
    threads: u32,
    shared_bytes: u32,
}

const F32_TILES: TileConfig = TileConfig {
    kernel: "gemm_f32",
    block_m: 64,
    block_n: 64,
    threads: 256,
    shared_bytes: 0,
};
const MMA_TILES: TileConfig = TileConfig {
    kernel: "gemm_bf16_mma",
    block_m: 128,
    block_n: 128,
    threads: 256,
    shared_bytes: 0,
};
fn tiles_for(dtype: DType, path: GemmPath) -> &'static TileConfig {
    match (dtype, path) {
        (DType::F32, _) => &F32_TILES,
        // The Hopper path runs gemm_bf16_mma for the K it does not take (gemm_hopper::takes).
        (_, GemmPath::Mma | GemmPath::Wgmma) => &MMA_TILES,
    }
}

/// The dtype shared by `a` and `b` (F32 or BF16).
fn float_dtype(a: &Tensor, b: &Tensor) -> Result<DType> {
    if !a.dtype().is_float() {
        return Err(Error::DType {
            tensor: "a".into(),
            expected: "F32 or BF16".into(),
            got: a.dtype().to_string(),
        });
    }
    if b.dtype() != a.dtype() {
        return Err(Error::DType {
            tensor: "b".into(),
            expected: format!("{} (the dtype of `a`)", a.dtype()),
            got: b.dtype().to_string(),
        });
    }
    Ok(a.dtype())
}

fn dims_fit_i32(dims: &[(&str, usize)]) -> Result<()> {
    for &(name, v) in dims {
        if v > i32::MAX as usize {
            return Err(Error::Invalid(format!(
                "gemm: {name} = {v} exceeds the kernels' 32-bit index range"
            )));
        }
    }
    Ok(())
}

/// A fresh F32 output: poisoned on emu and cuda (a kernel that misses an element shows as
/// NaN); zeros on cpu, where the reference writes every element and the poison pass was only
/// a second write of the whole output (fresh zero pages cost no pass at all).
fn output(backend: &Backend, shape: &[usize]) -> Result<Tensor> {
    match backend {
        Backend::Cpu => Tensor::zeros(backend, shape, DType::F32),
        _ => Tensor::poisoned(backend, shape, DType::F32),
    }
}

/// C[M,N] = A[M,K] · B[N,K]^T. `a` and `b` are both F32 or both BF16; C is F32.
pub fn gemm(backend: &Backend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    gemm_with_path(backend, a, b, GemmPath::from_env()?)
}

/// [`gemm`] with the bf16 kernel chosen explicitly (tests run both paths side by side).
pub fn gemm_with_path(backend: &Backend, a: &Tensor, b: &Tensor, path: GemmPath) -> Result<Tensor> {
    let (m, n, _) = plain_dims(a, b)?;
    let mut c = output(backend, &[m, n])?;
    gemm_into_with_path(backend, a, b, &mut c, path)?;
    Ok(c)
}

/// [`gemm`] into an existing F32 tensor `c` [M,N] on the same device (its contents are
/// overwritten; nothing is allocated).
pub fn gemm_into(backend: &Backend, a: &Tensor, b: &Tensor, c: &mut Tensor) -> Result<()> {
    gemm_into_with_path(backend, a, b, c, GemmPath::from_env()?)
}

/// [`gemm_into`] with the bf16 kernel chosen explicitly.
pub fn gemm_into_with_path(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    c: &mut Tensor,
    path: GemmPath,
) -> Result<()> {
    let (m, n, k) = plain_dims(a, b)?;
    c.expect_dtype("c", DType::F32)?;
    if c.shape() != [m, n] {
        return Err(Error::shape(
            "c",
            format!("[{m},{n}] (M from `a`, N from `b`)"),
            c.shape(),
        ));
    }
    batched(backend, a, b, c, 1, m, n, k, false, path)
}

/// (M, N, K) of a plain product, after checking the ranks and that K agrees.
fn plain_dims(a: &Tensor, b: &Tensor) -> Result<(usize, usize, usize)> {
    a.expect_rank("a", 2, "[M,K]")?;
    let (m, k) = (a.shape()[0], a.shape()[1]);
    if b.shape().len() != 2 || b.shape()[1] != k {
        return Err(Error::shape(
            "b",
            format!("[N,{k}] (K = {k} from `a`)"),
            b.shape(),
        ));
    }
    Ok((m, b.shape()[0], k))
}

/// Batched: C[i] = A[i] · B[i]^T with `a` [batch,M,K], `b` [batch,N,K] (or [N,K], one matrix
/// shared by every batch entry); C is [batch,M,N] F32.
pub fn gemm_batched(backend: &Backend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    gemm_batched_with_path(backend, a, b, GemmPath::from_env()?)
}

/// [`gemm_batched`] with the bf16 kernel chosen explicitly.
pub fn gemm_batched_with_path(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    path: GemmPath,
) -> Result<Tensor> {
    a.expect_rank("a", 3, "[batch,M,K]")?;
    let (batch, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let shared_b = b.shape().len() == 2;
    let ok = match b.shape() {
        [bb, _, bk] => *bb == batch && *bk == k,
        [_, bk] => *bk == k,
        _ => false,
    };
    if !ok {
        return Err(Error::shape(
            "b",
            format!("[{batch},N,{k}] or [N,{k}] (batch and K from `a`)"),
            b.shape(),
        ));
    }
    let n = b.shape()[b.shape().len() - 2];
    let mut c = output(backend, &[batch, m, n])?;
    batched(backend, a, b, &mut c, batch, m, n, k, shared_b, path)?;
    Ok(c)
}

#[allow(clippy::too_many_arguments)]
/// Runs the batched form into `c` (batch*m*n F32 elements, shape checked by the caller).
fn batched(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    c: &mut Tensor,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    shared_b: bool,
    path: GemmPath,
) -> Result<()> {
    let dtype = float_dtype(a, b)?;
    dims_fit_i32(&[("M", m), ("N", n), ("K", k), ("batch", batch)])?;
    match backend {
        Backend::Cpu => {
            let af = a.f32_data()?;
            let c = c.host_slice_mut::<f32>()?;
            // BF16 operands sum in the device's order (one FMA chain over K); F32 in the
            // reference's chunked order.
            let bf16 = dtype == DType::BF16;
            #[cfg(feature = "planted-faults")]
            if !bf16
                && crate::planted::gemm(&af, &b.f32_data()?, c, [batch, m, n, k], shared_b, SMALL_M)
            {
                return Ok(());
            }
            // Few rows: the small-row kernel from B packed once (kept on the weight). For BF16
            // only when K fits one of its chunks: then that chunk is the same chain from +0.
            if (batch == 1 || shared_b) && (!bf16 || k <= BF16_PACKED_MAX_K) {
                if let Some(pb) = small_rows_rhs(b, 1, m, n, k) {
                    for i in 0..batch {
                        gemm_packed_into(
                            &af[i * m * k..(i + 1) * m * k],
                            &pb,
                            0,
                            &mut c[i * m * n..(i + 1) * m * n],
                            m,
                        );
                    }
                    return Ok(());
                }
            }
            let product = if bf16 {
                gemm_chain_into
            } else {
                gemm_reference_into
            };
            let bf = b.f32_data()?;
            for i in 0..batch {
                let bi = if shared_b { 0 } else { i };
                if m * n > 0 {
                    product(
                        &af[i * m * k..(i + 1) * m * k],
                        &bf[bi * n * k..(bi + 1) * n * k],
                        &mut c[i * m * n..(i + 1) * m * n],
                        m,
                        n,
                        k,
                    );
                }
            }
            Ok(())
        }
        _ => {
            check_path(backend, dtype, path)?;
            if batch * m * n == 0 {
                return Ok(());
            }
            if batch > 65535 {
                return Err(Error::Invalid(format!(
                    "gemm_batched: batch = {batch} exceeds the grid's z limit (65535)"
                )));
            }
            if dtype == DType::BF16 && path == GemmPath::Wgmma && gemm_hopper::takes(k) {
                return gemm_hopper::batched(backend, a, b, c, batch, m, n, k, shared_b);
            }
            let t = tiles_for(dtype, path);
            let grid = [
                blocks_for(m, t.block_m),
                blocks_for(n, t.block_n),
                batch as u32,
            ];
            check_grid_y(grid[1], n)?;
            let launch = Launch::new(t.kernel, grid, [t.threads, 1, 1])
                .shared_bytes(t.shared_bytes)
                .arg_tensor(a)
                .arg_tensor(b)
                .arg_tensor(c)
                .arg_u64(0) // offsets: null = batched mode
                .arg_i32(m as i32)
                .arg_i32(n as i32)
                .arg_i32(k as i32)
                .arg_i32(0) // groups (unused in batched mode)
                .arg_i64((m * k) as i64)
                .arg_i64(if shared_b { 0 } else { (n * k) as i64 })
                .arg_i64((m * n) as i64);
            backend.launch(&launch)
        }
    }
}

/// Grouped (the MoE form): rows `offsets[g]..offsets[g+1]` of `a` [T,K] times `b_stack[g]`
/// [N,K]^T, for g in 0..G; `offsets` is I32 [G+1], 0 first, T last, non-decreasing (empty
/// segments allowed). C is [T,N] F32.
///
/// The offsets are checked on the host where they are in host memory, and on a device in debug
/// mode ([`crate::debug`]: a copy of G+1 integers and a stream sync); otherwise a device's
/// offsets are trusted (the MoE sort makes them valid by construction): a bad offset would
/// send the kernel outside `a`.
pub fn gemm_grouped(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
) -> Result<Tensor> {
    gemm_grouped_with_path(backend, a, b_stack, offsets, GemmPath::from_env()?)
}

/// [`gemm_grouped`] with the bf16 kernel chosen explicitly.
pub fn gemm_grouped_with_path(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
    path: GemmPath,
) -> Result<Tensor> {
    a.expect_rank("a", 2, "[T,K]")?;
    let (rows, k) = (a.shape()[0], a.shape()[1]);
    offsets.expect_dtype("offsets", DType::I32)?;
    offsets.expect_rank("offsets", 1, "[G+1]")?;
    let groups = offsets.shape()[0].saturating_sub(1);
    if offsets.shape()[0] == 0 {
        return Err(Error::shape(
            "offsets",
            "[G+1] with G >= 0",
            offsets.shape(),
        ));
    }
    if b_stack.shape().len() != 3 || b_stack.shape()[0] != groups || b_stack.shape()[2] != k {
        return Err(Error::shape(
            "b_stack",
            format!("[{groups},N,{k}] (G from `offsets`, K from `a`)"),
            b_stack.shape(),
        ));
    }
    let n = b_stack.shape()[1];
    let dtype = float_dtype(a, b_stack).map_err(|e| match e {
        Error::DType { expected, got, .. } if b_stack.dtype() != a.dtype() => Error::DType {
            tensor: "b_stack".into(),
            expected,
            got,
        },
        other => other,
    })?;
    dims_fit_i32(&[("T", rows), ("N", n), ("K", k), ("G", groups)])?;
    let bounds = if crate::debug::reads_back(offsets) {
        check_offsets(&offsets.to_vec::<i32>()?, Some(rows))?
    } else {
        Vec::new()
    };
    match backend {
        Backend::Cpu => {
            let af = a.f32_data()?;
            let bf = b_stack.f32_data()?;
            let mut c = vec![0.0f32; rows * n];
            let largest = bounds.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
            let packed = small_rows_rhs(b_stack, groups, largest, n, k);
            for g in 0..groups {
                let (r0, r1) = (bounds[g], bounds[g + 1]);
                if let (DType::BF16, Some(pb), true) =
                    (dtype, &packed, k <= BF16_PACKED_MAX_K && r1 > r0)
                {
                    // One chunk: the chain's bits (see BF16_PACKED_MAX_K).
                    gemm_packed_into(&af[r0 * k..r1 * k], pb, g, &mut c[r0 * n..r1 * n], r1 - r0);
                } else if dtype == DType::BF16 {
                    gemm_chain_into(
                        &af[r0 * k..r1 * k],
                        &bf[g * n * k..(g + 1) * n * k],
                        &mut c[r0 * n..r1 * n],
                        r1 - r0,
                        n,
                        k,
                    );
                } else if let (Some(pb), true) = (&packed, r1 > r0) {
                    gemm_packed_into(&af[r0 * k..r1 * k], pb, g, &mut c[r0 * n..r1 * n], r1 - r0);
                } else if r1 > r0 && n > 0 {
                    gemm_reference_into(
                        &af[r0 * k..r1 * k],
                        &bf[g * n * k..(g + 1) * n * k],
                        &mut c[r0 * n..r1 * n],
                        r1 - r0,
                        n,
                        k,
                    );
                }
            }
            Tensor::from_slice(backend, &[rows, n], &c)
        }
        _ => {
            check_path(backend, dtype, path)?;
            let c = Tensor::poisoned(backend, &[rows, n], DType::F32)?;
            if rows * n == 0 {
                return Ok(c);
            }
            if dtype == DType::BF16 && path == GemmPath::Wgmma && gemm_hopper::takes(k) {
                gemm_hopper::grouped(backend, a, b_stack, offsets, &c, rows, n, k, groups)?;
                return Ok(c);
            }
            let t = tiles_for(dtype, path);
            // Each segment needs ceil(len/BM) row tiles; their total is at most
            // ceil(T/BM) + G. Blocks past the last tile exit at once.
            let row_tiles = rows.div_ceil(t.block_m) + groups;
            if row_tiles > i32::MAX as usize {
                return Err(Error::Invalid(format!(
                    "gemm_grouped: {row_tiles} row tiles exceed the grid's x limit"
                )));
            }
            let grid = [row_tiles as u32, blocks_for(n, t.block_n), 1];
            check_grid_y(grid[1], n)?;
            let launch = Launch::new(t.kernel, grid, [t.threads, 1, 1])
                .shared_bytes(t.shared_bytes)
                .arg_tensor(a)
                .arg_tensor(b_stack)
                .arg_tensor(&c)
                .arg_tensor(offsets)
                .arg_i32(rows as i32)
                .arg_i32(n as i32)
                .arg_i32(k as i32)
                .arg_i32(groups as i32)
                .arg_i64(0)
                .arg_i64((n * k) as i64)
                .arg_i64(0);
            backend.launch(&launch)?;
            Ok(c)
        }
    }
}

pub(crate) fn check_grid_y(y: u32, n: usize) -> Result<()> {
    if y > 65535 {
        return Err(Error::Invalid(format!(
            "gemm: N = {n} needs {y} column tiles, over the grid's y limit (65535)"
        )));
    }
    Ok(())
}

/// The wgmma path needs Hopper (sm_90a PTX) on `cuda`; the emulator runs its portable version.
pub(super) fn check_path(backend: &Backend, dtype: DType, path: GemmPath) -> Result<()> {
    if dtype != DType::BF16 || path != GemmPath::Wgmma {
        return Ok(());
    }
    if let Some(cuda) = backend.cuda() {
        if cuda.arch() != crate::cuda::PtxArch::Sm90a {
            let (major, minor) = cuda.compute_capability();
            return Err(Error::Device(format!(
                "SLUICE_GEMM_PATH=wgmma needs an sm_90 GPU (H100/H200); cuda:{} is {} with \
                 compute capability {major}.{minor}; unset SLUICE_GEMM_PATH to use mma.sync",
                cuda.ordinal(),
                cuda.name()
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// `sluice kernel gemm`
// ---------------------------------------------------------------------------------------------

fn run_spec(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let c = gemm(backend, call.tensor("a")?, call.tensor("b")?)?;
    Ok(vec![("c", c)])
}

/// The kernel runner's `gemm` row (DESIGN.md section 7).
pub static SPEC: OpSpec = OpSpec {
    name: "gemm",
    summary: "C = A . B^T (F32 in true f32; BF16 multiplied exactly, accumulated in f32); \
              SLUICE_GEMM_PATH=wgmma opts into the unverified Hopper path",
    inputs: &[
        TensorSpec {
            name: "a",
            shape: "[M,K]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "b",
            shape: "[N,K]",
            dtypes: "F32|BF16 (as a)",
        },
    ],
    params: &[],
    outputs: &[TensorSpec {
        name: "c",
        shape: "[M,N]",
        dtypes: "F32",
    }],
    run: run_spec,
};
