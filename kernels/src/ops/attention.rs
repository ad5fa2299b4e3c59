//! Training attention (DESIGN.md 3.5): `attention_forward` / `attention_backward` over varlen
//! packed batches (cu_seqlens), causal or not, with GQA.
//!
//! Shapes: q[T,H,D], k[T,Hkv,D], v[T,Hkv,D] (F32 or BF16, all the same dtype), cu_seqlens[B+1]
//! I32 (sequence b holds packed tokens cu_seqlens[b] .. cu_seqlens[b+1]-1; cu_seqlens[0] = 0,
//! non-decreasing, cu_seqlens[B] = T). Head h reads kv head h / (H / Hkv). Outputs are F32:
//! out[T,H,D] and the per-row logsumexp lse[T,H] (natural log, of the scaled scores), which the
//! backward reuses. BF16 inputs are widened to f32 exactly; every sum and the softmax statistics
//! are f32.
//!
//! THE ORDER. A query row visits its keys in chunks of [`KEY_CHUNK`] = 32 keys counted from the
//! first key of its sequence, ascending, with the online-softmax update of [`RowState`] per
//! chunk. The CUDA kernels (kernels/cuda/attention.cu, kernels/cuda/paged_attention.cu) call one
//! device function, `chunk_step` of kernels/cuda/common/attention_chunk.cuh, with the same
//! operations in the same order; [`RowState`] is its Rust twin and the only Rust routine that
//! computes attention rows: the training reference here and the decode reference of
//! [`crate::ops::paged_attention`] both go through [`attend_row`]. So a row is a pure function
//! of its query and its keys/values (batch-invariant), and the paged decode of a query equals the
//! training forward's output for it bit for bit, on each device.

use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::{blocks_for, Launch};
use crate::ops::attention_tile::{self, attend_row_tiles, RowOrder};
use crate::par;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;

/// Keys per online-softmax step (the warp size: lane j of the warp owns key j of a chunk).
pub const KEY_CHUNK: usize = 32;
/// The largest head dimension the kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// Warps per block of the training kernels (one warp per row; must match attention.cu).
const WARPS: usize = 4;

/// The online-softmax state of one query row: running max `m`, running sum `l` and the running
/// weighted sum of values `acc`. The Rust twin of `RowState`/`chunk_step` in
/// kernels/cuda/common/attention_chunk.cuh: same operations, same order, same roundings.
#[derive(Clone, Debug)]
pub struct RowState {
    m: f32,
    l: f32,
    /// The running sum of the first `d` dims (on the stack: one state per attended row, so a
    /// heap allocation each was a measurable part of a decode step).
    acc: [f32; MAX_HEAD_DIM],
    d: usize,
}

/// Defines `$name`, which runs `$body_fn` compiled with hardware FMA (and AVX2 vectors) when the
/// CPU has them. The results are the same either way (a fused multiply-add rounds once, in
/// hardware or in the software `fmaf`, and vectorisation only spans independent output dims); without it every `mul_add` of the reference is a library call, several
/// times slower. The bodies are `#[inline(always)]` so they compile into the FMA-enabled wrapper.
macro_rules! fma_dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident<$($lt:lifetime,)* $($g:ident: $bound:path),*>($($a:ident: $t:ty),* $(,)?) -> $r:ty = $body_fn:ident;) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($lt,)* $($g: $bound),*>($($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn fast<$($lt,)* $($g: $bound),*>($($a: $t),*) -> $r {
                    $body_fn($($a),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: `fast` only needs AVX2 and FMA instructions, and the CPU has them.
                    return unsafe { fast($($a),*) };
                }
            }
            $body_fn($($a),*)
        }
    };
}

/// Dot product in ascending index order with fused multiply-adds from 0 (the kernels' order).
#[inline(always)]
pub fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc))
}

