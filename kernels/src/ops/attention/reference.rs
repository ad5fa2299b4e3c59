//! The CPU reference of training attention: the forward row by row through [`attend_row`], and
//! the backward (dq per query row; dk, dv per key row, or per sequence when there are few), in
//! the order the kernels of the selected path use.

use super::*;

/// CPU reference of the forward: out[T,H,D] and lse[T,H], rows in parallel (rayon), each row
/// through [`attend_row`].
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cu_seqlens: &[i32],
    dims: AttnDims,
    causal: bool,
    scale: f32,
    order: RowOrder,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    dims.check_lens(q.len(), k.len(), v.len())?;
    check_cu_seqlens(cu_seqlens, dims.t)?;
    let AttnDims { h, hkv, d, t } = dims;
    if out.len() != t * h * d || lse.len() != t * h {
        return Err(Error::Invalid(format!(
            "output buffers hold {} and {} values; expected out [T,H,D] = {} and lse [T,H] = {}",
            out.len(),
            lse.len(),
            t * h * d,
            t * h
        )));
    }
    let group = h / hkv;
    let keys = longest_sequence(cu_seqlens);
    par::rows2_mut(out, d, lse, 1, 2 * d * keys, |r, o, l| {
        let (tok, head) = (r / h, r % h);
        let g = head / group;
        let (s0, n) = key_range(cu_seqlens, tok, causal);
        let qr = &q[r * d..(r + 1) * d];
        l[0] = attend_row(
            order,
            qr,
            n,
            scale,
            |j| {
                let row = ((s0 + j) * hkv + g) * d;
                (&k[row..row + d], &v[row..row + d])
            },
            o,
        );
    });
    Ok(())
}

/// CPU reference of the backward from the forward's saved `out` and `lse`: dq[T,H,D],
/// dk[T,Hkv,D], dv[T,Hkv,D]. P = exp(scale*q.k - lse) is recomputed; dS = P*(dP - delta) with
/// delta = sum(dout*out) per row. dq rows and (dk, dv) rows each have one owner (rayon over
/// rows); every sum runs in the kernels' fixed order (keys ascending for dq; heads of the GQA
/// group ascending, then queries ascending, for dk and dv).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cu_seqlens: &[i32],
    dims: AttnDims,
    causal: bool,
    scale: f32,
    order: RowOrder,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    dims.check_lens(q.len(), k.len(), v.len())?;
    check_cu_seqlens(cu_seqlens, dims.t)?;
    let AttnDims { h, hkv, d, t } = dims;
    let (nq, nk) = (t * h * d, t * hkv * d);
    if out.len() != nq
        || dout.len() != nq
        || dq.len() != nq
        || lse.len() != t * h
        || dk.len() != nk
        || dv.len() != nk
    {
        return Err(Error::Invalid(format!(
            "backward buffers: out {}, dout {}, dq {} (expected {nq}), lse {} (expected {}), dk {}, dv {} (expected {nk})",
            out.len(), dout.len(), dq.len(), lse.len(), t * h, dk.len(), dv.len()
        )));
    }
    let delta: Vec<f32> = (0..t * h)
        .map(|r| {
            let (dor, outr) = (&dout[r * d..(r + 1) * d], &out[r * d..(r + 1) * d]);
            match order {
                RowOrder::Chunks => dot_fma(dor, outr),
                // v3's backward kernels compute v2's order (RowOrder::backward).
                RowOrder::Tiles | RowOrder::Wgmma => attention_tile::delta_tiles(dor, outr),
            }
        })
        .collect();

    let ctx = BwdCtx {
        q,
        k,
        v,
        cu_seqlens,
        dims,
        causal,
        scale,
        lse,
        dout,
        delta: &delta,
        round_bf16: order != RowOrder::Chunks,
    };
    let sequences = cu_seqlens.len() - 1;
    if sequences >= 2 * par::threads() {
        backward_by_sequence(&ctx, dq, dk, dv);
    } else {
        backward_by_row(&ctx, dq, dk, dv);
    }
    Ok(())
}

