//! The engine's contract: its configuration, what a caller sends (a [`Request`] and its stop
//! conditions) and gets back (handles, [`Event`]s, views, counters), and its errors.

use crate::kv_blocks::{KvError, KvStats};
use crate::trajectory::{
    Sample, SamplingParams, TerminalReason, TokenId, TrajectoryError, WeightVersion,
};
use sluice_model::infer::KvCache;
use sluice_model::{ModelConfig, Precision};
use std::fmt;

/// What happens to in-flight sequences on a weight swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SwapMode {
    /// Keep their K/V (computed with the old weights); later tokens record the new version.
    #[default]
    Continue,
    /// Drop their K/V and prefill them again with the new weights.
    Recompute,
}

/// How a sequence is preempted when the pool runs out of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PreemptMode {
    /// Drop its K/V; prefill it again when readmitted (prefix blocks still cached are reused).
    #[default]
    Recompute,
    /// Copy its K/V rows to host memory; copy them back into fresh blocks when readmitted.
    SwapToHost,
}

/// Engine limits and policies.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Bytes of the KV pool (every layer's K and V caches): the engine holds as many whole
    /// blocks as fit ([`KvCache::blocks_for_bytes`]), so a bf16 cache holds twice the tokens of
    /// an f32 one in the same bytes. Use [`EngineConfig::kv_bytes_for_blocks`] for a pool of a
    /// given block count.
    pub kv_bytes: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Tokens computed per step (prefill chunks plus one per decoding sequence), >= 1.
    pub max_batch_tokens: usize,
    /// Sequences admitted (holding KV and computing) at once, >= 1. A group of G counts G
    /// when its leader is admitted (a group larger than the limit runs alone).
    pub max_seqs: usize,
    pub preempt: PreemptMode,
    /// The default for [`Engine::swap_weights`].
    pub swap: SwapMode,
    /// What the engine computes in: f32, or bf16 (the bf16 weights of the learner's compute
    /// copy, a bf16 KV cache, the learner's rounding points). Must be the learner's precision
    /// for its log-probs to match the rollout's bit for bit.
    pub precision: Precision,
}

impl EngineConfig {
    /// The `kv_bytes` of a pool of `blocks` blocks of `block_size` slots for `model` in
    /// `precision`.
    pub fn kv_bytes_for_blocks(
        model: &ModelConfig,
        precision: Precision,
        block_size: usize,
        blocks: usize,
    ) -> usize {
        blocks * KvCache::block_bytes(model, precision.dtype(), block_size)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            // 8 MiB: 256 blocks of 16 slots of the small model in f32, 512 in bf16.
            kv_bytes: 8 << 20,
            block_size: crate::kv_blocks::DEFAULT_BLOCK_SIZE,
            max_batch_tokens: 2048,
            max_seqs: 64,
            preempt: PreemptMode::Recompute,
            swap: SwapMode::Continue,
            precision: Precision::F32,
        }
    }
}

/// When a turn stops (besides `max_new_tokens`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopConfig {
    /// The end-of-sequence token (kept in the output).
    pub eos: Option<TokenId>,
    /// Token sequences that end a turn when generated (kept in the output).
    pub stop_sequences: Vec<Vec<TokenId>>,
}

/// A rollout request: one prompt, sampled `group_size` times.
#[derive(Clone, Debug)]
pub struct Request {
    pub session_id: String,
    pub instance_id: String,
    pub task: String,
    /// G >= 1 samples of the prompt (group indices 0..G); the prompt is prefilled once.
    pub group_size: u32,
    pub prompt: Vec<TokenId>,
    /// Temperature, top-k, top-p, seed, and `max_new_tokens` per turn.
    pub sampling: SamplingParams,
    pub stop: StopConfig,
    /// false: the trajectory finishes when its first turn stops. true: it pauses after each
    /// turn for [`Engine::observe`] or [`Engine::finish`].
    pub multi_turn: bool,
}

impl Request {
    /// A single-turn request of one sample with default sampling.
    pub fn new(session_id: &str, prompt: Vec<TokenId>, max_new_tokens: u32) -> Request {
        Request {
            session_id: session_id.to_string(),
            instance_id: session_id.to_string(),
            task: String::new(),
            group_size: 1,
            prompt,
            sampling: SamplingParams {
                max_new_tokens,
                ..SamplingParams::default()
            },
            stop: StopConfig::default(),
            multi_turn: false,
        }
    }
}

/// A trajectory inside the engine (one group member).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqHandle(pub u64);

/// Why a turn stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    StopSequence,
    MaxNewTokens,
    /// The sequence alone needs more blocks than the pool has.
    Capacity,
}

