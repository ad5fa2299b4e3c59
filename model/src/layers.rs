//! The transformer's pieces at the level of tensors, each with its backward, on any device
//! (docs/model.md, "Forward and backward").
//!
//! Every function takes the [`Backend`] and tensors that live on it and calls the kernels
//! crate's device entry points: on `cpu` they run the CPU references, on `emu` and `cuda` the
//! CUDA kernels (under the emulator on `emu`). The learner ([`crate::forward`]) chains them into
//! the whole model. The projection and FFN functions ([`qkv`], [`project_qkv`], [`attn_output`],
//! [`ffn`], [`ffn_block`]) are meant for the rollout engine as well (with its paged attention in place of
//! [`attention`]), so that the engine and the learner compute a token's activations with the
//! same code.
//!
//! Shapes: T packed tokens, d = d_model, H query heads, Hkv KV heads, D = head_dim, f the hidden
//! width of an FFN, E experts, V the vocabulary. Activations are F32 `[T, ...]`, row-major,
//! except the GEMM inputs kept for the backward, which are in the GEMM dtype.
//!
//! Linear layers are `y = x W^T` (W `[out, in]`, the kernels' GEMM form). The backward's other
//! two forms go through the elementwise transpose (a copy, so no rounding is added):
//! `dX = dY W` is `gemm(dY, W^T)` and `dW = dY^T X` is `gemm(dY^T, X^T)`.
//!
//! Precision (docs/model.md, "Precision and rounding points"): a GEMM runs in the dtype of its
//! weight, and its activation operand is rounded to that dtype at the GEMM's input
//! ([`as_dtype`]). With F32 weights nothing is rounded. With the BF16 compute copy
//! ([`ModelWeights::from_arena`] of a BF16 arena) every GEMM operand is bf16 with f32
//! accumulation, q/k/v are rounded to bf16 after RoPE (the attention inputs, and what the
//! engine's KV cache holds), and the norm scales are widened to f32 (exactly), so norms,
//! softmax statistics, the residual stream and every output stay f32. The casts are
//! elementwise, so batch invariance is kept.
//!
//! Every op has a fixed summation order, so results are bit-identical run to run, and every op
//! of the forward works row by row (a token's row does not depend on the other rows or on T), so
//! a sequence's logits do not depend on what else is packed with it.

use crate::arena::Arena;
use crate::batch::PackedBatch;
use crate::config::{ModelConfig, ScoreFn};
use crate::layout::{FfnViews, Layout};
use sluice_kernels::ops::attention::{attention_backward_saved, attention_forward, resolve_scale};
use sluice_kernels::ops::elementwise::{residual_add, transpose};
use sluice_kernels::ops::embedding::{embedding, embedding_backward_host};
use sluice_kernels::ops::gemm::gemm;
use sluice_kernels::ops::moe::{
    moe_backward_saved, moe_forward_saved, MoeConfig, MoeSaved, ScoreFn as MoeScoreFn,
};
use sluice_kernels::ops::optim::cast_bf16_into;
use sluice_kernels::ops::rmsnorm::{rmsnorm, rmsnorm_backward};
use sluice_kernels::ops::rope::{rope, rope_backward};
use sluice_kernels::ops::swiglu::{swiglu, swiglu_backward};
use sluice_kernels::{Backend, DType, Error, Result, Tensor};

// ---------------------------------------------------------------------------------------------
// Sizes, weights, batch inputs.

/// The sizes and constants the layer pieces need, from a model config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dims {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub norm_eps: f32,
    pub rope_theta: f32,
    /// The attention softmax scale, 1/sqrt(head_dim).
    pub scale: f32,
    /// The routed experts' call parameters (k, score function, renormalisation; no aux loss).
    pub moe: MoeConfig,
}

impl Dims {
    pub fn new(cfg: &ModelConfig) -> Result<Dims> {
        Ok(Dims {
            d_model: cfg.d_model,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            vocab: cfg.vocab,
            norm_eps: cfg.norm_eps as f32,
            rope_theta: cfg.rope_theta as f32,
            scale: resolve_scale(None, cfg.head_dim)?,
            moe: MoeConfig {
                k: cfg.top_k,
                score_fn: match cfg.score_fn {
                    ScoreFn::Softmax => MoeScoreFn::Softmax,
                    ScoreFn::Sigmoid => MoeScoreFn::Sigmoid,
                },
                renorm: cfg.renorm,
                aux_alpha: 0.0,
            },
        })
    }
}

