//! `is_gate_loss`: the fused importance-sampling-gate policy loss over logits[N,V]
//! (DESIGN.md 3.6): the shared row log-sum-exp ([`super::row_reduce`]), the sampled token's
//! log-prob, the ratio `rho = exp(logp - behavior_logp)`, the gate, the loss, d loss / d logits
//! (to a separate buffer or in place over the logits) and the audit counters, without
//! materialising probabilities. CUDA: `kernels/cuda/is_gate_loss.cu`.
//!
//! Definitions (all f32; the device computes the same expressions in the same order):
//! - `m_t` = mask[t] (F32, or U8 converted to 0/1), `c_t` = weight[t] (default 1). A token is
//!   *masked* (in the loss) when `m_t != 0`. Its loss factor is `k_t = m_t * c_t`.
//! - `D = sum_t k_t` (fixed order). The loss is the weighted token mean
//!   `L = (1/D) sum_t term_t`; with no weight input `D` is the number of masked tokens
//!   (DESIGN's `D = sum m`). Per-token weights `c_t = 1/|sequence|` make `L` the sequence mean,
//!   `c_t = 1/|prompt group tokens|` the prompt mean. `D <= 0` (e.g. every token unmasked) gives
//!   `L = 0` and a zero gradient, never NaN. Weights must be finite and non-negative.
//! - `logp_t = logits[t, token_t] - lse_t` (-inf when the row is all -inf),
//!   `rho_t = exp(logp_t - behavior_logp_t)`.
//! - Clip bounds: `(eps_low, eps_high)` for a token whose advantage is >= 0, and
//!   [`GateParams::eps_neg`] (default the same pair) for one whose advantage is < 0: the four
//!   bounds of MiMo's recipe; `dis`'s gate and `ppo`'s clamp below use the token's pair.
//! - `dis`: inside = `1 - eps_low < rho < 1 + eps_high` (open); `term = -k * rho * A * logp`
//!   (rho a stop-gradient weight); d term / d logp = `-k * rho * A`. Gated low: `rho <= 1 -
//!   eps_low`; high: `rho >= 1 + eps_high`.
//! - `icepop`: inside = `1/beta <= rho <= beta` (closed); inside tokens use the PPO surrogate
//!   below, outside tokens contribute 0 to the loss and the gradient. Gated low: `rho < 1/beta`,
//!   high: `rho > beta`.
//! - `ppo`: `s1 = rho * A`, `s2 = clamp(rho, 1 - eps_low, 1 + eps_high) * A`,
//!   `term = -k * min(s1, s2)`; the gradient flows through rho where the unclipped branch is
//!   the minimum (`s1 <= s2`, ties included): d term / d logp = `-k * A * rho`, else 0.
//! - `pg`: `term = -k * A * logp`, d term / d logp = `-k * A`.
//! - Gated-out and unmasked tokens contribute exactly 0 (no `0 * inf`). A masked token whose
//!   logit is -inf has logp = -inf and rho = 0: `dis` and `icepop` gate it low, `ppo` clips it
//!   to a finite term with zero gradient, and `pg` adds 0 to the loss value for it (-A log 0 is
//!   infinite, and two of opposite signs would make the loss NaN) while keeping its finite
//!   gradient. The loss is never NaN for finite advantages, weights and behavior log-probs.
//! - `dlogits[t, j] = coef_t * ([j == token_t] - exp(logits[t, j] - lse_t))`,
//!   `coef_t = (d term_t / d logp_t) / D`; `coef_t = 0` when D <= 0 and in a row whose logits
//!   are all -inf (no mass: its gradient is 0 in every mode).
//!   dlogits has the logits' dtype (F32 or BF16, rounded to nearest even).
//! - Regularizers (issue 28 item 7), on every masked token whatever its gate, with the same
//!   factor k: **KL to a reference** ([`GateParams::kl`], per-token `ref_logp`):
//!   `term += kl_coef * k * kl_t`, `d term / d logp += kl_coef * k * dkl_t`, with
//!   k1: `kl = logp - ref`, `dkl = 1`; k3: `kl = e^(ref - logp) - 1 - (ref - logp)`,
//!   `dkl = 1 - e^(ref - logp)` (a token with logp or ref -inf adds 0). **Entropy**
//!   ([`GateParams::entropy`]): `H_t = -sum_j p_j log p_j` from one more online sum of the lse
//!   pass ([`super::row_reduce::EntState`]), output per row; with coefficient c != 0,
//!   `term -= c * k * H_t` and `dlogits[t, j] += (c k / D) * scale * p_j (log p_j + H_t)`
//!   (d H / d z_j = -p_j (log p_j + H)).
//! - `accepted[t]` = masked and inside the hard gate (`ppo`, `pg`: every masked token).
//! - Counters (F32[8], this order): 0 masked tokens, 1 accepted tokens, 2 ratio mean, 3 ratio
//!   min, 4 ratio max (over masked tokens; 0, 0, 0 when none), 5 gated low, 6 gated high,
//!   7 mean over masked tokens of (behavior_logp - logp) (0 when none).
//!
//! Reductions over N (D, the loss, the counters) use [`ROW_LANES`] lanes (lane l takes rows
//! l, l + 256, ... in order) and the fixed tree of [`lane_tree`]; the device runs the same
//! order in one block of a second and third tiny kernel. No atomics anywhere.

