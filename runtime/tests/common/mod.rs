//! Shared pieces of the engine tests: models, a scripted workload (groups, shared prompts,
//! multi-turn sessions), a driver that steps an engine and answers turns, and the learner's
//! log-probs of finished trajectories.
#![allow(dead_code, clippy::needless_range_loop)]

use sluice_kernels::ops::is_gate_loss::{
    is_gate_loss, is_gate_loss_reference, GateMode, GateParams, TokenBatch, TokenInputs,
};
use sluice_kernels::ops::sample::SampleParams;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, Tensor};
use sluice_model::infer::{self, InferWeights, KvCache, PrefillBatch};
use sluice_model::{forward, Model, ModelConfig, PackedBatch, Precision};
use sluice_runtime::buffer::ReadyGroup;
use sluice_runtime::engine::{
    Engine, EngineConfig, Event, Request, SeqHandle, StopConfig, StopReason,
};
use sluice_runtime::trajectory::{Sample, SamplingParams, TerminalReason, WeightVersion};
use std::collections::BTreeMap;

/// A model with larger weights than the training init (so the logits are far from uniform and
/// the sampled tokens vary), seed `seed`.
pub fn model(mut cfg: ModelConfig, seed: u64, backend: &Backend) -> Model {
    cfg.seed = seed;
    cfg.init_std = 0.15;
    Model::new(cfg, backend).unwrap()
}

/// [`model`] computing in `precision` (bf16: with its bf16 compute copy).
pub fn model_in(cfg: ModelConfig, seed: u64, backend: &Backend, precision: Precision) -> Model {
    let mut m = model(cfg, seed, backend);
    m.set_precision(backend, precision).unwrap();
    m
}

/// An engine on `m`'s compute weights (its f32 parameters, or its bf16 compute copy) at version
/// 0, in `m`'s precision (the learner's: what zero mismatch needs).
pub fn engine(m: &Model, backend: Backend, cfg: EngineConfig) -> Engine {
    let cfg = EngineConfig {
        precision: m.precision(),
        ..cfg
    };
    Engine::new(
        backend,
        &m.config,
        m.compute_weights(),
        WeightVersion(0),
        cfg,
    )
    .unwrap()
}

pub fn prompt(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// One request of the workload and how many observation turns its sessions get.
#[derive(Clone, Debug)]
pub struct Job {
    pub req: Request,
    /// Observation turns after the first turn (multi-turn requests only).
    pub turns: u32,
}

/// The workload of the zero-mismatch test: requests of different lengths, GRPO groups, two
/// requests sharing a long prompt prefix, multi-turn sessions with observations; EOS and a
/// stop sequence among the stop conditions.
pub fn workload(vocab: usize, seed: u64) -> Vec<Job> {
    let mut rng = Rng::new(seed);
    let shared = prompt(&mut rng, 37, vocab);
    let mut jobs = Vec::new();
    let mut add = |name: &str, p: Vec<u32>, g: u32, max_new: u32, turns: u32, eos: Option<u32>| {
        let mut req = Request::new(name, p, max_new);
        req.instance_id = format!("inst-{name}");
        req.group_size = g;
        req.sampling = SamplingParams {
            max_new_tokens: max_new,
            seed: 7,
            ..SamplingParams::default()
        };
        req.stop = StopConfig {
            eos,
            stop_sequences: vec![vec![1, 2]],
        };
        req.multi_turn = turns > 0;
        jobs.push(Job { req, turns });
    };
    add("a", prompt(&mut rng, 5, vocab), 4, 12, 0, Some(3));
    add("b", shared.clone(), 1, 20, 0, None);
    add("c", prompt(&mut rng, 9, vocab), 2, 6, 2, Some(3));
    let mut e = shared[..33].to_vec();
    e.extend(prompt(&mut rng, 6, vocab));
    add("e", e, 3, 9, 0, None);
    add("f", prompt(&mut rng, 1, vocab), 1, 17, 1, None);
    jobs
}

/// The observation a session gets after turn `turn`: a deterministic function of both.
pub fn observation(session: &str, turn: u32, vocab: usize) -> Vec<u32> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in session.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut rng = Rng::new(h ^ turn as u64);
    let n = 3 + (h as usize + turn as usize) % 5;
    prompt(&mut rng, n, vocab)
}