impl StopReason {
    /// The terminal reason of a single-turn trajectory that stopped this way.
    pub fn terminal(self) -> TerminalReason {
        match self {
            StopReason::Eos | StopReason::StopSequence => TerminalReason::Success,
            StopReason::MaxNewTokens | StopReason::Capacity => TerminalReason::Budget,
        }
    }
}

/// What a step reports.
#[derive(Clone, Debug)]
pub enum Event {
    /// A multi-turn trajectory's turn stopped; it waits for `observe` or `finish`.
    TurnEnded {
        handle: SeqHandle,
        session_id: String,
        group_index: u32,
        reason: StopReason,
        /// The tokens generated in this turn (what the environment reads).
        generated: Vec<TokenId>,
    },
    /// A single-turn trajectory finished (reward 0; terminal reason from the stop reason).
    Finished {
        handle: SeqHandle,
        reason: StopReason,
        sample: Box<Sample>,
    },
}

/// A trajectory the engine holds, read without ending it: what a server streams as tokens are
/// sampled, and the log-probs and versions of a turn it reports while the session stays open.
#[derive(Clone, Copy, Debug)]
pub struct TrajectoryView<'a> {
    /// Prompt, generated and observation tokens so far.
    pub tokens: &'a [TokenId],
    /// Per token: the behavior log-prob of a generated token, 0 elsewhere.
    pub behavior_logp: &'a [f32],
    /// Per token: the weight version that sampled it (generated) or computed its K/V.
    pub versions: &'a [WeightVersion],
    /// Between turns (waiting for `observe` or `finish`).
    pub paused: bool,
}

/// An event as an environment reads it: which trajectory, the tokens of the turn that just
/// ended, whether a length limit cut that turn, and the whole sample when the engine is done
/// with the trajectory (single-turn).
#[derive(Clone, Debug)]
pub struct EndedTurn {
    pub handle: SeqHandle,
    pub generated: Vec<TokenId>,
    /// Stopped by `max_new_tokens` or the context capacity rather than by a stop token: the
    /// task still scores what was written, but the episode ends with this turn as `budget`.
    pub cut: bool,
    pub sample: Option<Sample>,
}

impl Event {
    pub fn into_ended_turn(self) -> EndedTurn {
        let (handle, reason, generated, sample) = match self {
            Event::TurnEnded {
                handle,
                reason,
                generated,
                ..
            } => (handle, reason, generated, None),
            Event::Finished {
                handle,
                reason,
                sample,
            } => {
                let start = sample.turns.last().map_or(sample.prompt_len, |b| b.start);
                let generated = sample.tokens[start..].to_vec();
                (handle, reason, generated, Some(*sample))
            }
        };
        EndedTurn {
            handle,
            generated,
            cut: matches!(reason, StopReason::MaxNewTokens | StopReason::Capacity),
            sample,
        }
    }
}

#[derive(Debug)]
pub enum EngineError {
    /// A bad request or call, named.
    Invalid(String),
    UnknownHandle(SeqHandle),
    Kernel(sluice_kernels::Error),
    Kv(KvError),
    /// A trajectory failed validation (an engine bug).
    Trajectory(TrajectoryError),
    /// The trajectory would outgrow the KV pool: a length limit, not a fault.
    Capacity(String),
    /// An observation the engine cannot take (empty, ids outside the vocabulary): the
    /// environment's fault, not the engine's.
    Observation(String),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::Invalid(m) => write!(f, "engine: {m}"),
            EngineError::UnknownHandle(h) => {
                write!(f, "engine: no trajectory with handle {}", h.0)
            }
            EngineError::Kernel(e) => write!(f, "engine: {e}"),
            EngineError::Kv(e) => write!(f, "engine: {e}"),
            EngineError::Trajectory(e) => write!(f, "engine produced an invalid trajectory: {e}"),
            EngineError::Capacity(m) | EngineError::Observation(m) => write!(f, "engine: {m}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<sluice_kernels::Error> for EngineError {
    fn from(e: sluice_kernels::Error) -> Self {
        EngineError::Kernel(e)
    }
}

impl From<KvError> for EngineError {
    fn from(e: KvError) -> Self {
        EngineError::Kv(e)
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// Counters of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub steps: u64,
    /// Tokens whose K/V a prefill call computed.
    pub prefill_tokens: u64,
    /// Tokens a decode call computed.
    pub decode_tokens: u64,
    /// Tokens sampled.
    pub sampled_tokens: u64,
    pub preempted_recompute: u64,
    pub preempted_swap: u64,
    /// K/V rows copied to host memory by swap-out.
    pub swapped_out_tokens: u64,
    pub weight_swaps: u64,
    pub kv: KvStats,
}
