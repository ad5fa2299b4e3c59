//! What `sluice determinism run` computes and digests: the workloads, by name.
//!
//! - every op of the kernel runner ([`super::op_cases`]), one workload per op;
//! - `train_step`: forward, loss, backward and the optimizer step (Muon + AdamW) in f32 and in
//!   bf16 (the bf16 compute copy), digesting the loss, the gradient arena, the parameters, the
//!   optimizer's moments and the compute copy after each step;
//! - `engine`: the rollout engine's inference forward ([`sluice_model::infer`]): one prefill
//!   of several prompts (one of them past two cache blocks), then decode steps that feed back
//!   the sampled tokens (the batch-invariant sampler), in f32 and in bf16, digesting the
//!   logits, tokens and log-probs of every call and the KV caches at the end;
//! - `rl_stage`: a short asynchronous GRPO stage on the virtual clock (the replay mode: rollout
//!   engine, environments with latency, data buffer, learner, weight publication), digesting
//!   every batch the learner trained on, the per-step losses and the final weights.
//!
//! The preset picks the model and the lengths: `ci` the micro model (configs/model/micro.toml:
//! 1 train step, 4 decode steps, 1 learner step) so that the emulator finishes in CI; `full`
//! the small model (configs/model/small.toml: 2 train steps, 16 decode steps, 2 learner steps).

use super::op_cases;
use super::DetError;
use sluice_kernels::ops::sample::{sample, SampleParams};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Tensor};
use sluice_model::forward::loss_and_grad_on;
use sluice_model::infer::{self, DecodeBatch, InferWeights, KvCache, PrefillBatch};
use sluice_model::optim::{OptimConfig, Optimizer};
use sluice_model::{Model, ModelConfig, PackedBatch, Precision};
use std::fmt;

/// The model and lengths of the model workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Ci,
    Full,
}

