//! The optimizers (DESIGN.md sections 3.7 and 5): Muon for the matrix views, AdamW for the rest,
//! over the parameter arena, on any device.
//!
//! - [`Optimizer`]: the hyperparameters ([`OptimConfig`]) and the tables built once from the
//!   [`Layout`]: AdamW's segment table (one segment per AdamW view, with its weight decay) and
//!   Muon's block groups (every head / expert / whole-matrix block of the Muon views, grouped by
//!   block shape, so each shape is one batched Newton-Schulz);
//! - [`OptimState`] ([`state`]): the first-moment arena `m` (Muon's momentum on Muon views,
//!   AdamW's m on AdamW views), the second-moment arena `v` (AdamW views) and the step count,
//!   saved and loaded with checkpoints;
//! - [`clip`]: the global gradient norm (fixed-order reduction) and the clipping factor;
//! - [`muon`] and [`adamw`]: the two updates, each a handful of fused launches over the arena on
//!   emu/cuda and the CPU references over slices on cpu.
//!
//! One step ([`Optimizer::step`]): global norm of the gradient arena -> clip factor -> AdamW (one
//! launch over every AdamW element) -> for each Muon block shape: momentum + gather (one launch),
//! Newton-Schulz (one batched call), scaled apply with decoupled weight decay (one launch) ->
//! optionally the bf16 compute copy refreshed (one launch). Everything is f32 (master weights and
//! state); only the compute copy is bf16, and, on `cuda` by default
//! ([`MuonConfig::ns_precision`]), Newton-Schulz's GEMM operands.

pub mod adamw;
pub mod clip;
pub mod muon;
pub mod state;

pub use state::OptimState;

use crate::arena::Arena;
use crate::layout::Layout;
pub use sluice_kernels::ops::newton_schulz::NsPrecision;
use sluice_kernels::ops::newton_schulz::MAX_STEPS;
use sluice_kernels::ops::optim::SegmentTable;
use sluice_kernels::{Backend, DType, Device, Error, Result};
use std::sync::Arc;

/// Muon's hyperparameters (DESIGN.md section 3.7).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonConfig {
    /// Learning rate (before the schedule). The update is scaled by 0.2 sqrt(max(rows, cols))
    /// per block, which matches AdamW's update RMS, so the same rate as AdamW is a good start.
    pub lr: f32,
    /// Momentum mu (0.95).
    pub momentum: f32,
    /// Nesterov momentum (true): the orthogonalised input is g + mu m instead of m.
    pub nesterov: bool,
    /// Decoupled weight decay (0.1): p <- p (1 - lr wd) before the update.
    pub weight_decay: f32,
    /// Newton-Schulz steps (5).
    pub ns_steps: usize,
    /// The precision of Newton-Schulz's products. `None` (the default) picks per device:
    /// [`NsPrecision::Bf16`] on `cuda` (bf16 operands on the tensor cores, f32 accumulation,
    /// X kept in f32 between steps; about 4x the f32 path's error, which Muon's update
    /// tolerates), [`NsPrecision::F32`] on `cpu` and `emu` (where bf16 buys no speed).
    /// `Some(p)` forces `p` on every device.
    pub ns_precision: Option<NsPrecision>,
}

impl MuonConfig {
    /// The Newton-Schulz precision a step on `backend` uses (see [`MuonConfig::ns_precision`]).
    pub fn ns_precision_on(&self, backend: &Backend) -> NsPrecision {
        self.ns_precision
            .unwrap_or_else(|| NsPrecision::default_for(backend))
    }
}

/// AdamW's hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay on the AdamW matrices (embedding, LM head, router): 0.1.
    pub weight_decay: f32,
    /// Whether 1-D views (norm scales, biases) are decayed too (false: decaying a norm scale
    /// pulls it towards zero, which only fights the normalisation).
    pub decay_vectors: bool,
}

/// The learning-rate schedule: a factor on both optimizers' rates as a function of the step
/// number t = 1, 2, ... (the step being taken).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    Constant,
    /// Linear warmup from lr/warmup to lr over `warmup` steps, then a cosine down to
    /// `min_ratio * lr` at step `total` (and `min_ratio * lr` after).
    WarmupCosine {
        warmup: u64,
        total: u64,
        min_ratio: f32,
    },
}

