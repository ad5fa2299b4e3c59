//! The Hopper path of `gemm` ([`super::gemm::GemmPath::Wgmma`]): `gemm_bf16_wgmma` of
//! kernels/cuda/gemm_hopper.cu (tensor-map copies with 128-byte swizzle issued by a producer
//! thread, two consumer warpgroups on wgmma m64n256k16, a ring of full/empty mbarriers, a
//! persistent grid). This module builds the tensor maps and the grid; the kernel's header says
//! how it works, docs/perf/gemm.md what it should cost.
//!
//! Used for every BF16 product on the path when K % 8 == 0 (a tensor map's row stride must be a
//! multiple of 16 bytes); other K run `gemm_bf16_mma`. The choice depends on the device and K,
//! never on M, so a row's bits never depend on how many rows are multiplied with it.

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
const THREADS: u32 = 384;
/// 4 stages of A (128 x 64) and B (256 x 64) bf16, 8 mbarriers, 1024 bytes of alignment slack.
const SHARED_BYTES: u32 = 4 * (128 + 256) * 64 * 2 + 8 * 8 + 1024;
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
/// one tile to the next at small sizes; the grid changes no bits.
fn persistent_grid(backend: &Backend, tiles: usize) -> Result<u32> {
    let per_block = match backend.cuda() {
        Some(cuda) => tiles.div_ceil(cuda.sm_count()?),
        None => tiles.div_ceil(EMU_SMS).max(2),
    };
    Ok(tiles.div_ceil(per_block.max(1)).max(1) as u32)
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

#[allow(clippy::too_many_arguments)]
fn launch(
    backend: &Backend,
    map_a: &TensorMap<'_>,
    map_b: &TensorMap<'_>,
    c: &Tensor,
    offsets: Option<&Tensor>,
    [rows, n, k, groups]: [usize; 4],
    tiles: usize,
    shared_b: bool,
    stride_c: i64,
) -> Result<()> {
    if tiles > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "gemm: {tiles} tiles exceed the kernel's 32-bit tile index"
        )));
    }
    let grid = persistent_grid(backend, tiles)?;
    let launch = Launch::new("gemm_bf16_wgmma", [grid, 1, 1], [THREADS, 1, 1])
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
