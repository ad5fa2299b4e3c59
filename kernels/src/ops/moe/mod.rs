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
//! 4. grouped GEMMs over the segments (`gemm_grouped`) with SwiGLU in between (for BF16 inputs in
//!    the second up-projection's epilogue, `gemm_grouped_swiglu`; for F32 the `swiglu` kernel):
//!    y_e = (silu(x W1_e^T) * (x W3_e^T)) W2_e^T. Dropless: every slot is computed;
//! 5. combine y[t] = sum_{j ascending} gate[t,j] * y_e[slot (t,j)].
//!
//! Backward, from the forward's saved state ([`moe_forward_saved`] / [`moe_backward_saved`]; the
//! plain [`moe_backward`] recomputes it): dgate (a warp-per-slot dot) and d(y_e) from the
//! combine; dh = d(y_e) · W2_e, swiglu backward, dxs = da · W1_e + db · W3_e (`gemm_grouped_nn`:
//! the weights read in place as [K,N]); weight gradients per expert as one reduction over the
//! expert's contiguous segment, rows in ascending order, every expert in one launch
//! (`gemm_segment_tn`, no split: the order depends on the segment alone); the router gradient
//! flows through the kept gates only (through the renormalisation, then softmax or sigmoid over
//! all E); dx = (dlogits · W_r) + sum_{j ascending} dxs[slot (t,j)]. No atomics anywhere.
//!
//! Batch invariance: a token's y (and dx) depend on its own row only: the router row ops, the
//! grouped GEMMs (no split-K; a row's sum order depends on K alone) and the combine are row-wise.
//! The weight gradients are sums over tokens, so they depend on the batch by definition.
//!
//! Numerics: F32 inputs compute in f32 on every device (the GEMMs on `gemm_f32`). BF16 inputs:
//! the expert GEMMs run on tensor cores (`gemm_bf16_mma` and its grouped forms) with BF16
//! operands (x rows, h, d(ye), da and db rounded to BF16 once, nearest even) and f32
//! accumulation, and so do the expert weight gradients (`gemm_segment_tn` over the BF16-rounded
//! segments); SwiGLU's backward reads a and b as the forward kept them, rounded to BF16; the
//! router (x and W_r widened to f32 exactly), scores, gates, SwiGLU, combine and
//! dW_r stay f32.
//! On `cpu`, BF16 inputs run the CPU reference at the same rounding points: the inputs widened
//! exactly, h, a, b, d(ye), da and db rounded to bf16 values (nearest even) where the device rounds
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
//!
//! Files, one job each: this one (configuration, validation, the public entry points),
//! `routing` (scores, top-k gates, the stable sort, the auxiliary loss, the router backward),
//! `reference` (the CPU forward and backward: expert FFNs, weight gradients), `device` (the
//! emu/cuda launches) and `spec` (the `sluice kernel` rows).

mod device;
mod reference;
mod routing;
mod spec;

pub use reference::{
    moe_backward_reference, moe_forward_reference, MoeForwardOut, MoeGrads, MoePacked,
};
pub use routing::{moe_route_reference, moe_sort_reference, MoeRouting};
pub use spec::{BACKWARD_SPEC, FORWARD_SPEC};

use super::gemm::BF16_PACKED_MAX_K;
use super::topk::{MAX_E, MAX_K};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use device::{device_backward, device_forward, device_sort, widen, DeviceForward, Widened};
use reference::{backward_with_state, forward_state, ForwardState};

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
// Device entry points
// ---------------------------------------------------------------------------------------------

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
    /// [E+1] I32: the expert segment bounds of the stable sort (expert e owns sorted slots
    /// offsets[e]..offsets[e+1]).
    pub offsets: Tensor,
}

/// The gradients of [`moe_backward`], all F32.
pub struct MoeGradTensors {
    pub dx: Tensor,
    pub dw_router: Tensor,
    pub dw1: Tensor,
    pub dw3: Tensor,
    pub dw2: Tensor,
}

/// What the forward computed (routing, the expert-sorted rows, every expert activation), kept
/// by [`moe_forward_saved`] so that [`moe_backward_saved`] need not recompute it: the
/// backward's recomputation of the forward was a third of the backward's FLOPs. Opaque; it
/// lives on the device that made it.
pub struct MoeSaved {
    state: SavedState,
    dims: MoeDims,
    cfg: MoeConfig,
    /// Whether the expert GEMMs' operands were BF16.
    bf16: bool,
}

/// Boxed: the state is a dozen vectors or tensors, and the model keeps one per layer.
enum SavedState {
    Cpu(Box<ForwardState>),
    Device(Box<DeviceSaved>),
}