use super::row_reduce::{
    entropy_grad_row, exp_fast, lane_tree, row_ent_state, row_logprob, row_lse, softmax_grad_row,
    Logit, ROW_LANES,
};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;
use rayon::prelude::*;

mod terms;
pub use terms::*;

/// The sums of the finishing reduction (one per lane, then the fixed tree).
#[derive(Clone, Copy, Debug)]
struct Partial {
    term: f32,
    masked: f32,
    accepted: f32,
    ratio_sum: f32,
    ratio_min: f32,
    ratio_max: f32,
    low: f32,
    high: f32,
    diff: f32,
}

impl Partial {
    const ZERO: Partial = Partial {
        term: 0.0,
        masked: 0.0,
        accepted: 0.0,
        ratio_sum: 0.0,
        ratio_min: f32::INFINITY,
        ratio_max: f32::NEG_INFINITY,
        low: 0.0,
        high: 0.0,
        diff: 0.0,
    };
    fn combine(a: Partial, b: Partial) -> Partial {
        Partial {
            term: a.term + b.term,
            masked: a.masked + b.masked,
            accepted: a.accepted + b.accepted,
            ratio_sum: a.ratio_sum + b.ratio_sum,
            ratio_min: a.ratio_min.min(b.ratio_min),
            ratio_max: a.ratio_max.max(b.ratio_max),
            low: a.low + b.low,
            high: a.high + b.high,
            diff: a.diff + b.diff,
        }
    }
}

/// `D = sum_t mask[t] * weight[t]` in the fixed lane order.
pub fn denominator(mask: &[f32], weight: Option<&[f32]>) -> f32 {
    let mut lanes = [0.0f32; ROW_LANES];
    for (t, &m) in mask.iter().enumerate() {
        let c = weight.map_or(1.0, |w| w[t]);
        lanes[t % ROW_LANES] += m * c;
    }
    lane_tree(&mut lanes, |a, b| a + b)
}

/// Everything the loss returns except the gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct GateReference {
    pub loss: f32,
    pub logp: Vec<f32>,
    pub ratio: Vec<f32>,
    pub accepted: Vec<u8>,
    pub counters: [f32; 8],
    /// Each row's softmax entropy (empty unless [`GateParams::entropy`] is set).
    pub entropy: Vec<f32>,
}

/// The per-token inputs of the CPU reference.
#[derive(Clone, Copy, Debug)]
pub struct TokenInputs<'a> {
    pub tokens: &'a [i32],
    pub behavior_logp: &'a [f32],
    pub advantages: &'a [f32],
    pub mask: &'a [f32],
    pub weight: Option<&'a [f32]>,
    /// The reference policy's log-probs of the tokens (needed with [`GateParams::kl`]).
    pub ref_logp: Option<&'a [f32]>,
}

fn check_len(name: &str, len: usize, n: usize) -> Result<()> {
    if len != n {
        return Err(Error::shape(
            name,
            format!("[N] with N = {n} (the rows of logits)"),
            &[len],
        ));
    }
    Ok(())
}

/// Checks token ids against the vocabulary V (the error names `tokens`, the row and the id):
/// what [`is_gate_loss`] runs on the host copy, and what a caller with the ids in host memory
/// runs before uploading them.
pub fn check_tokens(tokens: &[i32], v: usize) -> Result<()> {
    if let Some((t, &tok)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &x)| x < 0 || x as usize >= v)
    {
        return Err(Error::Invalid(format!(
            "tensor `tokens`: row {t} holds {tok}, outside the vocabulary [0, {v})"
        )));
    }
    Ok(())
}