/// The pairwise tree sum of 32 values (halves 16, 8, 4, 2, 1), as every lane computes it.
#[inline(always)]
fn tree_sum32(x: &[f32; KEY_CHUNK]) -> f32 {
    let mut t = [0.0f32; 16];
    for i in 0..16 {
        t[i] = x[i] + x[i + 16];
    }
    let mut h = 8;
    while h >= 1 {
        for i in 0..h {
            t[i] += t[i + h];
        }
        h /= 2;
    }
    t[0]
}

/// Keys whose dot products run interleaved (independent FMA chains hide the FMA latency).
const DOT_LANES: usize = 8;

/// `out[jj] = dot_fma(q, keys[jj])` for the DOT_LANES keys, interleaved: each key's own chain is
/// d ascending from 0, so the bits are those of [`dot_fma`]. Every key holds `q.len()` values.
#[inline(always)]
pub(crate) fn dots8(q: &[f32], keys: &[&[f32]; DOT_LANES]) -> [f32; DOT_LANES] {
    let d = q.len();
    assert!(
        keys.iter().all(|k| k.len() == d),
        "dots8: every key must hold D values"
    );
    let mut acc = [0.0f32; DOT_LANES];
    for (dd, &qd) in q.iter().enumerate() {
        for jj in 0..DOT_LANES {
            // SAFETY: dd < d = keys[jj].len() (asserted above).
            let kv = unsafe { *keys[jj].get_unchecked(dd) };
            acc[jj] = qd.mul_add(kv, acc[jj]);
        }
    }
    acc
}

impl RowState {
    /// The state before any key: m = -inf, l = 0, acc = 0 (D values, D <= MAX_HEAD_DIM).
    pub fn new(d: usize) -> Self {
        assert!(d <= MAX_HEAD_DIM, "RowState: head dim {d} > {MAX_HEAD_DIM}");
        RowState {
            m: f32::NEG_INFINITY,
            l: 0.0,
            acc: [0.0; MAX_HEAD_DIM],
            d,
        }
    }

    /// Advances over one chunk of `keys.len()` (1..=KEY_CHUNK) keys with their values.
    #[inline(always)]
    pub fn chunk_step(&mut self, q: &[f32], keys: &[&[f32]], values: &[&[f32]], scale: f32) {
        let n = keys.len();
        debug_assert!((1..=KEY_CHUNK).contains(&n) && values.len() == n);
        let mut s = [f32::NEG_INFINITY; KEY_CHUNK];
        // Eight keys' dot products at a time (a short last group is padded with the first key of
        // the chunk, whose extra results are dropped).
        let mut j0 = 0;
        while j0 < n {
            let m = DOT_LANES.min(n - j0);
            let group: [&[f32]; DOT_LANES] =
                std::array::from_fn(|jj| &keys[if jj < m { j0 + jj } else { 0 }][..q.len()]);
            let acc = dots8(q, &group);
            for jj in 0..m {
                s[j0 + jj] = acc[jj] * scale;
            }
            j0 += DOT_LANES;
        }
        let cm = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_new = self.m.max(cm);
        let alpha = if self.m == f32::NEG_INFINITY {
            0.0
        } else {
            (self.m - m_new).exp()
        };
        let mut p = [0.0f32; KEY_CHUNK];
        for j in 0..n {
            p[j] = (s[j] - m_new).exp();
        }
        let csum = tree_sum32(&p);
        self.l = self.l.mul_add(alpha, csum);
        self.m = m_new;
        let acc = &mut self.acc[..self.d];
        for a in acc.iter_mut() {
            *a *= alpha;
        }
        // Per output dim the updates run over j ascending, as in the kernel (the loop nest is
        // swapped for the cache; each dim's sequence of operations is the same).
        for (pj, vj) in p.iter().zip(values) {
            for (a, &x) in acc.iter_mut().zip(vj.iter()) {
                *a = pj.mul_add(x, *a);
            }
        }
    }

