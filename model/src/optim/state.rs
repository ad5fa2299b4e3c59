//! The optimizer state: two f32 arenas of the parameters' layout and the step count.
//!
//! - `m`: the first moment of every view: Muon's momentum on Muon views, AdamW's m on AdamW
//!   views (one arena, because each view has exactly one optimizer);
//! - `v`: AdamW's second moment (its Muon-view windows are unused and stay zero in memory);
//! - `step`: the number of steps taken (AdamW's bias correction and the schedule use it).
//!
//! Checkpoints: [`OptimState::save`] writes the parameters plus the groups `optim_m` and
//! `optim_v` (tensors `optim_m.<view>`, `optim_v.<view>`) and the step count as the header
//! entry `sluice.meta.optim_step` (a decimal string) through [`checkpoint::save_with_meta`];
//! [`OptimState::load`] reads all of it back, all or nothing.

use crate::arena::Arena;
use crate::checkpoint;
use crate::config::ModelConfig;
use crate::layout::Layout;
use sluice_kernels::{Backend, DType, Error, Result};
use std::path::Path;
use std::sync::Arc;

/// Checkpoint group of the first-moment arena.
pub const M_PREFIX: &str = "optim_m";
/// Checkpoint group of the second-moment arena.
pub const V_PREFIX: &str = "optim_v";
/// Checkpoint metadata key of the step count.
pub const STEP_KEY: &str = "optim_step";

/// Optimizer state (see the module doc).
#[derive(Debug)]
pub struct OptimState {
    pub m: Arena,
    pub v: Arena,
    pub step: u64,
}

impl OptimState {
    /// Zero state (step 0) for `layout` on `backend`.
    pub fn new(backend: &Backend, layout: Arc<Layout>) -> Result<OptimState> {
        Ok(OptimState {
            m: Arena::zeros(backend, layout.clone(), DType::F32)?,
            v: Arena::zeros(backend, layout, DType::F32)?,
            step: 0,
        })
    }

    pub fn layout(&self) -> &Arc<Layout> {
        self.m.layout()
    }

    /// Clears the state: moments to zero, step count to 0 (as if freshly made).
    pub fn reset(&mut self, backend: &Backend) -> Result<()> {
        self.m.fill_zero(backend)?;
        self.v.fill_zero(backend)?;
        self.step = 0;
        Ok(())
    }

    /// Saves the parameters and this state to a checkpoint (see the module doc).
    pub fn save(&self, path: &Path, config: &ModelConfig, params: &Arena) -> Result<()> {
        checkpoint::save_with_meta(
            path,
            config,
            params,
            &[(M_PREFIX, &self.m), (V_PREFIX, &self.v)],
            &[(STEP_KEY, self.step.to_string())],
        )
    }

    /// Loads parameters and state from a checkpoint written by [`OptimState::save`], all or
    /// nothing: on any error `params` and `self` are unchanged. Returns the checkpoint's config.
    pub fn load(
        &mut self,
        path: &Path,
        backend: &Backend,
        config: &ModelConfig,
        params: &mut Arena,
    ) -> Result<ModelConfig> {
        let layout = self.layout().clone();
        if **params.layout() != *layout {
            return Err(Error::param(
                "params",
                "the parameter arena's layout is not the optimizer state's layout",
            ));
        }
        // Everything is read into fresh host arenas first, so a failure leaves params and the
        // state as they were; then copied to `backend`.
        let cpu = Backend::Cpu;
        let mut new_params = Arena::zeros(&cpu, layout.clone(), DType::F32)?;
        let mut m = Arena::zeros(&cpu, layout.clone(), DType::F32)?;
        let mut v = Arena::zeros(&cpu, layout.clone(), DType::F32)?;
        let (loaded_config, meta) = checkpoint::load_with_meta(
            path,
            &cpu,
            config,
            &mut new_params,
            &mut [(M_PREFIX, &mut m), (V_PREFIX, &mut v)],
        )?;
        let key = format!("{}{STEP_KEY}", checkpoint::META_PREFIX);
        let step = match meta.get(STEP_KEY) {
            Some(text) => text.parse::<u64>().map_err(|_| Error::Io {
                path: path.display().to_string(),
                message: format!("metadata `{key}` is `{text}`, not a step count"),
            })?,
            None => {
                return Err(Error::Io {
                    path: path.display().to_string(),
                    message: format!(
                        "metadata `{key}` is missing: the checkpoint holds no optimizer step count"
                    ),
                })
            }
        };
        let m_dev = m.cast_copy(backend, DType::F32)?;
        let v_dev = v.cast_copy(backend, DType::F32)?;
        params.copy_from(backend, &new_params)?;
        self.m = m_dev;
        self.v = v_dev;
        self.step = step;
        Ok(loaded_config)
    }
}
