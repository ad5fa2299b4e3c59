//! The MoE layer on emu/cuda: the inputs widened or narrowed for the GEMMs, the forward's and
//! backward's launches and the stable sort. The backward starts from the forward's saved state
//! ([`DeviceForward`]); its expert GEMMs are the gemm family's grouped forms reading the
//! segments and the weights in place (`gemm_grouped_nn`: d(ye) · W2_e, da · W1_e, db · W3_e;
//! `gemm_segment_tn`: every expert's weight gradient in one launch).

use super::{Inputs, MoeConfig, MoeDims, MoeGradTensors, ScoreFn};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::Result;
use crate::launch::{blocks_for, Launch};
use crate::ops::elementwise::softmax;
use crate::ops::gemm::{gemm, gemm_grouped, gemm_grouped_nn, gemm_nn, gemm_segment_tn};
use crate::ops::gemm_epilogue::gemm_grouped_swiglu;
use crate::ops::swiglu::{swiglu, swiglu_backward};
use crate::ops::topk::topk;
use crate::tensor::Tensor;

/// Slots per chunk of the counting sort: one thread counts and scatters one chunk, in order.
const SORT_CHUNK: usize = 256;
/// Threads per block of the grid-stride and per-chunk kernels.
const THREADS: u32 = 256;
/// Upper bound on grid-stride blocks.
const MAX_BLOCKS: usize = 4096;

fn ew_blocks(n: usize) -> u32 {
    blocks_for(n, THREADS as usize).min(MAX_BLOCKS as u32)
}
/// The inputs as the device path uses them: x and w_router as F32 (widened from BF16 by
/// moe_widen_bf16 when needed: the router, its gradient and dW_r run in f32), the expert weights
/// as given (F32 runs `gemm_f32`; BF16 runs the tensor-core `gemm_bf16_mma` path).
pub(super) struct Widened<'a> {
    x32: Option<Tensor>,
    wr32: Option<Tensor>,
    /// The same copies borrowed from a saved forward state (the backward's case).
    x32_saved: Option<&'a Tensor>,
    wr32_saved: Option<&'a Tensor>,
    x: &'a Tensor,
    w_router: &'a Tensor,
    w1: &'a Tensor,
    w3: &'a Tensor,
    w2: &'a Tensor,
}

impl<'a> Widened<'a> {
    pub(super) fn new(backend: &Backend, inp: &Inputs<'a>) -> Result<Self> {
        Ok(Widened {
            x32: widen(backend, inp.x)?,
            wr32: widen(backend, inp.w_router)?,
            x32_saved: None,
            wr32_saved: None,
            x: inp.x,
            w_router: inp.w_router,
            w1: inp.w1,
            w3: inp.w3,
            w2: inp.w2,
        })
    }
    /// The widened copies, for the saved state (the backward reads them again).
    pub(super) fn into_widened(self) -> (Option<Tensor>, Option<Tensor>) {
        (self.x32, self.wr32)
    }
    /// The inputs with the widened copies a forward of the same inputs made.
    pub(super) fn from_saved(
        inp: &Inputs<'a>,
        x32: Option<&'a Tensor>,
        wr32: Option<&'a Tensor>,
    ) -> Self {
        Widened {
            x32: None,
            wr32: None,
            x32_saved: x32,
            wr32_saved: wr32,
            x: inp.x,
            w_router: inp.w_router,
            w1: inp.w1,
            w3: inp.w3,
            w2: inp.w2,
        }
    }
    /// x as F32.
    fn x(&self) -> &Tensor {
        self.x32_saved.or(self.x32.as_ref()).unwrap_or(self.x)
    }
    /// w_router as F32.
    fn w_router(&self) -> &Tensor {
        self.wr32_saved
            .or(self.wr32.as_ref())
            .unwrap_or(self.w_router)
    }
    /// The dtype of the expert GEMMs' operands (the inputs' dtype).
    fn gemm_dtype(&self) -> DType {
        self.w1.dtype()
    }
}

