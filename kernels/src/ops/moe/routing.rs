//! MoE routing: scores, the top-k experts and gates of each token, the stable counting sort of
//! the token-slots into per-expert segments, the load-balancing loss, and the router's backward
//! (CPU references; the device launches are in `device`).

use super::{MoeConfig, MoeDims, ScoreFn};
use crate::ops::elementwise::softmax_reference;
use crate::ops::gemm::{
    gemm_chain_into, gemm_packed_into, gemm_reference, PackedB, BF16_PACKED_MAX_K,
};
use crate::ops::topk::{topk_reference, MAX_K};
use crate::par;

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
pub(super) fn route(
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
/// f_e / T (see the `moe` module documentation). Sums: P_e over t ascending, the loss over e
/// ascending.
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
/// d loss / d logits [T,E] from d loss / d gates [T,k], in the operation order of moe.cu's
/// `moe_router_backward` (one token per thread there, one row here):
/// - through g_j = v_j / S (S = sum of the kept v, j ascending) when `renorm`:
///   dv_j = (dg_j - sum_i dg_i (v_i / S)) / S; else dv_j = dg_j;
/// - dprobs = dv at the kept experts, 0 elsewhere, plus the auxiliary loss's coefficient at
///   every expert when it is on;
/// - softmax: dlogits[e] = p_e (dprobs[e] - s) with s = sum_j dv_j p_(idx j) over the kept
///   experts, j ascending (over every e ascending when the auxiliary loss is on); sigmoid:
///   dprobs[e] p_e (1 - p_e).
pub(super) fn router_backward(
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
