//! The `sluice` command's subcommands, as a library so tests can call them directly.

pub mod arms;
pub mod bench_cmd;
pub mod bench_serve;
pub mod bench_steps;
pub mod config;
pub mod delta_cmd;
pub mod determinism;
pub mod emu_cmd;
pub mod emu_profile_cmd;
pub mod eval_cmd;
pub mod experiment;
pub mod kernel_cmd;
pub mod progress;
pub mod report;
pub mod serve;
pub mod sft_cmd;
pub mod tasks;
pub mod tasks_cmd;
pub mod tokenizer_cmd;
pub mod train_cmd;