impl LrSchedule {
    /// The factor at step `t` (1-based).
    pub fn factor(&self, t: u64) -> f32 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::WarmupCosine {
                warmup,
                total,
                min_ratio,
            } => {
                if warmup > 0 && t <= warmup {
                    return t as f32 / warmup as f32;
                }
                let span = total.saturating_sub(warmup).max(1);
                let progress = (t.saturating_sub(warmup) as f64 / span as f64).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (min_ratio as f64 + (1.0 - min_ratio as f64) * cos) as f32
            }
        }
    }

    fn validate(&self) -> Result<()> {
        if let LrSchedule::WarmupCosine {
            warmup,
            total,
            min_ratio,
        } = *self
        {
            if total == 0 || warmup > total {
                return Err(Error::param(
                    "schedule",
                    format!(
                        "warmup {warmup} and total {total}: need 0 <= warmup <= total, total > 0"
                    ),
                ));
            }
            if !(0.0..=1.0).contains(&min_ratio) {
                return Err(Error::param(
                    "schedule.min_ratio",
                    format!("{min_ratio} is outside [0, 1]"),
                ));
            }
        }
        Ok(())
    }
}

/// Everything the optimizer step needs besides the arenas.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimConfig {
    pub muon: MuonConfig,
    pub adamw: AdamWConfig,
    /// Clip the gradient to this global L2 norm (None: no clipping; the norm is still computed
    /// and reported, and a non-finite norm still stops the step).
    pub clip_norm: Option<f32>,
    pub schedule: LrSchedule,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            muon: MuonConfig {
                lr: 3e-3,
                momentum: 0.95,
                nesterov: true,
                weight_decay: 0.1,
                ns_steps: 5,
                ns_precision: None,
            },
            adamw: AdamWConfig {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                decay_vectors: false,
            },
            clip_norm: Some(1.0),
            schedule: LrSchedule::Constant,
        }
    }
}

impl OptimConfig {
    /// The defaults with these learning rates and schedule (what a training run usually sets).
    pub fn with_lrs(muon_lr: f32, adamw_lr: f32, schedule: LrSchedule) -> OptimConfig {
        let mut c = OptimConfig::default();
        c.muon.lr = muon_lr;
        c.adamw.lr = adamw_lr;
        c.schedule = schedule;
        c
    }
}

fn check_nonneg(name: &str, v: f32) -> Result<()> {
    if !v.is_finite() || v < 0.0 {
        return Err(Error::param(
            name,
            format!("{v} must be a finite number >= 0"),
        ));
    }
    Ok(())
}

fn check_unit(name: &str, v: f32) -> Result<()> {
    if !(0.0..1.0).contains(&v) {
        return Err(Error::param(name, format!("{v} is outside [0, 1)")));
    }
    Ok(())
}

impl OptimConfig {
    /// Checks every value; the error names the parameter (`muon.lr`, `adamw.beta2`, ...).
    pub fn validate(&self) -> Result<()> {
        let m = &self.muon;
        check_nonneg("muon.lr", m.lr)?;
        check_unit("muon.momentum", m.momentum)?;
        check_nonneg("muon.weight_decay", m.weight_decay)?;
        if m.ns_steps == 0 || m.ns_steps > MAX_STEPS {
            return Err(Error::param(
                "muon.ns_steps",
                format!("{} is outside 1..={MAX_STEPS}", m.ns_steps),
            ));
        }
        let a = &self.adamw;
        check_nonneg("adamw.lr", a.lr)?;
        check_unit("adamw.beta1", a.beta1)?;
        check_unit("adamw.beta2", a.beta2)?;
        if !a.eps.is_finite() || a.eps <= 0.0 {
            return Err(Error::param("adamw.eps", format!("{} must be > 0", a.eps)));
        }
        check_nonneg("adamw.weight_decay", a.weight_decay)?;
        if let Some(c) = self.clip_norm {
            if !c.is_finite() || c <= 0.0 {
                return Err(Error::param(
                    "clip_norm",
                    format!("{c} must be a finite number > 0 (or None for no clipping)"),
                ));
            }
        }
        self.schedule.validate()
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The step number just taken (1 for the first).
    pub step: u64,
    /// The global L2 norm of the gradient arena, before clipping.
    pub grad_norm: f64,
    /// The factor the gradients were multiplied by (1 when not clipped).
    pub clip_scale: f32,
    /// The learning-rate factor used (schedule times any caller factor).
    pub lr_factor: f32,
}

/// Muon and AdamW over one [`Layout`]'s arenas, with the tables built for one device.
pub struct Optimizer {
    config: OptimConfig,
    /// The device the tables were built for; every step must run there.
    device: Device,
    layout: Arc<Layout>,
    adamw: SegmentTable,
    muon: Vec<muon::MuonGroup>,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Optimizer({:?}, {} AdamW elements, {} Muon block shapes)",
            self.config,
            self.adamw.total(),
            self.muon.len()
        )
    }
}

impl Optimizer {
    /// Validates `config` and builds the tables of `layout` on `backend`.
    pub fn new(backend: &Backend, layout: Arc<Layout>, config: OptimConfig) -> Result<Optimizer> {
        config.validate()?;
        let adamw = adamw::segment_table(backend, &layout, &config.adamw)?;
        let muon = muon::groups(backend, &layout)?;
        Ok(Optimizer {
            config,
            device: backend.device(),
            layout,
            adamw,
            muon,
        })
    }

