//! The optimizer state: two f32 arenas of the parameters' layout and the step count.
//!
//! - `m`: the first moment of every view: Muon's momentum on Muon views, AdamW's m on AdamW
//!   views (one arena, because each view has exactly one optimizer);
//! - `v`: AdamW's second moment (its Muon-view windows are unused and stay zero in memory);
//! - `step`: the number of steps taken (AdamW's bias correction and the schedule use it).
//!
//! Checkpoints: [`OptimState::save`] writes the parameters plus the groups `optim_m` and
//! `optim_v` (tensors `optim_m.<view>`, `optim_v.<view>`) through
//! [`checkpoint::save_with_extra`]. The checkpoint format has no slot for a scalar, so the step
//! count travels in the unused `v` window of the first Muon view: its elements 0 and 1 hold
//! `step mod 2^24` and `step / 2^24` as exactly representable f32 integers (so any step below
//! 2^48 round-trips exactly). [`OptimState::load`] reads them back and zeroes the two elements
//! again, so a loaded state is bit-identical to the saved one.

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
const STEP_RADIX: u64 = 1 << 24;

/// Optimizer state (see the module doc).
#[derive(Debug)]
pub struct OptimState {
    pub m: Arena,
    pub v: Arena,
    pub step: u64,
}

/// The arena index of the two step-count elements: the first Muon view's first two elements.
fn step_slot(layout: &Layout) -> Result<usize> {
    layout
        .views()
        .iter()
        .find(|v| v.class.is_muon() && v.numel() >= 2)
        .map(|v| v.offset)
        .ok_or_else(|| {
            Error::Invalid(
                "optimizer state: the model has no Muon view with 2 elements to hold the step \
                 count in a checkpoint"
                    .into(),
            )
        })
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
        let slot = step_slot(self.layout())?;
        if self.step >= STEP_RADIX * STEP_RADIX {
            return Err(Error::param(
                "state.step",
                format!("{} steps cannot be stored (at most 2^48)", self.step),
            ));
        }
        // A host copy of v with the step count in its unused slot; save downloads anyway.
        let mut v = self.v.to_vec()?;
        v[slot] = (self.step % STEP_RADIX) as f32;
        v[slot + 1] = (self.step / STEP_RADIX) as f32;
        let v = Arena::from_f32(&Backend::Cpu, self.layout().clone(), &v)?;
        checkpoint::save_with_extra(path, config, params, &[(M_PREFIX, &self.m), (V_PREFIX, &v)])
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
        let slot = step_slot(&layout)?;
        // Everything is read into fresh host arenas first, so a failure leaves params and the
        // state as they were; then copied to `backend`.
        let cpu = Backend::Cpu;
        let mut new_params = Arena::zeros(&cpu, layout.clone(), DType::F32)?;
        let mut m = Arena::zeros(&cpu, layout.clone(), DType::F32)?;
        let mut v = Arena::zeros(&cpu, layout.clone(), DType::F32)?;
        let loaded_config = checkpoint::load_with_extra(
            path,
            &cpu,
            config,
            &mut new_params,
            &mut [(M_PREFIX, &mut m), (V_PREFIX, &mut v)],
        )?;
        let host = v.as_mut_slice()?;
        let (lo, hi) = (host[slot], host[slot + 1]);
        let valid =
            |x: f32| x.is_finite() && x >= 0.0 && x.fract() == 0.0 && (x as u64) < STEP_RADIX;
        if !valid(lo) || !valid(hi) {
            return Err(Error::Io {
                path: path.display().to_string(),
                message: format!(
                    "tensor `{V_PREFIX}.{}`: elements 0 and 1 hold {lo} and {hi}, not a step count",
                    layout
                        .views()
                        .iter()
                        .find(|v| v.offset == slot)
                        .map(|v| v.name.as_str())
                        .unwrap_or("?")
                ),
            });
        }
        let step = hi as u64 * STEP_RADIX + lo as u64;
        host[slot] = 0.0;
        host[slot + 1] = 0.0;
        let m_dev = m.cast_copy(backend, DType::F32)?;
        let v_dev = v.cast_copy(backend, DType::F32)?;
        params.copy_from(backend, &new_params)?;
        self.m = m_dev;
        self.v = v_dev;
        self.step = step;
        Ok(loaded_config)
    }
}