    /// Writes out[d] = acc[d] / l; returns the row's logsumexp m + ln(l).
    #[inline(always)]
    pub fn finish(&self, out: &mut [f32]) -> f32 {
        for (o, &a) in out.iter_mut().zip(&self.acc[..self.d]) {
            *o = a / self.l;
        }
        self.m + self.l.ln()
    }
}

/// Attends one query row over `n_keys` keys (`kv(j)` gives key j's K and V rows, j counted from
/// the sequence start) in THE ORDER; writes `out` (D values) and returns the logsumexp. The one
/// routine of both the training reference and the paged decode reference. With no keys the
/// output is zero and the logsumexp -inf.
pub fn attend_row<'a, F: Fn(usize) -> (&'a [f32], &'a [f32])>(
    order: RowOrder,
    q: &[f32],
    n_keys: usize,
    scale: f32,
    kv: F,
    out: &mut [f32],
) -> f32 {
    attend_row_dispatch(order, q, n_keys, scale, kv, out)
}

fma_dispatch! {
    fn attend_row_dispatch<'a, F: KeyValueFn<'a>>(order: RowOrder, q: &[f32], n_keys: usize, scale: f32, kv: F, out: &mut [f32]) -> f32 = attend_row_body;
}

/// Where a row's key j and its value live (a trait alias, for the macro).
pub trait KeyValueFn<'a>: Fn(usize) -> (&'a [f32], &'a [f32]) {}
impl<'a, F: Fn(usize) -> (&'a [f32], &'a [f32])> KeyValueFn<'a> for F {}

#[inline(always)]
fn attend_row_body<'a, F: Fn(usize) -> (&'a [f32], &'a [f32])>(
    order: RowOrder,
    q: &[f32],
    n_keys: usize,
    scale: f32,
    kv: F,
    out: &mut [f32],
) -> f32 {
    if order == RowOrder::Tiles {
        return attend_row_tiles(q, n_keys, scale, kv, out, dots8);
    }
    if n_keys == 0 {
        out.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let mut st = RowState::new(q.len());
    let mut c0 = 0;
    while c0 < n_keys {
        let n = KEY_CHUNK.min(n_keys - c0);
        let mut keys: [&[f32]; KEY_CHUNK] = [&[]; KEY_CHUNK];
        let mut values: [&[f32]; KEY_CHUNK] = [&[]; KEY_CHUNK];
        for j in 0..n {
            let (kr, vr) = kv(c0 + j);
            keys[j] = kr;
            values[j] = vr;
        }
        st.chunk_step(q, &keys[..n], &values[..n], scale);
        c0 += KEY_CHUNK;
    }
    st.finish(out)
}

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Packed tokens.
    pub t: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads (divides `h`).
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
}

impl AttnDims {
    fn check_lens(&self, q: usize, k: usize, v: usize) -> Result<()> {
        let (nq, nk) = (self.t * self.h * self.d, self.t * self.hkv * self.d);
        for (name, got, want, shape) in [
            ("q", q, nq, "[T,H,D]"),
            ("k", k, nk, "[T,Hkv,D]"),
            ("v", v, nk, "[T,Hkv,D]"),
        ] {
            if got != want {
                return Err(Error::Invalid(format!(
                    "`{name}` has {got} elements; {shape} with {self:?} needs {want}"
                )));
            }
        }
        if self.hkv == 0 || !self.h.is_multiple_of(self.hkv) {
            return Err(Error::param(
                "Hkv",
                format!(
                    "{} query heads are not a multiple of {} kv heads",
                    self.h, self.hkv
                ),
            ));
        }
        if self.d == 0 || self.d > MAX_HEAD_DIM {
            return Err(Error::param(
                "D",
                format!("head dim {} is not in 1..={MAX_HEAD_DIM}", self.d),
            ));
        }
        Ok(())
    }
}

