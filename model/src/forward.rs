//! The forward, the losses and the hand-written backward of the whole model, on any device
//! (docs/model.md, "Forward and backward").
//!
//! The pieces are [`crate::layers`]' tensor functions, which call the kernels crate's device
//! entry points: the CPU references on `cpu`, the CUDA kernels on `cuda`, and the same CUDA
//! kernels under the emulator on `emu`. This file uploads the batch, copies the parameters out
//! of the arena once per call, chains embedding, layers and head, computes the loss with the
//! is_gate_loss op, runs the backward layer by layer in reverse, and writes each gradient into
//! its view of the gradient arena.
//!
//! Precision: the forward and backward read the model's compute weights
//! ([`Model::compute_weights`]): the f32 parameters, or in bf16 the bf16 compute copy, whose
//! dtype makes every GEMM bf16 (the rounding points of [`crate::layers`]). Gradients are
//! always f32 and go to the f32 gradient arena, for the f32 master weights.
//!
//! Each function comes in two forms: `*_on(backend, ...)` runs on the given backend (the one
//! the model's arenas live on), and the plain form picks the backend from the arena's storage
//! (`cpu` for host memory, `emu` with the schedule seed of `SLUICE_EMU_SEED` for emulator
//! memory; a CUDA arena needs the `*_on` form, since a CUDA backend is opened once and shared).

use crate::arena::Arena;
use crate::batch::PackedBatch;
use crate::config::ModelConfig;
use crate::layers::{
    embed, embed_backward, head, head_backward, layer, layer_backward, BatchTensors, Dims,
    LayerSaved, ModelWeights,
};
use crate::Model;
use sluice_kernels::ops::is_gate_loss::{
    is_gate_loss, GateMode, GateOutputs, GateParams, GateReference, TokenBatch, TokenInputs,
};
use sluice_kernels::{nvtx, Backend, Device, Error, Result, Tensor};

/// The backend that matches an arena's storage: `cpu` for host memory, `emu` (seed from
/// `SLUICE_EMU_SEED`) for the emulator's memory. CUDA backends are not reopened per call.
fn backend_of(arena: &Arena) -> Result<Backend> {
    match arena.tensor().device_kind() {
        "cpu" => Ok(Backend::Cpu),
        "emu" => Backend::open(Device::Emu),
        other => Err(Error::Device(format!(
            "the model's arenas live on {other}: call the `*_on` form of the forward functions \
             (e.g. forward::loss_and_grad_on) with the backend they were made on"
        ))),
    }
}

/// Everything the backward needs from the forward.
struct Forward {
    batch: BatchTensors,
    layers: Vec<LayerSaved>,
    x_final: Tensor,
    hf: Tensor,
    logits: Tensor,
}

fn forward_all(
    backend: &Backend,
    dims: &Dims,
    w: &ModelWeights,
    batch: &PackedBatch,
) -> Result<Forward> {
    if let Some(&bad) = batch
        .tokens()
        .iter()
        .find(|&&x| x < 0 || x as usize >= dims.vocab)
    {
        return Err(Error::Invalid(format!(
            "token id {bad} is outside the model's vocabulary 0..{}",
            dims.vocab
        )));
    }
    let bt = BatchTensors::upload(backend, batch)?;
    let mut x = embed(backend, &w.embed, &bt.tokens)?;
    let mut layers = Vec::with_capacity(w.layers.len());
    for lw in &w.layers {
        let _stage = nvtx::range_on(backend, "layer");
        let (saved, next) = layer(backend, dims, lw, x, &bt)?;
        layers.push(saved);
        x = next;
    }
    let (hf, logits) = head(backend, dims, &w.final_norm, &w.lm_head, &x)?;
    Ok(Forward {
        batch: bt,
        layers,
        x_final: x,
        hf,
        logits,
    })
}