/// An F32 tensor rounded to `dtype` for a GEMM operand (None when `dtype` is F32).
fn narrow(backend: &Backend, t: &Tensor, dtype: DType) -> Result<Option<Tensor>> {
    if dtype == DType::F32 {
        return Ok(None);
    }
    let out = Tensor::poisoned(backend, t.shape(), DType::BF16)?;
    let n = t.numel();
    // Grid-stride over n elements; reads src[i] (F32), writes dst[i] (BF16, nearest even).
    backend.launch(
        &Launch::new("moe_narrow_bf16", [ew_blocks(n), 1, 1], [THREADS, 1, 1])
            .arg_tensor(t)
            .arg_tensor(&out)
            .arg_i64(n as i64),
    )?;
    Ok(Some(out))
}

/// A BF16 tensor widened to F32 on the device (None when it is F32 already).
pub(super) fn widen(backend: &Backend, t: &Tensor) -> Result<Option<Tensor>> {
    if t.dtype() == DType::F32 {
        return Ok(None);
    }
    let out = Tensor::poisoned(backend, t.shape(), DType::F32)?;
    let n = t.numel();
    // Grid-stride over n elements; reads src[i] (BF16) and writes dst[i] (F32), both n long.
    backend.launch(
        &Launch::new("moe_widen_bf16", [ew_blocks(n), 1, 1], [THREADS, 1, 1])
            .arg_tensor(t)
            .arg_tensor(&out)
            .arg_i64(n as i64),
    )?;
    Ok(Some(out))
}

/// The forward's device intermediates, kept for the backward (`y` and the outputs the caller
/// takes are moved out by [`super::moe_forward_saved`]; what is left is the saved state).
pub(crate) struct DeviceForward {
    probs: Tensor,
    kept: Tensor,
    pub(super) idx: Tensor,
    pub(super) gate: Tensor,
    pub(super) offsets: Tensor,
    pos: Tensor,
    /// x's rows in expert order, in the GEMM dtype.
    xs: Tensor,
    /// The up-projections x W1^T and x W3^T, SwiGLU's inputs: f32 for F32 inputs, rounded to
    /// BF16 for BF16 inputs (what SwiGLU's backward reads).
    a: Tensor,
    b: Tensor,
    /// h = silu(a) * b: in f32 for F32 inputs (`h`), rounded to BF16 for BF16 inputs (`h_g`,
    /// written by the second up-projection's epilogue). The W2 GEMM's operand and dW2's.
    h: Option<Tensor>,
    h_g: Option<Tensor>,
    ye: Tensor,
    pub(super) y: Tensor,
    pub(super) aux_loss: Tensor,
    aux_coef: Tensor,
}

impl DeviceForward {
    /// The caller's [`super::MoeOutput`]: y and the aux loss moved out (the backward reads
    /// neither), the routing (top-k indices and gates, the segment bounds) copied device to
    /// device (no launch, no host sync), since the backward reads the state's own.
    pub(super) fn outputs(&mut self, backend: &Backend) -> Result<super::MoeOutput> {
        let copy = |t: &Tensor| t.copy_range(backend, 0, t.shape());
        Ok(super::MoeOutput {
            y: std::mem::replace(&mut self.y, Tensor::zeros(backend, &[0], DType::F32)?),
            aux_loss: std::mem::replace(
                &mut self.aux_loss,
                Tensor::zeros(backend, &[0], DType::F32)?,
            ),
            topk_idx: copy(&self.idx)?,
            topk_gate: copy(&self.gate)?,
            offsets: copy(&self.offsets)?,
        })
    }
}

