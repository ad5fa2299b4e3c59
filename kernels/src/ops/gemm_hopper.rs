//! The Hopper path of the gemm family ([`super::gemm::GemmPath::Wgmma`]): the kernels of
//! kernels/cuda/gemm_hopper.cu (tensor-map copies with 128-byte swizzle issued by a producer
//! thread, two consumer warpgroups on wgmma m64n256k16, a ring of full/empty mbarriers, a
//! persistent grid), in four forms: `gemm_bf16_wgmma` (C = A · B^T, batched or grouped),
//! `gemm_bf16_wgmma_nn` (B stored [K,N], read MN-major in place), `gemm_bf16_wgmma_segment_tn`
//! (out[g] = P_g^T · Q_g, both MN-major, ragged K) and `gemm_bf16_wgmma_swiglu` (the grouped
//! form with the SwiGLU epilogue). This module builds the tensor maps and the grid; the
//! kernel's header says how it works, docs/perf/gemm.md what it should cost.
//!
//! A form runs here when every tensor map's row stride is a multiple of 16 bytes (K % 8 for
//! K-major operands, N % 8 or M % 8 for MN-major ones); other shapes run the mma.sync kernels.
//! Those dimensions are weight dimensions: the choice depends on the device and the weights'
//! shape, never on the number of rows, so a row's bits never depend on how many rows are
//! multiplied with it.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::tensor::Tensor;
use crate::tensor_map::{Swizzle, TensorMap, TiledMap};

/// The kernel's tile and block (gemm_hopper.cu has the same numbers as `constexpr`s; a mismatch
/// shows up in every emu test).
pub(super) const BLOCK_M: usize = 128;
pub(super) const BLOCK_N: usize = 256;
const BLOCK_K: u32 = 64;
/// M/N elements of an MN-major box (gemm_hopper.cu's MN_BOX).
const MN_BOX: u32 = 64;
const THREADS: u32 = 384;
/// 4 stages of A (128 x 64) and B (256 x 64) bf16, 8 mbarriers, 1024 bytes of alignment slack.
const SHARED_BYTES: u32 = 4 * (128 + 256) * 64 * 2 + 8 * 8 + 1024;
/// The SwiGLU form adds its epilogue slabs after the barriers: 1024 bytes of alignment, then 8
/// consumer warps x 16 rows x 64 columns of f32.
const SWIGLU_SHARED_BYTES: u32 = 4 * (128 + 256) * 64 * 2 + 1024 + 8 * 16 * 64 * 4 + 1024;
/// Whether the Hopper kernel takes a product of inner dimension `k`.
pub(super) fn takes(k: usize) -> bool {
    k.is_multiple_of(8)
}

/// What C receives: F32, or BF16 rounded to nearest even (the caller's choice of epilogue).
fn out_bf16(c: &Tensor) -> Result<i32> {
    match c.dtype() {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        other => Err(Error::DType {
            tensor: "c".into(),
            expected: "F32 or BF16".into(),
            got: other.to_string(),
        }),
    }
}

/// The persistent grid on emu: an H100/H200's SM count (see [`persistent_grid`]).
const EMU_SMS: usize = 132;

/// The persistent grid: as few blocks as give the same number of rounds as one block per SM,
/// each taking the same number of tiles (ceil(tiles / SMs)), so no block idles in the last round
/// for nothing and every block does equal work (which also keeps the profiler's block sampling
/// exact). On emu each block takes at least two tiles, so the tests cover the ring carried from
/// one tile to the next at small sizes; under a sampled profile exactly two
/// ([`crate::emu::profile::sampling_blocks`]: a sample of blocks is then a sample of tiles, and
/// a doc-shape MoE launch emulates 16 tiles at `--blocks 8` rather than 400). The grid changes
/// no bits.
fn persistent_grid(backend: &Backend, tiles: usize) -> Result<u32> {
    let per_block = match backend.cuda() {
        Some(cuda) => tiles.div_ceil(cuda.sm_count()?),
        None if crate::emu::profile::sampling_blocks() => 2,
        None => tiles.div_ceil(EMU_SMS).max(2),
    };
    Ok(tiles.div_ceil(per_block.max(1)).max(1) as u32)
}

