//! The forward and the hand-written backward of the model on the `cpu` device, layer by layer,
//! built on the kernels crate's CPU references (docs/model.md, "Forward and backward").
//!
//! The ops are the kernel families' references (gemm, rmsnorm, rope, attention, swiglu,
//! embedding, moe, is_gate_loss); this file wires them together and transposes operands for the
//! backward GEMMs (the kernels' GEMM is the linear-layer form C = A B^T only). The routed experts
//! of an MoE layer are the moe family's `moe_forward_reference` / `moe_backward_reference`
//! (router, top-k gates, stable expert sort, grouped SwiGLU FFN, combine, and their backward);
//! the shared expert and the dense layers are plain SwiGLU FFNs here. Every sum has a fixed
//! order, so the results are bit-identical run to run, and nothing depends on where a sequence
//! sits in a packed batch.

use crate::arena::Arena;
use crate::batch::PackedBatch;
use crate::config::{ModelConfig, ScoreFn};
use crate::layout::{FfnViews, LayerViews, Layout};
use crate::Model;
use rayon::prelude::*;
use sluice_kernels::ops::attention::{
    attention_backward_reference, attention_forward_reference, resolve_scale, AttnDims,
};
use sluice_kernels::ops::embedding::{embedding_backward_reference, embedding_reference};
use sluice_kernels::ops::gemm::gemm_reference_into;
use sluice_kernels::ops::is_gate_loss::{
    is_gate_loss_reference, GateMode, GateParams, GateReference, TokenInputs,
};
use sluice_kernels::ops::moe::{
    moe_backward_reference, moe_forward_reference, MoeConfig, MoeDims, ScoreFn as MoeScoreFn,
};
use sluice_kernels::ops::rmsnorm::{rmsnorm_backward_reference, rmsnorm_reference};
use sluice_kernels::ops::rope::{rope_backward_reference, rope_reference};
use sluice_kernels::ops::swiglu::{swiglu_backward_reference, swiglu_reference};
use sluice_kernels::{Error, Result};

// ---------------------------------------------------------------------------------------------
// GEMM forms. The kernels' GEMM is y[m,n] = x[m,k] w[n,k]^T; the backward's two other forms are
// that GEMM on transposed copies (a transpose is a copy, so no rounding is added).

/// y[m,n] = x[m,k] w[n,k]^T.
fn linear(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    gemm_reference_into(x, w, &mut y, m, n, k);
    y
}

/// The transpose of a row-major [rows, cols] matrix, in 32 x 32 tiles (so both the reads and
/// the writes stay within a few cache lines per tile), tiles of column blocks in parallel.
fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 32;
    let mut t = vec![0.0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return t;
    }
    // Each task owns TILE rows of the output (= TILE columns of the input).
    t.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(cb, out)| {
            let c0 = cb * TILE;
            let cw = out.len() / rows;
            for r0 in (0..rows).step_by(TILE) {
                let r1 = (r0 + TILE).min(rows);
                for c in 0..cw {
                    let dst = &mut out[c * rows + r0..c * rows + r1];
                    for (i, d) in dst.iter_mut().enumerate() {
                        *d = a[(r0 + i) * cols + c0 + c];
                    }
                }
            }
        });
    t
}

/// dx[m,k] = dy[m,n] w[n,k].
fn linear_dx(dy: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    linear(dy, &transpose(w, n, k), m, k, n)
}

/// dw[n,k] = dy[m,n]^T x[m,k].
fn linear_dw(dy: &[f32], x: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    linear(&transpose(dy, m, n), &transpose(x, m, k), n, k, m)
}