/// Finished trajectories keyed by (session, group index).
pub type Results = BTreeMap<(String, u32), Sample>;

/// Steps `eng` until every job's trajectories finished, answering multi-turn sessions with
/// [`observation`]s. `submit_after[i]` = the number of steps before job i is submitted.
/// `on_step(engine, step)` runs between steps (e.g. a weight swap).
pub fn drive(
    eng: &mut Engine,
    jobs: &[Job],
    submit_after: &[u64],
    mut on_step: impl FnMut(&mut Engine, u64),
) -> Results {
    let vocab = eng.model_config().vocab;
    let mut owner: BTreeMap<SeqHandle, (String, u32, u32)> = BTreeMap::new(); // session, gi, turns left
    let mut out = Results::new();
    let mut submitted = vec![false; jobs.len()];
    let mut step = 0u64;
    let expected: usize = jobs.iter().map(|j| j.req.group_size as usize).sum();
    while out.len() < expected {
        for (i, j) in jobs.iter().enumerate() {
            if !submitted[i] && submit_after[i] <= step {
                let hs = eng.submit(j.req.clone()).unwrap();
                for (gi, h) in hs.into_iter().enumerate() {
                    owner.insert(h, (j.req.session_id.clone(), gi as u32, j.turns));
                }
                submitted[i] = true;
            }
        }
        on_step(eng, step);
        let events = eng.step().unwrap();
        step += 1;
        assert!(step < 10_000, "the engine made no progress");
        for ev in events {
            match ev {
                Event::Finished { sample, handle, .. } => {
                    let (s, gi, _) = owner[&handle].clone();
                    sample.validate().unwrap();
                    assert_eq!(sample.group_index, gi);
                    out.insert((s, gi), *sample);
                }
                Event::TurnEnded { handle, reason, .. } => {
                    let (s, gi, left) = owner[&handle].clone();
                    assert_ne!(reason, StopReason::Capacity);
                    if left == 0 {
                        let sample = eng.finish(handle, 1.0, TerminalReason::Success).unwrap();
                        sample.validate().unwrap();
                        out.insert((s, gi), sample);
                    } else {
                        let obs = observation(&format!("{s}/{gi}"), left, vocab);
                        eng.observe(handle, &obs, 5).unwrap();
                        owner.insert(handle, (s, gi, left - 1));
                    }
                }
            }
        }
    }
    assert!(eng.is_empty(), "trajectories left in the engine");
    out
}

/// The multiplier the sampler applied to the logits of `s`: 1/temperature in f32, 1 when greedy
/// (`SampleParams::scale`, the sampler's own function).
pub fn sampler_scale(s: &Sample) -> f32 {
    SampleParams {
        temperature: s.sampling.temperature,
        ..SampleParams::default()
    }
    .scale()
}

/// Multiplies each sequence's rows of `logits` ([rows, V], `batch`'s packing) by its sampler
/// scale with one f32 multiply: z = logits * (1/T), as the sampler forms z before its row
/// reduction. is_gate_loss at its default scale then computes log_softmax(z) exactly as the
/// sampler did.
/// When is_gate_loss takes the temperature itself (the lead's change on main: the same f32
/// multiply inside the kernel, the gradient scaled by 1/T), the learner passes it there instead
/// and this function goes; the log-probs are bit-identical either way.
pub fn scale_rows_by_temperature(
    logits: &mut [f32],
    v: usize,
    batch: &PackedBatch,
    samples: &[&Sample],
) {
    for (b, s) in samples.iter().enumerate() {
        let scale = sampler_scale(s);
        if scale == 1.0 {
            continue;
        }
        let r = batch.seq_range(b);
        for x in &mut logits[r.start * v..r.end * v] {
            *x *= scale;
        }
    }
}