/// Checks cu_seqlens: starts at 0, non-decreasing, ends at `t`.
pub fn check_cu_seqlens(cu: &[i32], t: usize) -> Result<()> {
    let bad = |why: String| Error::Invalid(format!("`cu_seqlens`: {why}"));
    if cu.len() < 2 {
        return Err(bad(format!(
            "has {} entries; expected [B+1] with B >= 1",
            cu.len()
        )));
    }
    if cu[0] != 0 {
        return Err(bad(format!("starts at {}; expected 0", cu[0])));
    }
    if let Some(w) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(bad(format!(
            "decreases at entry {}: {} then {}",
            w + 1,
            cu[w],
            cu[w + 1]
        )));
    }
    if cu[cu.len() - 1] as i64 != t as i64 {
        return Err(bad(format!(
            "ends at {}; expected T = {t} (the tokens of q)",
            cu[cu.len() - 1]
        )));
    }
    Ok(())
}

/// The sequence holding packed token `t`: its start and end.
fn sequence_of(cu: &[i32], t: usize) -> (usize, usize) {
    // The last b with cu[b] <= t (empty sequences before it are skipped).
    let b = cu.partition_point(|&c| c as usize <= t) - 1;
    (cu[b] as usize, cu[b + 1] as usize)
}

/// The length of the longest sequence of a varlen batch (what a row's work is sized by).
fn longest_sequence(cu: &[i32]) -> usize {
    cu.windows(2)
        .map(|w| (w[1] - w[0]).max(0) as usize)
        .max()
        .unwrap_or(0)
        .max(1)
}

/// The keys query `t` sees: the start of its sequence and how many keys.
fn key_range(cu: &[i32], t: usize, causal: bool) -> (usize, usize) {
    let (s0, s1) = sequence_of(cu, t);
    (s0, if causal { t + 1 - s0 } else { s1 - s0 })
}

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
                RowOrder::Tiles => attention_tile::delta_tiles(dor, outr),
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
        round_bf16: order == RowOrder::Tiles,
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

/// The forward's outputs: out[T,H,D] and lse[T,H], both F32.
#[derive(Debug)]
pub struct AttentionOutput {
    pub out: Tensor,
    pub lse: Tensor,
}

/// The backward's outputs, F32: dq[T,H,D], dk[T,Hkv,D], dv[T,Hkv,D].
#[derive(Debug)]
pub struct AttentionGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
}

/// Checks q, k, v and cu_seqlens (shapes, dtypes, values); returns the sizes.
pub fn validate_inputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
) -> Result<AttnDims> {
    q.expect_rank("q", 3, "[T,H,D]")?;
    if !q.dtype().is_float() {
        return Err(Error::DType {
            tensor: "q".into(),
            expected: "F32 or BF16".into(),
            got: q.dtype().to_string(),
        });
    }
    let (t, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    k.expect_rank("k", 3, "[T,Hkv,D]")?;
    let hkv = k.shape()[1];
    let kv_shape = format!("[T,Hkv,D] = [{t},Hkv,{d}] (T and D from q)");
    if k.shape()[0] != t || k.shape()[2] != d {
        return Err(Error::shape("k", kv_shape, k.shape()));
    }
    if v.shape() != k.shape() {
        return Err(Error::shape(
            "v",
            format!("[T,Hkv,D] = {:?} (the shape of k)", k.shape()),
            v.shape(),
        ));
    }
    k.expect_dtype("k", q.dtype())?;
    v.expect_dtype("v", q.dtype())?;
    if hkv == 0 || !h.is_multiple_of(hkv) {
        return Err(Error::shape(
            "k",
            format!("[T,Hkv,D] with Hkv >= 1 dividing H = {h} (GQA)"),
            k.shape(),
        ));
    }
    if d == 0 || d > MAX_HEAD_DIM {
        return Err(Error::shape(
            "q",
            format!("[T,H,D] with D in 1..={MAX_HEAD_DIM}"),
            q.shape(),
        ));
    }
    if h == 0 {
        return Err(Error::shape("q", "[T,H,D] with H >= 1", q.shape()));
    }
    if t > i32::MAX as usize / 2 {
        return Err(Error::shape("q", "[T,H,D] with T < 2^30", q.shape()));
    }
    cu_seqlens.expect_rank("cu_seqlens", 1, "[B+1]")?;
    cu_seqlens.expect_dtype("cu_seqlens", DType::I32)?;
    check_cu_seqlens(&cu_seqlens.to_vec::<i32>()?, t)?;
    Ok(AttnDims { t, h, hkv, d })
}

/// The softmax scale: the given one (finite) or 1/sqrt(D).
pub fn resolve_scale(scale: Option<f32>, d: usize) -> Result<f32> {
    match scale {
        None => Ok(1.0 / (d as f32).sqrt()),
        Some(s) if s.is_finite() => Ok(s),
        Some(s) => Err(Error::param("scale", format!("{s} is not a finite number"))),
    }
}

fn kernel_name(dtype: DType, f32_name: &'static str, bf16_name: &'static str) -> &'static str {
    if dtype == DType::BF16 {
        bf16_name
    } else {
        f32_name
    }
}