/// a += b elementwise.
fn add_into(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

// ---------------------------------------------------------------------------------------------
// Saved activations.

struct DenseCache {
    u: Vec<f32>,
    g: Vec<f32>,
    s: Vec<f32>,
}

/// The routed experts keep nothing: `moe_backward_reference` recomputes their forward.
struct MoeCache {
    shared: Option<DenseCache>,
}

enum FfnCache {
    Dense(DenseCache),
    Moe(Box<MoeCache>),
}

/// View indices of one MoE FFN.
#[derive(Clone, Copy)]
struct MoeViews {
    router: usize,
    w1: usize,
    w3: usize,
    w2: usize,
    shared: Option<(usize, usize, usize)>,
}

struct LayerCache {
    x_in: Vec<f32>,
    h1: Vec<f32>,
    /// q and k after RoPE, v: [T,H,D], [T,Hkv,D], [T,Hkv,D].
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    lse: Vec<f32>,
    x_mid: Vec<f32>,
    h2: Vec<f32>,
    ffn: FfnCache,
}

struct Activations {
    layers: Vec<LayerCache>,
    x_final: Vec<f32>,
    hf: Vec<f32>,
    logits: Vec<f32>,
}

/// The parameter slices of one forward.
struct Params<'a> {
    all: &'a [f32],
    layout: &'a Layout,
}

impl Params<'_> {
    fn at(&self, i: usize) -> &[f32] {
        &self.all[self.layout.views()[i].range()]
    }
}

/// Model dimensions used everywhere below.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    d: usize,
    h: usize,
    hkv: usize,
    hd: usize,
    e: usize,
    k: usize,
    f: usize,
    vocab: usize,
    eps: f32,
    theta: f32,
    scale: f32,
}

impl Dims {
    fn new(cfg: &ModelConfig, t: usize) -> Result<Dims> {
        Ok(Dims {
            t,
            d: cfg.d_model,
            h: cfg.n_heads,
            hkv: cfg.n_kv_heads,
            hd: cfg.head_dim,
            e: cfg.n_experts,
            k: cfg.top_k,
            f: cfg.expert_ffn_dim,
            vocab: cfg.vocab,
            eps: cfg.norm_eps as f32,
            theta: cfg.rope_theta as f32,
            scale: resolve_scale(None, cfg.head_dim)?,
        })
    }
    fn attn(&self) -> AttnDims {
        AttnDims {
            t: self.t,
            h: self.h,
            hkv: self.hkv,
            d: self.hd,
        }
    }
}

