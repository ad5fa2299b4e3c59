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
//! The grouped forms of a grouped layer's backward (B stored [K,N]; per-segment P^T · Q, the
//! weight gradient) are in `segments` ([`gemm_grouped_nn`], [`gemm_segment_tn`]).
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

use super::gemm_hopper;

mod reference;
mod segments;
use reference::check_offsets;
pub(crate) use reference::strided_operands_checked;
pub use reference::{
    gemm_batched_reference, gemm_grouped_reference, gemm_reference, gemm_reference_bf16,
    gemm_reference_into, gemm_strided_into, small_rows_rhs, BF16_PACKED_MAX_K, SMALL_M,
};
pub use segments::{
    gemm_grouped_nn, gemm_grouped_nn_with_path, gemm_nn, gemm_nn_with_path, gemm_segment_tn,
    gemm_segment_tn_reference, gemm_segment_tn_with_path,
};

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

thread_local! {
    /// This thread's override of `SLUICE_GEMM_PATH` ([`GemmPath::scoped`]).
    static PATH_OVERRIDE: std::cell::Cell<Option<GemmPath>> = const { std::cell::Cell::new(None) };
}

/// While alive, [`GemmPath::from_env`] returns its path on this thread (see [`GemmPath::scoped`]).
pub struct ScopedPath {
    previous: Option<GemmPath>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for ScopedPath {
    fn drop(&mut self) {
        PATH_OVERRIDE.with(|p| p.set(self.previous));
    }
}

impl GemmPath {
    /// Makes every op on this thread that takes its path from the environment (`gemm`, the
    /// grouped forms, the MoE layer's GEMMs) use `path` until the guard drops: what a bench row
    /// or a test of a composite op on one path needs, without setting a process-wide variable
    /// other threads read.
    pub fn scoped(path: GemmPath) -> ScopedPath {
        ScopedPath {
            previous: PATH_OVERRIDE.with(|p| p.replace(Some(path))),
            _not_send: std::marker::PhantomData,
        }
    }

    /// The path `SLUICE_GEMM_PATH` asks for (`mma`, the default, or `wgmma`), unless this
    /// thread holds a [`GemmPath::scoped`] guard.
    pub fn from_env() -> Result<GemmPath> {
        if let Some(path) = PATH_OVERRIDE.with(|p| p.get()) {
            return Ok(path);
        }
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

/// The grouped offsets' checks (0 first, non-decreasing, `rows` last) for the family's other
/// grouped entry points (gemm_epilogue's SwiGLU form).
pub(crate) fn check_grouped_offsets(offsets: &[i32], rows: usize) -> Result<Vec<usize>> {
    check_offsets(offsets, Some(rows))
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