/// The attention forward on `backend`: out[T,H,D] and lse[T,H] (F32). `scale` defaults to
/// 1/sqrt(D).
pub fn attention_forward(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionOutput> {
    attention_forward_on(
        attention_tile::attention_path()?,
        backend,
        q,
        k,
        v,
        cu_seqlens,
        causal,
        scale,
    )
}

/// [`attention_forward`] on an explicit attention path (v1 or v2) instead of the process's.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_on(
    path: attention_tile::AttentionPath,
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionOutput> {
    let dims = validate_inputs(q, k, v, cu_seqlens)?;
    let scale = resolve_scale(scale, dims.d)?;
    let AttnDims { t, h, hkv, d } = dims;
    let order = RowOrder::of(path, q.dtype(), d);
    match backend {
        Backend::Cpu => {
            let mut out = vec![0.0f32; t * h * d];
            let mut lse = vec![0.0f32; t * h];
            attention_forward_reference(
                &q.f32_data()?,
                &k.f32_data()?,
                &v.f32_data()?,
                &cu_seqlens.to_vec::<i32>()?,
                dims,
                causal,
                scale,
                order,
                &mut out,
                &mut lse,
            )?;
            Ok(AttentionOutput {
                out: Tensor::from_slice(backend, &[t, h, d], &out)?,
                lse: Tensor::from_slice(backend, &[t, h], &lse)?,
            })
        }
        _ => {
            let out = Tensor::poisoned(backend, &[t, h, d], DType::F32)?;
            let lse = Tensor::poisoned(backend, &[t, h], DType::F32)?;
            if t > 0 && order == RowOrder::Tiles {
                // Every (query tile, head) block writes its rows' out and lse once.
                attention_tile::launch_forward(
                    backend,
                    q,
                    k,
                    v,
                    cu_seqlens,
                    (t, h, hkv, d),
                    causal,
                    scale,
                    &out,
                    &lse,
                )?;
            } else if t > 0 {
                let b = cu_seqlens.numel() - 1;
                let name =
                    kernel_name(q.dtype(), "attention_forward_f32", "attention_forward_bf16");
                // The kernel reads q/k/v rows of tokens < T and cu_seqlens[0..=B], all checked
                // above; it writes each out/lse row exactly once.
                backend.launch(
                    &Launch::new(
                        name,
                        [blocks_for(t, WARPS), h as u32, 1],
                        [32 * WARPS as u32, 1, 1],
                    )
                    .arg_tensor(q)
                    .arg_tensor(k)
                    .arg_tensor(v)
                    .arg_tensor(cu_seqlens)
                    .arg_i32(b as i32)
                    .arg_i32(t as i32)
                    .arg_i32(h as i32)
                    .arg_i32(hkv as i32)
                    .arg_i32(d as i32)
                    .arg_i32(causal as i32)
                    .arg_f32(scale)
                    .arg_tensor(&out)
                    .arg_tensor(&lse),
                )?;
            }
            Ok(AttentionOutput { out, lse })
        }
    }
}

/// The attention backward on `backend`: runs the forward for `out` and `lse`, then the backward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    dout: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionGrads> {
    let fwd = attention_forward(backend, q, k, v, cu_seqlens, causal, scale)?;
    attention_backward_saved(
        backend, q, k, v, cu_seqlens, &fwd.out, &fwd.lse, dout, causal, scale,
    )
}

