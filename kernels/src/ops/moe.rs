//! MoE layer: `moe_forward` / `moe_backward` (DESIGN.md section 3.4, kernels/cuda/moe.cu).
//!
//! Forward, for x[T,d], w_router[E,d], w1[E,f,d], w3[E,f,d], w2[E,d,f]:
//! 1. router logits = x · W_r^T (`gemm`); scores = softmax (or sigmoid) over all E;
//! 2. the k largest scores per token (`topk`: ties to the lower index), so the k experts of a
//!    token are distinct; gates = those scores, divided by their sum (k ascending) when
//!    `renorm`;
//! 3. the T*k token-slots (slot = t*k + j) are sorted into contiguous per-expert segments by a
//!    STABLE counting sort: per-chunk counts [chunks,E], a fixed-order exclusive scan, and an
//!    ordered scatter (inside an expert's segment the slots keep ascending order, so tokens keep
//!    their order). No atomics: every count is owned by one thread;
//! 4. grouped GEMMs over the segments (`gemm_grouped`) with SwiGLU (`swiglu`) in between:
//!    y_e = (silu(x W1_e^T) * (x W3_e^T)) W2_e^T. Dropless: every slot is computed;
//! 5. combine y[t] = sum_{j ascending} gate[t,j] * y_e[slot (t,j)].
//!
//! Backward recomputes the forward's intermediates, then: dgate and d(y_e) from the combine;
//! dh = d(y_e) · W2_e, swiglu backward, dxs = da · W1_e + db · W3_e (grouped GEMMs against
//! transposed weights, transposed by moe.cu's own kernel); weight gradients per expert as one
//! reduction over the expert's contiguous segment, rows in ascending order (one thread per output
//! element, no split: the order depends on the segment alone); the router gradient flows through
//! the kept gates only (through the renormalisation, then softmax or sigmoid over all E);
//! dx = (dlogits · W_r) + sum_{j ascending} dxs[slot (t,j)]. No atomics anywhere.
//!
//! Batch invariance: a token's y (and dx) depend on its own row only: the router row ops, the
//! grouped GEMMs (no split-K; a row's sum order depends on K alone) and the combine are row-wise.
//! The weight gradients are sums over tokens, so they depend on the batch by definition.
//!
//! Numerics: F32 inputs compute in f32 on every device (the GEMMs on `gemm_f32`). BF16 inputs:
//! the expert GEMMs run on tensor cores (`gemm_bf16_mma`) with BF16 operands (x rows, h, d(ye),
//! da and db rounded to BF16 once, nearest even) and f32 accumulation, and so do the expert
//! weight gradients (one tensor-core `gemm` per expert over its transposed, BF16-rounded
//! segment); the router (x and W_r widened to f32 exactly), scores, gates, SwiGLU, combine and
//! dW_r stay f32.
//! On `cpu`, BF16 inputs run the CPU reference at the same rounding points: the inputs widened
//! exactly, h, d(ye), da and db rounded to bf16 values (nearest even) where the device rounds
//! them, every product and sum in f32 and in the device's order (every GEMM, the router's
//! included, one FMA chain over K; the softmax in the block reduction's order; the router
//! backward in `moe_router_backward`'s), so cpu and emu give the same bits, and cuda agrees to
//! the BF16 tolerance (the plain references [`moe_forward_reference`] and
//! [`moe_backward_reference`] are all-f32). Outputs are F32 (topk_idx I32).
//!
//! Optional switch-style load-balancing auxiliary loss (`MoeConfig::aux_alpha`, default 0 = off):
//! aux = alpha * E * sum_e f_e * P_e, with f_e the fraction of the T*k token-slots routed to
//! expert e (a count: no gradient) and P_e the mean score of expert e over the T tokens (t
//! ascending). Its gradient alpha * E * f_e / T reaches every score (not only the kept ones) and
//! is added before the score function's backward. The `sluice kernel` rows keep DESIGN 7's
//! contract (no aux parameter or output); the Rust API returns the loss in
//! [`MoeOutput::aux_loss`] and adds its gradient in [`moe_backward`].

use super::elementwise::{softmax, softmax_reference};
use super::gemm::{
    gemm, gemm_chain_into, gemm_chain_strided_into, gemm_grouped, gemm_packed_into, gemm_reference,
    gemm_reference_into, gemm_strided_into, small_rows_rhs, PackedB, BF16_PACKED_MAX_K,
};
use super::swiglu::{swiglu, swiglu_backward, swiglu_backward_reference, swiglu_reference_into};
use super::topk::{topk, topk_reference, MAX_E, MAX_K};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ScoreFn {
    /// softmax over all E logits of a token (the default).
    #[default]
    Softmax,
    /// sigmoid of each logit on its own.
    Sigmoid,
}

impl ScoreFn {
    /// Parses `softmax` or `sigmoid` (the `score_fn` parameter).
    pub fn parse(s: &str) -> Result<ScoreFn> {
        match s.trim() {
            "softmax" => Ok(ScoreFn::Softmax),
            "sigmoid" => Ok(ScoreFn::Sigmoid),
            other => Err(Error::param(
                "score_fn",
                format!("`{other}` is not a score function; use `softmax` or `sigmoid`"),
            )),
        }
    }
}

/// The parameters of an MoE layer call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per token, 1 <= k <= min(E, 16).
    pub k: usize,
    pub score_fn: ScoreFn,
    /// Divide the k kept scores by their sum.
    pub renorm: bool,
    /// Weight of the load-balancing auxiliary loss (0 = off).
    pub aux_alpha: f32,
}

impl MoeConfig {
    /// k experts per token, softmax scores, renormalised gates (the defaults of DESIGN 3.4).
    pub fn new(k: usize) -> Self {
        MoeConfig {
            k,
            score_fn: ScoreFn::Softmax,
            renorm: true,
            aux_alpha: 0.0,
        }
    }
}

/// The sizes of an MoE layer call: T tokens, model dim d, expert dim f, E experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub t: usize,
    pub d: usize,
    pub f: usize,
    pub e: usize,
}