/// Whether the NN form takes a product of inner dimension `k` and `n` output columns (A's rows
/// are K long, B's N long).
pub(super) fn takes_nn(k: usize, n: usize) -> bool {
    k.is_multiple_of(8) && n.is_multiple_of(8)
}

/// Whether the segment form takes P [T,m] and Q [T,n].
pub(super) fn takes_segment(m: usize, n: usize) -> bool {
    m.is_multiple_of(8) && n.is_multiple_of(8)
}

/// A map over an MN-major operand stored [batch, rows of K, mn] (mn contiguous): boxes of 64
/// elements of mn (one 128-byte swizzled row) x BLOCK_K rows. `batch` None: a 2D map.
fn mn_major_map<'t>(
    backend: &Backend,
    t: &'t Tensor,
    name: &str,
    mn: usize,
    k_rows: usize,
    batch: Option<usize>,
) -> Result<TensorMap<'t>> {
    let (dims, strides, boxes): (Vec<u64>, Vec<u64>, Vec<u32>) = match batch {
        Some(b) => (
            vec![mn as u64, k_rows as u64, b as u64],
            vec![(mn * 2) as u64, (k_rows * mn * 2) as u64],
            vec![MN_BOX, BLOCK_K, 1],
        ),
        None => (
            vec![mn as u64, k_rows as u64],
            vec![(mn * 2) as u64],
            vec![MN_BOX, BLOCK_K],
        ),
    };
    TensorMap::tiled(
        backend,
        t,
        name,
        &TiledMap {
            dims: &dims,
            strides: &strides,
            boxes: &boxes,
            swizzle: Swizzle::B128,
        },
    )
}

fn operand_map<'t>(
    backend: &Backend,
    t: &'t Tensor,
    name: &str,
    rows: usize,
    k: usize,
    batch: usize,
    box_rows: usize,
) -> Result<TensorMap<'t>> {
    TensorMap::tiled(
        backend,
        t,
        name,
        &TiledMap {
            dims: &[k as u64, rows as u64, batch as u64],
            strides: &[(k * 2) as u64, (rows * k * 2) as u64],
            boxes: &[BLOCK_K, box_rows as u32, 1],
            swizzle: Swizzle::B128,
        },
    )
}

/// The batched form (`b` shared by every entry when `shared_b`) into `c` [batch, M, N].
#[allow(clippy::too_many_arguments)]
pub(super) fn batched(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    shared_b: bool,
) -> Result<()> {
    let map_a = operand_map(backend, a, "a", m, k, batch, BLOCK_M)?;
    let map_b = operand_map(
        backend,
        b,
        "b",
        n,
        k,
        if shared_b { 1 } else { batch },
        BLOCK_N,
    )?;
    let tiles = batch * m.div_ceil(BLOCK_M) * n.div_ceil(BLOCK_N);
    launch(
        backend,
        "gemm_bf16_wgmma",
        &map_a,
        &map_b,
        c,
        None,
        [m, n, k, 0],
        tiles,
        shared_b,
        (m * n) as i64,
    )
}

/// The grouped form: rows `offsets[g]..offsets[g+1]` of `a` [T,K] times `b_stack[g]` [N,K]^T
/// into `c` [T,N]. The offsets were validated by the caller.
#[allow(clippy::too_many_arguments)]
pub(super) fn grouped(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
    c: &Tensor,
    rows: usize,
    n: usize,
    k: usize,
    groups: usize,
) -> Result<()> {
    let map_a = operand_map(backend, a, "a", rows, k, 1, BLOCK_M)?;
    let map_b = operand_map(backend, b_stack, "b_stack", n, k, groups.max(1), BLOCK_N)?;
    // Each segment needs ceil(len/BM) row tiles; their total is at most ceil(T/BM) + G.
    let tiles = (rows.div_ceil(BLOCK_M) + groups) * n.div_ceil(BLOCK_N);
    launch(
        backend,
        "gemm_bf16_wgmma",
        &map_a,
        &map_b,
        c,
        Some(offsets),
        [rows, n, k, groups],
        tiles,
        false,
        0,
    )
}

