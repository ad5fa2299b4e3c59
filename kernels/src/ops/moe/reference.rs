//! The MoE layer's CPU reference: the forward's state (sorted rows, every expert activation),
//! the experts' SwiGLU FFNs, the grouped products and per-expert weight gradients, and the
//! backward from that state.

use super::routing::{route, router_backward, MoeRouting};
use super::{Inputs, MoeConfig, MoeDims};
use crate::ops::block_reduce::warp_dot_fma;
use crate::ops::gemm::{
    gemm_chain_into, gemm_chain_strided_into, gemm_packed_into, gemm_reference_into,
    gemm_strided_into, small_rows_rhs, PackedB, BF16_PACKED_MAX_K,
};
use crate::ops::swiglu::{swiglu_backward_reference, swiglu_reference_into};
use crate::par;
use std::sync::Arc;

/// Everything the forward computes, kept for the backward.
pub(super) struct ForwardState {
    pub(super) routing: MoeRouting,
    /// x rows in sorted order, [N,d] (N = T*k).
    xs: Vec<f32>,
    /// x W1^T and x W3^T per sorted row, [N,f].
    a: Vec<f32>,
    b: Vec<f32>,
    /// silu(a) * b, [N,f].
    h: Vec<f32>,
    /// h W2^T, [N,d].
    ye: Vec<f32>,
    pub(super) y: Vec<f32>,
    /// The expert GEMMs' operands are rounded to bf16 values (BF16 inputs on `cpu`).
    pub(super) bf16: bool,
}

/// `v` rounded to the nearest bf16 value (ties to even), kept as f32: what a BF16 GEMM operand
/// holds.
fn round_bf16(v: &mut [f32]) {
    for x in v {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward_state(
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
    pub(super) fn for_call(inp: &Inputs<'_>) -> Option<MoePacked> {
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

/// The CPU reference of `moe_forward` (f32; see the `moe` module documentation for the steps).
///
/// # Panics
/// If slice lengths disagree with `dims` or k is out of range (the device entry point
/// [`moe_forward`](super::moe_forward) validates user input and returns an `Err` instead).
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
/// the `moe` module documentation (f32).
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
pub(super) fn backward_with_state(
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
    // position, then scattered to the slots), in the kernel's order: 32 lane-strided FMA
    // chains, then the warp's xor butterfly.
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
            for (o, &dv) in dyer.iter_mut().zip(dyr) {
                *o = g * dv;
            }
            // moe_combine_backward's warp-per-slot dot.
            dg[0] = warp_dot_fma(dyr, &s.ye[p * d..(p + 1) * d]);
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
    // The device keeps a and b in BF16 for BF16 inputs (the up-projection's epilogue rounds
    // them): SwiGLU's backward reads the rounded values.
    let rounded = |v: &[f32]| -> Vec<f32> {
        let mut r = v.to_vec();
        round_bf16(&mut r);
        r
    };
    let (saved_a, saved_b) = if s.bf16 {
        (
            std::borrow::Cow::Owned(rounded(&s.a)),
            std::borrow::Cow::Owned(rounded(&s.b)),
        )
    } else {
        (
            std::borrow::Cow::Borrowed(&s.a[..]),
            std::borrow::Cow::Borrowed(&s.b[..]),
        )
    };
    let (mut da, mut db) =
        swiglu_backward_reference(&saved_a, &saved_b, &dh).expect("moe: [N,f] operands");
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