impl Preset {
    pub fn parse(s: &str) -> Result<Preset, DetError> {
        match s {
            "ci" => Ok(Preset::Ci),
            "full" => Ok(Preset::Full),
            other => Err(DetError::Input(format!(
                "--preset {other:?}: use `ci` (the micro model) or `full` (the small model)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Ci => "ci",
            Preset::Full => "full",
        }
    }

    /// The model of the model workloads (micro or small).
    pub fn model(self) -> Result<ModelConfig, DetError> {
        match self {
            Preset::Ci => {
                ModelConfig::from_toml_str(include_str!("../../../configs/model/micro.toml"))
                    .map_err(|e| DetError::Run(format!("internal: configs/model/micro.toml: {e}")))
            }
            Preset::Full => Ok(ModelConfig::small()),
        }
    }

    pub fn train_steps(self) -> usize {
        match self {
            Preset::Ci => 1,
            Preset::Full => 2,
        }
    }

    pub fn decode_steps(self) -> usize {
        match self {
            Preset::Ci => 4,
            Preset::Full => 16,
        }
    }

    pub fn learner_steps(self) -> u64 {
        match self {
            Preset::Ci => 1,
            Preset::Full => 2,
        }
    }

    /// Sequence lengths of a training batch (one step).
    pub fn train_lengths(self) -> &'static [usize] {
        match self {
            Preset::Ci => &[5, 9, 13, 7],
            Preset::Full => &[16, 40, 24, 33, 8, 64, 20, 51],
        }
    }

    /// Prompt lengths of the engine workload.
    pub fn prompt_lengths(self) -> &'static [usize] {
        match self {
            Preset::Ci => &[5, 17, 33, 9],
            Preset::Full => &[5, 17, 33, 9, 40, 2],
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One output of a workload, as bytes in memory order.
pub struct Output {
    pub op: String,
    pub case: String,
    pub tensor: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Output {
    /// The tensor's bytes (downloaded from the device).
    pub fn of_tensor(
        op: &str,
        case: &str,
        tensor: &str,
        t: &Tensor,
    ) -> sluice_kernels::Result<Output> {
        Ok(Output {
            op: op.to_string(),
            case: case.to_string(),
            tensor: tensor.to_string(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            bytes: t.to_bytes()?,
        })
    }

    /// A host vector.
    pub fn of_slice<T: sluice_kernels::Element>(
        op: &str,
        case: &str,
        tensor: &str,
        v: &[T],
    ) -> Output {
        Output {
            op: op.to_string(),
            case: case.to_string(),
            tensor: tensor.to_string(),
            dtype: T::DTYPE,
            shape: vec![v.len()],
            bytes: bytemuck::cast_slice(v).to_vec(),
        }
    }
}

/// The model workloads, after the runner's ops.
pub const MODEL_WORKLOADS: &[&str] = &["train_step", "engine", "rl_stage"];

/// Every workload name `--ops` accepts, in run order.
pub fn names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = sluice_kernels::runner::ops()
        .iter()
        .map(|o| o.name)
        .collect();
    v.extend_from_slice(MODEL_WORKLOADS);
    v.extend(super::planted::workloads());
    v
}

/// Checks `--ops`: every name must be a workload; empty selects all. Returns the selection in
/// run order.
pub fn select(ops: &[String]) -> Result<Vec<&'static str>, DetError> {
    let all = names();
    for op in ops {
        if !all.contains(&op.as_str()) {
            return Err(DetError::Input(format!(
                "unknown op `{op}` in --ops; the workloads are: {}",
                all.join(", ")
            )));
        }
    }
    Ok(all
        .into_iter()
        .filter(|n| ops.is_empty() || ops.iter().any(|o| o == n))
        .collect())
}

fn kernel_err(workload: &str) -> impl Fn(sluice_kernels::Error) -> DetError + '_ {
    move |e| DetError::Run(format!("{workload}: {e}"))
}

/// Runs one workload on `backend`.
pub fn run(backend: &Backend, name: &str, preset: Preset) -> Result<Vec<Output>, DetError> {
    match name {
        "train_step" => train_step(backend, preset).map_err(kernel_err(name)),
        "engine" => engine(backend, preset).map_err(kernel_err(name)),
        "rl_stage" => super::rl_stage::run(backend, preset),
        _ if super::planted::workloads().contains(&name) => super::planted::run(backend, name),
        op => {
            let mut out = Vec::new();
            for c in op_cases::cases().iter().filter(|c| c.op == op) {
                out.extend(
                    op_cases::run_case(backend, c)
                        .map_err(|e| DetError::Run(format!("{op} [{}]: {e}", c.case)))?,
                );
            }
            Ok(out)
        }
    }
}

/// Sequences of the given lengths, ids from `rng`, with next-token targets and every position
/// but each sequence's last in the loss.
fn training_batch(
    rng: &mut Rng,
    vocab: usize,
    lengths: &[usize],
) -> sluice_kernels::Result<(PackedBatch, Vec<i32>, Vec<f32>)> {
    let seqs: Vec<Vec<i32>> = lengths
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(vocab) as i32).collect())
        .collect();
    let (mut targets, mut mask) = (Vec::new(), Vec::new());
    for s in &seqs {
        for i in 0..s.len() {
            let last = i + 1 == s.len();
            targets.push(if last { 0 } else { s[i + 1] });
            mask.push(if last { 0.0 } else { 1.0 });
        }
    }
    Ok((PackedBatch::pack(&seqs, vocab)?, targets, mask))
}

/// The `train_step` workload (see the module documentation).
fn train_step(backend: &Backend, preset: Preset) -> sluice_kernels::Result<Vec<Output>> {
    let cfg = preset
        .model()
        .map_err(|e| sluice_kernels::Error::Invalid(e.to_string()))?;
    let mut out = Vec::new();
    for precision in [Precision::F32, Precision::Bf16] {
        let mut model = Model::new(cfg.clone(), backend)?;
        model.set_precision(backend, precision)?;
        let opt = Optimizer::new(backend, model.layout().clone(), OptimConfig::default())?;
        let mut state = opt.new_state(backend)?;
        let mut rng = Rng::new(0x7e57_0001);
        for step in 1..=preset.train_steps() {
            let (batch, targets, mask) =
                training_batch(&mut rng, cfg.vocab, preset.train_lengths())?;
            let loss = loss_and_grad_on(backend, &mut model, &batch, &targets, &mask)?;
            let case = format!("{precision} step {step}");
            let op = "train_step";
            out.push(Output::of_slice(op, &case, "loss", &[loss]));
            out.push(Output::of_tensor(op, &case, "grads", model.grads.tensor())?);
            opt.step(
                backend,
                &mut model.params,
                &model.grads,
                &mut state,
                model.compute.as_mut(),
            )?;
            out.push(Output::of_tensor(
                op,
                &case,
                "params",
                model.params.tensor(),
            )?);
            out.push(Output::of_tensor(op, &case, "moment1", state.m.tensor())?);
            out.push(Output::of_tensor(op, &case, "moment2", state.v.tensor())?);
            if let Some(c) = &model.compute {
                out.push(Output::of_tensor(op, &case, "compute_copy", c.tensor())?);
            }
        }
    }
    Ok(out)
}

/// Block size of the engine workload's KV cache (the engine's default).
const BLOCK: usize = 16;

/// The `engine` workload (see the module documentation).
fn engine(backend: &Backend, preset: Preset) -> sluice_kernels::Result<Vec<Output>> {
    let cfg = preset
        .model()
        .map_err(|e| sluice_kernels::Error::Invalid(e.to_string()))?;
    let mut out = Vec::new();
    for precision in [Precision::F32, Precision::Bf16] {
        let mut model = Model::new(cfg.clone(), backend)?;
        model.set_precision(backend, precision)?;
        let w = InferWeights::from_arena(backend, &cfg, model.compute_weights(), 0, precision)?;
        let mut rng = Rng::new(0xe261_0e00);
        let prompts: Vec<Vec<i32>> = preset
            .prompt_lengths()
            .iter()
            .map(|&n| (0..n).map(|_| rng.below(cfg.vocab) as i32).collect())
            .collect();
        let seqs = Sequences::new(&prompts, preset.decode_steps());
        let mut cache = KvCache::new(backend, &cfg, seqs.blocks, BLOCK, precision.dtype())?;
        let case = |what: &str| format!("{precision} {what}");
        let op = "engine";
        let logits = infer::prefill(backend, &w, &mut cache, &seqs.prefill(&prompts))?;
        out.push(Output::of_tensor(op, &case("prefill"), "logits", &logits)?);
        let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let (mut tokens, logp) = seqs.sample(backend, &logits, &lens)?;
        out.push(Output::of_slice(op, &case("prefill"), "tokens", &tokens));
        out.push(Output::of_slice(op, &case("prefill"), "logprobs", &logp));
        for step in 1..=preset.decode_steps() {
            let logits = infer::decode(backend, &w, &mut cache, &seqs.decode(&tokens, &lens))?;
            let label = case(&format!("decode {step}"));
            out.push(Output::of_tensor(op, &label, "logits", &logits)?);
            lens.iter_mut().for_each(|l| *l += 1);
            let (next, logp) = seqs.sample(backend, &logits, &lens)?;
            out.push(Output::of_slice(op, &label, "tokens", &next));
            out.push(Output::of_slice(op, &label, "logprobs", &logp));
            tokens = next;
        }
        for l in 0..cfg.n_layers {
            out.push(Output::of_tensor(
                op,
                &case("caches"),
                &format!("k{l}"),
                &cache.k[l],
            )?);
            out.push(Output::of_tensor(
                op,
                &case("caches"),
                &format!("v{l}"),
                &cache.v[l],
            )?);
        }
    }
    Ok(out)
}

/// Sequences laid out in a paged cache: sequence b owns blocks `first[b]..first[b] + n[b]`,
/// enough for its prompt and every decode step.
pub struct Sequences {
    first: Vec<usize>,
    pub max_blocks: usize,
    pub blocks: usize,
}

impl Sequences {
    pub fn new(prompts: &[Vec<i32>], decode_steps: usize) -> Sequences {
        let mut first = Vec::new();
        let (mut blocks, mut max_blocks) = (0, 0);
        for p in prompts {
            let n = (p.len() + decode_steps + 1).div_ceil(BLOCK);
            first.push(blocks);
            blocks += n;
            max_blocks = usize::max(max_blocks, n);
        }
        Sequences {
            first,
            max_blocks,
            blocks,
        }
    }