/// The attention half of a layer: its RMSNorm scale `[d]`, `wq [H*D, d]`, `wk`/`wv`
/// `[Hkv*D, d]` and `wo [d, H*D]`. The same type holds their gradients.
pub struct AttnWeights {
    pub norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
}

/// A SwiGLU FFN `(silu(h w1^T) * (h w3^T)) w2^T`: `w1`, `w3 [f, d]`, `w2 [d, f]` (a dense layer
/// or the shared expert). The same type holds their gradients.
pub struct SwigluWeights {
    pub w1: Tensor,
    pub w3: Tensor,
    pub w2: Tensor,
}

/// The routed experts of an MoE layer (`router [E, d]`, `w1`/`w3 [E, f, d]`, `w2 [E, d, f]`),
/// and the optional shared expert. The same type holds their gradients.
pub struct MoeWeights {
    pub router: Tensor,
    pub w1: Tensor,
    pub w3: Tensor,
    pub w2: Tensor,
    pub shared: Option<SwigluWeights>,
}

/// A layer's FFN.
// One per layer: the variants' sizes (a few hundred bytes of tensor handles) do not matter.
#[allow(clippy::large_enum_variant)]
pub enum FfnWeights {
    Dense(SwigluWeights),
    Moe(MoeWeights),
}

/// One transformer layer (or its gradients).
pub struct LayerWeights {
    pub attn: AttnWeights,
    pub ffn_norm: Tensor,
    pub ffn: FfnWeights,
}

/// Every parameter of the model as tensors on one device (or every gradient): the arena's named
/// views, each copied out once ([`ModelWeights::from_arena`]) or written back once
/// ([`ModelWeights::write_to`]).
pub struct ModelWeights {
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Tensor,
}

impl ModelWeights {
    /// Every view of `arena` as a tensor on `backend` (one copy of the arena), in the arena's
    /// dtype: F32 weights compute in f32; a BF16 arena (the bf16 compute copy) gives BF16
    /// matrices (bf16 GEMMs), a BF16 embedding table (its lookup widens to f32) and the RMSNorm
    /// scales widened to F32 exactly (norms compute in f32).
    pub fn from_arena(backend: &Backend, arena: &Arena) -> Result<ModelWeights> {
        let view = |i: usize| arena.view_tensor(backend, i);
        let norm = |i: usize| widen_to_f32(backend, view(i)?);
        let swiglu = |(w1, w3, w2): (usize, usize, usize)| -> Result<SwigluWeights> {
            Ok(SwigluWeights {
                w1: view(w1)?,
                w3: view(w3)?,
                w2: view(w2)?,
            })
        };
        let layout = arena.layout();
        let mut layers = Vec::with_capacity(layout.layers().len());
        for lv in layout.layers() {
            let ffn = match lv.ffn {
                FfnViews::Dense { w1, w3, w2 } => FfnWeights::Dense(swiglu((w1, w3, w2))?),
                FfnViews::Moe {
                    router,
                    w1,
                    w3,
                    w2,
                    shared,
                } => FfnWeights::Moe(MoeWeights {
                    router: view(router)?,
                    w1: view(w1)?,
                    w3: view(w3)?,
                    w2: view(w2)?,
                    shared: shared.map(swiglu).transpose()?,
                }),
            };
            layers.push(LayerWeights {
                attn: AttnWeights {
                    norm: norm(lv.attn_norm)?,
                    wq: view(lv.wq)?,
                    wk: view(lv.wk)?,
                    wv: view(lv.wv)?,
                    wo: view(lv.wo)?,
                },
                ffn_norm: norm(lv.ffn_norm)?,
                ffn,
            });
        }
        Ok(ModelWeights {
            embed: view(layout.embed())?,
            layers,
            final_norm: norm(layout.final_norm())?,
            lm_head: view(layout.lm_head())?,
        })
    }

    /// Writes every tensor into its view of `arena` (e.g. gradients into the gradient arena).
    /// Each view is written exactly once; the padding between views is left as it is.
    pub fn write_to(&self, arena: &mut Arena) -> Result<()> {
        let layout = arena.layout().clone();
        let mut written = 0;
        self.visit(&layout, |i, t| {
            written += 1;
            arena.write_view(i, t)
        })?;
        if written != layout.views().len() {
            return Err(Error::Invalid(format!(
                "internal: {written} views written of the layout's {}",
                layout.views().len()
            )));
        }
        Ok(())
    }