/// Checks k against E and the top-k kernel's limits.
fn check_k(k: usize, e: usize) -> Result<()> {
    if k == 0 || k > MAX_K || k > e {
        return Err(Error::param(
            "k",
            format!(
                "k = {k} is out of range: need 1 <= k <= min(E, {MAX_K}) = {} with E = {e} experts",
                e.min(MAX_K)
            ),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// CPU reference (composed of the gemm, topk, softmax and swiglu references)
// ---------------------------------------------------------------------------------------------

/// The routing of a batch: scores, the kept experts and gates, and the expert-sorted slots.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeRouting {
    /// Scores (softmax or sigmoid of the router logits), [T,E].
    pub probs: Vec<f32>,
    /// The kept experts, [T,k], by score descending (ties to the lower index).
    pub idx: Vec<i32>,
    /// The kept scores, [T,k] (before renormalisation).
    pub kept: Vec<f32>,
    /// The gates, [T,k] (the kept scores, renormalised when asked).
    pub gate: Vec<f32>,
    /// Segment starts, [E+1]: expert e owns sorted positions offsets[e]..offsets[e+1].
    pub offsets: Vec<i32>,
    /// For each sorted position, its slot t*k + j, [T*k].
    pub perm: Vec<i32>,
    /// For each slot t*k + j, its sorted position, [T*k] (the inverse of `perm`).
    pub pos: Vec<i32>,
    /// The auxiliary loss (0 when `aux_alpha` is 0).
    pub aux_loss: f32,
    /// d aux / d score[t,e] = alpha * E * f_e / T, the same for every token, [E].
    pub aux_coef: Vec<f32>,
}

/// The stable counting sort of slots by expert: returns (offsets[E+1], perm[T*k], pos[T*k]).
/// Slots are visited in ascending order, so inside a segment they stay ascending.
pub fn moe_sort_reference(idx: &[i32], e: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut offsets = vec![0i32; e + 1];
    for &x in idx {
        offsets[x as usize + 1] += 1;
    }
    for i in 0..e {
        offsets[i + 1] += offsets[i];
    }
    let mut next = offsets[..e].to_vec();
    let mut perm = vec![0i32; idx.len()];
    let mut pos = vec![0i32; idx.len()];
    for (slot, &x) in idx.iter().enumerate() {
        let p = next[x as usize];
        next[x as usize] += 1;
        perm[p as usize] = slot as i32;
        pos[slot] = p;
    }
    (offsets, perm, pos)
}

/// Router of the reference: logits, scores, top-k, gates and the sort.
///
/// # Panics
/// If slice lengths disagree with `dims` or k is out of range (callers validate first).
pub fn moe_route_reference(
    x: &[f32],
    w_router: &[f32],
    dims: MoeDims,
    cfg: MoeConfig,
) -> MoeRouting {
    route(x, w_router, None, dims, cfg, false)
}

/// [`moe_route_reference`], the router product from `packed` when given (same bits). With
/// `device_order` (BF16 inputs), the router product is one FMA chain over all of d per logit,
/// the order of the device's `gemm_f32` (the packed kernel and the f32 reference are that
/// order when d fits one of their 256-long chunks).
fn route(
    x: &[f32],
    w_router: &[f32],
    packed: Option<&PackedB>,
    dims: MoeDims,
    cfg: MoeConfig,
    device_order: bool,
) -> MoeRouting {
    let MoeDims { t, d, e, .. } = dims;
    let k = cfg.k;
    let logits = match packed {
        Some(pb) if !device_order || d <= BF16_PACKED_MAX_K => {
            let mut l = vec![0.0f32; t * e];
            gemm_packed_into(x, pb, 0, &mut l, t);
            l
        }
        _ if device_order => {
            let mut l = vec![0.0f32; t * e];
            gemm_chain_into(x, w_router, &mut l, t, e, d);
            l
        }
        _ => gemm_reference(x, w_router, t, e, d),
    };
    let probs = match cfg.score_fn {
        ScoreFn::Softmax => {
            softmax_reference(&logits, t, e).expect("moe_route_reference: logits are [T,E]")
        }
        ScoreFn::Sigmoid => logits.iter().map(|&z| sigmoid(z)).collect(),
    };
    let (kept, idx) =
        topk_reference(&probs, t, e, k).expect("moe_route_reference: k <= E, probs are [T,E]");
    let mut gate = kept.clone();
    if cfg.renorm {
        for row in gate.chunks_mut(k) {
            let sum = row.iter().fold(0.0f32, |s, &v| s + v);
            for g in row.iter_mut() {
                *g /= sum;
            }
        }
    }
    let (offsets, perm, pos) = moe_sort_reference(&idx, e);
    let (aux_loss, aux_coef) = aux_reference(&probs, &offsets, t, e, k, cfg.aux_alpha);
    MoeRouting {
        probs,
        idx,
        kept,
        gate,
        offsets,
        perm,
        pos,
        aux_loss,
        aux_coef,
    }
}

/// The load-balancing loss alpha * E * sum_e f_e P_e and its gradient per score, alpha * E *
/// f_e / T (see the module documentation). Sums: P_e over t ascending, the loss over e ascending.
fn aux_reference(
    probs: &[f32],
    offsets: &[i32],
    t: usize,
    e: usize,
    k: usize,
    alpha: f32,
) -> (f32, Vec<f32>) {
    if alpha == 0.0 {
        return (0.0, vec![0.0; e]);
    }
    let scale = alpha * e as f32;
    let mut loss = 0.0f32;
    let mut coef = vec![0.0f32; e];
    for ex in 0..e {
        let frac = (offsets[ex + 1] - offsets[ex]) as f32 / (t * k) as f32;
        let mean = (0..t).fold(0.0f32, |s, tok| s + probs[tok * e + ex]) / t as f32;
        loss += frac * mean;
        coef[ex] = scale * frac / t as f32;
    }
    (scale * loss, coef)
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Everything the forward computes, kept for the backward.
struct ForwardState {
    routing: MoeRouting,
    /// x rows in sorted order, [N,d] (N = T*k).
    xs: Vec<f32>,
    /// x W1^T and x W3^T per sorted row, [N,f].
    a: Vec<f32>,
    b: Vec<f32>,
    /// silu(a) * b, [N,f].
    h: Vec<f32>,
    /// h W2^T, [N,d].
    ye: Vec<f32>,
    y: Vec<f32>,
    /// The expert GEMMs' operands are rounded to bf16 values (BF16 inputs on `cpu`).
    bf16: bool,
}

/// `v` rounded to the nearest bf16 value (ties to even), kept as f32: what a BF16 GEMM operand
/// holds.
fn round_bf16(v: &mut [f32]) {
    for x in v {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}

#[allow(clippy::too_many_arguments)]
fn forward_state(
    x: &[f32],
    w_router: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dims: MoeDims,
    cfg: MoeConfig,
    packed: Option<&MoePacked>,
    bf16: bool,
) -> ForwardState {
    let MoeDims { t, d, f, .. } = dims;
    let k = cfg.k;
    let routing = route(x, w_router, packed.map(|p| &*p.router), dims, cfg, bf16);
    let n = t * k;
    let mut xs = vec![0.0f32; n * d];
    par::rows_mut(&mut xs, d.max(1), d, |p, row| {
        let tok = routing.perm[p] as usize / k;
        row.copy_from_slice(&x[tok * d..(tok + 1) * d]);
    });
    let [a, b, h, ye] = experts_forward(&xs, [w1, w3, w2], packed, &routing.offsets, d, f, bf16);
    let mut y = vec![0.0f32; t * d];
    par::rows_mut(&mut y, d.max(1), 2 * k * d, |tok, row| {
        for j in 0..k {
            let g = routing.gate[tok * k + j];
            let p = routing.pos[tok * k + j] as usize;
            for (o, &v) in row.iter_mut().zip(&ye[p * d..(p + 1) * d]) {
                *o += g * v;
            }
        }
    });
    ForwardState {
        routing,
        xs,
        a,
        b,
        h,
        ye,
        y,
        bf16,
    }
}

/// One expert's share of [`experts_forward`]: its segment (rows `r0..r0 + rows` of the sorted
/// rows) and its slices of the four outputs.
struct ExpertTask<'a> {
    g: usize,
    r0: usize,
    rows: usize,
    a: &'a mut [f32],
    b: &'a mut [f32],
    h: &'a mut [f32],
    ye: &'a mut [f32],
}

/// Every expert's SwiGLU FFN on its segment of the sorted rows `xs` [N,d]: a = xs W1_e^T,
/// b = xs W3_e^T (both [N,f]), h = silu(a) * b (rounded to bf16 values when `bf16`: the
/// device's BF16 operand of W2), ye = h W2_e^T [N,d]. One task per expert (all
/// four steps of a segment in one task, so a call forks and joins the pool once, not once per
/// product), in parallel when the call is large enough; every row's arithmetic is the plain
/// references', so the bits do not depend on the grouping.
fn experts_forward(
    xs: &[f32],
    [w1, w3, w2]: [&[f32]; 3],
    packed: Option<&MoePacked>,
    offsets: &[i32],
    d: usize,
    f: usize,
    bf16: bool,
) -> [Vec<f32>; 4] {
    use rayon::prelude::*;
    let n = *offsets.last().unwrap_or(&0) as usize;
    let (mut a, mut b, mut h, mut ye) = (
        vec![0.0f32; n * f],
        vec![0.0f32; n * f],
        vec![0.0f32; n * f],
        vec![0.0f32; n * d],
    );
    if n == 0 || d == 0 || f == 0 {
        return [a, b, h, ye];
    }
    // Split the four outputs at the segment bounds: one set of disjoint slices per expert.
    let mut tasks: Vec<ExpertTask<'_>> = Vec::with_capacity(offsets.len() - 1);
    let (mut ra, mut rb, mut rh, mut ry) = (&mut a[..], &mut b[..], &mut h[..], &mut ye[..]);
    for (g, w) in offsets.windows(2).enumerate() {
        let rows = (w[1] - w[0]) as usize;
        let (a, ta) = std::mem::take(&mut ra).split_at_mut(rows * f);
        let (b, tb) = std::mem::take(&mut rb).split_at_mut(rows * f);
        let (h, th) = std::mem::take(&mut rh).split_at_mut(rows * f);
        let (ye, ty) = std::mem::take(&mut ry).split_at_mut(rows * d);
        (ra, rb, rh, ry) = (ta, tb, th, ty);
        if rows > 0 {
            let r0 = w[0] as usize;
            tasks.push(ExpertTask {
                g,
                r0,
                rows,
                a,
                b,
                h,
                ye,
            });
        }
    }
    let product =
        |src: &[f32], w: &[f32], pb: Option<&PackedB>, g, out: &mut [f32], rows, nn, kk| {
            // The plain weights are read only off the packed path (and may be empty on it).
            let wg = || &w[g * nn * kk..(g + 1) * nn * kk];
            match pb {
                // BF16 operands: the device's summation order (gemm_chain; the packed kernel is
                // that order when K fits one of its chunks).
                Some(pb) if bf16 && kk <= BF16_PACKED_MAX_K => {
                    gemm_packed_into(src, pb, g, out, rows)
                }
                _ if bf16 => gemm_chain_into(src, wg(), out, rows, nn, kk),
                Some(pb) => gemm_packed_into(src, pb, g, out, rows),
                None => gemm_reference_into(src, wg(), out, rows, nn, kk),
            }
        };
    let run = |t: ExpertTask<'_>| {
        let x = &xs[t.r0 * d..(t.r0 + t.rows) * d];
        product(x, w1, packed.map(|p| &*p.w1), t.g, t.a, t.rows, f, d);
        product(x, w3, packed.map(|p| &*p.w3), t.g, t.b, t.rows, f, d);
        swiglu_reference_into(t.a, t.b, t.h).expect("moe: a, b and h are one segment");
        if bf16 {
            round_bf16(t.h);
        }
        product(t.h, w2, packed.map(|p| &*p.w2), t.g, t.ye, t.rows, d, f);
    };
    if tasks.len() > 1 && par::pieces(n, 3 * d * f) > 1 {
        tasks.into_par_iter().with_max_len(1).for_each(run);
    } else {
        tasks.into_iter().for_each(run);
    }
    [a, b, h, ye]
}

/// The expert weights packed for the small-row GEMM ([`crate::ops::gemm_small`]), taken from
/// (and cached on) the weight tensors: what a decode step's MoE layer multiplies by.
pub struct MoePacked {
    router: Arc<PackedB>,
    w1: Arc<PackedB>,
    w3: Arc<PackedB>,
    w2: Arc<PackedB>,
}

impl MoePacked {
    /// The packed weights when a call of `t` tokens should use them (host F32 or BF16 weights,
    /// and few enough rows per expert: `t <= SMALL_M`, so no segment can exceed it).
    fn for_call(inp: &Inputs<'_>) -> Option<MoePacked> {
        let MoeDims { t, d, f, e } = inp.dims;
        Some(MoePacked {
            router: small_rows_rhs(inp.w_router, 1, t, e, d)?,
            w1: small_rows_rhs(inp.w1, e, t, f, d)?,
            w3: small_rows_rhs(inp.w3, e, t, f, d)?,
            w2: small_rows_rhs(inp.w2, e, t, d, f)?,
        })
    }
}

/// The outputs of [`moe_forward_reference`].
#[derive(Clone, Debug, PartialEq)]
pub struct MoeForwardOut {
    /// [T,d]
    pub y: Vec<f32>,
    /// [T,k]
    pub topk_idx: Vec<i32>,
    /// [T,k]
    pub topk_gate: Vec<f32>,
    /// The auxiliary loss (0 when off).
    pub aux_loss: f32,
}

/// The CPU reference of `moe_forward` (f32; see the module documentation for the steps).
///
/// # Panics
/// If slice lengths disagree with `dims` or k is out of range (the device entry point
/// [`moe_forward`] validates user input and returns an `Err` instead).
pub fn moe_forward_reference(
    x: &[f32],
    w_router: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dims: MoeDims,
    cfg: MoeConfig,
) -> MoeForwardOut {
    moe_forward_packed(x, w_router, w1, w3, w2, dims, cfg, None)
}

/// [`moe_forward_reference`] with the expert products from packed weights when given.
#[allow(clippy::too_many_arguments)]
fn moe_forward_packed(
    x: &[f32],
    w_router: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dims: MoeDims,
    cfg: MoeConfig,
    packed: Option<&MoePacked>,
) -> MoeForwardOut {
    check_lengths(x, w_router, w1, w3, w2, None, dims);
    let s = forward_state(x, w_router, w1, w3, w2, dims, cfg, packed, false);
    MoeForwardOut {
        y: s.y,
        topk_idx: s.routing.idx,
        topk_gate: s.routing.gate,
        aux_loss: s.routing.aux_loss,
    }
}

fn check_lengths(
    x: &[f32],
    w_router: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dy: Option<&[f32]>,
    dims: MoeDims,
) {
    let MoeDims { t, d, f, e } = dims;
    assert_eq!(x.len(), t * d, "moe reference: x must be [T,d]");
    assert_eq!(
        w_router.len(),
        e * d,
        "moe reference: w_router must be [E,d]"
    );
    assert_eq!(w1.len(), e * f * d, "moe reference: w1 must be [E,f,d]");
    assert_eq!(w3.len(), e * f * d, "moe reference: w3 must be [E,f,d]");
    assert_eq!(w2.len(), e * d * f, "moe reference: w2 must be [E,d,f]");
    if let Some(dy) = dy {
        assert_eq!(dy.len(), t * d, "moe reference: dy must be [T,d]");
    }
}

/// The gradients of the MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeGrads {
    /// [T,d]
    pub dx: Vec<f32>,
    /// [E,d]
    pub dw_router: Vec<f32>,
    /// [E,f,d]
    pub dw1: Vec<f32>,
    /// [E,f,d]
    pub dw3: Vec<f32>,
    /// [E,d,f]
    pub dw2: Vec<f32>,
}

/// out[g] = P_g^T · Q_g over the rows of segment g (P [N,p], Q [N,q], out [G,p,q]): the weight
/// gradient of a grouped linear layer, one GEMM per segment reading the segments through
/// transposed strides (the bits of a GEMM of transposed copies; no copies made).
fn segment_wgrad_reference(
    pm: &[f32],
    qm: &[f32],
    offsets: &[i32],
    p: usize,
    q: usize,
    bf16: bool,
) -> Vec<f32> {
    let product = if bf16 {
        gemm_chain_strided_into
    } else {
        gemm_strided_into
    };
    let groups = offsets.len() - 1;
    let mut out = vec![0.0f32; groups * p * q];
    if p * q == 0 {
        return out;
    }
    let rows = *offsets.last().unwrap_or(&0) as usize;
    let per_group = p * q * rows.div_ceil(groups.max(1));
    par::rows_mut(&mut out, p * q, per_group, |g, o| {
        let (r0, r1) = (offsets[g] as usize, offsets[g + 1] as usize);
        product(
            p,
            q,
            r1 - r0,
            (&pm[r0 * p..r1 * p], 1, p),
            (&qm[r0 * q..r1 * q], q, 1),
            o,
        );
    });
    out
}

/// The grouped product with weights as stored: rows `offsets[g]..offsets[g+1]` of `a` [N,k]
/// times `w[g]`, a row-major `[k, n]` matrix (the backward's `dY · W`, with no transposed
/// copy of W; with `bf16`, in the device's summation order).
fn grouped_kn(a: &[f32], w: &[f32], offsets: &[i32], n: usize, k: usize, bf16: bool) -> Vec<f32> {
    let product = if bf16 {
        gemm_chain_strided_into
    } else {
        gemm_strided_into
    };
    let bounds: Vec<usize> = offsets.iter().map(|&o| o as usize).collect();
    let rows = bounds.last().copied().unwrap_or(0);
    let mut c = vec![0.0f32; rows * n];
    if n == 0 {
        return c;
    }
    par::segments_mut(&mut c, n, &bounds, n * k, |g, r0, cg| {
        let r1 = r0 + cg.len() / n;
        product(
            r1 - r0,
            n,
            k,
            (&a[r0 * k..r1 * k], k, 1),
            (&w[g * k * n..(g + 1) * k * n], n, 1),
            cg,
        );
    });
    c
}

/// The CPU reference of `moe_backward`: recomputes the forward, then the gradients described in
/// the module documentation (f32).
///
/// # Panics
/// As [`moe_forward_reference`].
#[allow(clippy::too_many_arguments)]
pub fn moe_backward_reference(
    x: &[f32],
    w_router: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dy: &[f32],
    dims: MoeDims,
    cfg: MoeConfig,
) -> MoeGrads {
    check_lengths(x, w_router, w1, w3, w2, Some(dy), dims);
    let s = forward_state(x, w_router, w1, w3, w2, dims, cfg, None, false);
    backward_with_state(&s, x, w_router, w1, w3, w2, dy, dims, cfg)
}

/// The backward from the forward's state `s` (computed from the same inputs).
#[allow(clippy::too_many_arguments)]
fn backward_with_state(
    s: &ForwardState,
    x: &[f32],
    w_router: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    dy: &[f32],
    dims: MoeDims,
    cfg: MoeConfig,
) -> MoeGrads {
    let MoeDims { t, d, f, e } = dims;
    let k = cfg.k;
    let n = t * k;
    let r = &s.routing;

    // Combine backward: d(ye)[pos] = gate * dy[t]; dgate[t,j] = dy[t] . ye[pos] (by sorted
    // position, then scattered to the slots).
    let mut dye = vec![0.0f32; n * d];
    let mut dgate_sorted = vec![0.0f32; n];
    par::rows2_mut(
        &mut dye,
        d.max(1),
        &mut dgate_sorted,
        1,
        2 * d,
        |p, dyer, dg| {
            let slot = r.perm[p] as usize;
            let tok = slot / k;
            let g = r.gate[slot];
            let dyr = &dy[tok * d..(tok + 1) * d];
            let mut dot = 0.0f32;
            for ((o, &dv), &yv) in dyer.iter_mut().zip(dyr).zip(&s.ye[p * d..(p + 1) * d]) {
                *o = g * dv;
                dot += dv * yv;
            }
            dg[0] = dot;
        },
    );
    let mut dgate = vec![0.0f32; n];
    for (p, &slot) in r.perm.iter().enumerate() {
        dgate[slot as usize] = dgate_sorted[p];
    }
    if s.bf16 {
        // d(ye) is a BF16 operand of the dh GEMM and of dW2 on the device.
        round_bf16(&mut dye);
    }

    // Expert FFN backward.
    // dh = d(ye) W2_e (W2_e [d,f] read as stored), dxs = da W1_e + db W3_e (W1_e, W3_e [f,d]).
    let dh = grouped_kn(&dye, w2, &r.offsets, f, d, s.bf16);
    let (mut da, mut db) = swiglu_backward_reference(&s.a, &s.b, &dh).expect("moe: [N,f] operands");
    if s.bf16 {
        // da and db are BF16 operands of the dx GEMMs and of dW1 / dW3 on the device.
        round_bf16(&mut da);
        round_bf16(&mut db);
    }
    let dxa = grouped_kn(&da, w1, &r.offsets, d, f, s.bf16);
    let dxb = grouped_kn(&db, w3, &r.offsets, d, f, s.bf16);
    let dw2 = segment_wgrad_reference(&dye, &s.h, &r.offsets, d, f, s.bf16);
    let dw1 = segment_wgrad_reference(&da, &s.xs, &r.offsets, f, d, s.bf16);
    let dw3 = segment_wgrad_reference(&db, &s.xs, &r.offsets, f, d, s.bf16);

    // Router backward: through the renormalisation, then the score function over all E. With
    // BF16 inputs, the router's f32 products are FMA chains in the device's order (as the
    // expert products are).
    let dlogits = router_backward(r, &dgate, t, e, k, cfg);
    let mut dx_router = vec![0.0f32; t * d];
    let router_product = if s.bf16 {
        gemm_chain_strided_into
    } else {
        gemm_strided_into
    };
    router_product(t, d, e, (&dlogits, e, 1), (w_router, d, 1), &mut dx_router);
    let dw_router = segment_wgrad_reference(&dlogits, x, &[0, t as i32], e, d, s.bf16);

    // dx = router part + the expert parts of the token's k slots, j ascending.
    let mut dx = dx_router;
    par::rows_mut(&mut dx, d.max(1), 2 * k * d, |tok, row| {
        for j in 0..k {
            let p = r.pos[tok * k + j] as usize;
            for c in 0..d {
                row[c] += dxa[p * d + c] + dxb[p * d + c];
            }
        }
    });
    MoeGrads {
        dx,
        dw_router,
        dw1,
        dw3,
        dw2,
    }
}

/// d loss / d logits [T,E] from d loss / d gates [T,k], in the operation order of moe.cu's
/// `moe_router_backward` (one token per thread there, one row here):
/// - through g_j = v_j / S (S = sum of the kept v, j ascending) when `renorm`:
///   dv_j = (dg_j - sum_i dg_i (v_i / S)) / S; else dv_j = dg_j;
/// - dprobs = dv at the kept experts, 0 elsewhere, plus the auxiliary loss's coefficient at
///   every expert when it is on;
/// - softmax: dlogits[e] = p_e (dprobs[e] - s) with s = sum_j dv_j p_(idx j) over the kept
///   experts, j ascending (over every e ascending when the auxiliary loss is on); sigmoid:
///   dprobs[e] p_e (1 - p_e).
fn router_backward(
    r: &MoeRouting,
    dgate: &[f32],
    t: usize,
    e: usize,
    k: usize,
    cfg: MoeConfig,
) -> Vec<f32> {
    let sigmoid = cfg.score_fn == ScoreFn::Sigmoid;
    let aux = (cfg.aux_alpha != 0.0).then_some(&r.aux_coef[..]);
    let mut dlogits = vec![0.0f32; t * e];
    par::rows_mut(&mut dlogits, e.max(1), 4 * e, |tok, out| {
        let v = &r.kept[tok * k..(tok + 1) * k];
        let dg = &dgate[tok * k..(tok + 1) * k];
        let ix = &r.idx[tok * k..(tok + 1) * k];
        let p = &r.probs[tok * e..(tok + 1) * e];
        let mut dv_all = [0.0f32; MAX_K];
        let dv = &mut dv_all[..k];
        if cfg.renorm {
            let sum = v.iter().fold(0.0f32, |s, &x| s + x);
            let dot = (0..k).fold(0.0f32, |s, j| s + dg[j] * (v[j] / sum));
            for (o, &g) in dv.iter_mut().zip(dg) {
                *o = (g - dot) / sum;
            }
        } else {
            dv.copy_from_slice(dg);
        }
        let kept_at = |ex: usize| ix.iter().position(|&i| i as usize == ex);
        if let Some(coef) = aux {
            let dp = |ex: usize| coef[ex] + kept_at(ex).map_or(0.0, |j| dv[j]);
            if sigmoid {
                for (ex, o) in out.iter_mut().enumerate() {
                    *o = dp(ex) * (p[ex] * (1.0 - p[ex]));
                }
            } else {
                let s = (0..e).fold(0.0f32, |s, ex| s + dp(ex) * p[ex]);
                for (ex, o) in out.iter_mut().enumerate() {
                    *o = p[ex] * (dp(ex) - s);
                }
            }
            return;
        }
        if sigmoid {
            for (j, &ex) in ix.iter().enumerate() {
                let ex = ex as usize;
                out[ex] = dv[j] * (p[ex] * (1.0 - p[ex]));
            }
            return;
        }
        let s = (0..k).fold(0.0f32, |s, j| s + dv[j] * p[ix[j] as usize]);
        for (o, &pe) in out.iter_mut().zip(p) {
            *o = pe * (0.0 - s);
        }
        for (j, &ex) in ix.iter().enumerate() {
            let ex = ex as usize;
            out[ex] = p[ex] * (dv[j] - s);
        }
    });
    dlogits
}

// ---------------------------------------------------------------------------------------------
// Device entry points
// ---------------------------------------------------------------------------------------------

/// Slots per chunk of the counting sort: one thread counts and scatters one chunk, in order.
const SORT_CHUNK: usize = 256;
/// Threads per block of the grid-stride and per-chunk kernels.
const THREADS: u32 = 256;
/// Upper bound on grid-stride blocks.
const MAX_BLOCKS: usize = 4096;

fn ew_blocks(n: usize) -> u32 {
    blocks_for(n, THREADS as usize).min(MAX_BLOCKS as u32)
}

/// The validated inputs of a call.
struct Inputs<'a> {
    x: &'a Tensor,
    w_router: &'a Tensor,
    w1: &'a Tensor,
    w3: &'a Tensor,
    w2: &'a Tensor,
    dims: MoeDims,
}

#[allow(clippy::too_many_arguments)]
fn check_inputs<'a>(
    backend: &Backend,
    x: &'a Tensor,
    w_router: &'a Tensor,
    w1: &'a Tensor,
    w3: &'a Tensor,
    w2: &'a Tensor,
    dy: Option<&Tensor>,
    cfg: MoeConfig,
) -> Result<Inputs<'a>> {
    if x.shape().len() != 2 || x.shape()[0] == 0 || x.shape()[1] == 0 {
        return Err(Error::shape("x", "[T,d] with T >= 1, d >= 1", x.shape()));
    }
    let (t, d) = (x.shape()[0], x.shape()[1]);
    let ws = w_router.shape();
    if ws.len() != 2 || ws[1] != d || ws[0] == 0 || ws[0] > MAX_E {
        return Err(Error::shape(
            "w_router",
            format!("[E,{d}] (d from `x`, 1 <= E <= {MAX_E})"),
            ws,
        ));
    }
    let e = ws[0];
    let s1 = w1.shape();
    if s1.len() != 3 || s1[0] != e || s1[2] != d || s1[1] == 0 {
        return Err(Error::shape(
            "w1",
            format!("[{e},f,{d}] (E from `w_router`, d from `x`, f >= 1)"),
            s1,
        ));
    }
    let f = s1[1];
    if w3.shape() != [e, f, d] {
        return Err(Error::shape(
            "w3",
            format!("[{e},{f},{d}] (the shape of `w1`)"),
            w3.shape(),
        ));
    }
    if w2.shape() != [e, d, f] {
        return Err(Error::shape(
            "w2",
            format!("[{e},{d},{f}] ([E,d,f] from `w1`)"),
            w2.shape(),
        ));
    }
    if let Some(dy) = dy {
        if dy.shape() != [t, d] {
            return Err(Error::shape(
                "dy",
                format!("[{t},{d}] (the shape of `x`)"),
                dy.shape(),
            ));
        }
    }
    let mut named: Vec<(&str, &Tensor)> = vec![
        ("x", x),
        ("w_router", w_router),
        ("w1", w1),
        ("w3", w3),
        ("w2", w2),
    ];
    if let Some(dy) = dy {
        named.push(("dy", dy));
    }
    for (name, tensor) in &named {
        // dy may also be F32 with BF16 inputs (an f32 gradient: the backward widens a BF16 dy
        // to f32 before using it, so an F32 one skips a rounding).
        let f32_dy = *name == "dy" && tensor.dtype() == DType::F32;
        if !tensor.dtype().is_float() || (tensor.dtype() != x.dtype() && !f32_dy) {
            return Err(Error::DType {
                tensor: name.to_string(),
                expected: format!("F32 or BF16, the dtype of `x` ({})", x.dtype()),
                got: tensor.dtype().to_string(),
            });
        }
        if !tensor.is_on(backend.device()) {
            return Err(Error::Invalid(format!(
                "tensor `{name}` lives on {}, but the op runs on {}; upload it first",
                tensor.device_kind(),
                backend.device()
            )));
        }
    }
    check_k(cfg.k, e)?;
    let n = t * cfg.k;
    for (name, v) in [
        ("T*k", n),
        ("T*k*d", n * d),
        ("T*k*f", n * f),
        ("E*f*d", e * f * d),
    ] {
        if v > i32::MAX as usize {
            return Err(Error::Invalid(format!(
                "moe: {name} = {v} exceeds the kernels' 32-bit index range"
            )));
        }
    }
    Ok(Inputs {
        x,
        w_router,
        w1,
        w3,
        w2,
        dims: MoeDims { t, d, f, e },
    })
}