    /// Block table rows (unused entries 0).
    pub fn table(&self) -> Vec<i32> {
        let mut t = vec![0i32; self.first.len() * self.max_blocks];
        for (b, &f) in self.first.iter().enumerate() {
            let end = self.first.get(b + 1).copied().unwrap_or(self.blocks);
            for (j, blk) in (f..end).enumerate() {
                t[b * self.max_blocks + j] = blk as i32;
            }
        }
        t
    }

    /// The cache slot of sequence b's position `pos`.
    pub fn slot(&self, b: usize, pos: usize) -> i32 {
        ((self.first[b] + pos / BLOCK) * BLOCK + pos % BLOCK) as i32
    }

    /// One prefill call over the prompts, the logits of each prompt's last token.
    pub fn prefill(&self, prompts: &[Vec<i32>]) -> PrefillBatch {
        let mut b = PrefillBatch {
            cu_seqlens: vec![0],
            block_table: self.table(),
            max_blocks: self.max_blocks,
            ..PrefillBatch::default()
        };
        for (s, p) in prompts.iter().enumerate() {
            for (i, &t) in p.iter().enumerate() {
                b.tokens.push(t);
                b.positions.push(i as i32);
                b.slots.push(self.slot(s, i));
            }
            b.cu_seqlens.push(b.tokens.len() as i32);
            b.context_lens.push(p.len() as i32);
            b.logits_rows.push(b.tokens.len() as i32 - 1);
        }
        b
    }

