//! sluice-model: the Mixture-of-Experts transformer that sluice trains (DESIGN.md section 5).
//!
//! - [`config`]: the architecture, read from TOML and validated key by key;
//! - [`layout`]: the table of named views (name, offset, shape, optimizer class, init rule);
//! - [`arena`]: one contiguous buffer holding every view (parameters, gradients, optimizer state,
//!   a bf16 compute copy);
//! - [`layers`]: the transformer's pieces (norm + q/k/v + RoPE, attention, output projection,
//!   dense/MoE/shared FFN, embedding, head) and their backward, as tensor functions on any device;
//! - [`forward`]: the whole model's forward, the losses and the hand-written backward, on any
//!   device (cpu, emu, cuda);
//! - [`infer`]: the inference forward over a paged KV cache (prefill, decode) on any device;
//! - [`gradcheck`]: finite-difference checks of a gradient arena, view by view;
//! - [`init`]: the seeded, documented initialisation;
//! - [`batch`]: packed variable-length batches (tokens, cu_seqlens, positions);
//! - [`checkpoint`]: safetensors checkpoints, validated on load and swapped in all or nothing;
//! - [`precision`]: f32 or bf16 mixed precision, and where bf16 rounds (the rounding points).
//!
//! docs/model.md describes the architecture, the config keys, the layout and the file format.

pub mod arena;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod forward;
pub mod gradcheck;
pub mod infer;
pub mod init;
pub mod layers;
pub mod layout;
pub mod optim;
pub mod precision;
pub mod synthetic;

pub use arena::Arena;
pub use batch::PackedBatch;
pub use config::{ModelConfig, ScoreFn};
pub use layout::{HeadAxis, Layout, OptimClass, OptimKind, ViewSpec};
pub use precision::Precision;
pub use sluice_kernels as kernels;

use sluice_kernels::{Backend, DType, Result};
use std::path::Path;
use std::sync::Arc;

/// A model: its config, the shared layout, the f32 parameters (the master weights), the f32
/// gradients, and in bf16 precision the bf16 compute copy the forward and backward read.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub params: Arena,
    pub grads: Arena,
    /// The bf16 compute copy of `params` when the model computes in bf16 ([`Precision::Bf16`]);
    /// None in f32, where `params` are the compute weights. Kept fresh by the optimizer step
    /// (pass `model.compute.as_mut()` as its compute copy) and by [`Model::load`]; after any
    /// other change to `params`, call [`Model::refresh_compute`].
    pub compute: Option<Arena>,
}

impl Model {
    /// A freshly initialised model (from `config.seed`) with zero gradients, on `backend`.
    pub fn new(config: ModelConfig, backend: &Backend) -> Result<Model> {
        config.validate()?;
        let layout = Arc::new(Layout::new(&config)?);
        let values = init::initial_values(&layout, config.seed, config.init_std);
        let params = Arena::from_f32(backend, layout.clone(), &values)?;
        let grads = Arena::zeros(backend, layout, DType::F32)?;
        Ok(Model {
            config,
            params,
            grads,
            compute: None,
        })
    }

    /// A model read from a checkpoint (its config from the file's metadata).
    pub fn from_checkpoint(path: &Path, backend: &Backend) -> Result<Model> {
        let (config, params) = checkpoint::load_new(path, backend)?;
        let grads = Arena::zeros(backend, params.layout().clone(), DType::F32)?;
        Ok(Model {
            config,
            params,
            grads,
            compute: None,
        })
    }

    /// The precision the model computes in: bf16 when it has a compute copy.
    pub fn precision(&self) -> Precision {
        match self.compute {
            Some(_) => Precision::Bf16,
            None => Precision::F32,
        }
    }

    /// Switches the precision: bf16 makes the compute copy (the parameters rounded to bf16,
    /// nearest even, by the `cast_bf16` op on `backend`), f32 drops it.
    pub fn set_precision(&mut self, backend: &Backend, precision: Precision) -> Result<()> {
        match precision {
            Precision::F32 => self.compute = None,
            Precision::Bf16 => {
                if self.compute.is_none() {
                    self.compute = Some(Arena::zeros(
                        backend,
                        self.params.layout().clone(),
                        DType::BF16,
                    )?);
                }
                self.refresh_compute(backend)?;
            }
        }
        Ok(())
    }

    /// Rounds the parameters into the compute copy again (nothing in f32).
    pub fn refresh_compute(&mut self, backend: &Backend) -> Result<()> {
        if let Some(c) = &mut self.compute {
            sluice_kernels::ops::optim::cast_bf16_into(
                backend,
                self.params.tensor(),
                c.tensor_mut(),
            )?;
        }
        Ok(())
    }

    /// The weights the forward and backward read: the bf16 compute copy, or the f32
    /// parameters.
    pub fn compute_weights(&self) -> &Arena {
        self.compute.as_ref().unwrap_or(&self.params)
    }

    pub fn layout(&self) -> &Arc<Layout> {
        self.params.layout()
    }

    /// Saves the parameters to a safetensors checkpoint.
    pub fn save(&self, path: &Path) -> Result<()> {
        checkpoint::save(path, &self.config, &self.params)
    }

    /// Loads parameters from a checkpoint of the same architecture; on error the model is
    /// unchanged. The model takes the checkpoint's config (its `seed`/`init_std` may differ),
    /// and a bf16 model's compute copy is refreshed.
    pub fn load(&mut self, path: &Path, backend: &Backend) -> Result<()> {
        let config = checkpoint::load_into(path, backend, &self.config, &mut self.params)?;
        self.config = config;
        self.refresh_compute(backend)
    }
}