/// The backward with one task per row of dq and per row of dk/dv: each (query, key) pair's
/// P and dS are computed twice (once for dq, once for dk/dv). Used when there are too few
/// sequences to keep every thread busy with [`backward_by_sequence`]; the bits are the same.
fn backward_by_row(c: &BwdCtx<'_>, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
    let AttnDims { h, hkv, d, .. } = c.dims;
    let keys = longest_sequence(c.cu_seqlens);
    // dq: one row per (token, head); keys ascending.
    par::rows_mut(dq, d, 3 * d * keys, |r, dqr| dq_row(c, r, dqr));
    // dk, dv: one row per (token, kv head); heads of the group ascending, queries ascending.
    par::rows2_mut(dk, d, dv, d, 3 * d * keys * (h / hkv), |r, dkr, dvr| {
        dkdv_row(c, r, dkr, dvr)
    });
}

/// The backward with one task per sequence: each (query, key) pair's P and dS computed once
/// and used for dq, dk and dv together, the dot products eight keys at a time. Every sum keeps
/// THE ORDER of [`backward_by_row`] (dq: keys ascending; dk, dv: heads of the group ascending,
/// then queries ascending), and P, dP are the same products (an FMA is symmetric in its two
/// factors), so the bits are the same.
fn backward_by_sequence(c: &BwdCtx<'_>, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
    use rayon::prelude::*;
    let AttnDims { h, hkv, d, .. } = c.dims;
    let cu = c.cu_seqlens;
    let mut tasks = Vec::with_capacity(cu.len() - 1);
    let (mut rq, mut rk, mut rv) = (dq, dk, dv);
    for w in cu.windows(2) {
        let (s0, s1) = (w[0] as usize, w[1] as usize);
        let (a, q_rest) = rq.split_at_mut((s1 - s0) * h * d);
        let (b, k_rest) = rk.split_at_mut((s1 - s0) * hkv * d);
        let (e, v_rest) = rv.split_at_mut((s1 - s0) * hkv * d);
        (rq, rk, rv) = (q_rest, k_rest, v_rest);
        tasks.push((s0, s1, a, b, e));
    }
    let longest = longest_sequence(cu);
    let per_seq = 4 * d * h * longest * longest;
    let run = |(s0, s1, a, b, e): (usize, usize, &mut [f32], &mut [f32], &mut [f32])| {
        sequence_backward(c, s0, s1, a, b, e)
    };
    if par::pieces(tasks.len(), per_seq) > 1 {
        tasks.into_par_iter().for_each(run);
    } else {
        tasks.into_iter().for_each(run);
    }
}

fma_dispatch! {
    fn sequence_backward<'a,>(c: &BwdCtx<'a>, s0: usize, s1: usize, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) -> () = sequence_backward_body;
}