/// C = A · B with B stored [K,N] (`b` [K,N], or [G,K,N] grouped over `offsets`) into `c`
/// [rows,N] F32 or BF16. The offsets were validated by the caller.
#[allow(clippy::too_many_arguments)]
pub(super) fn nn(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    grouped: Option<(&Tensor, usize)>,
    c: &Tensor,
    rows: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    let groups = grouped.map_or(0, |(_, g)| g);
    let map_a = operand_map(backend, a, "a", rows, k, 1, BLOCK_M)?;
    let map_b = mn_major_map(backend, b, "b", n, k, Some(groups.max(1)))?;
    let row_tiles = match grouped {
        Some(_) => rows.div_ceil(BLOCK_M) + groups,
        None => rows.div_ceil(BLOCK_M),
    };
    launch(
        backend,
        "gemm_bf16_wgmma_nn",
        &map_a,
        &map_b,
        c,
        grouped.map(|(o, _)| o),
        [rows, n, k, groups],
        row_tiles * n.div_ceil(BLOCK_N),
        false,
        0,
    )
}

/// out[g] = P_g^T · Q_g over the row segments of `p` [T,m] and `q` [T,n] into `out` [G,m,n]
/// F32. The offsets were validated by the caller (the kernel clamps them into [0, T]).
#[allow(clippy::too_many_arguments)]
pub(super) fn segment_tn(
    backend: &Backend,
    p: &Tensor,
    q: &Tensor,
    offsets: &Tensor,
    out: &Tensor,
    t_rows: usize,
    m: usize,
    n: usize,
    groups: usize,
) -> Result<()> {
    let map_p = mn_major_map(backend, p, "p", m, t_rows, None)?;
    let map_q = mn_major_map(backend, q, "q", n, t_rows, Some(1))?;
    let tiles = groups * m.div_ceil(BLOCK_M) * n.div_ceil(BLOCK_N);
    let grid = grid_for(backend, tiles)?;
    let launch = Launch::new("gemm_bf16_wgmma_segment_tn", [grid, 1, 1], [THREADS, 1, 1])
        .shared_bytes(SHARED_BYTES)
        .arg_tensor_map(&map_p)
        .arg_tensor_map(&map_q)
        .arg_tensor(out)
        .arg_tensor(offsets)
        .arg_i32(m as i32)
        .arg_i32(n as i32)
        .arg_i32(t_rows as i32)
        .arg_i32(groups as i32)
        .arg_i32(tiles as i32);
    backend.launch(&launch)
}

/// The SwiGLU form's outputs (gemm_bf16_mma_swiglu's): `b_f32` (the product, F32) and `b_b`
/// (BF16) optional, `h_b` = bf16(silu(a) · b), `a_b` = bf16(a) optional; all [T,N].
pub(super) struct SwigluOut<'t> {
    pub swiglu_a: &'t Tensor,
    pub b_f32: Option<&'t Tensor>,
    pub b_b: Option<&'t Tensor>,
    pub h_b: &'t Tensor,
    pub a_b: Option<&'t Tensor>,
}

/// The grouped C = A · B_g^T with the SwiGLU epilogue (see [`SwigluOut`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn grouped_swiglu(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
    out: &SwigluOut<'_>,
    rows: usize,
    n: usize,
    k: usize,
    groups: usize,
) -> Result<()> {
    let map_a = operand_map(backend, a, "a", rows, k, 1, BLOCK_M)?;
    let map_b = operand_map(backend, b_stack, "b_stack", n, k, groups.max(1), BLOCK_N)?;
    let tiles = (rows.div_ceil(BLOCK_M) + groups) * n.div_ceil(BLOCK_N);
    let grid = grid_for(backend, tiles)?;
    let launch = Launch::new("gemm_bf16_wgmma_swiglu", [grid, 1, 1], [THREADS, 1, 1])
        .shared_bytes(SWIGLU_SHARED_BYTES)
        .arg_tensor_map(&map_a)
        .arg_tensor_map(&map_b);
    let launch = arg_opt(launch, out.b_f32)
        .arg_tensor(offsets)
        .arg_i32(rows as i32)
        .arg_i32(n as i32)
        .arg_i32(k as i32)
        .arg_i32(groups as i32)
        .arg_i32(tiles as i32)
        .arg_tensor(out.swiglu_a);
    let launch = arg_opt(launch, out.b_b).arg_tensor(out.h_b);
    backend.launch(&arg_opt(launch, out.a_b))
}

