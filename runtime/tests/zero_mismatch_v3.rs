//! The zero-mismatch contract (DESIGN 6.6) on attention v3 (`SLUICE_ATTENTION=wgmma`: the
//! FlashAttention-3-style kernels of kernels/cuda/attention_wgmma.cu and
//! paged_attention_wgmma.cu, docs/perf/attention.md "v3"): the engine's decode and prefill and the
//! learner's training forward all take v3, and every generated token's behavior log-prob equals
//! the learner's bit for bit, on the emulator, bf16.
//!
//! The attention path is read from the environment once per process, so this binary holds this
//! one test, which sets the variable before any attention runs. The case is small (the tiny
//! model, three requests of three new tokens): each engine step is a whole model pass under the
//! emulator, and the v2 and v1 paths have the full suite in zero_mismatch.rs.

mod common;

use common::*;
use sluice_kernels::ops::attention_tile::{attention_path, AttentionPath};
use sluice_kernels::Backend;
use sluice_model::{ModelConfig, Precision};
use sluice_runtime::engine::{EngineConfig, PreemptMode, SwapMode};

#[test]
fn emu_engine_logps_equal_the_learner_on_the_v3_path_bf16() {
    std::env::set_var("SLUICE_ATTENTION", "wgmma");
    assert_eq!(attention_path().unwrap(), AttentionPath::Wgmma);
    let backend = Backend::emu_with_seed(1);
    let m = model_in(ModelConfig::tiny(), 5, &backend, Precision::Bf16);
    let mut jobs = workload(m.config.vocab, 13);
    jobs.truncate(3);
    for j in &mut jobs {
        j.req.sampling.max_new_tokens = 3;
        j.turns = j.turns.min(1);
    }
    let cfg = EngineConfig {
        kv_bytes: EngineConfig::kv_bytes_for_blocks(&m.config, m.precision(), 4, 64),
        block_size: 4,
        // Each engine step is a whole model pass under the emulator: prompts prefilled in one step.
        max_batch_tokens: 128,
        max_seqs: 16,
        preempt: PreemptMode::Recompute,
        swap: SwapMode::Continue,
        precision: m.precision(),
    };
    let mut eng = engine(&m, backend, cfg);
    let res = drive(&mut eng, &jobs, &[0, 0, 0], |_, _| {});
    let c = assert_bit_identical_on(eng.backend(), &m, &res, usize::MAX);
    println!("v3 on emu: {c:?}");
    assert!(c.tokens >= 9, "only {} tokens compared: {c:?}", c.tokens);
}
