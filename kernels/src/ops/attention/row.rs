//! One query row's attention on the CPU: the online-softmax state of THE ORDER (v1: 32-key
//! chunks, the twin of kernels/cuda/common/attention_chunk.cuh) and the dispatch of a row to it
//! or to the tile order (v2, [`crate::ops::attention_tile`]). The one routine of the training and
//! decode references.

use super::*;

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
pub(crate) const DOT_LANES: usize = 8;

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
    match order {
        RowOrder::Tiles => {
            return attend_row_tiles::<{ attention_tile::KEY_TILE }, _>(
                q, n_keys, scale, kv, out, dots8,
            )
        }
        RowOrder::Wgmma => {
            return attend_row_tiles::<{ crate::ops::attention_wgmma::KEY_TILE }, _>(
                q, n_keys, scale, kv, out, dots8,
            )
        }
        RowOrder::Chunks => {}
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
