//! sluice-runtime: the RL system (rollout engine, data buffer, learner, weight sync).
//!
//! What exists so far (docs/runtime.md): the trajectory schema and its validator
//! ([`trajectory`]), the paged KV block manager ([`kv_blocks`]), the session router
//! ([`router`]) and the rollout engine with its replicas ([`engine`]). The data buffer, the
//! learner and weight sync arrive with their issues. The crate's place in the dependency chain is kernels <- model <- runtime <- trainer
//! (DESIGN.md section 1).

pub mod advantage;
pub mod buffer;
pub mod clock;
pub mod distill;
pub mod engine;
pub mod env;
pub mod eval;
pub mod hash;
pub mod health;
pub mod kv_blocks;
pub mod learner;
pub mod metrics;
pub mod mismatch;
pub mod orchestrator;
pub mod regularize;
pub mod remote;
pub mod router;
pub mod scoring;
pub mod sync;
pub mod system;
pub mod trajectory;

pub use sluice_model as model;