/// The CPU reference: `logits` is [n, v] row-major; writes d loss / d logits to `dlogits`
/// (same shape and dtype) and returns the rest.
pub fn is_gate_loss_reference<T: Logit>(
    logits: &[T],
    n: usize,
    v: usize,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
    dlogits: &mut [T],
) -> Result<GateReference> {
    if logits.len() != n * v {
        return Err(Error::shape(
            "logits",
            format!("[{n},{v}] (N x V elements)"),
            &[logits.len()],
        ));
    }
    reference_impl(Some(logits), dlogits, n, v, inputs, params)
}

/// The CPU reference in place: overwrites `logits` ([n, v]) with d loss / d logits.
pub fn is_gate_loss_reference_in_place<T: Logit>(
    logits: &mut [T],
    n: usize,
    v: usize,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<GateReference> {
    reference_impl(None, logits, n, v, inputs, params)
}

/// The reference over rows read from `src`, or from `grad` itself when `src` is None.
fn reference_impl<T: Logit>(
    src: Option<&[T]>,
    grad: &mut [T],
    n: usize,
    v: usize,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<GateReference> {
    params.validate()?;
    if n == 0 || v == 0 || grad.len() != n * v {
        return Err(Error::shape(
            if src.is_some() { "dlogits" } else { "logits" },
            format!("[N,V] = [{n},{v}] with N >= 1 and V >= 1"),
            &[grad.len()],
        ));
    }
    check_len("tokens", inputs.tokens.len(), n)?;
    check_len("behavior_logp", inputs.behavior_logp.len(), n)?;
    check_len("advantages", inputs.advantages.len(), n)?;
    check_len("mask", inputs.mask.len(), n)?;
    if let Some(w) = inputs.weight {
        check_len("weight", w.len(), n)?;
    }
    match (params.kl, inputs.ref_logp) {
        (Some(_), Some(r)) => check_len("ref_logp", r.len(), n)?,
        (Some(_), None) => return Err(missing_ref_logp()),
        _ => {}
    }
    check_tokens(inputs.tokens, v)?;

    let d = denominator(inputs.mask, inputs.weight);
    let scale = params.scale();
    let bonus = params.entropy.filter(|&c| c != 0.0);
    // One row per task: lse pass, token math, gradient pass (two reads of the row, one write).
    let work = |t: usize, row: Option<&[T]>, grad: &mut [T]| -> (f32, TokenTerm, f32) {
        let tok = inputs.tokens[t] as usize;
        // z = logits * scale, the sampler's scaled logits (scale 1: z = logits, same bits).
        // With the entropy, its sum rides along the lse pass (same lse bits).
        let (lse, h, z_tok) = {
            let r = row.unwrap_or(grad);
            let (lse, h) = match params.entropy {
                None => (row_lse(r, scale), 0.0),
                Some(_) => {
                    let st = row_ent_state(r, scale);
                    (st.lse_state().lse(), st.entropy())
                }
            };
            (lse, h, r[tok].to_f32() * scale)
        };
        let logp = row_logprob(z_tok, lse);
        let c = inputs.weight.map_or(1.0, |w| w[t]);
        let mut tt = token_term(
            params,
            logp,
            inputs.behavior_logp[t],
            inputs.advantages[t],
            inputs.mask[t],
            c,
        );
        let k = inputs.mask[t] * c;
        if let (Some(kl), Some(r)) = (params.kl, inputs.ref_logp) {
            // The regularizers act on every masked token, whatever the gate decided.
            if k != 0.0 {
                let (est, dest) = kl_estimate(kl.estimator, logp, r[t]);
                let w = kl.coef * k;
                tt.term += w * est;
                tt.dterm += w * dest;
            }
        }
        if let Some(ec) = bonus {
            if k != 0.0 {
                tt.term += -((ec * k) * h);
            }
        }
        let live = lse != f32::NEG_INFINITY;
        // A row with no mass (all -inf) has no softmax to move: zero gradient in every mode.
        // d z / d logits = scale, folded into the coefficient (exact at scale 1).
        let coef = if d > 0.0 && live {
            (tt.dterm / d) * scale
        } else {
            0.0
        };
        if let (Some(ec), true) = (bonus, live) {
            let ecoef = if d > 0.0 { ((ec * k) / d) * scale } else { 0.0 };
            entropy_grad_row(row, grad, coef, ecoef, lse, h, scale);
            let lz = z_tok - lse;
            let p = exp_fast(lz);
            grad[tok] = T::from_f32(coef * (1.0 - p) + (ecoef * p) * (lz + h));
        } else if live {
            softmax_grad_row(row, grad, coef, lse, scale);
            grad[tok] = T::from_f32(coef * (1.0 - exp_fast(z_tok - lse)));
        } else {
            // No mass: softmax is taken as 0.
            for g in grad.iter_mut() {
                *g = T::from_f32(coef * 0.0);
            }
            grad[tok] = T::from_f32(coef);
        }
        (logp, tt, h)
    };
    let rows: Vec<(f32, TokenTerm, f32)> = match src {
        Some(logits) => logits
            .par_chunks(v)
            .zip(grad.par_chunks_mut(v))
            .enumerate()
            .map(|(t, (row, g))| work(t, Some(row), g))
            .collect(),
        None => grad
            .par_chunks_mut(v)
            .enumerate()
            .map(|(t, g)| work(t, None, g))
            .collect(),
    };

    let mut lanes = [Partial::ZERO; ROW_LANES];
    for (t, (logp, tt, _)) in rows.iter().enumerate() {
        let lane = &mut lanes[t % ROW_LANES];
        lane.term += tt.term;
        if inputs.mask[t] != 0.0 {
            lane.masked += 1.0;
            lane.accepted += if tt.accepted { 1.0 } else { 0.0 };
            lane.ratio_sum += tt.rho;
            lane.ratio_min = lane.ratio_min.min(tt.rho);
            lane.ratio_max = lane.ratio_max.max(tt.rho);
            lane.low += if tt.gate == Gate::Low { 1.0 } else { 0.0 };
            lane.high += if tt.gate == Gate::High { 1.0 } else { 0.0 };
            lane.diff += inputs.behavior_logp[t] - logp;
        }
    }
    let total = lane_tree(&mut lanes, Partial::combine);
    let any = total.masked > 0.0;
    let counters = [
        total.masked,
        total.accepted,
        if any {
            total.ratio_sum / total.masked
        } else {
            0.0
        },
        if any { total.ratio_min } else { 0.0 },
        if any { total.ratio_max } else { 0.0 },
        total.low,
        total.high,
        if any { total.diff / total.masked } else { 0.0 },
    ];
    Ok(GateReference {
        loss: if d > 0.0 { total.term / d } else { 0.0 },
        logp: rows.iter().map(|r| r.0).collect(),
        ratio: rows.iter().map(|r| r.1.rho).collect(),
        accepted: rows.iter().map(|r| r.1.accepted as u8).collect(),
        counters,
        entropy: match params.entropy {
            Some(_) => rows.iter().map(|r| r.2).collect(),
            None => Vec::new(),
        },
    })
}

/// The per-token tensors of the device entry point (all [N] on the launch's backend).
#[derive(Clone, Copy, Debug)]
pub struct TokenBatch<'a> {
    /// I32 token ids in [0, V).
    pub tokens: &'a Tensor,
    /// F32 log-probs under the behavior (rollout) policy.
    pub behavior_logp: &'a Tensor,
    /// F32 advantages.
    pub advantages: &'a Tensor,
    /// F32 (any value; non-zero = in the loss) or U8 (0/1, converted to F32).
    pub mask: &'a Tensor,
    /// Optional F32 per-token weight (default 1).
    pub weight: Option<&'a Tensor>,
    /// F32 log-probs under the reference policy (needed with [`GateParams::kl`]).
    pub ref_logp: Option<&'a Tensor>,
}

/// The loss's outputs on the backend.
#[derive(Debug)]
pub struct GateOutputs {
    /// F32[1].
    pub loss: Tensor,
    /// F32[N].
    pub logp: Tensor,
    /// F32[N].
    pub ratio: Tensor,
    /// U8[N].
    pub accepted: Tensor,
    /// F32[8], in the order of the module comment.
    pub counters: Tensor,
    /// F32[N], each row's softmax entropy (with [`GateParams::entropy`]).
    pub entropy: Option<Tensor>,
}

fn missing_ref_logp() -> Error {
    Error::Invalid(
        "tensor `ref_logp`: the KL term (kl) needs the reference policy's log-probs".into(),
    )
}

/// Validates the inputs; returns (N, V) and the mask as F32 (converted from U8 if needed).
fn validate(
    backend: &Backend,
    logits: &Tensor,
    batch: &TokenBatch<'_>,
    params: &GateParams,
) -> Result<(usize, usize, Option<Tensor>)> {
    params.validate()?;
    logits.expect_rank("logits", 2, "[N,V]")?;
    if !logits.dtype().is_float() {
        return Err(Error::DType {
            tensor: "logits".into(),
            expected: "F32 or BF16".into(),
            got: logits.dtype().to_string(),
        });
    }
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    if n == 0 || v == 0 || n > i32::MAX as usize || v > i32::MAX as usize {
        return Err(Error::shape(
            "logits",
            "[N,V] with 1 <= N, V < 2^31",
            logits.shape(),
        ));
    }
    let vec_n = |name: &str, t: &Tensor, dtypes: &[DType]| -> Result<()> {
        if t.shape() != [n] {
            return Err(Error::shape(
                name,
                format!("[N] with N = {n} (the rows of logits)"),
                t.shape(),
            ));
        }
        if !dtypes.contains(&t.dtype()) {
            let names: Vec<_> = dtypes.iter().map(|d| d.name()).collect();
            return Err(Error::DType {
                tensor: name.into(),
                expected: names.join(" or "),
                got: t.dtype().to_string(),
            });
        }
        Ok(())
    };
    vec_n("tokens", batch.tokens, &[DType::I32])?;
    vec_n("behavior_logp", batch.behavior_logp, &[DType::F32])?;
    vec_n("advantages", batch.advantages, &[DType::F32])?;
    vec_n("mask", batch.mask, &[DType::F32, DType::U8])?;
    if let Some(w) = batch.weight {
        vec_n("weight", w, &[DType::F32])?;
    }
    match (params.kl, batch.ref_logp) {
        (Some(_), Some(r)) => vec_n("ref_logp", r, &[DType::F32])?,
        (Some(_), None) => return Err(missing_ref_logp()),
        _ => {}
    }
    for t in [
        batch.tokens,
        batch.behavior_logp,
        batch.advantages,
        batch.mask,
    ]
    .into_iter()
    .chain(batch.weight)
    .chain(batch.ref_logp)
    {
        if !t.is_on(backend.device()) {
            return Err(Error::Invalid(format!(
                "an input of is_gate_loss lives on {}, not on {}",
                t.device_kind(),
                backend.device()
            )));
        }
    }
    // Token ids index the logits: checked here (N * 4 bytes) rather than read out of bounds,
    // where they are in host memory and, on a device, in debug mode (a copy and a sync);
    // otherwise the caller checked its host copy (the model's `gate_objective`, with
    // [`check_tokens`]).
    if crate::debug::reads_back(batch.tokens) {
        check_tokens(&batch.tokens.to_vec::<i32>()?, v)?;
    }
    let mask_f32 = if batch.mask.dtype() == DType::U8 {
        let m: Vec<f32> = batch
            .mask
            .to_vec::<u8>()?
            .iter()
            .map(|&b| if b != 0 { 1.0 } else { 0.0 })
            .collect();
        Some(Tensor::from_slice(backend, &[n], &m)?)
    } else {
        None
    };
    Ok((n, v, mask_f32))
}

/// Runs the loss; returns the outputs and d loss / d logits (a new tensor, logits' dtype).
pub fn is_gate_loss(
    backend: &Backend,
    logits: &Tensor,
    batch: &TokenBatch<'_>,
    params: &GateParams,
) -> Result<(GateOutputs, Tensor)> {
    let (n, v, mask_f32) = validate(backend, logits, batch, params)?;
    let mask = mask_f32.as_ref().unwrap_or(batch.mask);
    // The CPU reference writes every element; zeros (lazily mapped pages) spare it the extra
    // pass of filling a poison pattern. Device outputs are poisoned.
    let mut dlogits = match backend {
        Backend::Cpu => Tensor::zeros(backend, &[n, v], logits.dtype())?,
        _ => Tensor::poisoned(backend, &[n, v], logits.dtype())?,
    };
    let out = match backend {
        Backend::Cpu => cpu_run(logits, &mut dlogits, batch, mask, params, n, v)?,
        _ => device_run(backend, logits, &dlogits, batch, mask, params, n, v)?,
    };
    Ok((out, dlogits))
}

/// Runs the loss writing d loss / d logits over the logits themselves (no second [N,V] buffer).
pub fn is_gate_loss_in_place(
    backend: &Backend,
    logits: &mut Tensor,
    batch: &TokenBatch<'_>,
    params: &GateParams,
) -> Result<GateOutputs> {
    let (n, v, mask_f32) = validate(backend, logits, batch, params)?;
    let mask = mask_f32.as_ref().unwrap_or(batch.mask);
    match backend {
        Backend::Cpu => cpu_run_in_place(logits, batch, mask, params, n, v),
        // The kernel's gradient pass reads each logit before the same thread overwrites it, and
        // starts after the lse pass has finished (a block barrier), so in place is safe.
        _ => device_run(backend, logits, logits, batch, mask, params, n, v),
    }
}

#[allow(clippy::too_many_arguments)]
fn cpu_run(
    logits: &Tensor,
    dlogits: &mut Tensor,
    batch: &TokenBatch<'_>,
    mask: &Tensor,
    params: &GateParams,
    n: usize,
    v: usize,
) -> Result<GateOutputs> {
    let tokens = batch.tokens.host_slice::<i32>()?;
    let inputs = TokenInputs {
        tokens,
        behavior_logp: batch.behavior_logp.host_slice::<f32>()?,
        advantages: batch.advantages.host_slice::<f32>()?,
        mask: mask.host_slice::<f32>()?,
        weight: match batch.weight {
            Some(w) => Some(w.host_slice::<f32>()?),
            None => None,
        },
        ref_logp: match batch.ref_logp {
            Some(r) if params.kl.is_some() => Some(r.host_slice::<f32>()?),
            _ => None,
        },
    };
    let r = match logits.dtype() {
        DType::F32 => is_gate_loss_reference(
            logits.host_slice::<f32>()?,
            n,
            v,
            &inputs,
            params,
            dlogits.host_slice_mut::<f32>()?,
        )?,
        _ => is_gate_loss_reference(
            logits.host_slice::<bf16>()?,
            n,
            v,
            &inputs,
            params,
            dlogits.host_slice_mut::<bf16>()?,
        )?,
    };
    outputs_of(&r, n)
}

fn cpu_run_in_place(
    logits: &mut Tensor,
    batch: &TokenBatch<'_>,
    mask: &Tensor,
    params: &GateParams,
    n: usize,
    v: usize,
) -> Result<GateOutputs> {
    let inputs = TokenInputs {
        tokens: batch.tokens.host_slice::<i32>()?,
        behavior_logp: batch.behavior_logp.host_slice::<f32>()?,
        advantages: batch.advantages.host_slice::<f32>()?,
        mask: mask.host_slice::<f32>()?,
        weight: match batch.weight {
            Some(w) => Some(w.host_slice::<f32>()?),
            None => None,
        },
        ref_logp: match batch.ref_logp {
            Some(r) if params.kl.is_some() => Some(r.host_slice::<f32>()?),
            _ => None,
        },
    };
    let r = match logits.dtype() {
        DType::F32 => {
            is_gate_loss_reference_in_place(logits.host_slice_mut::<f32>()?, n, v, &inputs, params)?
        }
        _ => is_gate_loss_reference_in_place(
            logits.host_slice_mut::<bf16>()?,
            n,
            v,
            &inputs,
            params,
        )?,
    };
    outputs_of(&r, n)
}

fn outputs_of(r: &GateReference, n: usize) -> Result<GateOutputs> {
    let b = &Backend::Cpu;
    Ok(GateOutputs {
        loss: Tensor::from_slice(b, &[1], &[r.loss])?,
        logp: Tensor::from_slice(b, &[n], &r.logp)?,
        ratio: Tensor::from_slice(b, &[n], &r.ratio)?,
        accepted: Tensor::from_slice(b, &[n], &r.accepted)?,
        counters: Tensor::from_slice(b, &[8], &r.counters)?,
        entropy: if r.entropy.is_empty() {
            None
        } else {
            Some(Tensor::from_slice(b, &[n], &r.entropy)?)
        },
    })
}

/// Threads per block of every is_gate_loss kernel (the lanes of the fixed order).
const THREADS: u32 = ROW_LANES as u32;

#[allow(clippy::too_many_arguments)]
fn device_run(
    backend: &Backend,
    logits: &Tensor,
    dlogits: &Tensor,
    batch: &TokenBatch<'_>,
    mask: &Tensor,
    params: &GateParams,
    n: usize,
    v: usize,
) -> Result<GateOutputs> {
    let logp = Tensor::poisoned(backend, &[n], DType::F32)?;
    let ratio = Tensor::poisoned(backend, &[n], DType::F32)?;
    let accepted = Tensor::poisoned(backend, &[n], DType::U8)?;
    let loss = Tensor::poisoned(backend, &[1], DType::F32)?;
    let counters = Tensor::poisoned(backend, &[8], DType::F32)?;
    // Per-row loss terms [0, N) and D at [N]: the per-block partials of the deterministic
    // reduction (no atomics: the finishing kernel sums them in a fixed order).
    let scratch = Tensor::poisoned(backend, &[n + 1], DType::F32)?;
    let (weight, has_weight) = match batch.weight {
        Some(w) => (w, 1),
        None => (mask, 0),
    };
    let (n32, v32) = (n as i32, v as i32);
    backend.launch(
        &Launch::new("is_gate_loss_denom", [1, 1, 1], [THREADS, 1, 1])
            .arg_tensor(mask)
            .arg_tensor(weight)
            .arg_i32(has_weight)
            .arg_tensor(&scratch)
            .arg_i32(n32),
    )?;
    let kernel = match (params.entropy, logits.dtype()) {
        (None, DType::F32) => "is_gate_loss_f32",
        (None, _) => "is_gate_loss_bf16",
        (Some(c), DType::F32) if c != 0.0 => "is_gate_loss_bonus_f32",
        (Some(c), _) if c != 0.0 => "is_gate_loss_bonus_bf16",
        (Some(_), DType::F32) => "is_gate_loss_entropy_f32",
        (Some(_), _) => "is_gate_loss_entropy_bf16",
    };
    let entropy = match params.entropy {
        Some(_) => Some(Tensor::poisoned(backend, &[n], DType::F32)?),
        None => None,
    };
    // Unused pointers get a valid tensor (the kernel never reads `ref_logp` with kl off, nor
    // writes `entropy` without the entropy variant).
    let ref_logp = match params.kl {
        Some(_) => batch.ref_logp.ok_or_else(missing_ref_logp)?,
        None => batch.behavior_logp,
    };
    let (kl_mode, kl_coef) = params.kl.map_or((0, 0.0), |k| (k.estimator.code(), k.coef));
    backend.launch(
        &Launch::new(kernel, [n as u32, 1, 1], [THREADS, 1, 1])
            .arg_tensor(logits)
            .arg_tensor(dlogits)
            .arg_tensor(batch.tokens)
            .arg_tensor(batch.behavior_logp)
            .arg_tensor(batch.advantages)
            .arg_tensor(mask)
            .arg_tensor(weight)
            .arg_i32(has_weight)
            .arg_tensor(&logp)
            .arg_tensor(&ratio)
            .arg_tensor(&accepted)
            .arg_tensor(&scratch)
            .arg_i32(n32)
            .arg_i32(v32)
            .arg_i32(params.mode.code())
            .arg_f32(params.eps_low)
            .arg_f32(params.eps_high)
            .arg_f32(params.neg_pair().0)
            .arg_f32(params.neg_pair().1)
            .arg_f32(params.beta)
            .arg_f32(params.scale())
            .arg_tensor(ref_logp)
            .arg_i32(kl_mode)
            .arg_f32(kl_coef)
            .arg_f32(params.entropy.unwrap_or(0.0))
            .arg_tensor(entropy.as_ref().unwrap_or(&logp)),
    )?;
    backend.launch(
        &Launch::new("is_gate_loss_finish", [1, 1, 1], [THREADS, 1, 1])
            .arg_tensor(mask)
            .arg_tensor(batch.behavior_logp)
            .arg_tensor(batch.advantages)
            .arg_tensor(&logp)
            .arg_tensor(&ratio)
            .arg_tensor(&accepted)
            .arg_tensor(&scratch)
            .arg_i32(n32)
            .arg_i32(params.mode.code())
            .arg_f32(params.eps_low)
            .arg_f32(params.eps_high)
            .arg_f32(params.neg_pair().0)
            .arg_f32(params.neg_pair().1)
            .arg_f32(params.beta)
            .arg_tensor(&loss)
            .arg_tensor(&counters),
    )?;
    Ok(GateOutputs {
        loss,
        logp,
        ratio,
        accepted,
        counters,
        entropy,
    })
}

fn run_spec(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let params = GateParams {
        mode: GateMode::parse(call.param("mode")?)?,
        eps_low: call.param_f32("eps_low")?,
        eps_high: call.param_f32("eps_high")?,
        eps_neg: match (call.param("eps_low_neg")?, call.param("eps_high_neg")?) {
            ("same", "same") => None,
            _ => Some((
                call.param_f32("eps_low_neg")?,
                call.param_f32("eps_high_neg")?,
            )),
        },
        beta: call.param_f32("beta")?,
        temperature: call.param_f32("temperature")?,
        entropy: match call.param("entropy_coef")? {
            "off" => None,
            _ => Some(call.param_f32("entropy_coef")?),
        },
        kl: match call.param("kl_estimator")? {
            "off" => None,
            est => Some(KlPenalty {
                estimator: KlEstimator::parse(est)?,
                coef: call.param_f32("kl_coef")?,
            }),
        },
    };
    let batch = TokenBatch {
        tokens: call.tensor("tokens")?,
        behavior_logp: call.tensor("behavior_logp")?,
        advantages: call.tensor("advantages")?,
        mask: call.tensor("mask")?,
        weight: call.optional_tensor("weight"),
        ref_logp: call.optional_tensor("ref_logp"),
    };
    let (out, dlogits) = is_gate_loss(backend, call.tensor("logits")?, &batch, &params)?;
    let mut outputs = vec![
        ("loss", out.loss),
        ("dlogits", dlogits),
        ("logp", out.logp),
        ("ratio", out.ratio),
        ("accepted", out.accepted),
        ("counters", out.counters),
    ];
    if let Some(e) = out.entropy {
        outputs.push(("entropy", e));
    }
    Ok(outputs)
}

/// The `sluice kernel is_gate_loss` row (DESIGN.md section 7).
pub static SPEC: OpSpec = OpSpec {
    name: "is_gate_loss",
    summary: "fused IS-gate policy loss (modes dis|icepop|ppo|pg); loss = sum(term)/D, D = sum(mask*weight); \
              dlogits in the logits' dtype; counters = [masked, accepted, ratio_mean, ratio_min, ratio_max, \
              gated_low, gated_high, mean(behavior_logp - logp)]",
    inputs: &[
        TensorSpec { name: "logits", shape: "[N,V]", dtypes: "F32|BF16" },
        TensorSpec { name: "tokens", shape: "[N]", dtypes: "I32" },
        TensorSpec { name: "behavior_logp", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "advantages", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "mask", shape: "[N]", dtypes: "F32|U8" },
        TensorSpec { name: "weight", shape: "[N]", dtypes: "F32 (optional, default 1)" },
        TensorSpec { name: "ref_logp", shape: "[N]", dtypes: "F32 (optional; needed with kl_estimator)" },
    ],
    params: &[
        ParamSpec { name: "mode", default: Some("dis"), help: "dis | icepop | ppo | pg" },
        ParamSpec { name: "eps_low", default: Some("0.2"), help: "lower clip/gate epsilon" },
        ParamSpec { name: "eps_high", default: Some("0.28"), help: "upper clip/gate epsilon" },
        ParamSpec { name: "eps_low_neg", default: Some("same"), help: "lower epsilon for tokens with a negative advantage (same: eps_low; set both _neg params or neither)" },
        ParamSpec { name: "eps_high_neg", default: Some("same"), help: "upper epsilon for tokens with a negative advantage (same: eps_high)" },
        ParamSpec { name: "beta", default: Some("2"), help: "icepop gate [1/beta, beta]" },
        ParamSpec {
            name: "temperature",
            default: Some("1"),
            help: "the rollout's sampling temperature: logp under log_softmax(logits / temperature)",
        },
        ParamSpec { name: "entropy_coef", default: Some("off"), help: "off | c >= 0: output each row's entropy; c != 0 adds the bonus -c*mask*weight*H" },
        ParamSpec { name: "kl_estimator", default: Some("off"), help: "off | k1 | k3: KL to the reference log-probs ref_logp" },
        ParamSpec { name: "kl_coef", default: Some("0"), help: "the KL term's coefficient (with kl_estimator)" },
    ],
    outputs: &[
        TensorSpec { name: "loss", shape: "[1]", dtypes: "F32" },
        TensorSpec { name: "dlogits", shape: "[N,V]", dtypes: "F32|BF16 (the logits' dtype)" },
        TensorSpec { name: "logp", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "ratio", shape: "[N]", dtypes: "F32" },
        TensorSpec { name: "accepted", shape: "[N]", dtypes: "U8" },
        TensorSpec { name: "counters", shape: "[8]", dtypes: "F32" },
        TensorSpec { name: "entropy", shape: "[N]", dtypes: "F32 (with entropy_coef)" },
    ],
    run: run_spec,
};