    /// One decode call: token `tokens[b]` at position `lens[b]` of sequence b.
    pub fn decode(&self, tokens: &[i32], lens: &[usize]) -> DecodeBatch {
        DecodeBatch {
            tokens: tokens.to_vec(),
            positions: lens.iter().map(|&l| l as i32).collect(),
            slots: lens
                .iter()
                .enumerate()
                .map(|(b, &l)| self.slot(b, l))
                .collect(),
            block_table: self.table(),
            max_blocks: self.max_blocks,
            context_lens: lens.iter().map(|&l| l as i32 + 1).collect(),
        }
    }

    /// Samples each row (temperature 1, no truncation, keyed by request id 1000 + b and the
    /// position of the token sampled).
    pub fn sample(
        &self,
        backend: &Backend,
        logits: &Tensor,
        lens: &[usize],
    ) -> sluice_kernels::Result<(Vec<i32>, Vec<f32>)> {
        let b = lens.len();
        let ids: Vec<u64> = (0..b as u64).map(|r| 1000 + r).collect();
        let pos: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let ids = Tensor::from_slice(backend, &[b], &ids)?;
        let pos = Tensor::from_slice(backend, &[b], &pos)?;
        let p = SampleParams {
            seed: 5,
            ..SampleParams::default()
        };
        let (tokens, logp) = sample(backend, logits, &ids, &pos, &p)?;
        Ok((tokens.to_vec()?, logp.to_vec()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_ops_are_named_and_the_selection_keeps_run_order() {
        let e = select(&["gemm".into(), "nope".into()]).unwrap_err();
        assert!(
            matches!(&e, DetError::Input(m) if m.contains("unknown op `nope`")),
            "{e}"
        );
        let s = select(&["engine".into(), "gemm".into()]).unwrap();
        assert_eq!(s, vec!["gemm", "engine"]);
        assert_eq!(select(&[]).unwrap().len(), names().len());
    }

    #[test]
    fn sequences_get_disjoint_blocks() {
        let prompts = vec![vec![1; 5], vec![2; 17], vec![3; 33]];
        let s = Sequences::new(&prompts, 4);
        assert_eq!(s.blocks, 1 + 2 + 3);
        assert_eq!(s.max_blocks, 3);
        assert_eq!(s.table(), vec![0, 0, 0, 1, 2, 0, 3, 4, 5]);
        assert_eq!(s.slot(1, 16), (2 * BLOCK) as i32);
    }
}
