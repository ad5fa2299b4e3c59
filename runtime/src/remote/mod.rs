//! Rollout servers as replicas (`rollout.servers`, docs/runtime.md "Rollout servers"): the
//! scheduler drives a `sluice serve` process over HTTP with the same units of work it gives an
//! in-process replica.
//!
//! - [`unit`]: one unit of work on an engine (commands, then one step), shared by the
//!   in-process lane and the server's `/lane/step`, so both compute the same tokens.
//! - [`wire`]: the JSON of `/lane/join` and `/lane/step` (f32 as bit patterns).
//! - [`client`]: the trainer's side: join (a full sync), deliveries, units of work,
//!   heartbeats.

pub mod client;
pub mod unit;
pub mod wire;

pub use client::{ClientError, ServerClient};
