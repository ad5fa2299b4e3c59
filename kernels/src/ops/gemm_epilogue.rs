//! The batched bf16 GEMM with an epilogue: C = A · B^T as [`super::gemm::gemm_batched`], then
//! per output element
//!
//! ```text
//! v = fmaf(beta, E[i,j], alpha * acc)      (v = alpha * acc without E)
//! ```
//!
//! in f32, written to any of four outputs: f32 [batch,M,N], f32 transposed [batch,N,M], bf16
//! [batch,M,N] (round-to-nearest-even) and bf16 transposed [batch,N,M]. It is what Newton-Schulz
//! needs between its products (issue 23 item 4): one launch instead of a GEMM, a poisoned f32
//! output and an elementwise pass that read the product back.
//!
//! Devices: `emu` / `cuda` run `gemm_bf16_mma_epilogue` (kernels/cuda/gemm.cu: the mma.sync
//! main loop of `gemm_bf16_mma`, then the tile staged through shared memory 32 rows at a time
//! so that every load and store of the epilogue is coalesced, transposed ones included). The
//! wgmma path has only the SwiGLU epilogue ([`gemm_grouped_swiglu`]): this one always runs
//! mma.sync, whatever `SLUICE_GEMM_PATH` says.
//! `cpu` runs the bf16 chain ([`gemm_chain_into`], the emulated mma.sync's order) and the same
//! formula, so cpu and emu agree bit for bit.
//!
//! [`gemm_grouped_swiglu`] is the grouped form with the SwiGLU epilogue (the MoE forward's
//! second up-projection): b = A · W3_g^T and h = silu(a) * b for a given f32 `a`, written as
//! BF16 h, a and b, with the bits of `gemm_grouped`, `swiglu` and the bf16 rounding run one
//! after the other.
//!
//! Bits: `acc` is the value the plain GEMM writes (same main loop), and the formula is the one
//! the removed `newton_schulz_combine_bf16` kernel applied to it, so a fused result has the bits
//! of the GEMM followed by that combine. [`GemmEpilogue::identity`] gives the plain GEMM's bits
//! (1 * acc is acc); plain callers keep `gemm_bf16_mma` and its launch as they were.

use super::gemm::{check_grid_y, gemm_chain_into, gemm_grouped_with_path, GemmPath};
use super::swiglu::swiglu_reference_into;
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::tensor::Tensor;
use half::bf16;

/// The kernel and its tile (gemm.cu's `MMA_BM`, `MMA_BN`, 256 threads).
const KERNEL: &str = "gemm_bf16_mma_epilogue";
const BLOCK_M: usize = 128;
const BLOCK_N: usize = 128;
const THREADS: u32 = 256;

/// What [`gemm_batched_epilogue`] does after the product (see the module docs). Outputs that
/// are `None` are not written; at least one must be given. No output may overlap `a`, `b` or
/// `e`.
pub struct GemmEpilogue<'t> {
    /// Scales the product.
    pub alpha: f32,
    /// Scales `e` (unused without it).
    pub beta: f32,
    /// E [batch,M,N] F32, or none (v = alpha * acc).
    pub e: Option<&'t Tensor>,
    /// v as F32 [batch,M,N].
    pub c: Option<&'t mut Tensor>,
    /// v transposed, F32 [batch,N,M].
    pub c_t: Option<&'t mut Tensor>,
    /// bf16(v), BF16 [batch,M,N].
    pub c_b: Option<&'t mut Tensor>,
    /// bf16(v) transposed, BF16 [batch,N,M].
    pub c_bt: Option<&'t mut Tensor>,
}

impl<'t> GemmEpilogue<'t> {
    /// v = acc into `c`: the plain GEMM.
    pub fn identity(c: &'t mut Tensor) -> Self {
        GemmEpilogue {
            c: Some(c),
            ..GemmEpilogue::scaled(1.0)
        }
    }

    /// v = alpha * acc, no outputs yet (set the fields).
    pub fn scaled(alpha: f32) -> Self {
        GemmEpilogue {
            alpha,
            beta: 0.0,
            e: None,
            c: None,
            c_t: None,
            c_b: None,
            c_bt: None,
        }
    }