    pub fn config(&self) -> &OptimConfig {
        &self.config
    }

    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The Muon block groups: `(rows, cols, number of blocks)` per block shape, in the order the
    /// step runs them.
    pub fn muon_shapes(&self) -> Vec<(usize, usize, usize)> {
        self.muon
            .iter()
            .map(|g| (g.rows, g.cols, g.table.blocks().len()))
            .collect()
    }

    /// Fresh (zero) state for this optimizer's layout on `backend`.
    pub fn new_state(&self, backend: &Backend) -> Result<OptimState> {
        OptimState::new(backend, self.layout.clone())
    }

    /// One step with the schedule's learning-rate factor. See [`Optimizer::step_scaled`].
    pub fn step(
        &self,
        backend: &Backend,
        params: &mut Arena,
        grads: &Arena,
        state: &mut OptimState,
        compute_copy: Option<&mut Arena>,
    ) -> Result<StepStats> {
        self.step_scaled(backend, params, grads, state, compute_copy, 1.0)
    }

    /// One step, the learning rates multiplied by the schedule's factor and `lr_factor` (the
    /// schedule hook for a caller that drives its own schedule: use [`LrSchedule::Constant`]
    /// and pass the factor here). Updates `params` (f32 master weights) and `state` in place
    /// from `grads`; when `compute_copy` is given (a BF16 arena of the same layout, the CUDA
    /// compute copy), it is refreshed from the new parameters.
    ///
    /// Every input is checked before anything changes: a mismatched layout, a wrong dtype, an
    /// arena on another device, a bad `lr_factor` or a non-finite gradient norm is an `Err`
    /// and leaves parameters and state as they were.
    pub fn step_scaled(
        &self,
        backend: &Backend,
        params: &mut Arena,
        grads: &Arena,
        state: &mut OptimState,
        compute_copy: Option<&mut Arena>,
        lr_factor: f32,
    ) -> Result<StepStats> {
        let _stage = sluice_kernels::nvtx::range_on(backend, "optimizer");
        check_nonneg("lr_factor", lr_factor)?;
        let device = backend.device();
        if device != self.device {
            return Err(Error::param(
                "backend",
                format!(
                    "the optimizer's tables were built for {}, but the step runs on {device}; \
                     build the optimizer on the device it steps on",
                    self.device
                ),
            ));
        }
        let mut arenas: Vec<(&str, &Arena, DType)> = vec![
            ("params", &*params, DType::F32),
            ("grads", grads, DType::F32),
            ("state.m", &state.m, DType::F32),
            ("state.v", &state.v, DType::F32),
        ];
        if let Some(c) = compute_copy.as_deref() {
            arenas.push(("compute_copy", c, DType::BF16));
        }
        for (name, arena, dtype) in arenas {
            if **arena.layout() != *self.layout {
                return Err(Error::param(
                    name,
                    "the arena's layout is not the optimizer's layout (a different model)",
                ));
            }
            arena.tensor().expect_dtype(name, dtype)?;
            if !arena.tensor().is_on(device) {
                return Err(Error::param(
                    name,
                    format!(
                        "the arena lives on {}, not on the step's device {device}",
                        arena.tensor().device_kind()
                    ),
                ));
            }
        }
        let t = state
            .step
            .checked_add(1)
            .ok_or_else(|| Error::param("state.step", "the step count would overflow"))?;
        let lr = self.config.schedule.factor(t) * lr_factor;
        check_nonneg("lr_factor", lr)?;

        let grad_norm = clip::global_norm(backend, grads)?;
        if !grad_norm.is_finite() {
            return Err(Error::param(
                "grads",
                format!(
                    "the global gradient norm is {grad_norm}: a NaN or infinite gradient; the \
                     step was not taken (parameters and optimizer state unchanged)"
                ),
            ));
        }
        let clip_scale = clip::clip_scale(grad_norm, self.config.clip_norm);

        adamw::step(
            backend,
            &self.adamw,
            &self.config.adamw,
            params,
            grads,
            state,
            t,
            lr,
            clip_scale,
        )?;
        muon::step(
            backend,
            &self.muon,
            &self.config.muon,
            params,
            grads,
            state,
            lr,
            clip_scale,
        )?;
        state.step = t;
        if let Some(c) = compute_copy {
            sluice_kernels::ops::optim::cast_bf16_into(backend, params.tensor(), c.tensor_mut())?;
        }
        Ok(StepStats {
            step: t,
            grad_norm,
            clip_scale,
            lr_factor: lr,
        })
    }
}
