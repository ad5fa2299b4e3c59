//! `sluice determinism run|probe|check|diff` (DESIGN 2 and 7; docs/determinism.md): digests
//! of every op and of whole training, decode and RL steps, compared across runs (separate
//! processes), thread counts, schedule seeds, machines and commits; invariance probes; golden
//! digests per numerics class that CI gates on.
//!
//! - [`record`]: the versioned JSON files and the digest scheme;
//! - [`class`]: the numerics class (what goldens are keyed by) and the machine;
//! - [`workloads`], [`op_cases`], [`rl_stage`]: what is computed and digested;
//! - [`procs`]: the separate processes (this binary re-run with the hidden `record`);
//! - [`compare`]: records against each other, with the first differing element from dumps;
//! - [`golden`]: `check` and `--bless`; [`diff`]: two records side by side;
//! - [`probes`]: the invariance probes;
//! - [`planted`]: the test-only faults (feature `planted-faults`).
//!
//! Exit codes: 0 when everything agrees, 1 when bits differ (or a probe fails, or a workload
//! fails to run), 2 for bad input (an unknown op or probe, a file of another format version,
//! truncated JSON), with one line naming it.

pub mod class;
pub mod compare;
pub mod diff;
pub mod golden;
pub mod op_cases;
pub mod planted;
pub mod probes;
pub mod procs;
pub mod record;
pub mod rl_stage;
pub mod workloads;

use clap::{Args, Subcommand};
use sluice_kernels::Device;
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use workloads::Preset;

/// What went wrong, and the exit code it gives.
#[derive(Debug)]
pub enum DetError {
    /// The user's input: a flag, an op or probe name, a file (exit 2). One line.
    Input(String),
    /// Bits differ, or a probe failed (exit 1); the details were printed already.
    Failed(String),
    /// A workload or a process could not run (exit 1).
    Run(String),
}

impl DetError {
    pub fn exit_code(&self) -> u8 {
        match self {
            DetError::Input(_) => 2,
            DetError::Failed(_) | DetError::Run(_) => 1,
        }
    }
}

impl fmt::Display for DetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DetError::Input(m) | DetError::Failed(m) | DetError::Run(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for DetError {}

/// The device, preset and op selection every subcommand shares.
#[derive(Args, Clone, Debug)]
pub struct Selection {
    /// cpu, emu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// ci (the micro model; emu's default) or full (the small model; the default elsewhere).
    #[arg(long)]
    pub preset: Option<String>,
    /// Only these workloads (comma-separated): runner ops, train_step, engine, rl_stage.
    #[arg(long, value_delimiter = ',')]
    pub ops: Vec<String>,
}

/// A [`Selection`] checked.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub device: Device,
    pub preset: Preset,
    pub ops: Vec<String>,
}

impl Selection {
    /// Parses and checks the selection; `default_preset` applies when `--preset` is absent.
    pub fn resolve(&self, default_preset: Option<Preset>) -> Result<Resolved, DetError> {
        let device: Device = self
            .device
            .parse()
            .map_err(|e: sluice_kernels::Error| DetError::Input(e.to_string()))?;
        let preset = match &self.preset {
            Some(p) => Preset::parse(p)?,
            None => default_preset.unwrap_or(match device {
                Device::Emu => Preset::Ci,
                _ => Preset::Full,
            }),
        };
        let ops: Vec<String> = self
            .ops
            .iter()
            .map(|o| o.trim().to_string())
            .filter(|o| !o.is_empty())
            .collect();
        workloads::select(&ops)?;
        Ok(Resolved {
            device,
            preset,
            ops,
        })
    }
}