    /// v = fmaf(beta, E, alpha * acc), no outputs yet (set the fields).
    pub fn scaled_plus(alpha: f32, beta: f32, e: &'t Tensor) -> Self {
        GemmEpilogue {
            beta,
            e: Some(e),
            ..GemmEpilogue::scaled(alpha)
        }
    }

    /// v for one element: the kernel's formula.
    fn value(&self, acc: f32, e: Option<f32>) -> f32 {
        let v = self.alpha * acc;
        match e {
            Some(e) => self.beta.mul_add(e, v),
            None => v,
        }
    }
}

/// Checks that `t` is `dtype` with shape `shape`, naming it `name`.
fn expect(t: &Tensor, name: &str, dtype: DType, shape: [usize; 3]) -> Result<()> {
    t.expect_dtype(name, dtype)?;
    if t.shape() != shape {
        let [b, r, c] = shape;
        return Err(Error::shape(name, format!("[{b},{r},{c}]"), t.shape()));
    }
    Ok(())
}

/// C = A[i] · B[i]^T for each batch entry i, with `a` [batch,M,K] and `b` [batch,N,K] (or
/// [N,K], shared), both BF16, through the epilogue `ep` (see [`GemmEpilogue`]).
pub fn gemm_batched_epilogue(
    backend: &Backend,
    a: &Tensor,
    b: &Tensor,
    mut ep: GemmEpilogue<'_>,
) -> Result<()> {
    a.expect_rank("a", 3, "[batch,M,K]")?;
    a.expect_dtype("a", DType::BF16)?;
    b.expect_dtype("b", DType::BF16)?;
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
    for (name, v) in [("M", m), ("N", n), ("K", k), ("batch", batch)] {
        if v > i32::MAX as usize {
            return Err(Error::Invalid(format!(
                "gemm_batched_epilogue: {name} = {v} exceeds the kernel's 32-bit index range"
            )));
        }
    }
    let (mn, nm) = ([batch, m, n], [batch, n, m]);
    if let Some(e) = ep.e {
        expect(e, "e", DType::F32, mn)?;
    }
    let outs: [(&str, DType, [usize; 3], Option<&Tensor>); 4] = [
        ("c", DType::F32, mn, ep.c.as_deref()),
        ("c_t", DType::F32, nm, ep.c_t.as_deref()),
        ("c_b", DType::BF16, mn, ep.c_b.as_deref()),
        ("c_bt", DType::BF16, nm, ep.c_bt.as_deref()),
    ];
    if outs.iter().all(|o| o.3.is_none()) {
        return Err(Error::Invalid(
            "gemm_batched_epilogue: no output given; set at least one of c, c_t, c_b, c_bt".into(),
        ));
    }
    for (name, dtype, shape, t) in outs {
        if let Some(t) = t {
            expect(t, name, dtype, shape)?;
        }
    }
    if batch * m * n == 0 {
        return Ok(());
    }
    if let Backend::Cpu = backend {
        return on_cpu(a, b, &mut ep, (batch, m, n, k), shared_b);
    }
    if batch > 65535 {
        return Err(Error::Invalid(format!(
            "gemm_batched_epilogue: batch = {batch} exceeds the grid's z limit (65535)"
        )));
    }
    let grid = [blocks_for(m, BLOCK_M), blocks_for(n, BLOCK_N), batch as u32];
    check_grid_y(grid[1], n)?;
    let mut launch = Launch::new(KERNEL, grid, [THREADS, 1, 1])
        .arg_tensor(a)
        .arg_tensor(b);
    launch = match ep.c.as_deref() {
        Some(t) => launch.arg_tensor(t),
        None => launch.arg_u64(0),
    };
    launch = launch
        .arg_u64(0) // offsets: null = batched mode
        .arg_i32(m as i32)
        .arg_i32(n as i32)
        .arg_i32(k as i32)
        .arg_i32(0) // groups (unused in batched mode)
        .arg_i64((m * k) as i64)
        .arg_i64(if shared_b { 0 } else { (n * k) as i64 })
        .arg_i64((m * n) as i64);
    launch = match ep.e {
        Some(t) => launch.arg_tensor(t),
        None => launch.arg_u64(0),
    };
    for t in [ep.c_t.as_deref(), ep.c_b.as_deref(), ep.c_bt.as_deref()] {
        launch = match t {
            Some(t) => launch.arg_tensor(t),
            None => launch.arg_u64(0),
        };
    }
    backend.launch(&launch.arg_f32(ep.alpha).arg_f32(ep.beta))
}

