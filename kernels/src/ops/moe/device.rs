//! The MoE layer on emu/cuda: the inputs widened or narrowed for the GEMMs, the forward's and
//! backward's launches, the stable sort, the transposes and the per-expert weight gradients.

use super::{Inputs, MoeConfig, MoeDims, MoeGradTensors, ScoreFn};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::elementwise::softmax;
use crate::ops::gemm::{gemm, gemm_grouped};
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
            x: inp.x,
            w_router: inp.w_router,
            w1: inp.w1,
            w3: inp.w3,
            w2: inp.w2,
        })
    }
    /// x as F32.
    fn x(&self) -> &Tensor {
        self.x32.as_ref().unwrap_or(self.x)
    }
    /// w_router as F32.
    fn w_router(&self) -> &Tensor {
        self.wr32.as_ref().unwrap_or(self.w_router)
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

/// The forward's device intermediates (kept for the backward).
pub(super) struct DeviceForward {
    probs: Tensor,
    kept: Tensor,
    pub(super) idx: Tensor,
    pub(super) gate: Tensor,
    pub(super) offsets: Tensor,
    pos: Tensor,
    xs: Tensor,
    a: Tensor,
    b: Tensor,
    h: Tensor,
    ye: Tensor,
    pub(super) y: Tensor,
    pub(super) aux_loss: Tensor,
    aux_coef: Tensor,
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
    let b = gemm_grouped(backend, &xs, w.w3, &offsets)?;
    let h = swiglu(backend, &a, &b)?;
    let h_g = narrow(backend, &h, gd)?;
    let ye = gemm_grouped(backend, h_g.as_ref().unwrap_or(&h), w.w2, &offsets)?;

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

/// The expert segment bounds on the host: the caller's copy (checked against the device's in
/// debug mode), else a copy of `offsets` (a host sync inside the op).
fn host_bounds(offsets: &Tensor, given: Option<&[i32]>) -> Result<Vec<i32>> {
    match given {
        Some(b) => {
            if crate::debug::enabled() {
                let device = offsets.to_vec::<i32>()?;
                if device != b {
                    return Err(Error::Invalid(format!(
                        "`bounds`: the caller's expert segment bounds {b:?} are not the \
                         routing's {device:?}; pass the offsets of the forward of the same inputs"
                    )));
                }
            }
            Ok(b.to_vec())
        }
        None => offsets.to_vec::<i32>(),
    }
}

/// `[batch, rows, cols]` -> `[batch, cols, rows]` on the device (moe_transpose).
fn device_transpose(
    backend: &Backend,
    src: &Tensor,
    batch: usize,
    rows: usize,
    cols: usize,
) -> Result<Tensor> {
    let dst = Tensor::poisoned(backend, &[batch, cols, rows], src.dtype())?;
    let kernel = if src.dtype() == DType::F32 {
        "moe_transpose"
    } else {
        "moe_transpose_bf16"
    };
    // 32x32 tiles through shared memory; blockIdx.z is the batch entry (<= E <= 512, or 1).
    backend.launch(
        &Launch::new(
            kernel,
            [blocks_for(cols, 32), blocks_for(rows, 32), batch as u32],
            [32, 8, 1],
        )
        .arg_tensor(src)
        .arg_tensor(&dst)
        .arg_i32(rows as i32)
        .arg_i32(cols as i32),
    )?;
    Ok(dst)
}

/// out[g] = P_g^T · Q_g per segment (P [N,p], Q [N,q], offsets [G+1]) -> [G,p,q].
/// [`device_wgrad`] on tensor cores, for BF16 inputs: per expert with tokens, the segment's rows
/// of P and Q are transposed (and rounded to BF16) into Pt [p,n_e] and Qt [q,n_e]
/// (`moe_transpose_rows_bf16`), `gemm` gives Pt · Qt^T = P_e^T Q_e [p,q] with K = n_e ascending
/// in the gemm family's fixed order (no split-K), and `moe_copy` puts it at out[e]. Experts
/// without tokens get zeros. `bounds` is the host copy of the offsets (E+1 entries).
fn device_wgrad_mma(
    backend: &Backend,
    pm: &Tensor,
    qm: &Tensor,
    bounds: &[i32],
    p: usize,
    q: usize,
) -> Result<Tensor> {
    let groups = bounds.len() - 1;
    let out = Tensor::zeros(backend, &[groups, p, q], DType::F32)?;
    let seg_t = |src: &Tensor, cols: usize, r0: usize, n: usize| -> Result<Tensor> {
        let dst = Tensor::poisoned(backend, &[cols, n], DType::BF16)?;
        let kernel = if src.dtype() == DType::F32 {
            "moe_transpose_rows_f32_bf16"
        } else {
            "moe_transpose_rows_bf16"
        };
        // Rows r0..r0+n of src [N,cols] (within N: the offsets bound them) -> dst [cols,n].
        backend.launch(
            &Launch::new(
                kernel,
                [blocks_for(cols, 32), blocks_for(n, 32), 1],
                [32, 8, 1],
            )
            .arg_tensor(src)
            .arg_tensor(&dst)
            .arg_i32(r0 as i32)
            .arg_i32(n as i32)
            .arg_i32(cols as i32),
        )?;
        Ok(dst)
    };
    for g in 0..groups {
        let (r0, r1) = (bounds[g] as usize, bounds[g + 1] as usize);
        if r1 <= r0 {
            continue;
        }
        let pt = seg_t(pm, p, r0, r1 - r0)?;
        let qt = seg_t(qm, q, r0, r1 - r0)?;
        let c = gemm(backend, &pt, &qt)?;
        let m = p * q;
        // Grid-stride: out[g*m + i] = c[i] for i < m (out holds groups*m elements).
        backend.launch(
            &Launch::new("moe_copy", [ew_blocks(m), 1, 1], [THREADS, 1, 1])
                .arg_tensor(&c)
                .arg_tensor(&out)
                .arg_i64((g * m) as i64)
                .arg_i64(m as i64),
        )?;
    }
    Ok(out)
}

fn device_wgrad(
    backend: &Backend,
    pm: &Tensor,
    qm: &Tensor,
    offsets: &Tensor,
    groups: usize,
    p: usize,
    q: usize,
) -> Result<Tensor> {
    let out = Tensor::poisoned(backend, &[groups, p, q], DType::F32)?;
    // 64x64 outputs per 256-thread block, each summed over its segment's rows in ascending
    // order; blockIdx.z is the segment (<= E). Reads rows offsets[g]..offsets[g+1] (within N,
    // by construction of offsets) and writes out[g] only.
    backend.launch(
        &Launch::new(
            "moe_segment_wgrad",
            [blocks_for(q, 64), blocks_for(p, 64), groups as u32],
            [THREADS, 1, 1],
        )
        .arg_tensor(pm)
        .arg_tensor(qm)
        .arg_tensor(offsets)
        .arg_tensor(&out)
        .arg_i32(p as i32)
        .arg_i32(q as i32),
    )?;
    Ok(out)
}

pub(super) fn device_backward(
    backend: &Backend,
    w: &Widened<'_>,
    dy: &Tensor,
    dims: MoeDims,
    cfg: MoeConfig,
    bounds: Option<&[i32]>,
) -> Result<MoeGradTensors> {
    let MoeDims { t, d, f, e } = dims;
    let k = cfg.k;
    let n = t * k;
    let s = device_forward(backend, w, dims, cfg)?;

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

    // Expert FFN backward.
    // Expert FFN backward: the GEMM operands in the GEMM dtype (d(ye), da, db rounded to BF16
    // for BF16 inputs), the weight gradients from the f32 activations.
    let gd = w.gemm_dtype();
    let w2t = device_transpose(backend, w.w2, e, d, f)?; // [E,f,d]
    let dye_g = narrow(backend, &dye, gd)?;
    let dh = gemm_grouped(backend, dye_g.as_ref().unwrap_or(&dye), &w2t, &s.offsets)?;
    let (da, db) = swiglu_backward(backend, &s.a, &s.b, &dh)?;
    let w1t = device_transpose(backend, w.w1, e, f, d)?; // [E,d,f]
    let w3t = device_transpose(backend, w.w3, e, f, d)?;
    let (da_g, db_g) = (narrow(backend, &da, gd)?, narrow(backend, &db, gd)?);
    let dxa = gemm_grouped(backend, da_g.as_ref().unwrap_or(&da), &w1t, &s.offsets)?;
    let dxb = gemm_grouped(backend, db_g.as_ref().unwrap_or(&db), &w3t, &s.offsets)?;
    let (dw2, dw1, dw3) = if gd == DType::F32 {
        (
            device_wgrad(backend, &dye, &s.h, &s.offsets, e, d, f)?,
            device_wgrad(backend, &da, &s.xs, &s.offsets, e, f, d)?,
            device_wgrad(backend, &db, &s.xs, &s.offsets, e, f, d)?,
        )
    } else {
        let bounds = host_bounds(&s.offsets, bounds)?;
        (
            device_wgrad_mma(backend, &dye, &s.h, &bounds, d, f)?,
            device_wgrad_mma(backend, &da, &s.xs, &bounds, f, d)?,
            device_wgrad_mma(backend, &db, &s.xs, &bounds, f, d)?,
        )
    };

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
    let wrt = device_transpose(backend, w.w_router(), 1, e, d)?.reshape(&[d, e])?;
    let dx_router = gemm(backend, &dlogits, &wrt)?;
    let whole = Tensor::from_slice(backend, &[2], &[0i32, t as i32])?;
    let dw_router = device_wgrad(backend, &dlogits, w.x(), &whole, 1, e, d)?.reshape(&[e, d])?;

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