/// The outputs of [`moe_forward`].
pub struct MoeOutput {
    /// [T,d] F32
    pub y: Tensor,
    /// [T,k] I32
    pub topk_idx: Tensor,
    /// [T,k] F32
    pub topk_gate: Tensor,
    /// [1] F32: the load-balancing loss (0 when `aux_alpha` is 0).
    pub aux_loss: Tensor,
}

/// The gradients of [`moe_backward`], all F32.
pub struct MoeGradTensors {
    pub dx: Tensor,
    pub dw_router: Tensor,
    pub dw1: Tensor,
    pub dw3: Tensor,
    pub dw2: Tensor,
}

/// What the CPU forward computed (routing, the expert-sorted rows, every expert activation),
/// kept by [`moe_forward_saved`] so that [`moe_backward_saved`] need not recompute it: the
/// backward's recomputation of the forward was about a sixth of a training step's FLOPs.
/// Opaque; only the `cpu` device makes one.
pub struct MoeSaved {
    /// Boxed: the state is a dozen vectors, and the model keeps one per layer in an enum.
    state: Box<ForwardState>,
    dims: MoeDims,
    cfg: MoeConfig,
}

/// The MoE layer forward on any device (see the module documentation).
#[allow(clippy::too_many_arguments)]
pub fn moe_forward(
    backend: &Backend,
    x: &Tensor,
    w_router: &Tensor,
    w1: &Tensor,
    w3: &Tensor,
    w2: &Tensor,
    cfg: MoeConfig,
) -> Result<MoeOutput> {
    Ok(moe_forward_saved(backend, x, w_router, w1, w3, w2, cfg)?.0)
}