    /// Calls `f(view index, tensor)` for every tensor, in layout order.
    fn visit(
        &self,
        layout: &Layout,
        mut f: impl FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let mismatch = || {
            Error::Invalid(
                "internal: the tensors do not match the layout's layers or FFN kinds".into(),
            )
        };
        if self.layers.len() != layout.layers().len() {
            return Err(mismatch());
        }
        f(layout.embed(), &self.embed)?;
        for (lw, lv) in self.layers.iter().zip(layout.layers()) {
            let a = &lw.attn;
            f(lv.attn_norm, &a.norm)?;
            f(lv.wq, &a.wq)?;
            f(lv.wk, &a.wk)?;
            f(lv.wv, &a.wv)?;
            f(lv.wo, &a.wo)?;
            f(lv.ffn_norm, &lw.ffn_norm)?;
            match (&lv.ffn, &lw.ffn) {
                (FfnViews::Dense { w1, w3, w2 }, FfnWeights::Dense(s)) => {
                    f(*w1, &s.w1)?;
                    f(*w3, &s.w3)?;
                    f(*w2, &s.w2)?;
                }
                (
                    FfnViews::Moe {
                        router,
                        w1,
                        w3,
                        w2,
                        shared,
                    },
                    FfnWeights::Moe(m),
                ) => {
                    f(*router, &m.router)?;
                    f(*w1, &m.w1)?;
                    f(*w3, &m.w3)?;
                    f(*w2, &m.w2)?;
                    match (shared, &m.shared) {
                        (Some((s1, s3, s2)), Some(s)) => {
                            f(*s1, &s.w1)?;
                            f(*s3, &s.w3)?;
                            f(*s2, &s.w2)?;
                        }
                        (None, None) => {}
                        _ => return Err(mismatch()),
                    }
                }
                _ => return Err(mismatch()),
            }
        }
        f(layout.final_norm(), &self.final_norm)?;
        f(layout.lm_head(), &self.lm_head)
    }
}

/// A packed batch's index tensors on the device: `tokens [T]`, `positions [T]` (each token's
/// index within its own sequence, the RoPE position) and `cu_seqlens [B+1]`, all I32.
pub struct BatchTensors {
    pub tokens: Tensor,
    pub positions: Tensor,
    pub cu_seqlens: Tensor,
    /// The token ids in host memory too: the embedding backward sorts them on the host, which
    /// would otherwise read them back from the device.
    pub host_tokens: Vec<i32>,
}

impl BatchTensors {
    /// Uploads a packed batch to `backend`.
    pub fn upload(backend: &Backend, batch: &PackedBatch) -> Result<BatchTensors> {
        let t = batch.len();
        Ok(BatchTensors {
            tokens: Tensor::from_slice(backend, &[t], batch.tokens())?,
            positions: Tensor::from_slice(backend, &[t], batch.positions())?,
            cu_seqlens: Tensor::from_slice(
                backend,
                &[batch.cu_seqlens().len()],
                batch.cu_seqlens(),
            )?,
            host_tokens: batch.tokens().to_vec(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Dtypes: the rounding points.

/// A GEMM operand: the caller's tensor as it is, or a rounded copy.
pub enum Operand<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl std::ops::Deref for Operand<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Operand::Borrowed(t) => t,
            Operand::Owned(t) => t,
        }
    }
}

/// `t` as an operand of dtype `dtype`: itself when it has that dtype, else (F32 to BF16) a copy
/// rounded to nearest even by the `cast_bf16` op on `backend` (the device kernel on emu and
/// cuda, its reference on cpu). This is the rounding point at every bf16 GEMM input.
pub fn as_dtype<'a>(backend: &Backend, t: &'a Tensor, dtype: DType) -> Result<Operand<'a>> {
    if t.dtype() == dtype {
        return Ok(Operand::Borrowed(t));
    }
    Ok(Operand::Owned(round_to(backend, t, dtype)?))
}

/// [`as_dtype`] for an owned tensor: `t` itself, or its rounded copy.
pub fn into_dtype(backend: &Backend, t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t);
    }
    round_to(backend, &t, dtype)
}

fn round_to(backend: &Backend, t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() != DType::F32 || dtype != DType::BF16 {
        return Err(Error::Invalid(format!(
            "internal: a {} activation cannot become a {dtype} GEMM operand (only F32 is \
             rounded to BF16)",
            t.dtype()
        )));
    }
    let mut out = Tensor::zeros(backend, t.shape(), DType::BF16)?;
    cast_bf16_into(backend, t, &mut out)?;
    Ok(out)
}