/// The learner's log-probs of every token of each trajectory (0 where not generated): the
/// training forward (`forward::logits`) over ONE packed batch of all the full sequences, the
/// rows scaled by each sequence's 1/temperature, then is_gate_loss's logp (the row reduction the
/// sampler shares).
pub fn learner_logps(m: &Model, samples: &[&Sample]) -> Vec<Vec<f32>> {
    let v = m.config.vocab;
    let seqs: Vec<Vec<i32>> = samples
        .iter()
        .map(|s| s.tokens.iter().map(|&t| t as i32).collect())
        .collect();
    let batch = PackedBatch::pack(&seqs, v).unwrap();
    let mut logits = forward::logits(m, &batch).unwrap();
    scale_rows_by_temperature(&mut logits, v, &batch, samples);
    let n = batch.len();
    // Row r predicts the next token of its sequence.
    let mut targets = vec![0i32; n];
    let mut mask = vec![0.0f32; n];
    for (b, s) in samples.iter().enumerate() {
        let r = batch.seq_range(b);
        for j in 0..s.tokens.len() - 1 {
            targets[r.start + j] = s.tokens[j + 1] as i32;
            mask[r.start + j] = if s.loss_mask[j + 1] { 1.0 } else { 0.0 };
        }
    }
    let zeros = vec![0.0f32; n];
    let ones = vec![1.0f32; n];
    let inputs = TokenInputs {
        tokens: &targets,
        behavior_logp: &zeros,
        advantages: &ones,
        mask: &mask,
        weight: None,
        ref_logp: None,
    };
    let params = GateParams {
        mode: GateMode::Pg,
        ..GateParams::default()
    };
    let mut dl = vec![0.0f32; logits.len()];
    let r = is_gate_loss_reference(&logits, n, v, &inputs, &params, &mut dl).unwrap();
    samples
        .iter()
        .enumerate()
        .map(|(b, s)| {
            let r0 = batch.seq_range(b).start;
            let mut lp = vec![0.0f32; s.tokens.len()];
            for j in 1..s.tokens.len() {
                if s.loss_mask[j] {
                    lp[j] = r.logp[r0 + j - 1];
                }
            }
            lp
        })
        .collect()
}

/// Asserts that every generated token whose version passes `which` has the learner's log-prob
/// bit for bit; returns how many tokens were compared.
#[must_use = "a zero-mismatch check must assert how many tokens it compared"]
pub fn assert_bit_identical(
    m: &Model,
    results: &Results,
    which: impl Fn(WeightVersion) -> bool,
) -> usize {
    let samples: Vec<&Sample> = results.values().collect();
    let learner = learner_logps(m, &samples);
    let mut compared = 0;
    for (s, lp) in samples.iter().zip(&learner) {
        for j in 0..s.tokens.len() {
            if s.loss_mask[j] && which(s.weight_version[j]) {
                assert_eq!(
                    s.behavior_logp[j].to_bits(),
                    lp[j].to_bits(),
                    "session {} sample {} token {j}: engine logp {} learner {}",
                    s.session_id,
                    s.group_index,
                    s.behavior_logp[j],
                    lp[j]
                );
                compared += 1;
            }
        }
    }
    compared
}

/// is_gate_loss's logp on `backend` for logits [n, V] (host values uploaded) of rows whose
/// targets/mask are given.
fn device_logp(backend: &Backend, logits: Tensor, targets: &[i32], mask: &[f32]) -> Vec<f32> {
    let n = targets.len();
    let tokens = Tensor::from_slice(backend, &[n], targets).unwrap();
    let zeros = Tensor::from_slice(backend, &[n], &vec![0.0f32; n]).unwrap();
    let ones = Tensor::from_slice(backend, &[n], &vec![1.0f32; n]).unwrap();
    let mask = Tensor::from_slice(backend, &[n], mask).unwrap();
    let batch = TokenBatch {
        tokens: &tokens,
        behavior_logp: &zeros,
        advantages: &ones,
        mask: &mask,
        weight: None,
        ref_logp: None,
    };
    let params = GateParams {
        mode: GateMode::Pg,
        ..GateParams::default()
    };
    let (out, _) = is_gate_loss(backend, &logits, &batch, &params).unwrap();
    out.logp.to_vec::<f32>().unwrap()
}