#[derive(Subcommand, Debug)]
pub enum DeterminismCommand {
    /// Digest every workload in N separate processes and require the same bits; exit 1
    /// naming the op and tensor that differ.
    Run {
        #[command(flatten)]
        sel: Selection,
        /// Separate processes to compare (at least 2).
        #[arg(long, default_value_t = 2)]
        runs: usize,
        /// Write the record (the first run's digests, with what produced them) here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Keep every output here (run-K.safetensors), to show the first differing element
        /// and both values when runs differ.
        #[arg(long)]
        dump: Option<PathBuf>,
    },
    /// Invariance probes, each a named yes/no with its first counterexample.
    Probe {
        /// The device; the preset (default ci) picks the model of the model probes; --ops
        /// limits the workloads the thread_count and schedule_seed probes digest.
        #[command(flatten)]
        sel: Selection,
        /// Only these probes (comma-separated); `--list` names them.
        #[arg(long, value_delimiter = ',')]
        probes: Vec<String>,
        /// Print the probes and what each checks.
        #[arg(long)]
        list: bool,
        /// Also write the verdicts as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Compare this machine's digests with the goldens of its numerics class (DIR/<class>/
    /// <preset>.json); with --bless, rewrite them.
    Check {
        #[command(flatten)]
        sel: Selection,
        /// The goldens' folder (tests/golden in this repository).
        #[arg(long)]
        golden: PathBuf,
        /// Separate processes (run-to-run identity is checked first).
        #[arg(long, default_value_t = 2)]
        runs: usize,
        /// Rewrite the golden of this class with this run's digests.
        #[arg(long)]
        bless: bool,
        /// Why the bits changed (required with --bless; kept in the golden's history).
        #[arg(long)]
        reason: Option<String>,
    },
    /// What differs between two records (`run --json`): digests (op, tensor, shape, dtype),
    /// and machine, class, commit and thread count; exit 0 only when the digests agree.
    Diff { a: PathBuf, b: PathBuf },
    /// Internal: one process's record as JSON on stdout (`run` starts this N times).
    #[command(hide = true)]
    Record {
        #[command(flatten)]
        sel: Selection,
        /// Write every output to this safetensors file.
        #[arg(long)]
        dump: Option<PathBuf>,
    },
}

/// Runs a `sluice determinism` subcommand; the report goes to `out`.
pub fn run(cmd: &DeterminismCommand, out: &mut dyn Write) -> Result<(), DetError> {
    planted::check_env()?;
    match cmd {
        DeterminismCommand::Run {
            sel,
            runs,
            json,
            dump,
        } => {
            let r = sel.resolve(None)?;
            compare::run_command(&r, *runs, json.as_deref(), dump.as_deref(), out)
        }
        DeterminismCommand::Probe {
            sel,
            probes,
            list,
            json,
        } => {
            if *list {
                let _ = write!(out, "{}", probes::list());
                return Ok(());
            }
            let r = sel.resolve(Some(Preset::Ci))?;
            probes::run_command(&r, probes, json.as_deref(), out)
        }
        DeterminismCommand::Check {
            sel,
            golden,
            runs,
            bless,
            reason,
        } => {
            let r = sel.resolve(Some(Preset::Ci))?;
            let reason =
                match (bless, reason) {
                    (true, Some(why)) if !why.trim().is_empty() => Some(why.trim().to_string()),
                    (true, _) => return Err(DetError::Input(
                        "--bless needs --reason \"why the bits changed\" (kept in the golden's \
                         history)"
                            .to_string(),
                    )),
                    (false, Some(_)) => {
                        return Err(DetError::Input(
                            "--reason goes with --bless (it says why the goldens were rewritten)"
                                .to_string(),
                        ))
                    }
                    (false, None) => None,
                };
            golden::check_command(&r, golden, *runs, reason.as_deref(), out)
        }
        DeterminismCommand::Diff { a, b } => diff::diff_command(a, b, out),
        DeterminismCommand::Record { sel, dump } => {
            let r = sel.resolve(None)?;
            let record = procs::compute_record(&r, dump.as_deref())?;
            let text = serde_json::to_string(&record)
                .map_err(|e| DetError::Run(format!("internal: cannot encode the record: {e}")))?;
            writeln!(out, "{text}")
                .map_err(|e| DetError::Run(format!("cannot write the record: {e}")))?;
            Ok(())
        }
    }
}