/// A BF16 vector widened to F32 exactly (an F32 one as it is): the norm scales of the bf16
/// compute copy, for the f32 RMSNorm. On every device the embedding lookup of row 0 of the
/// vector seen as a `[1, n]` table, which copies (and widens) it on the device.
fn widen_to_f32(backend: &Backend, t: Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        return Ok(t);
    }
    let shape = t.shape().to_vec();
    let n = t.numel();
    let row0 = Tensor::from_slice(backend, &[1], &[0i32])?;
    embedding(backend, &t.reshape(&[1, n])?, &row0)?.reshape(&shape)
}

// ---------------------------------------------------------------------------------------------
// Linear layers. Each GEMM runs in the dtype of its weight (or, for the weight gradient, of the
// saved input); the activation or gradient operand is rounded to it at the input.

/// y[T, n] = x[T, k] w[n, k]^T.
pub fn linear(backend: &Backend, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    gemm(backend, &*as_dtype(backend, x, w.dtype())?, w)
}

/// dx[T, k] = dy[T, n] w[n, k]: the input gradient of [`linear`].
pub fn linear_dx(backend: &Backend, dy: &Tensor, w: &Tensor) -> Result<Tensor> {
    gemm(
        backend,
        &*as_dtype(backend, dy, w.dtype())?,
        &transpose(backend, w)?,
    )
}

/// dw[n, k] = dy[T, n]^T x[T, k], given `x_t` = x^T `[k, T]` (the forward's GEMM input,
/// transposed once by the caller when several weights share it): the weight gradient of
/// [`linear`].
pub fn linear_dw(backend: &Backend, dy: &Tensor, x_t: &Tensor) -> Result<Tensor> {
    let dy = as_dtype(backend, dy, x_t.dtype())?;
    gemm(backend, &transpose(backend, &dy)?, x_t)
}

