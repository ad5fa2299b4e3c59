//! The `sluice` command's subcommands, as a library so tests can call them directly.

pub mod kernel_cmd;