/// The outputs of [`gemm_grouped_swiglu`], all BF16 [T,N] (round-to-nearest-even of f32 values).
pub struct SwigluProducts {
    /// silu(gate) * b: the next GEMM's operand.
    pub h: Tensor,
    /// The gate input, rounded.
    pub gate: Tensor,
    /// The product, rounded.
    pub b: Tensor,
}

/// Grouped (the MoE form, as [`super::gemm::gemm_grouped`]: rows `offsets[g]..offsets[g+1]`
/// of `a` [T,K] times `b_stack[g]` [N,K]^T, both BF16) with the SwiGLU epilogue: for the
/// product b and `gate` [T,N] F32, h = silu(gate) * b (silu(x) = x / (1 + e^-x) as the swiglu
/// family computes it), then h, gate and b rounded to BF16 ([`SwigluProducts`]; the MoE keeps
/// gate and b for SwiGLU's backward). One launch on emu/cuda: `gemm_bf16_mma_swiglu`, or
/// `gemm_bf16_wgmma_swiglu` on the Hopper path (`SLUICE_GEMM_PATH=wgmma`) when K % 8 == 0, as
/// [`super::gemm::gemm_grouped`] chooses; on cpu the grouped GEMM, the swiglu reference and the
/// rounding, which is what the kernels' bits are (tested: kernels/tests/gemm_epilogue.rs and
/// gemm_hopper.rs).
pub fn gemm_grouped_swiglu(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
    gate: &Tensor,
) -> Result<SwigluProducts> {
    gemm_grouped_swiglu_with_path(backend, a, b_stack, offsets, gate, GemmPath::from_env()?)
}

/// [`gemm_grouped_swiglu`] with the kernel chosen explicitly.
pub fn gemm_grouped_swiglu_with_path(
    backend: &Backend,
    a: &Tensor,
    b_stack: &Tensor,
    offsets: &Tensor,
    gate: &Tensor,
    path: GemmPath,
) -> Result<SwigluProducts> {
    a.expect_dtype("a", DType::BF16)?;
    b_stack.expect_dtype("b_stack", DType::BF16)?;
    a.expect_rank("a", 2, "[T,K]")?;
    let (rows, k) = (a.shape()[0], a.shape()[1]);
    let n = match b_stack.shape() {
        [_, n, bk] if *bk == k => *n,
        other => {
            return Err(Error::shape(
                "b_stack",
                format!("[G,N,{k}] (K from `a`)"),
                other,
            ))
        }
    };
    gate.expect_dtype("gate", DType::F32)?;
    if gate.shape() != [rows, n] {
        return Err(Error::shape(
            "gate",
            format!("[{rows},{n}] (T from `a`, N from `b_stack`)"),
            gate.shape(),
        ));
    }
    if let Backend::Cpu = backend {
        let b = gemm_grouped_with_path(backend, a, b_stack, offsets, GemmPath::Mma)?;
        let (b, gate) = (b.f32_data()?, gate.f32_data()?);
        let mut h = vec![0.0f32; rows * n];
        swiglu_reference_into(&gate, &b, &mut h)?;
        let rounded = |v: &[f32]| -> Result<Tensor> {
            let r: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            Tensor::from_slice(backend, &[rows, n], &r)
        };
        return Ok(SwigluProducts {
            h: rounded(&h)?,
            gate: rounded(&gate)?,
            b: rounded(&b)?,
        });
    }
    // The offsets' checks and the grid are gemm_grouped's; a zero-row call returns at once.
    offsets.expect_dtype("offsets", DType::I32)?;
    offsets.expect_rank("offsets", 1, "[G+1]")?;
    let groups = offsets.shape()[0].saturating_sub(1);
    if b_stack.shape()[0] != groups {
        return Err(Error::shape(
            "b_stack",
            format!("[{groups},N,{k}] (G from `offsets`)"),
            b_stack.shape(),
        ));
    }
    if crate::debug::reads_back(offsets) {
        super::gemm::check_grouped_offsets(&offsets.to_vec::<i32>()?, rows)?;
    }
    let out = SwigluProducts {
        h: Tensor::poisoned(backend, &[rows, n], DType::BF16)?,
        gate: Tensor::poisoned(backend, &[rows, n], DType::BF16)?,
        b: Tensor::poisoned(backend, &[rows, n], DType::BF16)?,
    };
    if rows * n == 0 {
        return Ok(out);
    }
    super::gemm::check_path(backend, DType::BF16, path)?;
    if path == GemmPath::Wgmma && super::gemm_hopper::takes(k) {
        let products = super::gemm_hopper::SwigluOut {
            swiglu_a: gate,
            b_f32: None,
            b_b: Some(&out.b),
            h_b: &out.h,
            a_b: Some(&out.gate),
        };
        super::gemm_hopper::grouped_swiglu(
            backend, a, b_stack, offsets, &products, rows, n, k, groups,
        )?;
        return Ok(out);
    }
    let row_tiles = rows.div_ceil(BLOCK_M) + groups;
    if row_tiles > i32::MAX as usize || [rows, n, k].iter().any(|&v| v > i32::MAX as usize) {
        return Err(Error::Invalid(format!(
            "gemm_grouped_swiglu: T = {rows}, N = {n}, K = {k} exceed the kernel's 32-bit ranges"
        )));
    }
    let grid = [row_tiles as u32, blocks_for(n, BLOCK_N), 1];
    check_grid_y(grid[1], n)?;
    // Row tiles of every segment in order (the surplus blocks exit), as gemm_grouped; each
    // block writes its tile's rows of h, gate and b (BF16), reading the same elements of gate.
    backend.launch(
        &Launch::new("gemm_bf16_mma_swiglu", grid, [THREADS, 1, 1])
            .arg_tensor(a)
            .arg_tensor(b_stack)
            .arg_u64(0) // c: no f32 product
            .arg_tensor(offsets)
            .arg_i32(rows as i32)
            .arg_i32(n as i32)
            .arg_i32(k as i32)
            .arg_i32(groups as i32)
            .arg_i64(0)
            .arg_i64((n * k) as i64)
            .arg_i64(0)
            .arg_tensor(gate)
            .arg_tensor(&out.b)
            .arg_tensor(&out.h)
            .arg_tensor(&out.gate),
    )?;
    Ok(out)
}