/// dq, dk, dv of the tokens s0..s1 of one sequence (the rows of that sequence only).
#[inline(always)]
fn sequence_backward_body(
    c: &BwdCtx<'_>,
    s0: usize,
    s1: usize,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let AttnDims { h, hkv, d, .. } = c.dims;
    let group = h / hkv;
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    for g in 0..hkv {
        for head in g * group..(g + 1) * group {
            for i in s0..s1 {
                let qi = i * h + head;
                let qr = &c.q[qi * d..(qi + 1) * d];
                let dor = &c.dout[qi * d..(qi + 1) * d];
                let (lse, delta) = (c.lse[qi], c.delta[qi]);
                let j_end = if c.causal { i + 1 } else { s1 };
                let dqr = &mut dq[((i - s0) * h + head) * d..((i - s0) * h + head + 1) * d];
                let kv_row = |j: usize| (j * hkv + g) * d;
                let mut j = s0;
                while j < j_end {
                    let m = DOT_LANES.min(j_end - j);
                    let lane = |jj: usize| kv_row(if jj < m { j + jj } else { j });
                    let keys: [&[f32]; DOT_LANES] =
                        std::array::from_fn(|jj| &c.k[lane(jj)..lane(jj) + d]);
                    let vals: [&[f32]; DOT_LANES] =
                        std::array::from_fn(|jj| &c.v[lane(jj)..lane(jj) + d]);
                    let qk = dots8(qr, &keys);
                    let dpv = dots8(dor, &vals);
                    for jj in 0..m {
                        let p = (qk[jj] * c.scale - lse).exp();
                        let ds = c.operand(p * (dpv[jj] - delta));
                        let p = c.operand(p);
                        for (a, &x) in dqr.iter_mut().zip(keys[jj]) {
                            *a = ds.mul_add(x, *a);
                        }
                        let kr = ((j + jj - s0) * hkv + g) * d;
                        let (dvr, dkr) = (&mut dv[kr..kr + d], &mut dk[kr..kr + d]);
                        for ((a, b), (&x, &y)) in dvr.iter_mut().zip(dkr).zip(dor.iter().zip(qr)) {
                            *a = p.mul_add(x, *a);
                            *b = ds.mul_add(y, *b);
                        }
                    }
                    j += DOT_LANES;
                }
            }
        }
    }
    for a in dq.iter_mut() {
        *a *= c.scale;
    }
    for b in dk.iter_mut() {
        *b *= c.scale;
    }
}

/// The inputs of the backward's row routines.
struct BwdCtx<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    cu_seqlens: &'a [i32],
    dims: AttnDims,
    causal: bool,
    scale: f32,
    lse: &'a [f32],
    dout: &'a [f32],
    delta: &'a [f32],
    /// The tile order's rounding: P and dS to bf16 before they multiply dO, K and Q (the
    /// operands of the v2 kernels' mma.sync).
    round_bf16: bool,
}

impl BwdCtx<'_> {
    /// The operand value of a P or dS: itself, or rounded to bf16 in the tile order.
    #[inline(always)]
    fn operand(&self, x: f32) -> f32 {
        if self.round_bf16 {
            attention_tile::round_bf16(x)
        } else {
            x
        }
    }
}

fma_dispatch! {
    fn dq_row<'a,>(c: &BwdCtx<'a>, r: usize, dqr: &mut [f32]) -> () = dq_row_body;
}

fma_dispatch! {
    fn dkdv_row<'a,>(c: &BwdCtx<'a>, r: usize, dkr: &mut [f32], dvr: &mut [f32]) -> () = dkdv_row_body;
}

/// dq row r = (token, head): keys ascending.
#[inline(always)]
fn dq_row_body(c: &BwdCtx<'_>, r: usize, dqr: &mut [f32]) {
    let AttnDims { h, hkv, d, .. } = c.dims;
    let (tok, head) = (r / h, r % h);
    let g = head / (h / hkv);
    let (s0, n) = key_range(c.cu_seqlens, tok, c.causal);
    let qr = &c.q[r * d..(r + 1) * d];
    let dor = &c.dout[r * d..(r + 1) * d];
    dqr.fill(0.0);
    for j in 0..n {
        let row = ((s0 + j) * hkv + g) * d;
        let kr = &c.k[row..row + d];
        let p = (dot_fma(qr, kr) * c.scale - c.lse[r]).exp();
        let dp = dot_fma(dor, &c.v[row..row + d]);
        let ds = c.operand(p * (dp - c.delta[r]));
        for (a, &x) in dqr.iter_mut().zip(kr) {
            *a = ds.mul_add(x, *a);
        }
    }
    for a in dqr.iter_mut() {
        *a *= c.scale;
    }
}