/// An optional tensor argument: its pointer, or null.
fn arg_opt<'t>(launch: Launch<'t>, t: Option<&'t Tensor>) -> Launch<'t> {
    match t {
        Some(t) => launch.arg_tensor(t),
        None => launch.arg_u64(0),
    }
}

/// The persistent grid for `tiles` tiles, which must fit the kernels' 32-bit tile index.
fn grid_for(backend: &Backend, tiles: usize) -> Result<u32> {
    if tiles > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "gemm: {tiles} tiles exceed the kernel's 32-bit tile index"
        )));
    }
    persistent_grid(backend, tiles)
}

#[allow(clippy::too_many_arguments)]
fn launch(
    backend: &Backend,
    kernel: &'static str,
    map_a: &TensorMap<'_>,
    map_b: &TensorMap<'_>,
    c: &Tensor,
    offsets: Option<&Tensor>,
    [rows, n, k, groups]: [usize; 4],
    tiles: usize,
    shared_b: bool,
    stride_c: i64,
) -> Result<()> {
    let grid = grid_for(backend, tiles)?;
    let launch = Launch::new(kernel, [grid, 1, 1], [THREADS, 1, 1])
        .shared_bytes(SHARED_BYTES)
        .arg_tensor_map(map_a)
        .arg_tensor_map(map_b)
        .arg_tensor(c);
    let launch = match offsets {
        Some(o) => launch.arg_tensor(o),
        None => launch.arg_u64(0), // null: batched mode
    };
    let launch = launch
        .arg_i32(rows as i32)
        .arg_i32(n as i32)
        .arg_i32(k as i32)
        .arg_i32(groups as i32)
        .arg_i32(tiles as i32)
        .arg_i32(shared_b as i32)
        .arg_i32(out_bf16(c)?)
        .arg_i64(stride_c);
    backend.launch(&launch)
}

/// C[M,N] = A[M,K] · B[N,K]^T on the Hopper kernel with the caller's epilogue: `c` is F32 or
/// BF16 (rounded to nearest even from the f32 accumulator). BF16 `a` and `b`, K % 8 == 0, and
/// a device that runs the kernel (sm_90 on cuda, or emu).
pub fn gemm_wgmma_into(backend: &Backend, a: &Tensor, b: &Tensor, c: &mut Tensor) -> Result<()> {
    a.expect_dtype("a", DType::BF16)?;
    b.expect_dtype("b", DType::BF16)?;
    a.expect_rank("a", 2, "[M,K]")?;
    let (m, k) = (a.shape()[0], a.shape()[1]);
    if b.shape().len() != 2 || b.shape()[1] != k {
        return Err(Error::shape(
            "b",
            format!("[N,{k}] (K from `a`)"),
            b.shape(),
        ));
    }
    let n = b.shape()[0];
    if c.shape() != [m, n] {
        return Err(Error::shape("c", format!("[{m},{n}]"), c.shape()));
    }
    out_bf16(c)?;
    if !takes(k) {
        return Err(Error::Invalid(format!(
            "gemm_wgmma_into: K = {k} is not a multiple of 8 (the tensor maps' row stride must \
             be a multiple of 16 bytes)"
        )));
    }
    super::gemm::check_path(backend, DType::BF16, super::gemm::GemmPath::Wgmma)?;
    if matches!(backend, Backend::Cpu) {
        return Err(Error::Invalid(
            "gemm_wgmma_into runs the Hopper kernel: use --device emu or an sm_90 GPU".into(),
        ));
    }
    if m * n == 0 {
        return Ok(());
    }
    batched(backend, a, b, c, 1, m, n, k, false)
}
