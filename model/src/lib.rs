//! sluice-model: the Mixture-of-Experts transformer that sluice trains.
//!
//! The model itself (config, parameter arena, forward/backward, checkpoints) arrives with the
//! model issue; until then this crate only fixes the place of the model in the dependency chain
//! kernels <- model <- runtime <- trainer (DESIGN.md section 1).

pub use sluice_kernels as kernels;