/// dk, dv row r = (token, kv head): heads of the GQA group ascending, then queries ascending.
#[inline(always)]
fn dkdv_row_body(c: &BwdCtx<'_>, r: usize, dkr: &mut [f32], dvr: &mut [f32]) {
    let AttnDims { h, hkv, d, .. } = c.dims;
    let group = h / hkv;
    let (tok, g) = (r / hkv, r % hkv);
    let (s0, s1) = sequence_of(c.cu_seqlens, tok);
    let q_begin = if c.causal { tok } else { s0 };
    let kr = &c.k[r * d..(r + 1) * d];
    let vr = &c.v[r * d..(r + 1) * d];
    dkr.fill(0.0);
    dvr.fill(0.0);
    for head in g * group..(g + 1) * group {
        for i in q_begin..s1 {
            let qi = i * h + head;
            let qr = &c.q[qi * d..(qi + 1) * d];
            let dor = &c.dout[qi * d..(qi + 1) * d];
            let p = (dot_fma(kr, qr) * c.scale - c.lse[qi]).exp();
            let dp = dot_fma(vr, dor);
            let ds = c.operand(p * (dp - c.delta[qi]));
            let p = c.operand(p);
            for ((a, b), (&x, &y)) in dvr.iter_mut().zip(dkr.iter_mut()).zip(dor.iter().zip(qr)) {
                *a = p.mul_add(x, *a);
                *b = ds.mul_add(y, *b);
            }
        }
    }
    for b in dkr.iter_mut() {
        *b *= c.scale;
    }
}

#[cfg(test)]
mod backward_paths {
    use super::*;
    use crate::testing::Rng;

    /// The per-sequence backward must give the per-row backward's bits (the public reference
    /// picks one by the number of sequences, so both must agree).
    #[test]
    fn by_sequence_equals_by_row_bit_for_bit() {
        let mut rng = Rng::new(5);
        for (causal, cu, round_bf16) in [
            (true, vec![0i32, 1, 18, 18, 45, 46], false),
            (false, vec![0, 17, 20, 53], false),
            (true, vec![0i32, 1, 18, 18, 45, 46], true),
        ] {
            let t = *cu.last().unwrap() as usize;
            let dims = AttnDims {
                t,
                h: 4,
                hkv: 2,
                d: 17,
            };
            let (nq, nk) = (t * 4 * 17, t * 2 * 17);
            let (q, k, v) = (
                rng.normal_vec(nq, 1.0),
                rng.normal_vec(nk, 1.0),
                rng.normal_vec(nk, 1.0),
            );
            let dout = rng.normal_vec(nq, 1.0);
            let (mut out, mut lse) = (vec![f32::NAN; nq], vec![f32::NAN; t * 4]);
            attention_forward_reference(
                &q,
                &k,
                &v,
                &cu,
                dims,
                causal,
                0.3,
                RowOrder::Chunks,
                &mut out,
                &mut lse,
            )
            .unwrap();
            let delta: Vec<f32> = (0..t * 4)
                .map(|r| dot_fma(&dout[r * 17..(r + 1) * 17], &out[r * 17..(r + 1) * 17]))
                .collect();
            let ctx = BwdCtx {
                q: &q,
                k: &k,
                v: &v,
                cu_seqlens: &cu,
                dims,
                causal,
                scale: 0.3,
                lse: &lse,
                dout: &dout,
                delta: &delta,
                round_bf16,
            };
            let mut a = (vec![f32::NAN; nq], vec![f32::NAN; nk], vec![f32::NAN; nk]);
            let mut b = (vec![f32::NAN; nq], vec![f32::NAN; nk], vec![f32::NAN; nk]);
            backward_by_row(&ctx, &mut a.0, &mut a.1, &mut a.2);
            backward_by_sequence(&ctx, &mut b.0, &mut b.1, &mut b.2);
            for (name, x, y) in [("dq", &a.0, &b.0), ("dk", &a.1, &b.1), ("dv", &a.2, &b.2)] {
                assert!(x.iter().all(|v| v.is_finite()), "{name}: unwritten rows");
                let same = x
                    .iter()
                    .zip(y.iter())
                    .all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(
                    same,
                    "{name} differs between the two paths (causal {causal}, round {round_bf16})"
                );
            }
        }
    }
}