/// The attention backward from the forward's saved `out` [T,H,D] and `lse` [T,H] (F32), and
/// dout[T,H,D] (the dtype of q, or F32 for BF16 inputs). Returns dq, dk, dv (F32).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_saved(
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionGrads> {
    attention_backward_saved_on(
        attention_tile::attention_path()?,
        backend,
        q,
        k,
        v,
        cu_seqlens,
        out,
        lse,
        dout,
        causal,
        scale,
    )
}

/// [`attention_backward_saved`] on an explicit attention path (v1 or v2) instead of the
/// process's. BF16 inputs with a BF16 dout take v2's kernels on the tile path; an F32 dout takes
/// v1 on widened copies (the tile kernels' operands are bf16).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_saved_on(
    path: attention_tile::AttentionPath,
    backend: &Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    causal: bool,
    scale: Option<f32>,
) -> Result<AttentionGrads> {
    let dims = validate_inputs(q, k, v, cu_seqlens)?;
    let scale = resolve_scale(scale, dims.d)?;
    let AttnDims { t, h, hkv, d } = dims;
    let q_shape = format!("[T,H,D] = [{t},{h},{d}] (the shape of q)");
    if dout.shape() != q.shape() {
        return Err(Error::shape("dout", q_shape, dout.shape()));
    }
    if dout.dtype() == DType::F32 && q.dtype() == DType::BF16 && !matches!(backend, Backend::Cpu) {
        // An f32 gradient for bf16 inputs: the bf16 kernels widen every input to f32 exactly,
        // so running the f32 kernels on widened copies gives the same bits a mixed kernel would
        // (at the cost of the copies).
        let widen = |t: &Tensor| t.cast(backend, DType::F32);
        return attention_backward_saved_on(
            path,
            backend,
            &widen(q)?,
            &widen(k)?,
            &widen(v)?,
            cu_seqlens,
            out,
            lse,
            dout,
            causal,
            Some(scale),
        );
    }
    if dout.dtype() != q.dtype() && !(dout.dtype() == DType::F32 && q.dtype() == DType::BF16) {
        return Err(Error::DType {
            tensor: "dout".into(),
            expected: format!("{} (the dtype of q) or F32", q.dtype()),
            got: dout.dtype().to_string(),
        });
    }
    if out.shape() != q.shape() {
        return Err(Error::shape("out", q_shape, out.shape()));
    }
    out.expect_dtype("out", DType::F32)?;
    if lse.shape() != [t, h] {
        return Err(Error::shape(
            "lse",
            format!("[T,H] = [{t},{h}]"),
            lse.shape(),
        ));
    }
    lse.expect_dtype("lse", DType::F32)?;
    // The order of the backward: the tiles' only when every operand is bf16.
    let order = RowOrder::of(path, dout.dtype(), d).min_with(RowOrder::of(path, q.dtype(), d));
    match backend {
        Backend::Cpu => {
            let mut dq = vec![0.0f32; t * h * d];
            let mut dk = vec![0.0f32; t * hkv * d];
            let mut dv = vec![0.0f32; t * hkv * d];
            attention_backward_reference(
                &q.f32_data()?,
                &k.f32_data()?,
                &v.f32_data()?,
                &cu_seqlens.to_vec::<i32>()?,
                dims,
                causal,
                scale,
                order,
                &out.to_vec::<f32>()?,
                &lse.to_vec::<f32>()?,
                &dout.f32_data()?,
                &mut dq,
                &mut dk,
                &mut dv,
            )?;
            Ok(AttentionGrads {
                dq: Tensor::from_slice(backend, &[t, h, d], &dq)?,
                dk: Tensor::from_slice(backend, &[t, hkv, d], &dk)?,
                dv: Tensor::from_slice(backend, &[t, hkv, d], &dv)?,
            })
        }
        _ => {
            let dq = Tensor::poisoned(backend, &[t, h, d], DType::F32)?;
            let dk = Tensor::poisoned(backend, &[t, hkv, d], DType::F32)?;
            let dv = Tensor::poisoned(backend, &[t, hkv, d], DType::F32)?;
            if t == 0 {
                return Ok(AttentionGrads { dq, dk, dv });
            }
            if order == RowOrder::Tiles {
                // delta and lse head-major, then the two passes, each output row written once.
                attention_tile::launch_backward(
                    backend,
                    [q, k, v, cu_seqlens, dout, out, lse],
                    (t, h, hkv, d),
                    causal,
                    scale,
                    [&dq, &dk, &dv],
                )?;
                return Ok(AttentionGrads { dq, dk, dv });
            }
            let delta = Tensor::poisoned(backend, &[t, h], DType::F32)?;
            let bf = q.dtype() == DType::BF16;
            let b = (cu_seqlens.numel() - 1) as i32;
            let rows = t * h;
            // delta[r] = dout[r] . out[r]: one thread per row, each written once.
            backend.launch(
                &Launch::new(
                    if bf {
                        "attention_bwd_delta_bf16"
                    } else {
                        "attention_bwd_delta_f32"
                    },
                    [blocks_for(rows, 128), 1, 1],
                    [128, 1, 1],
                )
                .arg_tensor(dout)
                .arg_tensor(out)
                .arg_i32(rows as i32)
                .arg_i32(d as i32)
                .arg_tensor(&delta),
            )?;
            // dq: one warp per (token, head) row, each written once.
            backend.launch(
                &Launch::new(
                    if bf {
                        "attention_bwd_dq_bf16"
                    } else {
                        "attention_bwd_dq_f32"
                    },
                    [blocks_for(t, WARPS), h as u32, 1],
                    [32 * WARPS as u32, 1, 1],
                )
                .arg_tensor(q)
                .arg_tensor(k)
                .arg_tensor(v)
                .arg_tensor(cu_seqlens)
                .arg_tensor(dout)
                .arg_tensor(lse)
                .arg_tensor(&delta)
                .arg_i32(b)
                .arg_i32(t as i32)
                .arg_i32(h as i32)
                .arg_i32(hkv as i32)
                .arg_i32(d as i32)
                .arg_i32(causal as i32)
                .arg_f32(scale)
                .arg_tensor(&dq),
            )?;
            // dk, dv: one warp per (token, kv head) row, each written once (no atomics).
            backend.launch(
                &Launch::new(
                    if bf {
                        "attention_bwd_dkdv_bf16"
                    } else {
                        "attention_bwd_dkdv_f32"
                    },
                    [blocks_for(t, WARPS), hkv as u32, 1],
                    [32 * WARPS as u32, 1, 1],
                )
                .arg_tensor(q)
                .arg_tensor(k)
                .arg_tensor(v)
                .arg_tensor(cu_seqlens)
                .arg_tensor(dout)
                .arg_tensor(lse)
                .arg_tensor(&delta)
                .arg_i32(b)
                .arg_i32(t as i32)
                .arg_i32(h as i32)
                .arg_i32(hkv as i32)
                .arg_i32(d as i32)
                .arg_i32(causal as i32)
                .arg_f32(scale)
                .arg_tensor(&dk)
                .arg_tensor(&dv),
            )?;
            Ok(AttentionGrads { dq, dk, dv })
        }
    }
}