fn host_params(arena: &Arena) -> Result<&[f32]> {
    arena.as_slice().map_err(|_| {
        Error::Device(
            "the model forward and backward run on the cpu device for now; open the model \
             with --device cpu"
                .into(),
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Forward.

fn dense_forward(
    h: &[f32],
    w1: &[f32],
    w3: &[f32],
    w2: &[f32],
    t: usize,
    d: usize,
    f: usize,
) -> Result<(DenseCache, Vec<f32>)> {
    let u = linear(h, w1, t, f, d);
    let g = linear(h, w3, t, f, d);
    let s = swiglu_reference(&u, &g)?;
    let y = linear(&s, w2, t, d, f);
    Ok((DenseCache { u, g, s }, y))
}

/// The moe family's config and sizes for the routed experts of an MoE layer.
fn moe_call(cfg: &ModelConfig, dm: Dims) -> (MoeDims, MoeConfig) {
    let dims = MoeDims {
        t: dm.t,
        d: dm.d,
        f: dm.f,
        e: dm.e,
    };
    let mc = MoeConfig {
        k: dm.k,
        score_fn: match cfg.score_fn {
            ScoreFn::Softmax => MoeScoreFn::Softmax,
            ScoreFn::Sigmoid => MoeScoreFn::Sigmoid,
        },
        renorm: cfg.renorm,
        aux_alpha: 0.0,
    };
    (dims, mc)
}

fn moe_forward(
    cfg: &ModelConfig,
    dm: Dims,
    p: &Params<'_>,
    views: MoeViews,
    h: &[f32],
) -> Result<(MoeCache, Vec<f32>)> {
    let Dims { t, d, .. } = dm;
    let MoeViews {
        router,
        w1,
        w3,
        w2,
        shared,
    } = views;
    let (dims, mc) = moe_call(cfg, dm);
    let mut out = moe_forward_reference(h, p.at(router), p.at(w1), p.at(w3), p.at(w2), dims, mc).y;
    let shared = match shared {
        Some((s1, s3, s2)) => {
            let fs = p.layout.views()[s1].shape[0];
            let (cache, y) = dense_forward(h, p.at(s1), p.at(s3), p.at(s2), t, d, fs)?;
            add_into(&mut out, &y);
            Some(cache)
        }
        None => None,
    };
    Ok((MoeCache { shared }, out))
}

fn layer_forward(
    cfg: &ModelConfig,
    dm: Dims,
    p: &Params<'_>,
    lv: &LayerViews,
    batch: &PackedBatch,
    x_in: Vec<f32>,
) -> Result<(LayerCache, Vec<f32>)> {
    let Dims {
        t,
        d,
        h,
        hkv,
        hd,
        eps,
        theta,
        scale,
        ..
    } = dm;
    let h1 = rmsnorm_reference(&x_in, p.at(lv.attn_norm), t, d, eps)?;
    let q = linear(&h1, p.at(lv.wq), t, h * hd, d);
    let kk = linear(&h1, p.at(lv.wk), t, hkv * hd, d);
    let v = linear(&h1, p.at(lv.wv), t, hkv * hd, d);
    let q = rope_reference(&q, batch.positions(), t, h, hd, theta)?;
    let kk = rope_reference(&kk, batch.positions(), t, hkv, hd, theta)?;
    let mut attn = vec![0.0f32; t * h * hd];
    let mut lse = vec![0.0f32; t * h];
    attention_forward_reference(
        &q,
        &kk,
        &v,
        batch.cu_seqlens(),
        dm.attn(),
        true,
        scale,
        &mut attn,
        &mut lse,
    )?;
    let o = linear(&attn, p.at(lv.wo), t, d, h * hd);
    let mut x_mid = x_in.clone();
    add_into(&mut x_mid, &o);
    let h2 = rmsnorm_reference(&x_mid, p.at(lv.ffn_norm), t, d, eps)?;
    let (ffn, y) = match lv.ffn {
        FfnViews::Dense { w1, w3, w2 } => {
            let fd = p.layout.views()[w1].shape[0];
            let (c, y) = dense_forward(&h2, p.at(w1), p.at(w3), p.at(w2), t, d, fd)?;
            (FfnCache::Dense(c), y)
        }
        FfnViews::Moe {
            router,
            w1,
            w3,
            w2,
            shared,
        } => {
            let views = MoeViews {
                router,
                w1,
                w3,
                w2,
                shared,
            };
            let (c, y) = moe_forward(cfg, dm, p, views, &h2)?;
            (FfnCache::Moe(Box::new(c)), y)
        }
    };
    let mut x_out = x_mid.clone();
    add_into(&mut x_out, &y);
    Ok((
        LayerCache {
            x_in,
            h1,
            q,
            k: kk,
            v,
            attn,
            lse,
            x_mid,
            h2,
            ffn,
        },
        x_out,
    ))
}

fn forward_all(cfg: &ModelConfig, params: &Arena, batch: &PackedBatch) -> Result<Activations> {
    let layout = params.layout();
    let p = Params {
        all: host_params(params)?,
        layout,
    };
    if let Some(&bad) = batch.tokens().iter().find(|&&x| x as usize >= cfg.vocab) {
        return Err(Error::Invalid(format!(
            "token id {bad} is outside the model's vocabulary 0..{}",
            cfg.vocab
        )));
    }
    let dm = Dims::new(cfg, batch.len())?;
    let mut x = embedding_reference(p.at(layout.embed()), batch.tokens(), dm.vocab, dm.d)?;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for lv in layout.layers() {
        let (cache, next) = layer_forward(cfg, dm, &p, lv, batch, x)?;
        layers.push(cache);
        x = next;
    }
    let hf = rmsnorm_reference(&x, p.at(layout.final_norm()), dm.t, dm.d, dm.eps)?;
    let logits = linear(&hf, p.at(layout.lm_head()), dm.t, dm.vocab, dm.d);
    Ok(Activations {
        layers,
        x_final: x,
        hf,
        logits,
    })
}

/// The logits [T, vocab] of a packed batch.
pub fn logits(model: &Model, batch: &PackedBatch) -> Result<Vec<f32>> {
    Ok(forward_all(&model.config, &model.params, batch)?.logits)
}

/// The supervised loss of one batch: the mean over tokens with `mask != 0` of
/// -log p(targets[t] | tokens[..=t]) (the is_gate_loss row routine in `pg` mode with advantage
/// 1), and d loss / d logits.
fn lm_loss(logits: &[f32], dm: Dims, targets: &[i32], mask: &[f32]) -> Result<(f32, Vec<f32>)> {
    if targets.len() != dm.t || mask.len() != dm.t {
        return Err(Error::Invalid(format!(
            "targets ({}) and mask ({}) must have one entry per token of the batch ({})",
            targets.len(),
            mask.len(),
            dm.t
        )));
    }
    let zeros = vec![0.0f32; dm.t];
    let ones = vec![1.0f32; dm.t];
    let inputs = TokenInputs {
        tokens: targets,
        behavior_logp: &zeros,
        advantages: &ones,
        mask,
        weight: None,
    };
    let params = GateParams {
        mode: GateMode::Pg,
        ..GateParams::default()
    };
    let (r, dlogits) = gate_objective(logits, dm, &inputs, &params)?;
    Ok((r.loss, dlogits))
}

/// The is_gate_loss objective over the logits, and d loss / d logits.
fn gate_objective(
    logits: &[f32],
    dm: Dims,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<(GateReference, Vec<f32>)> {
    let mut dlogits = vec![0.0f32; logits.len()];
    let r = is_gate_loss_reference(logits, dm.t, dm.vocab, inputs, params, &mut dlogits)?;
    Ok((r, dlogits))
}

/// The supervised loss of a batch (forward only).
pub fn loss(model: &Model, batch: &PackedBatch, targets: &[i32], mask: &[f32]) -> Result<f32> {
    loss_of(&model.config, &model.params, batch, targets, mask)
}

/// The supervised loss of a batch for a config and a parameter arena (forward only).
pub fn loss_of(
    cfg: &ModelConfig,
    params: &Arena,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    let acts = forward_all(cfg, params, batch)?;
    let dm = Dims::new(cfg, batch.len())?;
    Ok(lm_loss(&acts.logits, dm, targets, mask)?.0)
}

// ---------------------------------------------------------------------------------------------
// Backward.

/// Gradients of one view, written into the gradient arena at the end.
type Grads = Vec<(usize, Vec<f32>)>;

fn dense_backward(
    h: &[f32],
    c: &DenseCache,
    w: (&[f32], &[f32], &[f32]),
    dy: &[f32],
    t: usize,
    d: usize,
    f: usize,
) -> Result<(Vec<f32>, [Vec<f32>; 3])> {
    let (w1, w3, w2) = w;
    let dw2 = linear_dw(dy, &c.s, t, d, f);
    let ds = linear_dx(dy, w2, t, d, f);
    let (du, dg) = swiglu_backward_reference(&c.u, &c.g, &ds)?;
    let dw1 = linear_dw(&du, h, t, f, d);
    let dw3 = linear_dw(&dg, h, t, f, d);
    let mut dh = linear_dx(&du, w1, t, f, d);
    add_into(&mut dh, &linear_dx(&dg, w3, t, f, d));
    Ok((dh, [dw1, dw3, dw2]))
}

fn moe_backward(
    cx: &Ctx<'_>,
    views: MoeViews,
    h: &[f32],
    c: &MoeCache,
    dy: &[f32],
    grads: &mut Grads,
) -> Result<Vec<f32>> {
    let Ctx { cfg, dm, p, .. } = *cx;
    let Dims { t, d, .. } = dm;
    let MoeViews {
        router,
        w1,
        w3,
        w2,
        shared,
    } = views;
    let (dims, mc) = moe_call(cfg, dm);
    let g = moe_backward_reference(h, p.at(router), p.at(w1), p.at(w3), p.at(w2), dy, dims, mc);
    grads.extend([(w1, g.dw1), (w3, g.dw3), (w2, g.dw2), (router, g.dw_router)]);
    let mut dh = g.dx;
    if let (Some((s1, s3, s2)), Some(sc)) = (shared, &c.shared) {
        let fs = p.layout.views()[s1].shape[0];
        let (dhs, [g1, g3, g2]) =
            dense_backward(h, sc, (p.at(s1), p.at(s3), p.at(s2)), dy, t, d, fs)?;
        add_into(&mut dh, &dhs);
        grads.extend([(s1, g1), (s3, g3), (s2, g2)]);
    }
    Ok(dh)
}

/// What every backward step reads: the config, the dimensions, the parameters and the batch.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    cfg: &'a ModelConfig,
    dm: Dims,
    p: &'a Params<'a>,
    batch: &'a PackedBatch,
}

fn layer_backward(
    cx: &Ctx<'_>,
    lv: &LayerViews,
    c: &LayerCache,
    dx_out: Vec<f32>,
    grads: &mut Grads,
) -> Result<Vec<f32>> {
    let Ctx { dm, p, batch, .. } = *cx;
    let Dims {
        t,
        d,
        h,
        hkv,
        hd,
        eps,
        theta,
        scale,
        ..
    } = dm;
    // FFN half: x_out = x_mid + ffn(rmsnorm(x_mid)).
    let dh2 = match (&lv.ffn, &c.ffn) {
        (FfnViews::Dense { w1, w3, w2 }, FfnCache::Dense(dc)) => {
            let fd = p.layout.views()[*w1].shape[0];
            let (dh, [g1, g3, g2]) = dense_backward(
                &c.h2,
                dc,
                (p.at(*w1), p.at(*w3), p.at(*w2)),
                &dx_out,
                t,
                d,
                fd,
            )?;
            grads.extend([(*w1, g1), (*w3, g3), (*w2, g2)]);
            dh
        }
        (
            FfnViews::Moe {
                router,
                w1,
                w3,
                w2,
                shared,
            },
            FfnCache::Moe(mc),
        ) => {
            let views = MoeViews {
                router: *router,
                w1: *w1,
                w3: *w3,
                w2: *w2,
                shared: *shared,
            };
            moe_backward(cx, views, &c.h2, mc, &dx_out, grads)?
        }
        _ => {
            return Err(Error::Invalid(
                "internal: a layer's saved activations do not match its FFN kind".into(),
            ))
        }
    };
    let (dxm, dnorm2) = rmsnorm_backward_reference(&c.x_mid, p.at(lv.ffn_norm), &dh2, t, d, eps)?;
    grads.push((lv.ffn_norm, dnorm2));
    let mut dx_mid = dx_out;
    add_into(&mut dx_mid, &dxm);
    // Attention half: x_mid = x_in + attention(rmsnorm(x_in)) wo^T.
    grads.push((lv.wo, linear_dw(&dx_mid, &c.attn, t, d, h * hd)));
    let dattn = linear_dx(&dx_mid, p.at(lv.wo), t, d, h * hd);
    let mut dq = vec![0.0f32; t * h * hd];
    let mut dk = vec![0.0f32; t * hkv * hd];
    let mut dv = vec![0.0f32; t * hkv * hd];
    attention_backward_reference(
        &c.q,
        &c.k,
        &c.v,
        batch.cu_seqlens(),
        dm.attn(),
        true,
        scale,
        &c.attn,
        &c.lse,
        &dattn,
        &mut dq,
        &mut dk,
        &mut dv,
    )?;
    let dq = rope_backward_reference(&dq, batch.positions(), t, h, hd, theta)?;
    let dk = rope_backward_reference(&dk, batch.positions(), t, hkv, hd, theta)?;
    grads.push((lv.wq, linear_dw(&dq, &c.h1, t, h * hd, d)));
    grads.push((lv.wk, linear_dw(&dk, &c.h1, t, hkv * hd, d)));
    grads.push((lv.wv, linear_dw(&dv, &c.h1, t, hkv * hd, d)));
    let mut dh1 = linear_dx(&dq, p.at(lv.wq), t, h * hd, d);
    add_into(&mut dh1, &linear_dx(&dk, p.at(lv.wk), t, hkv * hd, d));
    add_into(&mut dh1, &linear_dx(&dv, p.at(lv.wv), t, hkv * hd, d));
    let (dxi, dnorm1) = rmsnorm_backward_reference(&c.x_in, p.at(lv.attn_norm), &dh1, t, d, eps)?;
    grads.push((lv.attn_norm, dnorm1));
    let mut dx_in = dx_mid;
    add_into(&mut dx_in, &dxi);
    Ok(dx_in)
}

/// Forward, supervised loss and backward of one batch: returns the loss and OVERWRITES
/// `model.grads` with d loss / d params (every view; padding stays zero).
///
/// `targets[t]` is the token to predict at position t (usually the next token of the same
/// sequence) and `mask[t]` (0 or 1) says whether position t is in the loss.
pub fn loss_and_grad(
    model: &mut Model,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    let acts = forward_all(&model.config, &model.params, batch)?;
    let dm = Dims::new(&model.config, batch.len())?;
    let (loss, dlogits) = lm_loss(&acts.logits, dm, targets, mask)?;
    backward(model, batch, &acts, dlogits)?;
    Ok(loss)
}

/// Forward, the is_gate_loss policy objective (DESIGN 3.6: `dis`, `icepop`, `ppo` or `pg` per
/// `params`) and backward of one batch: returns the loss, per-token log-probs, ratios, accepted
/// flags and counters, and OVERWRITES `model.grads` with d loss / d params.
/// `inputs.tokens[t]` is the sampled token whose log-prob position t's logits give.
pub fn policy_loss_and_grad(
    model: &mut Model,
    batch: &PackedBatch,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<GateReference> {
    let acts = forward_all(&model.config, &model.params, batch)?;
    let dm = Dims::new(&model.config, batch.len())?;
    let (r, dlogits) = gate_objective(&acts.logits, dm, inputs, params)?;
    backward(model, batch, &acts, dlogits)?;
    Ok(r)
}

/// The backward from d loss / d logits, layer by layer, into `model.grads`.
fn backward(
    model: &mut Model,
    batch: &PackedBatch,
    acts: &Activations,
    dlogits: Vec<f32>,
) -> Result<()> {
    let cfg = &model.config;
    let layout = model.params.layout().clone();
    let dm = Dims::new(cfg, batch.len())?;
    let p = Params {
        all: host_params(&model.params)?,
        layout: &layout,
    };
    let mut grads: Grads = Vec::with_capacity(layout.views().len());
    let Dims {
        t, d, vocab, eps, ..
    } = dm;
    grads.push((layout.lm_head(), linear_dw(&dlogits, &acts.hf, t, vocab, d)));
    let dhf = linear_dx(&dlogits, p.at(layout.lm_head()), t, vocab, d);
    let (mut dx, dfinal) =
        rmsnorm_backward_reference(&acts.x_final, p.at(layout.final_norm()), &dhf, t, d, eps)?;
    grads.push((layout.final_norm(), dfinal));
    let cx = Ctx {
        cfg,
        dm,
        p: &p,
        batch,
    };
    for (lv, c) in layout.layers().iter().zip(&acts.layers).rev() {
        dx = layer_backward(&cx, lv, c, dx, &mut grads)?;
    }
    grads.push((
        layout.embed(),
        embedding_backward_reference(&dx, batch.tokens(), vocab, d)?,
    ));
    // Every view gets exactly one gradient; write them into the arena.
    let g = model.grads.as_mut_slice().map_err(|_| {
        Error::Device("the gradient arena must be in host memory (--device cpu)".into())
    })?;
    g.fill(0.0);
    let mut seen = vec![false; layout.views().len()];
    for (i, values) in grads {
        let spec = &layout.views()[i];
        if values.len() != spec.numel() || seen[i] {
            return Err(Error::Invalid(format!(
                "internal: gradient of `{}` has {} values (expected {}) or was written twice",
                spec.name,
                values.len(),
                spec.numel()
            )));
        }
        seen[i] = true;
        g[spec.range()].copy_from_slice(&values);
    }
    if let Some(i) = seen.iter().position(|s| !s) {
        return Err(Error::Invalid(format!(
            "internal: no gradient was computed for `{}`",
            layout.views()[i].name
        )));
    }
    Ok(())
}