pub(super) fn device_forward(
    backend: &Backend,
    w: &Widened<'_>,
    dims: MoeDims,
    cfg: MoeConfig,
) -> Result<DeviceForward> {
    let MoeDims { t, d, e, .. } = dims;
    let k = cfg.k;
    let n = t * k;

    // 1. Router: logits, scores, top-k, gates.
    let logits = gemm(backend, w.x(), w.w_router())?;
    let probs = match cfg.score_fn {
        ScoreFn::Softmax => softmax(backend, &logits)?,
        ScoreFn::Sigmoid => {
            let p = Tensor::poisoned(backend, &[t, e], DType::F32)?;
            let m = t * e;
            // Grid-stride; element i of logits -> element i of p (both t*e long).
            backend.launch(
                &Launch::new("moe_sigmoid", [ew_blocks(m), 1, 1], [THREADS, 1, 1])
                    .arg_tensor(&logits)
                    .arg_tensor(&p)
                    .arg_i64(m as i64),
            )?;
            p
        }
    };
    let (kept, idx) = topk(backend, &probs, k)?;
    let gate = Tensor::poisoned(backend, &[t, k], DType::F32)?;
    // One thread per token: reads kept[t,:], writes gate[t,:] (T*k each).
    backend.launch(
        &Launch::new(
            "moe_gates",
            [blocks_for(t, THREADS as usize), 1, 1],
            [THREADS, 1, 1],
        )
        .arg_tensor(&kept)
        .arg_tensor(&gate)
        .arg_i32(t as i32)
        .arg_i32(k as i32)
        .arg_i32(cfg.renorm as i32),
    )?;

    // 2. Stable counting sort of the T*k slots by expert.
    let (offsets, perm, pos) = device_sort(backend, &idx, n, e)?;
    let aux_loss = Tensor::poisoned(backend, &[1], DType::F32)?;
    let aux_coef = Tensor::poisoned(backend, &[e], DType::F32)?;
    // One block: P_e over t ascending (thread per expert), the loss over e ascending by thread
    // 0; reads probs [T,E] and offsets [E+1], writes aux_loss [1] and aux_coef [E].
    backend.launch(
        &Launch::new("moe_aux_loss", [1, 1, 1], [THREADS, 1, 1])
            .arg_tensor(&probs)
            .arg_tensor(&offsets)
            .arg_tensor(&aux_loss)
            .arg_tensor(&aux_coef)
            .arg_i32(t as i32)
            .arg_i32(e as i32)
            .arg_i32(k as i32)
            .arg_f32(cfg.aux_alpha),
    )?;

    // 3. Gather x rows into expert order, grouped GEMMs with SwiGLU.
    // xs in the GEMM dtype (rows of x copied, so exact in BF16 too).
    let gd = w.gemm_dtype();
    let xs = Tensor::poisoned(backend, &[n, d], gd)?;
    let gather = if gd == DType::F32 {
        "moe_gather_rows"
    } else {
        "moe_gather_rows_bf16"
    };
    let x_src = if gd == DType::F32 { w.x() } else { w.x };
    // Grid-stride over n*d: xs[p,c] = x[perm[p]/k, c]; perm holds slots < n = T*k.
    backend.launch(
        &Launch::new(gather, [ew_blocks(n * d), 1, 1], [THREADS, 1, 1])
            .arg_tensor(x_src)
            .arg_tensor(&perm)
            .arg_tensor(&xs)
            .arg_i32(n as i32)
            .arg_i32(d as i32)
            .arg_i32(k as i32),
    )?;
    let a = gemm_grouped(backend, &xs, w.w1, &offsets)?;
    // BF16: SwiGLU and the rounding of h, a and b in the second up-projection's epilogue (h
    // never exists in f32; a's f32 copy lives until then); F32: the plain GEMM and the swiglu
    // kernel.
    let (a, b, h, h_g) = if gd == DType::F32 {
        let b = gemm_grouped(backend, &xs, w.w3, &offsets)?;
        let h = swiglu(backend, &a, &b)?;
        (a, b, Some(h), None)
    } else {
        let p = gemm_grouped_swiglu(backend, &xs, w.w3, &offsets, &a)?;
        (p.gate, p.b, None, Some(p.h))
    };
    let h_op = h_g.as_ref().or(h.as_ref()).ok_or_else(|| {
        crate::error::Error::Invalid("moe: internal: no hidden state after SwiGLU".into())
    })?;
    let ye = gemm_grouped(backend, h_op, w.w2, &offsets)?;

    // 4. Combine, k ascending.
    let y = Tensor::poisoned(backend, &[t, d], DType::F32)?;
    // Grid-stride over t*d: y[t,c] = sum_j gate[t,j] * ye[pos[t,j], c]; pos < n.
    backend.launch(
        &Launch::new("moe_combine", [ew_blocks(t * d), 1, 1], [THREADS, 1, 1])
            .arg_tensor(&ye)
            .arg_tensor(&gate)
            .arg_tensor(&pos)
            .arg_tensor(&y)
            .arg_i32(t as i32)
            .arg_i32(d as i32)
            .arg_i32(k as i32),
    )?;
    Ok(DeviceForward {
        probs,
        kept,
        idx,
        gate,
        offsets,
        pos,
        xs,
        a,
        b,
        h,
        h_g,
        ye,
        y,
        aux_loss,
        aux_coef,
    })
}
/// The stable counting sort on the device: (offsets [E+1], perm [N], pos [N]), all I32.
pub(super) fn device_sort(
    backend: &Backend,
    idx: &Tensor,
    n: usize,
    e: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let chunks = n.div_ceil(SORT_CHUNK).max(1);
    let counts = Tensor::poisoned(backend, &[chunks, e], DType::I32)?;
    let bases = Tensor::poisoned(backend, &[chunks, e], DType::I32)?;
    let offsets = Tensor::poisoned(backend, &[e + 1], DType::I32)?;
    let perm = Tensor::poisoned(backend, &[n], DType::I32)?;
    let pos = Tensor::poisoned(backend, &[n], DType::I32)?;
    let grid = [blocks_for(chunks, THREADS as usize), 1, 1];
    // Thread c owns row c of counts [chunks,E]: zeroes it, then counts slots
    // c*CHUNK..min(n,(c+1)*CHUNK) of idx (each in [0,E), from topk).
    backend.launch(
        &Launch::new("moe_sort_count", grid, [THREADS, 1, 1])
            .arg_tensor(idx)
            .arg_tensor(&counts)
            .arg_i32(n as i32)
            .arg_i32(e as i32)
            .arg_i32(SORT_CHUNK as i32),
    )?;
    // One block: per-expert totals (chunks ascending), the exclusive scan over experts, and the
    // base of every (chunk, expert) pair; writes offsets [E+1] and bases [chunks,E].
    backend.launch(
        &Launch::new("moe_sort_scan", [1, 1, 1], [THREADS, 1, 1])
            .arg_tensor(&counts)
            .arg_tensor(&bases)
            .arg_tensor(&offsets)
            .arg_i32(chunks as i32)
            .arg_i32(e as i32),
    )?;
    // Thread c walks its chunk's slots in ascending order, taking positions from its own row
    // of bases; writes perm[p] = slot and pos[slot] = p (p < n, a permutation).
    backend.launch(
        &Launch::new("moe_sort_scatter", grid, [THREADS, 1, 1])
            .arg_tensor(idx)
            .arg_tensor(&bases)
            .arg_tensor(&perm)
            .arg_tensor(&pos)
            .arg_i32(n as i32)
            .arg_i32(e as i32)
            .arg_i32(SORT_CHUNK as i32),
    )?;
    Ok((offsets, perm, pos))
}

