//! Whole-model rows of `sluice bench`: one train step (forward, loss, backward, Muon + AdamW
//! step) and one decode step (the engine's inference forward for a batch of sequences over
//! the paged cache), in bf16, with the launches and host syncs each step makes (the harness
//! counts them). They live here, not in the kernels' case table, because the model crate sits
//! above the kernels.
//!
//! Models: the micro model for the tiny preset, the small model (configs/model/small.toml) for
//! quick and doc, and for doc also the GPU-sized config of docs/perf/precision.md (d_model
//! 2048, 16 layers, 16 heads / 4 KV heads of 128, 16 experts top-2 of width 1408, vocabulary
//! 32768; 16 sequences of 2048 tokens per train step). The doc preset puts these last: they
//! take the longest, and the rows before them are already written if the run is cut.

use crate::determinism::workloads::Sequences;
use sluice_kernels::bench::{BenchCase, BenchRun, Pass};
use sluice_kernels::bench_cases::Preset;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, Error, Result};
use sluice_model::forward::loss_and_grad_on;
use sluice_model::infer::{self, InferWeights, KvCache};
use sluice_model::optim::{OptimConfig, Optimizer};
use sluice_model::{Model, ModelConfig, PackedBatch, Precision};

/// The GPU-sized config of docs/perf/precision.md.
fn gpu_sized() -> ModelConfig {
    ModelConfig {
        vocab: 32768,
        d_model: 2048,
        n_layers: 16,
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: 128,
        n_experts: 16,
        top_k: 2,
        expert_ffn_dim: 1408,
        ..ModelConfig::small()
    }
}

fn micro() -> Result<ModelConfig> {
    ModelConfig::from_toml_str(include_str!("../../configs/model/micro.toml"))
        .map_err(|e| Error::Invalid(format!("internal: configs/model/micro.toml: {e}")))
}

/// A model in bf16 on `backend`.
fn bf16_model(backend: &Backend, cfg: &ModelConfig) -> Result<Model> {
    let mut m = Model::new(cfg.clone(), backend)?;
    m.set_precision(backend, Precision::Bf16)?;
    Ok(m)
}

/// Active parameters per token (the GEMM FLOPs' count): attention projections, the k experts
/// visited, the router and the LM head; 2 FLOPs per multiply-add.
fn active_params(c: &ModelConfig) -> f64 {
    let attn = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads);
    let moe = c.top_k * 3 * c.d_model * c.expert_ffn_dim + c.n_experts * c.d_model;
    (c.n_layers * (attn + moe) + c.vocab * c.d_model) as f64
}

fn train_step_case(name: &'static str, cfg: ModelConfig, seqs: usize, len: usize) -> BenchCase {
    let tokens = seqs * len;
    BenchCase {
        op: "train_step",
        pass: Pass::Step,
        path: name,
        check: "forward_emu::cuda_matches_cpu_and_is_deterministic",
        cuda_only: false,
        shape: format!("{name} model, {seqs}x{len} tokens bf16"),
        // The parameter arena read and written by the optimizer (f32 master, two moments,
        // gradients) dominates the compulsory bytes.
        bytes: 4.0 * 4.0 * active_params(&cfg),
        // Forward and backward GEMMs: 3 x 2 x active params x tokens (attention left out).
        flops: 6.0 * active_params(&cfg) * tokens as f64,
        prepare: Box::new(move |b| {
            let mut model = bf16_model(b, &cfg)?;
            let opt = Optimizer::new(b, model.layout().clone(), OptimConfig::default())?;
            let mut state = opt.new_state(b)?;
            let mut rng = Rng::new(0xbe4c_0001);
            let batch: Vec<Vec<i32>> = (0..seqs)
                .map(|_| (0..len).map(|_| rng.below(cfg.vocab) as i32).collect())
                .collect();
            let targets: Vec<i32> = batch
                .iter()
                .flat_map(|s| s.iter().skip(1).copied().chain([0]))
                .collect();
            let mask: Vec<f32> = batch
                .iter()
                .flat_map(|s| (0..s.len()).map(|i| if i + 1 < s.len() { 1.0 } else { 0.0 }))
                .collect();
            let packed = PackedBatch::pack(&batch, cfg.vocab)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                loss_and_grad_on(b, &mut model, &packed, &targets, &mask)?;
                opt.step(
                    b,
                    &mut model.params,
                    &model.grads,
                    &mut state,
                    model.compute.as_mut(),
                )
                .map(|_| ())
            });
            Ok(run)
        }),
    }
}

fn decode_step_case(name: &'static str, cfg: ModelConfig, batch: usize, ctx: usize) -> BenchCase {
    BenchCase {
        op: "decode_step",
        pass: Pass::Step,
        path: name,
        check: "zero_mismatch::cuda_engine_logps_equal_the_learner_on_cuda",
        cuda_only: false,
        shape: format!("{name} model, batch {batch}, context {ctx} bf16"),
        // Every weight read once per step (bf16), plus the KV cache of the context.
        bytes: 2.0 * active_params(&cfg)
            + (2 * batch * ctx * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2) as f64,
        flops: 2.0 * active_params(&cfg) * batch as f64,
        prepare: Box::new(move |b| {
            let model = bf16_model(b, &cfg)?;
            let w = InferWeights::from_arena(b, &cfg, model.compute_weights(), 0, Precision::Bf16)?;
            let mut rng = Rng::new(0xdec0_0001);
            let prompts: Vec<Vec<i32>> = (0..batch)
                .map(|_| (0..ctx).map(|_| rng.below(cfg.vocab) as i32).collect())
                .collect();
            let seqs = Sequences::new(&prompts, 1);
            let mut cache = KvCache::new(b, &cfg, seqs.blocks, 16, Precision::Bf16.dtype())?;
            infer::prefill(b, &w, &mut cache, &seqs.prefill(&prompts))?;
            let lens = vec![ctx; batch];
            let tokens: Vec<i32> = (0..batch).map(|i| (i % cfg.vocab) as i32).collect();
            let step = seqs.decode(&tokens, &lens);
            // The same step each run: it rewrites the same cache slots with the same values.
            let run: BenchRun =
                Box::new(move |b: &Backend| infer::decode(b, &w, &mut cache, &step).map(|_| ()));
            Ok(run)
        }),
    }
}

/// The step cases of a preset (appended after the op cases).
pub fn step_cases(preset: Preset) -> Result<Vec<BenchCase>> {
    Ok(match preset {
        Preset::Tiny => vec![
            train_step_case("micro", micro()?, 2, 8),
            decode_step_case("micro", micro()?, 2, 8),
        ],
        Preset::Quick => vec![
            train_step_case("small", ModelConfig::small(), 8, 64),
            decode_step_case("small", ModelConfig::small(), 16, 64),
        ],
        Preset::Doc => vec![
            train_step_case("small", ModelConfig::small(), 32, 64),
            decode_step_case("small", ModelConfig::small(), 16, 256),
            decode_step_case("gpu-sized", gpu_sized(), 64, 2048),
            train_step_case("gpu-sized", gpu_sized(), 16, 2048),
        ],
    })
}