fn targets_mask(s: &Sample) -> (Vec<i32>, Vec<f32>) {
    let n = s.tokens.len();
    let mut targets = vec![0i32; n];
    let mut mask = vec![0.0f32; n];
    for j in 0..n - 1 {
        targets[j] = s.tokens[j + 1] as i32;
        mask[j] = if s.loss_mask[j + 1] { 1.0 } else { 0.0 };
    }
    (targets, mask)
}

fn compare(s: &Sample, logp: &[f32], what: &str) -> usize {
    let mut compared = 0;
    for j in 1..s.tokens.len() {
        if s.loss_mask[j] {
            assert_eq!(
                s.behavior_logp[j].to_bits(),
                logp[j - 1].to_bits(),
                "{what}: session {} sample {} token {j}: engine {} vs {}",
                s.session_id,
                s.group_index,
                s.behavior_logp[j],
                logp[j - 1]
            );
            compared += 1;
        }
    }
    compared
}

/// Recomputes each trajectory on `backend` with ONE prefill over its full sequence (fresh
/// cache, contiguous slots), then is_gate_loss's logp there; asserts bit identity with the
/// engine's behavior log-probs. Returns the tokens compared.
#[must_use = "a zero-mismatch check must assert how many tokens it compared"]
pub fn assert_full_recompute_identical(backend: &Backend, m: &Model, results: &Results) -> usize {
    let w = InferWeights::from_arena(backend, &m.config, m.compute_weights(), 0, m.precision())
        .unwrap();
    let mut compared = 0;
    for s in results.values() {
        let n = s.tokens.len();
        let bs = 4;
        let nb = n.div_ceil(bs);
        let mut cache = KvCache::new(backend, &m.config, nb, bs, m.precision().dtype()).unwrap();
        let batch = PrefillBatch {
            tokens: s.tokens.iter().map(|&t| t as i32).collect(),
            positions: (0..n as i32).collect(),
            slots: (0..n as i32).collect(),
            cu_seqlens: vec![0, n as i32],
            block_table: (0..nb as i32).collect(),
            max_blocks: nb,
            context_lens: vec![n as i32],
            logits_rows: (0..n as i32).collect(),
        };
        let logits = infer::prefill(backend, &w, &mut cache, &batch).unwrap();
        let (targets, mask) = targets_mask(s);
        let lp = device_logp(backend, logits, &targets, &mask);
        compared += compare(s, &lp, "full-sequence recompute");
    }
    compared
}

/// What [`assert_bit_identical_on`] compared.
#[derive(Clone, Copy, Debug, Default)]
pub struct LearnerComparison {
    /// Generated tokens whose behavior log-prob equalled the learner's, bit for bit.
    pub tokens: usize,
    /// Of those, tokens sampled at a temperature other than 1.
    pub tempered_tokens: usize,
    /// Learner forward passes (packed batches).
    pub batches: usize,
    /// The most rows one packed batch held.
    pub max_rows: usize,
}