/// The logits `[T, vocab]` of a packed batch, downloaded.
pub fn logits_on(backend: &Backend, model: &Model, batch: &PackedBatch) -> Result<Vec<f32>> {
    let dims = Dims::new(&model.config)?;
    let w = ModelWeights::from_arena(backend, model.compute_weights())?;
    forward_all(backend, &dims, &w, batch)?
        .logits
        .to_vec::<f32>()
}

/// [`logits_on`] on the backend of the model's arena.
pub fn logits(model: &Model, batch: &PackedBatch) -> Result<Vec<f32>> {
    logits_on(&backend_of(&model.params)?, model, batch)
}

/// The per-token inputs of the supervised loss as the is_gate_loss op takes them: `pg` mode
/// with advantage 1 and no behavior dependence is -mean over masked tokens of log p(target).
struct Uploaded {
    tokens: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Option<Tensor>,
    ref_logp: Option<Tensor>,
}

impl Uploaded {
    fn new(backend: &Backend, inputs: &TokenInputs<'_>) -> Result<Uploaded> {
        let up = |name: &str, v: &[f32]| {
            Tensor::from_slice(backend, &[v.len()], v)
                .map_err(|e| Error::Invalid(format!("`{name}`: {e}")))
        };
        Ok(Uploaded {
            tokens: Tensor::from_slice(backend, &[inputs.tokens.len()], inputs.tokens)?,
            behavior_logp: up("behavior_logp", inputs.behavior_logp)?,
            advantages: up("advantages", inputs.advantages)?,
            mask: up("mask", inputs.mask)?,
            weight: inputs.weight.map(|w| up("weight", w)).transpose()?,
            ref_logp: inputs.ref_logp.map(|r| up("ref_logp", r)).transpose()?,
        })
    }

    fn batch(&self) -> TokenBatch<'_> {
        TokenBatch {
            tokens: &self.tokens,
            behavior_logp: &self.behavior_logp,
            advantages: &self.advantages,
            mask: &self.mask,
            weight: self.weight.as_ref(),
            ref_logp: self.ref_logp.as_ref(),
        }
    }
}