/// The cpu device: the bf16 chain per batch entry, then the epilogue element by element.
fn on_cpu(
    a: &Tensor,
    b: &Tensor,
    ep: &mut GemmEpilogue<'_>,
    (batch, m, n, k): (usize, usize, usize, usize),
    shared_b: bool,
) -> Result<()> {
    let af = a.f32_data()?;
    let bf = b.f32_data()?;
    let e = match ep.e {
        Some(e) => Some(e.f32_data()?),
        None => None,
    };
    let mut v = vec![0.0f32; batch * m * n];
    for i in 0..batch {
        let bi = if shared_b { 0 } else { i };
        let c = &mut v[i * m * n..(i + 1) * m * n];
        gemm_chain_into(
            &af[i * m * k..(i + 1) * m * k],
            &bf[bi * n * k..(bi + 1) * n * k],
            c,
            m,
            n,
            k,
        );
        for (j, x) in c.iter_mut().enumerate() {
            *x = ep.value(*x, e.as_ref().map(|e| e[i * m * n + j]));
        }
    }
    // Element (i, r, col) of v is at (i, col, r) in the transposed outputs.
    let t_index = |j: usize| {
        let (i, rc) = (j / (m * n), j % (m * n));
        i * m * n + (rc % n) * m + rc / n
    };
    if let Some(c) = ep.c.as_deref_mut() {
        c.host_slice_mut::<f32>()?.copy_from_slice(&v);
    }
    if let Some(c) = ep.c_b.as_deref_mut() {
        for (o, &x) in c.host_slice_mut::<bf16>()?.iter_mut().zip(&v) {
            *o = bf16::from_f32(x);
        }
    }
    if let Some(c) = ep.c_t.as_deref_mut() {
        let o = c.host_slice_mut::<f32>()?;
        for (j, &x) in v.iter().enumerate() {
            o[t_index(j)] = x;
        }
    }
    if let Some(c) = ep.c_bt.as_deref_mut() {
        let o = c.host_slice_mut::<bf16>()?;
        for (j, &x) in v.iter().enumerate() {
            o[t_index(j)] = bf16::from_f32(x);
        }
    }
    Ok(())
}