/// [`moe_forward`], also returning (on `cpu`) the state [`moe_backward_saved`] takes.
#[allow(clippy::too_many_arguments)]
pub fn moe_forward_saved(
    backend: &Backend,
    x: &Tensor,
    w_router: &Tensor,
    w1: &Tensor,
    w3: &Tensor,
    w2: &Tensor,
    cfg: MoeConfig,
) -> Result<(MoeOutput, Option<MoeSaved>)> {
    let inp = check_inputs(backend, x, w_router, w1, w3, w2, None, cfg)?;
    let MoeDims { t, d, .. } = inp.dims;
    let k = cfg.k;
    if let Backend::Cpu = backend {
        let packed = MoePacked::for_call(&inp);
        let bf16 = x.dtype() == DType::BF16;
        // BF16 weights packed (kept on the tensors, widened once) with every K within one chunk:
        // the router and expert products read only the packed copies, so the weights are not
        // widened again on every call (a decode step's cost otherwise).
        let f = inp.dims.f;
        let packed_only = bf16 && packed.is_some() && d.max(f) <= BF16_PACKED_MAX_K;
        fn weights(w: &Tensor, packed_only: bool) -> Result<std::borrow::Cow<'_, [f32]>> {
            if packed_only {
                Ok(std::borrow::Cow::Borrowed(&[]))
            } else {
                w.f32_data()
            }
        }
        let mut state = forward_state(
            &x.f32_data()?,
            &weights(w_router, packed_only)?,
            &weights(w1, packed_only)?,
            &weights(w3, packed_only)?,
            &weights(w2, packed_only)?,
            inp.dims,
            cfg,
            packed.as_ref(),
            bf16,
        );
        let r = &state.routing;
        let out = MoeOutput {
            y: Tensor::from_f32_vec(backend, &[t, d], std::mem::take(&mut state.y))?,
            topk_idx: Tensor::from_slice(backend, &[t, k], &r.idx)?,
            topk_gate: Tensor::from_slice(backend, &[t, k], &r.gate)?,
            aux_loss: Tensor::from_slice(backend, &[1], &[r.aux_loss])?,
        };
        let saved = MoeSaved {
            state: Box::new(state),
            dims: inp.dims,
            cfg,
        };
        return Ok((out, Some(saved)));
    }
    let w = Widened::new(backend, &inp)?;
    let s = device_forward(backend, &w, inp.dims, cfg)?;
    Ok((
        MoeOutput {
            y: s.y,
            topk_idx: s.idx,
            topk_gate: s.gate,
            aux_loss: s.aux_loss,
        },
        None,
    ))
}

