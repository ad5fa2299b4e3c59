//! The `sluice` command's subcommands, as a library so tests can call them directly.

pub mod bench_cmd;
pub mod emu_cmd;
pub mod kernel_cmd;
pub mod sft_cmd;
