//! sluice-runtime: the RL system (rollout engine, data buffer, learner, weight sync).
//!
//! The runtime arrives with the rollout-engine issue; until then this crate only fixes its place
//! in the dependency chain kernels <- model <- runtime <- trainer (DESIGN.md section 1).

pub use sluice_model as model;