/// The backward from the forward's saved state `s` (of the same inputs: the caller checks).
pub(super) fn device_backward(
    backend: &Backend,
    w: &Widened<'_>,
    s: &DeviceForward,
    dy: &Tensor,
    dims: MoeDims,
    cfg: MoeConfig,
) -> Result<MoeGradTensors> {
    let MoeDims { t, d, e, .. } = dims;
    let k = cfg.k;
    let n = t * k;

    // Combine backward: dye [N,d] and dgate [T,k].
    let dye = Tensor::poisoned(backend, &[n, d], DType::F32)?;
    let dgate = Tensor::poisoned(backend, &[t, k], DType::F32)?;
    // Grid-stride over slots*d for dye[pos[slot], c] = gate[slot] * dy[slot/k, c]; threads
    // with id < n also compute dgate[slot] = dy[slot/k] . ye[pos[slot]] (c ascending).
    backend.launch(
        &Launch::new(
            "moe_combine_backward",
            [ew_blocks(n * d), 1, 1],
            [THREADS, 1, 1],
        )
        .arg_tensor(dy)
        .arg_tensor(&s.ye)
        .arg_tensor(&s.gate)
        .arg_tensor(&s.pos)
        .arg_tensor(&dye)
        .arg_tensor(&dgate)
        .arg_i32(t as i32)
        .arg_i32(d as i32)
        .arg_i32(k as i32),
    )?;

    // Expert FFN backward: the GEMM operands in the GEMM dtype (d(ye), da, db rounded to BF16
    // for BF16 inputs), the weights read in place as [K,N] (W2_e [d,f], W1_e and W3_e [f,d]),
    // the weight gradients over each expert's segment of rows, all experts in one launch each.
    let gd = w.gemm_dtype();
    let dye_g = narrow(backend, &dye, gd)?;
    let dye_g = dye_g.as_ref().unwrap_or(&dye);
    let dh = gemm_grouped_nn(backend, dye_g, w.w2, &s.offsets)?;
    let (da, db) = swiglu_backward(backend, &s.a, &s.b, &dh)?;
    let (da_g, db_g) = (narrow(backend, &da, gd)?, narrow(backend, &db, gd)?);
    let (da_g, db_g) = (da_g.as_ref().unwrap_or(&da), db_g.as_ref().unwrap_or(&db));
    let dxa = gemm_grouped_nn(backend, da_g, w.w1, &s.offsets)?;
    let dxb = gemm_grouped_nn(backend, db_g, w.w3, &s.offsets)?;
    let h_op = s.h_g.as_ref().or(s.h.as_ref()).ok_or_else(|| {
        crate::error::Error::Invalid("moe: internal: the saved state has no hidden state".into())
    })?;
    let dw2 = gemm_segment_tn(backend, dye_g, h_op, &s.offsets)?;
    let dw1 = gemm_segment_tn(backend, da_g, &s.xs, &s.offsets)?;
    let dw3 = gemm_segment_tn(backend, db_g, &s.xs, &s.offsets)?;

    // Router backward.
    let dlogits = Tensor::poisoned(backend, &[t, e], DType::F32)?;
    // One thread per token: row t of dlogits [T,E] from dgate, kept, idx (row t) and probs.
    backend.launch(
        &Launch::new(
            "moe_router_backward",
            [blocks_for(t, THREADS as usize), 1, 1],
            [THREADS, 1, 1],
        )
        .arg_tensor(&s.probs)
        .arg_tensor(&s.kept)
        .arg_tensor(&s.idx)
        .arg_tensor(&dgate)
        .arg_tensor(&s.aux_coef)
        .arg_tensor(&dlogits)
        .arg_i32(t as i32)
        .arg_i32(e as i32)
        .arg_i32(k as i32)
        .arg_i32(cfg.renorm as i32)
        .arg_i32(match cfg.score_fn {
            ScoreFn::Softmax => 0,
            ScoreFn::Sigmoid => 1,
        })
        .arg_i32((cfg.aux_alpha != 0.0) as i32),
    )?;
    // dx_router = dlogits · W_r and dW_r = dlogits^T x: one group of all T rows, in f32.
    let dx_router = gemm_nn(backend, &dlogits, w.w_router())?;
    let whole = Tensor::from_slice(backend, &[2], &[0i32, t as i32])?;
    let dw_router = gemm_segment_tn(backend, &dlogits, w.x(), &whole)?.reshape(&[e, d])?;

    let dx = Tensor::poisoned(backend, &[t, d], DType::F32)?;
    // Grid-stride over t*d: dx[t,c] = dx_router[t,c] + sum_j (dxa + dxb)[pos[t,j], c].
    backend.launch(
        &Launch::new(
            "moe_unpermute_dx",
            [ew_blocks(t * d), 1, 1],
            [THREADS, 1, 1],
        )
        .arg_tensor(&dx_router)
        .arg_tensor(&dxa)
        .arg_tensor(&dxb)
        .arg_tensor(&s.pos)
        .arg_tensor(&dx)
        .arg_i32(t as i32)
        .arg_i32(d as i32)
        .arg_i32(k as i32),
    )?;
    Ok(MoeGradTensors {
        dx,
        dw_router,
        dw1,
        dw3,
        dw2,
    })
}