/// The rows of a 2-D or 3-D tensor.
fn rows(t: &Tensor) -> usize {
    t.shape().first().copied().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Attention half: x_mid = x + attention(rope(rmsnorm(x) W_{q,k,v}^T)) wo^T.

/// The attention inputs of a layer: `h = rmsnorm(x)` in the GEMM dtype (the q/k/v projections'
/// input, kept for their weight gradients), and q `[T,H,D]`, k, v `[T,Hkv,D]` with RoPE applied
/// to q and k, in the weights' dtype (bf16-rounded in bf16 precision).
pub struct Qkv {
    pub h: Tensor,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

/// RMSNorm, the q/k/v projections and RoPE at `positions [T]` (I32).
pub fn qkv(
    backend: &Backend,
    dims: &Dims,
    w: &AttnWeights,
    x: &Tensor,
    positions: &Tensor,
) -> Result<Qkv> {
    let h = rmsnorm(backend, x, &w.norm, dims.norm_eps)?;
    let h = into_dtype(backend, h, w.wq.dtype())?;
    let (q, k, v) = project_qkv(backend, dims, w, &h, positions)?;
    Ok(Qkv { h, q, k, v })
}

/// The q/k/v projections of the normalised input h `[T, d]` and RoPE at `positions [T]` (I32):
/// q `[T,H,D]`, k and v `[T,Hkv,D]` (what a paged-KV engine appends to its cache and attends
/// with), in the weights' dtype: RoPE runs in f32 on the f32 GEMM outputs, then q, k and v are
/// rounded to bf16 when the weights are bf16.
pub fn project_qkv(
    backend: &Backend,
    dims: &Dims,
    w: &AttnWeights,
    h: &Tensor,
    positions: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let t = rows(h);
    let (hq, hkv, hd) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
    let dtype = w.wq.dtype();
    let h = as_dtype(backend, h, dtype)?;
    let q = linear(backend, &h, &w.wq)?.reshape(&[t, hq, hd])?;
    let k = linear(backend, &h, &w.wk)?.reshape(&[t, hkv, hd])?;
    let v = linear(backend, &h, &w.wv)?.reshape(&[t, hkv, hd])?;
    let q = rope(backend, &q, positions, dims.rope_theta)?;
    let k = rope(backend, &k, positions, dims.rope_theta)?;
    Ok((
        into_dtype(backend, q, dtype)?,
        into_dtype(backend, k, dtype)?,
        into_dtype(backend, v, dtype)?,
    ))
}

/// Causal varlen attention over a packed batch: the output `[T, H*D]` (F32) and its
/// log-sum-exp `[T, H]` (the backward's saved state).
pub fn attention(
    backend: &Backend,
    dims: &Dims,
    qkv: &Qkv,
    cu_seqlens: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let t = rows(&qkv.q);
    let a = attention_forward(
        backend,
        &qkv.q,
        &qkv.k,
        &qkv.v,
        cu_seqlens,
        true,
        Some(dims.scale),
    )?;
    Ok((a.out.reshape(&[t, dims.n_heads * dims.head_dim])?, a.lse))
}

/// The output projection and the residual: x + out wo^T, with out `[T, H*D]`.
pub fn attn_output(backend: &Backend, w: &AttnWeights, x: &Tensor, out: &Tensor) -> Result<Tensor> {
    residual_add(backend, x, &linear(backend, out, &w.wo)?)
}

/// What the attention half's backward needs.
pub struct AttnSaved {
    pub x: Tensor,
    pub qkv: Qkv,
    /// The attention output `[T, H*D]` (F32) and its log-sum-exp `[T, H]`.
    pub out: Tensor,
    pub lse: Tensor,
}

/// The attention half of a layer: returns x_mid and the saved state.
pub fn attn_block(
    backend: &Backend,
    dims: &Dims,
    w: &AttnWeights,
    x: Tensor,
    batch: &BatchTensors,
) -> Result<(AttnSaved, Tensor)> {
    let qkv = qkv(backend, dims, w, &x, &batch.positions)?;
    let (out, lse) = attention(backend, dims, &qkv, &batch.cu_seqlens)?;
    let x_mid = attn_output(backend, w, &x, &out)?;
    Ok((AttnSaved { x, qkv, out, lse }, x_mid))
}

/// The backward of [`attn_block`]: from d loss / d x_mid, returns d loss / d x and the
/// gradients of the norm scale and the four projections.
pub fn attn_block_backward(
    backend: &Backend,
    dims: &Dims,
    w: &AttnWeights,
    saved: AttnSaved,
    dx_mid: Tensor,
    batch: &BatchTensors,
) -> Result<(Tensor, AttnWeights)> {
    let AttnSaved { x, qkv, out, lse } = saved;
    let Qkv { h, q, k, v } = qkv;
    let t = rows(&x);
    let (hq, hkv, hd) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
    let dtype = w.wo.dtype();
    // Output projection (dx_mid rounded once for both of its GEMMs; the output rounded as the
    // forward rounded it).
    let dxm = as_dtype(backend, &dx_mid, dtype)?;
    let out_t = transpose(backend, &*as_dtype(backend, &out, dtype)?)?;
    let dwo = linear_dw(backend, &dxm, &out_t)?;
    drop(out_t);
    // Rounded to the model's dtype: in a bf16 model dO is an operand of the attention
    // backward's mma.sync (the tile kernels, docs/perf/attention.md); in an f32 model a no-op.
    let dout =
        into_dtype(backend, linear_dx(backend, &dxm, &w.wo)?, dtype)?.reshape(&[t, hq, hd])?;
    drop(dxm);
    let out = out.reshape(&[t, hq, hd])?;
    // Attention, then RoPE.
    let g = attention_backward_saved(
        backend,
        &q,
        &k,
        &v,
        &batch.cu_seqlens,
        &out,
        &lse,
        &dout,
        true,
        Some(dims.scale),
    )?;
    let theta = dims.rope_theta;
    let dq = rope_backward(backend, &g.dq, &batch.positions, theta)?.reshape(&[t, hq * hd])?;
    let dk = rope_backward(backend, &g.dk, &batch.positions, theta)?.reshape(&[t, hkv * hd])?;
    let dv = g.dv.reshape(&[t, hkv * hd])?;
    // q/k/v projections: one transpose of h serves all three weight gradients; each gradient
    // is rounded once for its two GEMMs.
    let h_t = transpose(backend, &h)?;
    let (dq, dk, dv) = (
        into_dtype(backend, dq, dtype)?,
        into_dtype(backend, dk, dtype)?,
        into_dtype(backend, dv, dtype)?,
    );
    let dwq = linear_dw(backend, &dq, &h_t)?;
    let dwk = linear_dw(backend, &dk, &h_t)?;
    let dwv = linear_dw(backend, &dv, &h_t)?;
    let dh = residual_add(
        backend,
        &linear_dx(backend, &dq, &w.wq)?,
        &linear_dx(backend, &dk, &w.wk)?,
    )?;
    let dh = residual_add(backend, &dh, &linear_dx(backend, &dv, &w.wv)?)?;
    // RMSNorm and the residual.
    let (dxn, dnorm) = rmsnorm_backward(backend, &x, &w.norm, &dh, dims.norm_eps)?;
    let dx = residual_add(backend, &dx_mid, &dxn)?;
    Ok((
        dx,
        AttnWeights {
            norm: dnorm,
            wq: dwq,
            wk: dwk,
            wv: dwv,
            wo: dwo,
        },
    ))
}

// ---------------------------------------------------------------------------------------------
// FFN half: x_out = x_mid + ffn(rmsnorm(x_mid)).

/// What a SwiGLU FFN's backward needs: u = h w1^T, g = h w3^T (both [T, f], F32) and
/// s = silu(u) * g in the GEMM dtype (the input of w2, kept for its weight gradient).
pub struct SwigluSaved {
    pub u: Tensor,
    pub g: Tensor,
    pub s: Tensor,
}

/// A SwiGLU FFN on h `[T, d]`: y = (silu(h w1^T) * (h w3^T)) w2^T `[T, d]`.
pub fn swiglu_ffn(
    backend: &Backend,
    w: &SwigluWeights,
    h: &Tensor,
) -> Result<(SwigluSaved, Tensor)> {
    let h = as_dtype(backend, h, w.w1.dtype())?;
    let u = linear(backend, &h, &w.w1)?;
    let g = linear(backend, &h, &w.w3)?;
    let s = into_dtype(backend, swiglu(backend, &u, &g)?, w.w2.dtype())?;
    let y = linear(backend, &s, &w.w2)?;
    Ok((SwigluSaved { u, g, s }, y))
}

/// The backward of [`swiglu_ffn`] given `h_t` = h^T `[d, T]` (h in the GEMM dtype): returns dh
/// and the gradients.
pub fn swiglu_ffn_backward(
    backend: &Backend,
    w: &SwigluWeights,
    h_t: &Tensor,
    saved: SwigluSaved,
    dy: &Tensor,
) -> Result<(Tensor, SwigluWeights)> {
    let SwigluSaved { u, g, s } = saved;
    let dtype = w.w2.dtype();
    let dy = as_dtype(backend, dy, dtype)?;
    let dw2 = linear_dw(backend, &dy, &transpose(backend, &s)?)?;
    let ds = linear_dx(backend, &dy, &w.w2)?;
    let (du, dg) = swiglu_backward(backend, &u, &g, &ds)?;
    let (du, dg) = (
        into_dtype(backend, du, dtype)?,
        into_dtype(backend, dg, dtype)?,
    );
    let dw1 = linear_dw(backend, &du, h_t)?;
    let dw3 = linear_dw(backend, &dg, h_t)?;
    let dh = residual_add(
        backend,
        &linear_dx(backend, &du, &w.w1)?,
        &linear_dx(backend, &dg, &w.w3)?,
    )?;
    Ok((
        dh,
        SwigluWeights {
            w1: dw1,
            w3: dw3,
            w2: dw2,
        },
    ))
}

/// What an MoE FFN keeps for the backward: the shared expert's state and the routed experts'
/// forward state (routing, expert-sorted rows, activations), so the backward recomputes
/// nothing and needs nothing on the host.
pub struct MoeFfnSaved {
    pub shared: Option<SwigluSaved>,
    pub routed: MoeSaved,
}

/// The routed experts (the moe family: router, top-k gates, stable expert sort, grouped SwiGLU,
/// combine) plus the shared expert when there is one. `h` in the GEMM dtype (the moe op takes
/// its input in the experts' dtype: with bf16 weights it runs the router in f32 on h widened
/// exactly and the expert GEMMs in bf16, the hidden state rounded to bf16 before W2).
pub fn moe_ffn(
    backend: &Backend,
    dims: &Dims,
    w: &MoeWeights,
    h: &Tensor,
) -> Result<(MoeFfnSaved, Tensor)> {
    let h = as_dtype(backend, h, w.w1.dtype())?;
    let (out, routed_saved) =
        moe_forward_saved(backend, &h, &w.router, &w.w1, &w.w3, &w.w2, dims.moe)?;
    let routed = out.y;
    match &w.shared {
        Some(sw) => {
            let (saved, ys) = swiglu_ffn(backend, sw, &h)?;
            let y = residual_add(backend, &routed, &ys)?;
            Ok((
                MoeFfnSaved {
                    shared: Some(saved),
                    routed: routed_saved,
                },
                y,
            ))
        }
        None => Ok((
            MoeFfnSaved {
                shared: None,
                routed: routed_saved,
            },
            routed,
        )),
    }
}

/// The backward of [`moe_ffn`] from its saved state. `h_t` (h^T) is needed only with a shared
/// expert.
pub fn moe_ffn_backward(
    backend: &Backend,
    dims: &Dims,
    w: &MoeWeights,
    h: &Tensor,
    h_t: Option<&Tensor>,
    saved: MoeFfnSaved,
    dy: &Tensor,
) -> Result<(Tensor, MoeWeights)> {
    let MoeFfnSaved { shared, routed } = saved;
    let h = as_dtype(backend, h, w.w1.dtype())?;
    let g = moe_backward_saved(
        backend,
        &h,
        &w.router,
        &w.w1,
        &w.w3,
        &w.w2,
        dy,
        dims.moe,
        Some(&routed),
    )?;
    let (dh, shared_grads) = match (&w.shared, shared, h_t) {
        (Some(sw), Some(saved), Some(h_t)) => {
            let (dhs, sg) = swiglu_ffn_backward(backend, sw, h_t, saved, dy)?;
            (residual_add(backend, &g.dx, &dhs)?, Some(sg))
        }
        (None, None, _) => (g.dx, None),
        _ => {
            return Err(Error::Invalid(
                "internal: the shared expert's weights, saved state and h^T do not match".into(),
            ))
        }
    };
    Ok((
        dh,
        MoeWeights {
            router: g.dw_router,
            w1: g.dw1,
            w3: g.dw3,
            w2: g.dw2,
            shared: shared_grads,
        },
    ))
}

/// What a layer's FFN keeps for the backward.
pub enum FfnSaved {
    Dense(SwigluSaved),
    /// The shared expert's state and the routed experts' forward state.
    Moe(MoeFfnSaved),
}

impl FfnWeights {
    /// The dtype of the FFN's GEMMs (its weights').
    pub fn dtype(&self) -> DType {
        match self {
            FfnWeights::Dense(s) => s.w1.dtype(),
            FfnWeights::Moe(m) => m.w1.dtype(),
        }
    }
}

/// A layer's FFN (dense or MoE) on h = rmsnorm(x_mid) `[T, d]`.
pub fn ffn(
    backend: &Backend,
    dims: &Dims,
    w: &FfnWeights,
    h: &Tensor,
) -> Result<(FfnSaved, Tensor)> {
    match w {
        FfnWeights::Dense(sw) => {
            let (saved, y) = swiglu_ffn(backend, sw, h)?;
            Ok((FfnSaved::Dense(saved), y))
        }
        FfnWeights::Moe(mw) => {
            let (saved, y) = moe_ffn(backend, dims, mw, h)?;
            Ok((FfnSaved::Moe(saved), y))
        }
    }
}

/// The backward of [`ffn`]: returns dh and the FFN's gradients. `h` is the forward's input in
/// the GEMM dtype.
pub fn ffn_backward(
    backend: &Backend,
    dims: &Dims,
    w: &FfnWeights,
    h: &Tensor,
    saved: FfnSaved,
    dy: &Tensor,
) -> Result<(Tensor, FfnWeights)> {
    match (w, saved) {
        (FfnWeights::Dense(sw), FfnSaved::Dense(saved)) => {
            let h_t = transpose(backend, &*as_dtype(backend, h, sw.w1.dtype())?)?;
            let (dh, g) = swiglu_ffn_backward(backend, sw, &h_t, saved, dy)?;
            Ok((dh, FfnWeights::Dense(g)))
        }
        (FfnWeights::Moe(mw), FfnSaved::Moe(saved)) => {
            let h_t = match saved.shared {
                Some(_) => Some(transpose(backend, &*as_dtype(backend, h, mw.w1.dtype())?)?),
                None => None,
            };
            let (dh, g) = moe_ffn_backward(backend, dims, mw, h, h_t.as_ref(), saved, dy)?;
            Ok((dh, FfnWeights::Moe(g)))
        }
        _ => Err(Error::Invalid(
            "internal: a layer's saved activations do not match its FFN kind".into(),
        )),
    }
}

/// What the FFN half's backward needs.
pub struct FfnBlockSaved {
    /// The half's input x_mid, and h = rmsnorm(x_mid) in the GEMM dtype.
    pub x: Tensor,
    pub h: Tensor,
    pub ffn: FfnSaved,
}

/// The FFN half of a layer: x_out = x_mid + ffn(rmsnorm(x_mid) * norm).
pub fn ffn_block(
    backend: &Backend,
    dims: &Dims,
    norm: &Tensor,
    w: &FfnWeights,
    x: Tensor,
) -> Result<(FfnBlockSaved, Tensor)> {
    let h = rmsnorm(backend, &x, norm, dims.norm_eps)?;
    let h = into_dtype(backend, h, w.dtype())?;
    let (saved, y) = ffn(backend, dims, w, &h)?;
    let x_out = residual_add(backend, &x, &y)?;
    Ok((FfnBlockSaved { x, h, ffn: saved }, x_out))
}

/// The backward of [`ffn_block`]: returns d loss / d x_mid, the norm scale's gradient and the
/// FFN's gradients.
pub fn ffn_block_backward(
    backend: &Backend,
    dims: &Dims,
    norm: &Tensor,
    w: &FfnWeights,
    saved: FfnBlockSaved,
    dx_out: Tensor,
) -> Result<(Tensor, Tensor, FfnWeights)> {
    let FfnBlockSaved { x, h, ffn } = saved;
    let (dh, grads) = ffn_backward(backend, dims, w, &h, ffn, &dx_out)?;
    let (dxn, dnorm) = rmsnorm_backward(backend, &x, norm, &dh, dims.norm_eps)?;
    let dx = residual_add(backend, &dx_out, &dxn)?;
    Ok((dx, dnorm, grads))
}

// ---------------------------------------------------------------------------------------------
// Whole layers, the embedding and the head.

/// What a layer's backward needs.
pub struct LayerSaved {
    pub attn: AttnSaved,
    pub ffn: FfnBlockSaved,
}

/// One transformer layer: x -> x_out.
pub fn layer(
    backend: &Backend,
    dims: &Dims,
    w: &LayerWeights,
    x: Tensor,
    batch: &BatchTensors,
) -> Result<(LayerSaved, Tensor)> {
    let (attn, x_mid) = attn_block(backend, dims, &w.attn, x, batch)?;
    let (ffn, x_out) = ffn_block(backend, dims, &w.ffn_norm, &w.ffn, x_mid)?;
    Ok((LayerSaved { attn, ffn }, x_out))
}

/// The backward of [`layer`]: d loss / d x and the layer's gradients.
pub fn layer_backward(
    backend: &Backend,
    dims: &Dims,
    w: &LayerWeights,
    saved: LayerSaved,
    dx_out: Tensor,
    batch: &BatchTensors,
) -> Result<(Tensor, LayerWeights)> {
    let (dx_mid, dffn_norm, dffn) =
        ffn_block_backward(backend, dims, &w.ffn_norm, &w.ffn, saved.ffn, dx_out)?;
    let (dx, dattn) = attn_block_backward(backend, dims, &w.attn, saved.attn, dx_mid, batch)?;
    Ok((
        dx,
        LayerWeights {
            attn: dattn,
            ffn_norm: dffn_norm,
            ffn: dffn,
        },
    ))
}

/// The token embedding: rows of `table [V, d]` at `tokens [T]` (I32), as F32 (a BF16 table's
/// rows widened exactly).
pub fn embed(backend: &Backend, table: &Tensor, tokens: &Tensor) -> Result<Tensor> {
    embedding(backend, table, tokens)
}

/// The gradient of the embedding table `[V, d]` from d loss / d x `[T, d]`.
pub fn embed_backward(
    backend: &Backend,
    dims: &Dims,
    dx: &Tensor,
    tokens: &[i32],
) -> Result<Tensor> {
    embedding_backward_host(backend, dx, tokens, dims.vocab)
}

/// The final RMSNorm and the LM head: (hf = rmsnorm(x) [T, d] in the GEMM dtype,
/// logits = hf lm_head^T [T, V] F32).
pub fn head(
    backend: &Backend,
    dims: &Dims,
    final_norm: &Tensor,
    lm_head: &Tensor,
    x: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let hf = rmsnorm(backend, x, final_norm, dims.norm_eps)?;
    let hf = into_dtype(backend, hf, lm_head.dtype())?;
    let logits = linear(backend, &hf, lm_head)?;
    Ok((hf, logits))
}

/// The backward of [`head`] from d loss / d logits: (d loss / d x, d final_norm, d lm_head).
pub fn head_backward(
    backend: &Backend,
    dims: &Dims,
    final_norm: &Tensor,
    lm_head: &Tensor,
    x: &Tensor,
    hf: &Tensor,
    dlogits: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    // d loss / d logits rounded once for both of its GEMMs.
    let dl = as_dtype(backend, dlogits, lm_head.dtype())?;
    let dlm = linear_dw(backend, &dl, &transpose(backend, hf)?)?;
    let dhf = linear_dx(backend, &dl, lm_head)?;
    let (dx, dnorm) = rmsnorm_backward(backend, x, final_norm, &dhf, dims.norm_eps)?;
    Ok((dx, dnorm, dlm))
}