/// The text of the scale parameter's default in `sluice kernel --list`.
pub const SCALE_DEFAULT: &str = "1/sqrt(D)";

/// Reads the `scale` parameter: its default text means 1/sqrt(D).
pub fn scale_param(call: &OpCall) -> Result<Option<f32>> {
    if call.param("scale")?.trim() == SCALE_DEFAULT {
        Ok(None)
    } else {
        call.param_f32("scale").map(Some)
    }
}

const FWD_INPUTS: &[TensorSpec] = &[
    TensorSpec {
        name: "q",
        shape: "[T,H,D]",
        dtypes: "F32|BF16",
    },
    TensorSpec {
        name: "k",
        shape: "[T,Hkv,D]",
        dtypes: "F32|BF16",
    },
    TensorSpec {
        name: "v",
        shape: "[T,Hkv,D]",
        dtypes: "F32|BF16",
    },
    TensorSpec {
        name: "cu_seqlens",
        shape: "[B+1]",
        dtypes: "I32",
    },
];

const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "causal",
        default: Some("true"),
        help: "a query sees only the keys at or before its position in its sequence",
    },
    ParamSpec {
        name: "scale",
        default: Some(SCALE_DEFAULT),
        help: "softmax scale applied to q.k",
    },
];

fn run_forward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let fwd = attention_forward(
        backend,
        call.tensor("q")?,
        call.tensor("k")?,
        call.tensor("v")?,
        call.tensor("cu_seqlens")?,
        call.param_bool("causal")?,
        scale_param(call)?,
    )?;
    Ok(vec![("out", fwd.out)])
}