/// The learner's training forward on `m`'s device over packed batches of up to `per_batch`
/// sequences each (in `results` order), each sequence's rows scaled by its 1/temperature, then
/// is_gate_loss on `backend`: every generated token's learner log-prob must equal the engine's
/// behavior log-prob bit for bit.
#[must_use = "a zero-mismatch check must assert how many tokens it compared"]
pub fn assert_bit_identical_on(
    backend: &Backend,
    m: &Model,
    results: &Results,
    per_batch: usize,
) -> LearnerComparison {
    let v = m.config.vocab;
    let samples: Vec<&Sample> = results.values().collect();
    let mut c = LearnerComparison::default();
    for chunk in samples.chunks(per_batch.max(1)) {
        let seqs: Vec<Vec<i32>> = chunk
            .iter()
            .map(|s| s.tokens.iter().map(|&t| t as i32).collect())
            .collect();
        let batch = PackedBatch::pack(&seqs, v).unwrap();
        let mut logits = forward::logits_on(backend, m, &batch).unwrap();
        scale_rows_by_temperature(&mut logits, v, &batch, chunk);
        let n = batch.len();
        let mut targets = vec![0i32; n];
        let mut mask = vec![0.0f32; n];
        for (b, s) in chunk.iter().enumerate() {
            let r0 = batch.seq_range(b).start;
            let (t, mk) = targets_mask(s);
            targets[r0..r0 + t.len()].copy_from_slice(&t);
            mask[r0..r0 + mk.len()].copy_from_slice(&mk);
        }
        let logits = Tensor::from_slice(backend, &[n, v], &logits).unwrap();
        let lp = device_logp(backend, logits, &targets, &mask);
        for (b, s) in chunk.iter().enumerate() {
            let r = batch.seq_range(b);
            let k = compare(s, &lp[r], "learner (packed)");
            c.tokens += k;
            if s.sampling.temperature != 1.0 {
                c.tempered_tokens += k;
            }
        }
        c.batches += 1;
        c.max_rows = c.max_rows.max(n);
    }
    c
}

/// Four groups of two trajectories sampled by `m` on cpu at version 0, ready for a learner:
/// group g's prompt is [1, 2 + g, 5, 7], `new_tokens` tokens at sampling seed `seed0 + g`, and
/// its two members get rewards 0 and 1 (every advantage is non-zero). `task(g)`: group g's
/// task, set on its requests too; None leaves the requests' task unset and names the group "t".
pub fn reward_pair_groups(
    m: &Model,
    new_tokens: u32,
    seed0: u64,
    task: impl Fn(usize) -> Option<&'static str>,
) -> Vec<ReadyGroup> {
    let cfg = &m.config;
    let mut engine = Engine::new(
        Backend::Cpu,
        cfg,
        m.compute_weights(),
        WeightVersion(0),
        EngineConfig {
            kv_bytes: EngineConfig::kv_bytes_for_blocks(cfg, Precision::F32, 16, 64),
            max_seqs: 8,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    for g in 0..4u32 {
        let mut req = Request::new(&format!("s{g}"), vec![1, 2 + g, 5, 7], new_tokens);
        req.instance_id = format!("inst{g}");
        if let Some(t) = task(g as usize) {
            req.task = t.into();
        }
        req.group_size = 2;
        req.sampling = SamplingParams {
            max_new_tokens: new_tokens,
            seed: seed0 + u64::from(g),
            ..SamplingParams::default()
        };
        engine.submit(req).unwrap();
    }
    let mut out: Vec<ReadyGroup> = (0..4)
        .map(|g| ReadyGroup {
            instance_id: format!("inst{g}"),
            task: task(g).unwrap_or("t").into(),
            samples: Vec::new(),
            duplicated: 0,
        })
        .collect();
    for e in engine.run_until_idle().unwrap() {
        if let Event::Finished { sample, .. } = e {
            let g: usize = sample.instance_id["inst".len()..].parse().unwrap();
            out[g].samples.push(*sample);
        }
    }
    for (g, group) in out.iter_mut().enumerate() {
        group.samples.sort_by_key(|s| s.group_index);
        assert_eq!(group.samples.len(), 2);
        for (i, s) in group.samples.iter_mut().enumerate() {
            if task(g).is_some() {
                assert_eq!(s.task, group.task);
            }
            s.reward = i as f32;
        }
    }
    out
}