/// The is_gate_loss objective over the logits: its outputs and d loss / d logits.
fn gate_objective(
    backend: &Backend,
    logits: &Tensor,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<(GateOutputs, Tensor)> {
    // The ids checked here, on the host copy, so the op need not read them back.
    sluice_kernels::ops::is_gate_loss::check_tokens(
        inputs.tokens,
        logits.shape().get(1).copied().unwrap_or(0),
    )?;
    let up = Uploaded::new(backend, inputs)?;
    is_gate_loss(backend, logits, &up.batch(), params)
}

/// The supervised loss: the mean over tokens with `mask != 0` of -log p(targets[t]) (the
/// is_gate_loss row routine in `pg` mode with advantage 1) as a `[1]` tensor, and d loss /
/// d logits.
fn lm_loss(
    backend: &Backend,
    logits: &Tensor,
    targets: &[i32],
    mask: &[f32],
) -> Result<(Tensor, Tensor)> {
    let t = logits.shape()[0];
    if targets.len() != t || mask.len() != t {
        return Err(Error::Invalid(format!(
            "targets ({}) and mask ({}) must have one entry per token of the batch ({t})",
            targets.len(),
            mask.len(),
        )));
    }
    let zeros = vec![0.0f32; t];
    let ones = vec![1.0f32; t];
    let inputs = TokenInputs {
        tokens: targets,
        behavior_logp: &zeros,
        advantages: &ones,
        mask,
        weight: None,
        ref_logp: None,
    };
    let params = GateParams {
        mode: GateMode::Pg,
        ..GateParams::default()
    };
    let (out, dlogits) = gate_objective(backend, logits, &inputs, &params)?;
    Ok((out.loss, dlogits))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn first_f32(bytes: &[u8]) -> Result<f32> {
    f32s(bytes)
        .first()
        .copied()
        .ok_or_else(|| Error::Invalid("internal: an empty loss tensor".into()))
}

/// The single value of a `[1]` tensor.
fn scalar(t: &Tensor) -> Result<f32> {
    t.to_vec::<f32>()?
        .first()
        .copied()
        .ok_or_else(|| Error::Invalid("internal: an empty loss tensor".into()))
}

/// The supervised loss of a batch (forward only, on the model's compute weights).
pub fn loss_on(
    backend: &Backend,
    model: &Model,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    let w = model.compute_weights();
    loss_of_on(backend, &model.config, w, batch, targets, mask)
}

/// [`loss_on`] on the backend of the model's arena.
pub fn loss(model: &Model, batch: &PackedBatch, targets: &[i32], mask: &[f32]) -> Result<f32> {
    loss_on(&backend_of(&model.params)?, model, batch, targets, mask)
}

/// The supervised loss of a batch for a config and a parameter arena (forward only; a BF16
/// arena computes in bf16).
pub fn loss_of_on(
    backend: &Backend,
    cfg: &ModelConfig,
    params: &Arena,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    let dims = Dims::new(cfg)?;
    let w = ModelWeights::from_arena(backend, params)?;
    let fwd = forward_all(backend, &dims, &w, batch)?;
    scalar(&lm_loss(backend, &fwd.logits, targets, mask)?.0)
}

/// [`loss_of_on`] on the backend of the arena.
pub fn loss_of(
    cfg: &ModelConfig,
    params: &Arena,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    loss_of_on(&backend_of(params)?, cfg, params, batch, targets, mask)
}

/// Forward, supervised loss and backward of one batch: returns the loss and OVERWRITES
/// `model.grads` with d loss / d params (every view; padding zero).
///
/// `targets[t]` is the token to predict at position t (usually the next token of the same
/// sequence) and `mask[t]` (0 or 1) says whether position t is in the loss.
pub fn loss_and_grad_on(
    backend: &Backend,
    model: &mut Model,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    let dims = Dims::new(&model.config)?;
    let w = ModelWeights::from_arena(backend, model.compute_weights())?;
    let fwd = {
        let _stage = nvtx::range_on(backend, "forward");
        forward_all(backend, &dims, &w, batch)?
    };
    let (loss, dlogits) = {
        let _stage = nvtx::range_on(backend, "loss");
        lm_loss(backend, &fwd.logits, targets, mask)?
    };
    // The step's first host sync (the optimizer's gradient norm is the second).
    let loss = Tensor::download_many(&[&loss])?;
    let _stage = nvtx::range_on(backend, "backward");
    backward(backend, &dims, &w, fwd, &dlogits, &mut model.grads)?;
    first_f32(&loss[0])
}

/// [`loss_and_grad_on`] on the backend of the model's arenas.
pub fn loss_and_grad(
    model: &mut Model,
    batch: &PackedBatch,
    targets: &[i32],
    mask: &[f32],
) -> Result<f32> {
    let backend = backend_of(&model.params)?;
    loss_and_grad_on(&backend, model, batch, targets, mask)
}

/// Forward, the is_gate_loss policy objective (DESIGN 3.6: `dis`, `icepop`, `ppo` or `pg` per
/// `params`) and backward of one batch: returns the loss, per-token log-probs, ratios, accepted
/// flags and counters (downloaded), and OVERWRITES `model.grads` with d loss / d params.
/// `inputs.tokens[t]` is the sampled token whose log-prob position t's logits give.
pub fn policy_loss_and_grad_on(
    backend: &Backend,
    model: &mut Model,
    batch: &PackedBatch,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<GateReference> {
    let dims = Dims::new(&model.config)?;
    let w = ModelWeights::from_arena(backend, model.compute_weights())?;
    let fwd = {
        let _stage = nvtx::range_on(backend, "forward");
        forward_all(backend, &dims, &w, batch)?
    };
    let (out, dlogits) = {
        let _stage = nvtx::range_on(backend, "is_gate_loss");
        gate_objective(backend, &fwd.logits, inputs, params)?
    };
    // The step's first host sync (the optimizer's gradient norm is the second).
    let mut wanted = vec![
        &out.loss,
        &out.counters,
        &out.logp,
        &out.ratio,
        &out.accepted,
    ];
    wanted.extend(out.entropy.as_ref());
    let got = Tensor::download_many(&wanted)?;
    drop(out);
    {
        let _stage = nvtx::range_on(backend, "backward");
        backward(backend, &dims, &w, fwd, &dlogits, &mut model.grads)?;
    }
    let counters = f32s(&got[1]);
    Ok(GateReference {
        loss: first_f32(&got[0])?,
        logp: f32s(&got[2]),
        ratio: f32s(&got[3]),
        accepted: got[4].clone(),
        entropy: got.get(5).map(|b| f32s(b)).unwrap_or_default(),
        counters: counters.try_into().map_err(|c: Vec<f32>| {
            Error::Invalid(format!("internal: {} loss counters, expected 8", c.len()))
        })?,
    })
}

/// The log-probs of `targets` under a parameter arena, forward only (a frozen reference
/// policy's, issue 28's KL): the forward and the is_gate_loss row routine at `temperature` with
/// every token out of the loss, so the same kernels and the same reduction as a training pass
/// (equal weights give the learner's logp bit for bit). Its gradient output is discarded.
pub fn token_logps_of_on(
    backend: &Backend,
    cfg: &ModelConfig,
    params: &Arena,
    batch: &PackedBatch,
    targets: &[i32],
    temperature: f32,
) -> Result<Vec<f32>> {
    let dims = Dims::new(cfg)?;
    let w = ModelWeights::from_arena(backend, params)?;
    let fwd = forward_all(backend, &dims, &w, batch)?;
    let zeros = vec![0.0f32; targets.len()];
    let inputs = TokenInputs {
        tokens: targets,
        behavior_logp: &zeros,
        advantages: &zeros,
        mask: &zeros,
        weight: None,
        ref_logp: None,
    };
    let params = GateParams {
        mode: GateMode::Pg,
        temperature,
        ..GateParams::default()
    };
    let (out, _) = gate_objective(backend, &fwd.logits, &inputs, &params)?;
    out.logp.to_vec::<f32>()
}

/// [`policy_loss_and_grad_on`] on the backend of the model's arenas.
pub fn policy_loss_and_grad(
    model: &mut Model,
    batch: &PackedBatch,
    inputs: &TokenInputs<'_>,
    params: &GateParams,
) -> Result<GateReference> {
    let backend = backend_of(&model.params)?;
    policy_loss_and_grad_on(&backend, model, batch, inputs, params)
}

/// The backward from d loss / d logits, layer by layer in reverse, into `grads` (zeroed first,
/// then every view written once: no view has more than one gradient contribution to add, as
/// nothing is tied; the embedding and the LM head are separate views).
fn backward(
    backend: &Backend,
    dims: &Dims,
    w: &ModelWeights,
    fwd: Forward,
    dlogits: &Tensor,
    grads: &mut Arena,
) -> Result<()> {
    let Forward {
        batch,
        layers,
        x_final,
        hf,
        ..
    } = fwd;
    let (mut dx, dfinal, dlm) = head_backward(
        backend,
        dims,
        &w.final_norm,
        &w.lm_head,
        &x_final,
        &hf,
        dlogits,
    )?;
    drop((x_final, hf));
    let mut layer_grads = Vec::with_capacity(layers.len());
    for (lw, saved) in w.layers.iter().zip(layers).rev() {
        let _stage = nvtx::range_on(backend, "layer_backward");
        let (dx_in, g) = layer_backward(backend, dims, lw, saved, dx, &batch)?;
        layer_grads.push(g);
        dx = dx_in;
    }
    layer_grads.reverse();
    let g = ModelWeights {
        embed: embed_backward(backend, dims, &dx, &batch.host_tokens)?,
        layers: layer_grads,
        final_norm: dfinal,
        lm_head: dlm,
    };
    grads.fill_zero(backend)?;
    g.write_to(grads)
}