/// The device intermediates, and x and W_r widened to F32 where they were BF16.
struct DeviceSaved {
    fwd: DeviceForward,
    x32: Option<Tensor>,
    wr32: Option<Tensor>,
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
    if let Backend::Cpu = backend {
        return Ok(moe_forward_saved(backend, x, w_router, w1, w3, w2, cfg)?.0);
    }
    // No state kept: the outputs are moved out of the intermediates, nothing copied.
    let inp = check_inputs(backend, x, w_router, w1, w3, w2, None, cfg)?;
    let w = Widened::new(backend, &inp)?;
    let s = device_forward(backend, &w, inp.dims, cfg)?;
    Ok(MoeOutput {
        y: s.y,
        topk_idx: s.idx,
        topk_gate: s.gate,
        aux_loss: s.aux_loss,
        offsets: s.offsets,
    })
}

/// [`moe_forward`], also returning the state [`moe_backward_saved`] takes.
#[allow(clippy::too_many_arguments)]
pub fn moe_forward_saved(
    backend: &Backend,
    x: &Tensor,
    w_router: &Tensor,
    w1: &Tensor,
    w3: &Tensor,
    w2: &Tensor,
    cfg: MoeConfig,
) -> Result<(MoeOutput, MoeSaved)> {
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
            offsets: Tensor::from_slice(backend, &[r.offsets.len()], &r.offsets)?,
        };
        let saved = MoeSaved {
            state: SavedState::Cpu(Box::new(state)),
            dims: inp.dims,
            cfg,
            bf16,
        };
        return Ok((out, saved));
    }
    let w = Widened::new(backend, &inp)?;
    let mut s = device_forward(backend, &w, inp.dims, cfg)?;
    let out = s.outputs(backend)?;
    let (x32, wr32) = w.into_widened();
    Ok((
        out,
        MoeSaved {
            state: SavedState::Device(Box::new(DeviceSaved { fwd: s, x32, wr32 })),
            dims: inp.dims,
            cfg,
            bf16: x.dtype() == DType::BF16,
        },
    ))
}

/// The MoE layer backward on any device: gradients of sum(dy * y) with respect to x and the
/// weights (see the module documentation). Recomputes the forward: a caller that ran it keeps
/// its state and calls [`moe_backward_saved`].
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
/// [`moe_forward_saved`] on the same device) instead of recomputing it; the gradients are the
/// same bits (the forward is deterministic). A state of other sizes, parameters, dtype or
/// device is an error; `None` recomputes. The state holds the forward's activations, not the
/// inputs: the caller must pass the inputs it ran the forward on.
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
    saved: Option<&MoeSaved>,
) -> Result<MoeGradTensors> {
    let inp = check_inputs(backend, x, w_router, w1, w3, w2, Some(dy), cfg)?;
    let MoeDims { t, d, f, e } = inp.dims;
    let bf16 = x.dtype() == DType::BF16;
    if let Some(s) = &saved {
        if s.dims != inp.dims || s.cfg != cfg || s.bf16 != bf16 {
            return Err(Error::Invalid(format!(
                "moe_backward_saved: the saved forward state is of {:?} / {:?} (bf16 operands: \
                 {}), the call of {:?} / {cfg:?} with {} inputs",
                s.dims,
                s.cfg,
                s.bf16,
                inp.dims,
                x.dtype()
            )));
        }
        let on_cpu = matches!(backend, Backend::Cpu);
        if on_cpu != matches!(s.state, SavedState::Cpu(_)) {
            return Err(Error::Invalid(format!(
                "moe_backward_saved: the saved forward state was made on another device than \
                 {}; run the forward and the backward on the same device",
                backend.device()
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
        let recomputed;
        let state: &ForwardState = match saved.map(|s| &s.state) {
            Some(SavedState::Cpu(state)) => state,
            _ => {
                recomputed = forward_state(&xs, &wr, &w1s, &w3s, &w2s, inp.dims, cfg, None, bf16);
                &recomputed
            }
        };
        let g = backward_with_state(state, &xs, &wr, &w1s, &w3s, &w2s, &dys, inp.dims, cfg);
        return Ok(MoeGradTensors {
            dx: Tensor::from_f32_vec(backend, &[t, d], g.dx)?,
            dw_router: Tensor::from_f32_vec(backend, &[e, d], g.dw_router)?,
            dw1: Tensor::from_f32_vec(backend, &[e, f, d], g.dw1)?,
            dw3: Tensor::from_f32_vec(backend, &[e, f, d], g.dw3)?,
            dw2: Tensor::from_f32_vec(backend, &[e, d, f], g.dw2)?,
        });
    }
    let recomputed;
    let (w, state) = match saved.map(|s| &s.state) {
        Some(SavedState::Device(saved)) => (
            Widened::from_saved(&inp, saved.x32.as_ref(), saved.wr32.as_ref()),
            &saved.fwd,
        ),
        _ => {
            let w = Widened::new(backend, &inp)?;
            recomputed = device_forward(backend, &w, inp.dims, cfg)?;
            (w, &recomputed)
        }
    };
    let dyw = widen(backend, dy)?;
    let dy = dyw.as_ref().unwrap_or(dy);
    device_backward(backend, &w, state, dy, inp.dims, cfg)
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
