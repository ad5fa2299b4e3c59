//! `sluice emu profile`: an op of the kernel runner run under the emulator's profiler
//! (docs/emulator.md, "Profiling"), with the op's useful FLOPs and compulsory bytes beside the
//! counts, an occupancy estimate and a lower bound on H200 time (both labelled as models).
//!
//! [`cases`] builds every op's inputs at two presets: `small` (seconds, in CI) and `doc` (the
//! shapes of docs/perf/<family>.md, DESIGN 9.1), each with the op's sampling of its launches.

pub mod bound;
pub mod cases;
pub mod report;

use crate::device::Backend;
use crate::emu::profile::{KernelProfile, LazyAlloc, Recording, Sampling};
use crate::error::{Error, Result};
use crate::runner::{self, OpCall};
use crate::tensor::Tensor;
use std::collections::BTreeMap;

/// Blocks sampled per launch at the doc preset when `--blocks` is not given.
pub const DOC_BLOCKS: u64 = 32;

/// Which shapes a case uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Small shapes that profile in seconds (CI).
    Small,
    /// The shapes of docs/perf/<family>.md (DESIGN 9.1).
    Doc,
}

impl Preset {
    pub fn parse(s: &str) -> Result<Preset> {
        match s {
            "small" => Ok(Preset::Small),
            "doc" => Ok(Preset::Doc),
            _ => Err(Error::Invalid(format!(
                "unknown preset `{s}`: the presets are `small` and `doc`"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Small => "small",
            Preset::Doc => "doc",
        }
    }
}

/// One op at one shape, ready to run through the kernel runner.
pub struct ProfileCase {
    pub op: &'static str,
    /// The shape in words, e.g. `M=N=K=4096 bf16`.
    pub shape: String,
    /// Useful FLOPs of the op's math (DESIGN 9.1: GEMM 2MNK, attention 4·D per visible pair
    /// forward and 2.5x that backward, MoE the GEMMs of the k experts each token visits).
    pub op_flops: f64,
    /// Bytes the op must read and write at minimum (every input once, every output once).
    pub compulsory_bytes: f64,
    /// The runner's inputs, already on the backend.
    pub tensors: BTreeMap<String, Tensor>,
    /// The runner's string parameters (missing ones take their defaults).
    pub params: BTreeMap<String, String>,
    /// How the op's launches are sampled when `--blocks N` is given: [`crate::emu::profile::Strata`]
    /// by kernel name (index producers run in full).
    pub strata: fn(&str) -> crate::emu::profile::Strata,
}

/// The profile of one op: its launches, in order.
pub struct OpProfile {
    pub op: String,
    pub shape: String,
    pub preset: String,
    pub op_flops: f64,
    pub compulsory_bytes: f64,
    pub kernels: Vec<KernelProfile>,
}

/// Runs `case` on `backend` (emu) under a recording; `blocks` samples each launch's blocks.
pub fn profile_case(
    backend: &Backend,
    case: ProfileCase,
    blocks: Option<u64>,
) -> Result<OpProfile> {
    if !matches!(backend, Backend::Emu(_)) {
        return Err(Error::Invalid(
            "the profiler runs on the emu device only".to_string(),
        ));
    }
    let spec = runner::find(case.op)?;
    let call = OpCall::new(spec, case.tensors, case.params)?;
    let recording = Recording::start(Sampling {
        max_blocks: blocks,
        strata: case.strata,
    })
    .map_err(Error::Invalid)?;
    let outputs = (spec.run)(backend, &call);
    let kernels = recording.finish();
    drop(outputs?);
    Ok(OpProfile {
        op: case.op.to_string(),
        shape: case.shape,
        preset: String::new(),
        op_flops: case.op_flops,
        compulsory_bytes: case.compulsory_bytes,
        kernels,
    })
}

/// Builds the case of `op` at `preset` and profiles it. With `lazy`, inputs and outputs are
/// allocated lazily (doc shapes): inputs that steer control flow are still filled.
pub fn profile_op(
    backend: &Backend,
    op: &str,
    preset: Preset,
    blocks: Option<u64>,
) -> Result<OpProfile> {
    runner::find(op)?;
    // The doc shapes have up to millions of blocks: sampled unless the caller says otherwise.
    let blocks = blocks.or((preset == Preset::Doc).then_some(DOC_BLOCKS));
    let _lazy = (preset == Preset::Doc).then(LazyAlloc::enable);
    let case = cases::case(op, preset, backend)?;
    let mut p = profile_case(backend, case, blocks)?;
    p.preset = preset.name().to_string();
    Ok(p)
}