/// The MoE layer backward on any device: gradients of sum(dy * y) with respect to x and the
/// weights (see the module documentation). Recomputes the forward.
#[allow(clippy::too_many_arguments)]
pub fn moe_backward(
    backend: &Backend,
    x: &Tensor,
    w_router: &Tensor,
    w1: &Tensor,
    w3: &Tensor,
    w2: &Tensor,
    dy: &Tensor,
    cfg: MoeConfig,
) -> Result<MoeGradTensors> {
    moe_backward_saved(backend, x, w_router, w1, w3, w2, dy, cfg, None)
}

/// [`moe_backward`] from the state of the forward of the SAME inputs (`saved`, from
/// [`moe_forward_saved`] on `cpu`) instead of recomputing it; the gradients are the same bits
/// (the forward is deterministic). A state of other sizes or parameters is an error; `None`
/// recomputes.
#[allow(clippy::too_many_arguments)]
pub fn moe_backward_saved(
    backend: &Backend,
    x: &Tensor,
    w_router: &Tensor,
    w1: &Tensor,
    w3: &Tensor,
    w2: &Tensor,
    dy: &Tensor,
    cfg: MoeConfig,
    saved: Option<MoeSaved>,
) -> Result<MoeGradTensors> {
    let inp = check_inputs(backend, x, w_router, w1, w3, w2, Some(dy), cfg)?;
    let MoeDims { t, d, f, e } = inp.dims;
    if let Some(s) = &saved {
        if s.dims != inp.dims || s.cfg != cfg || s.state.bf16 != (x.dtype() == DType::BF16) {
            return Err(Error::Invalid(format!(
                "moe_backward_saved: the saved forward state is of {:?} / {:?} (bf16 operands: \
                 {}), the call of {:?} / {cfg:?} with {} inputs",
                s.dims,
                s.cfg,
                s.state.bf16,
                inp.dims,
                x.dtype()
            )));
        }
    }
    if let Backend::Cpu = backend {
        let (xs, wr, w1s, w3s, w2s, dys) = (
            x.f32_data()?,
            w_router.f32_data()?,
            w1.f32_data()?,
            w3.f32_data()?,
            w2.f32_data()?,
            dy.f32_data()?,
        );
        let state = match saved {
            Some(s) => s.state,
            None => Box::new(forward_state(
                &xs,
                &wr,
                &w1s,
                &w3s,
                &w2s,
                inp.dims,
                cfg,
                None,
                x.dtype() == DType::BF16,
            )),
        };
        let g = backward_with_state(&state, &xs, &wr, &w1s, &w3s, &w2s, &dys, inp.dims, cfg);
        return Ok(MoeGradTensors {
            dx: Tensor::from_f32_vec(backend, &[t, d], g.dx)?,
            dw_router: Tensor::from_f32_vec(backend, &[e, d], g.dw_router)?,
            dw1: Tensor::from_f32_vec(backend, &[e, f, d], g.dw1)?,
            dw3: Tensor::from_f32_vec(backend, &[e, f, d], g.dw3)?,
            dw2: Tensor::from_f32_vec(backend, &[e, d, f], g.dw2)?,
        });
    }
    let w = Widened::new(backend, &inp)?;
    let dyw = widen(backend, dy)?;
    let dy = dyw.as_ref().unwrap_or(dy);
    device_backward(backend, &w, dy, inp.dims, cfg)
}