fn run_backward(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let g = attention_backward(
        backend,
        call.tensor("q")?,
        call.tensor("k")?,
        call.tensor("v")?,
        call.tensor("cu_seqlens")?,
        call.tensor("dout")?,
        call.param_bool("causal")?,
        scale_param(call)?,
    )?;
    Ok(vec![("dq", g.dq), ("dk", g.dk), ("dv", g.dv)])
}

/// `sluice kernel attention_forward`.
pub static FORWARD_SPEC: OpSpec = OpSpec {
    name: "attention_forward",
    summary: "varlen causal/GQA attention forward over 32-key tiles: BF16 on tensor cores (128-query tiles, f32 accumulation), F32 on the SIMT path (SLUICE_ATTENTION=simt puts BF16 there too); out F32",
    inputs: FWD_INPUTS,
    params: PARAMS,
    outputs: &[TensorSpec { name: "out", shape: "[T,H,D]", dtypes: "F32" }],
    run: run_forward,
};

/// `sluice kernel attention_backward`.
pub static BACKWARD_SPEC: OpSpec = OpSpec {
    name: "attention_backward",
    summary: "attention backward: recomputes the forward, then dq, dk, dv without atomics (BF16 on tensor-core tiles, F32 on the SIMT path; outputs F32)",
    inputs: &[
        TensorSpec {
            name: "q",
            shape: "[T,H,D]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "k",
            shape: "[T,Hkv,D]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "v",
            shape: "[T,Hkv,D]",
            dtypes: "F32|BF16",
        },
        TensorSpec {
            name: "cu_seqlens",
            shape: "[B+1]",
            dtypes: "I32",
        },
        TensorSpec {
            name: "dout",
            shape: "[T,H,D]",
            dtypes: "F32|BF16 (the dtype of q)",
        },
    ],
    params: PARAMS,
    outputs: &[
        TensorSpec {
            name: "dq",
            shape: "[T,H,D]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dk",
            shape: "[T,Hkv,D]",
            dtypes: "F32",
        },
        TensorSpec {
            name: "dv",
            shape: "[T,Hkv,D]",
            dtypes: "F32",
        },
    ],
    run: run_backward,
};

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