/// The inputs as the device path uses them: x and w_router as F32 (widened from BF16 by
/// moe_widen_bf16 when needed: the router, its gradient and dW_r run in f32), the expert weights
/// as given (F32 runs `gemm_f32`; BF16 runs the tensor-core `gemm_bf16_mma` path).
struct Widened<'a> {
    x32: Option<Tensor>,
    wr32: Option<Tensor>,
    x: &'a Tensor,
    w_router: &'a Tensor,
    w1: &'a Tensor,
    w3: &'a Tensor,
    w2: &'a Tensor,
}

impl<'a> Widened<'a> {
    fn new(backend: &Backend, inp: &Inputs<'a>) -> Result<Self> {
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
fn widen(backend: &Backend, t: &Tensor) -> Result<Option<Tensor>> {
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
struct DeviceForward {
    probs: Tensor,
    kept: Tensor,
    idx: Tensor,
    gate: Tensor,
    offsets: Tensor,
    pos: Tensor,
    xs: Tensor,
    a: Tensor,
    b: Tensor,
    h: Tensor,
    ye: Tensor,
    y: Tensor,
    aux_loss: Tensor,
    aux_coef: Tensor,
}

fn device_forward(
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

/// The stable counting sort of token-slots by expert on any device: `idx` [T,k] I32 with every
/// entry in [0, E) -> (offsets [E+1], perm [T*k], pos [T*k]), all I32, as
/// [`moe_sort_reference`] defines them. The entries are checked on the host first (a copy on
/// cuda), so a bad index is an `Err` naming `idx`, never a kernel reading out of bounds.
pub fn moe_sort(backend: &Backend, idx: &Tensor, e: usize) -> Result<(Tensor, Tensor, Tensor)> {
    idx.expect_dtype("idx", DType::I32)?;
    idx.expect_rank("idx", 2, "[T,k]")?;
    if e == 0 || e > MAX_E {
        return Err(Error::param(
            "E",
            format!("E = {e}: need 1 <= E <= {MAX_E}"),
        ));
    }
    let n = idx.numel();
    if n == 0 || n > i32::MAX as usize {
        return Err(Error::shape(
            "idx",
            "[T,k] with 1 <= T*k < 2^31",
            idx.shape(),
        ));
    }
    let host = idx.to_vec::<i32>()?;
    if let Some((i, v)) = host
        .iter()
        .enumerate()
        .find(|(_, &v)| v < 0 || v as usize >= e)
    {
        return Err(Error::Invalid(format!(
            "tensor `idx`: element {i} is {v}, outside [0, E) = [0, {e})"
        )));
    }
    if let Backend::Cpu = backend {
        let (offsets, perm, pos) = moe_sort_reference(&host, e);
        return Ok((
            Tensor::from_slice(backend, &[e + 1], &offsets)?,
            Tensor::from_slice(backend, &[n], &perm)?,
            Tensor::from_slice(backend, &[n], &pos)?,
        ));
    }
    device_sort(backend, idx, n, e)
}

/// The stable counting sort on the device: (offsets [E+1], perm [N], pos [N]), all I32.
fn device_sort(
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

fn device_backward(
    backend: &Backend,
    w: &Widened<'_>,
    dy: &Tensor,
    dims: MoeDims,
    cfg: MoeConfig,
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
        let bounds = s.offsets.to_vec::<i32>()?;
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

// ---------------------------------------------------------------------------------------------
// `sluice kernel moe_forward` / `moe_backward`
// ---------------------------------------------------------------------------------------------

fn config_of(call: &OpCall) -> Result<MoeConfig> {
    Ok(MoeConfig {
        k: call.param_usize("k")?,
        score_fn: ScoreFn::parse(call.param("score_fn")?)?,
        renorm: call.param_bool("renorm")?,
        // DESIGN 7's rows have no aux parameter: the auxiliary loss is a Rust API option.
        aux_alpha: 0.0,
    })
}

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let out = moe_forward(
        backend,
        call.tensor("x")?,
        call.tensor("w_router")?,
        call.tensor("w1")?,
        call.tensor("w3")?,
        call.tensor("w2")?,
        config_of(call)?,
    )?;
    Ok(vec![
        ("y", out.y),
        ("topk_idx", out.topk_idx),
        ("topk_gate", out.topk_gate),
    ])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let g = moe_backward(
        backend,
        call.tensor("x")?,
        call.tensor("w_router")?,
        call.tensor("w1")?,
        call.tensor("w3")?,
        call.tensor("w2")?,
        call.tensor("dy")?,
        config_of(call)?,
    )?;
    Ok(vec![
        ("dx", g.dx),
        ("dw_router", g.dw_router),
        ("dw1", g.dw1),
        ("dw3", g.dw3),
        ("dw2", g.dw2),
    ])
}

const FLOATS: &str = "F32|BF16 (as x)";

const FORWARD_INPUTS: &[TensorSpec] = &[
    TensorSpec {
        name: "x",
        shape: "[T,d]",
        dtypes: "F32|BF16 (BF16: tensor-core expert GEMMs)",
    },
    TensorSpec {
        name: "w_router",
        shape: "[E,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w1",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w3",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w2",
        shape: "[E,d,f]",
        dtypes: FLOATS,
    },
];

const BACKWARD_INPUTS: &[TensorSpec] = &[
    TensorSpec {
        name: "x",
        shape: "[T,d]",
        dtypes: "F32|BF16 (BF16: tensor-core expert GEMMs)",
    },
    TensorSpec {
        name: "w_router",
        shape: "[E,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w1",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w3",
        shape: "[E,f,d]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "w2",
        shape: "[E,d,f]",
        dtypes: FLOATS,
    },
    TensorSpec {
        name: "dy",
        shape: "[T,d]",
        dtypes: FLOATS,
    },
];

const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "k",
        default: None,
        help: "experts per token, 1 <= k <= min(E, 16); required",
    },
    ParamSpec {
        name: "score_fn",
        default: Some("softmax"),
        help: "softmax (over all E) or sigmoid",
    },
    ParamSpec {
        name: "renorm",
        default: Some("true"),
        help: "divide the k kept scores by their sum",
    },
];

/// `sluice kernel moe_forward` (DESIGN.md section 7).
pub static FORWARD_SPEC: OpSpec = OpSpec {
    name: "moe_forward",
    summary: "MoE layer: router, deterministic top-k gates, stable expert sort, grouped SwiGLU \
              FFN, combine (dropless; F32 in f32, BF16 expert GEMMs on tensor cores)",
    inputs: FORWARD_INPUTS,
    params: PARAMS,
    outputs: &[
        TensorSpec {
            name: "y",
            shape: "[T,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "topk_idx",
            shape: "[T,k]",
            dtypes: "I32",
        },
        TensorSpec {
            name: "topk_gate",
            shape: "[T,k]",
            dtypes: "F32",
        },
    ],
    run: run_forward,
};

/// `sluice kernel moe_backward` (DESIGN.md section 7).
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "moe_backward",
    summary: "MoE layer backward: dx and every weight gradient of sum(dy * y); router gradient \
              through the kept gates; no atomics, fixed reduction order",
    inputs: BACKWARD_INPUTS,
    params: PARAMS,
    outputs: &[
        TensorSpec {
            name: "dx",
            shape: "[T,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw_router",
            shape: "[E,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw1",
            shape: "[E,f,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw3",
            shape: "[E,f,d]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dw2",
            shape: "[E,d,f]",
            dtypes: "F32",
        },
    ],
    run: run_backward,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sort_is_stable_and_inverse() {
        let idx = [2, 0, 1, 2, 0, 1, 2, 0];
        let (offsets, perm, pos) = moe_sort_reference(&idx, 4);
        assert_eq!(offsets, [0, 3, 5, 8, 8]);
        assert_eq!(perm, [1, 4, 7, 2, 5, 0, 3, 6]);
        for (slot, &p) in pos.iter().enumerate() {
            assert_eq!(perm[p as usize] as usize, slot);
        }
    }
}
