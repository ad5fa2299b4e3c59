//! The model-level identities of the inference path (DESIGN 3.5, 6.6): a prefill split into
//! chunks gives the bits of one prefill of the whole prompt, and decoding token by token gives,
//! layer by layer, the bits of the training forward over the same tokens.

use super::Verdict;
use crate::determinism::compare::first_difference;
use crate::determinism::workloads::{Preset, Sequences};
use crate::determinism::DetError;
use sluice_kernels::ops::embedding::embedding;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, Result, Tensor};
use sluice_model::infer::{self, AttnInputs, InferWeights, KvCache, PrefillBatch};
use sluice_model::layers::{self, BatchTensors, Dims, ModelWeights};
use sluice_model::{Model, ModelConfig, PackedBatch, Precision};

/// The two precisions of the model probes.
const PRECISIONS: [Precision; 2] = [Precision::F32, Precision::Bf16];

fn model(backend: &Backend, cfg: &ModelConfig, precision: Precision) -> Result<Model> {
    let mut cfg = cfg.clone();
    // Larger weights than the training init: logits far from uniform, varied activations.
    cfg.init_std = 0.15;
    let mut m = Model::new(cfg, backend)?;
    m.set_precision(backend, precision)?;
    Ok(m)
}

fn tokens(rng: &mut Rng, vocab: usize, lengths: &[usize]) -> Vec<Vec<i32>> {
    lengths
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(vocab) as i32).collect())
        .collect()
}

/// `want` and `got` (f32 rows of `width`) compared; the first difference as text.
fn first_diff(width: usize, want: &[f32], got: &[f32]) -> Option<(usize, String, String)> {
    let a: &[u8] = bytemuck::cast_slice(want);
    let b: &[u8] = bytemuck::cast_slice(got);
    let rows = want.len() / width.max(1);
    first_difference("F32", &[rows, width], a, b).map(|(flat, _, x, y)| (flat, x, y))
}

/// Chunked prefill = one-shot prefill: two prompts (45 and 29 tokens) prefilled in one call,
/// and again in four calls of uneven chunks (7, 16, 1, 21 and 13, 16 tokens: across cache
/// blocks and 32-key chunks, one chunk of a single token); every token's logits and every K/V
/// row of the caches must have the same bits.
pub fn chunked_prefill(
    backend: &Backend,
    preset: Preset,
) -> std::result::Result<Verdict, DetError> {
    let run = || -> Result<std::result::Result<usize, String>> {
        let cfg = preset
            .model()
            .map_err(|e| sluice_kernels::Error::Invalid(e.to_string()))?;
        let mut checked = 0;
        for precision in PRECISIONS {
            let m = model(backend, &cfg, precision)?;
            let w = InferWeights::from_arena(backend, &cfg, m.compute_weights(), 0, precision)?;
            let prompts = tokens(&mut Rng::new(0xc4a2), cfg.vocab, &[45, 29]);
            let seqs = Sequences::new(&prompts, 0);
            let chunks: [&[usize]; 2] = [&[7, 16, 1, 21], &[13, 16]];
            // One shot: every row's logits.
            let mut cache1 = KvCache::new(backend, &cfg, seqs.blocks, 16, precision.dtype())?;
            let mut one = seqs.prefill(&prompts);
            one.logits_rows = (0..one.tokens.len() as i32).collect();
            let whole = infer::prefill(backend, &w, &mut cache1, &one)?.to_vec::<f32>()?;
            // Chunked: call c takes chunk c of each prompt that has one.
            let mut cache2 = KvCache::new(backend, &cfg, seqs.blocks, 16, precision.dtype())?;
            let v = cfg.vocab;
            let mut done = [0usize; 2];
            let mut got = vec![vec![0f32; 0]; 2];
            for c in 0..4 {
                let mut b = PrefillBatch {
                    cu_seqlens: vec![0],
                    block_table: Vec::new(),
                    max_blocks: seqs.max_blocks,
                    ..PrefillBatch::default()
                };
                let full = seqs.table();
                let mut members = Vec::new();
                for s in 0..2 {
                    let Some(&n) = chunks[s].get(c) else { continue };
                    for (i, &token) in prompts[s].iter().enumerate().skip(done[s]).take(n) {
                        b.tokens.push(token);
                        b.positions.push(i as i32);
                        b.slots.push(seqs.slot(s, i));
                        b.logits_rows.push(b.tokens.len() as i32 - 1);
                    }
                    b.cu_seqlens.push(b.tokens.len() as i32);
                    b.context_lens.push((done[s] + n) as i32);
                    b.block_table
                        .extend_from_slice(&full[s * seqs.max_blocks..(s + 1) * seqs.max_blocks]);
                    members.push((s, n));
                    done[s] += n;
                }
                let logits = infer::prefill(backend, &w, &mut cache2, &b)?.to_vec::<f32>()?;
                let mut row = 0;
                for (s, n) in members {
                    got[s].extend_from_slice(&logits[row * v..(row + n) * v]);
                    row += n;
                }
            }
            let mut start = 0;
            for s in 0..2 {
                let n = prompts[s].len();
                checked += n;
                if let Some((flat, a, bb)) =
                    first_diff(v, &whole[start * v..(start + n) * v], &got[s])
                {
                    return Ok(Err(format!(
                        "{precision}: prompt {s}, token {} of {n}, logit {}: one-shot {a}, chunked {bb}",
                        flat / v,
                        flat % v
                    )));
                }
                start += n;
            }
            for l in 0..cfg.n_layers {
                for (name, a, b) in [
                    ("k", &cache1.k[l], &cache2.k[l]),
                    ("v", &cache1.v[l], &cache2.v[l]),
                ] {
                    checked += 1;
                    if a.to_bytes()? != b.to_bytes()? {
                        return Ok(Err(format!(
                            "{precision}: layer {l}'s {name} cache differs between one-shot and \
                             chunked prefill"
                        )));
                    }
                }
            }
        }
        Ok(Ok(checked))
    };
    match run().map_err(|e| DetError::Run(format!("chunked_prefill: {e}")))? {
        Ok(n) => Ok(Verdict::pass(format!(
            "prompts of 45 and 29 tokens in chunks 7,16,1,21 and 13,16, f32 and bf16: {n} \
             logits rows and caches bit for bit"
        ))),
        Err(c) => Ok(Verdict::fail(c)),
    }
}

/// Decode = the training forward, layer by layer: two sequences (40 and 23 tokens) decoded one
/// token per step from an empty cache; after the embedding and after every layer each token's
/// hidden row, and its logits, must have the bits of the training forward over the packed
/// sequences.
pub fn decode_equals_training(
    backend: &Backend,
    preset: Preset,
) -> std::result::Result<Verdict, DetError> {
    let run = || -> Result<std::result::Result<usize, String>> {
        let cfg = preset
            .model()
            .map_err(|e| sluice_kernels::Error::Invalid(e.to_string()))?;
        let dims = Dims::new(&cfg)?;
        let d = cfg.d_model;
        let mut checked = 0;
        for precision in PRECISIONS {
            let m = model(backend, &cfg, precision)?;
            let seqs_tokens = tokens(&mut Rng::new(0xdec0), cfg.vocab, &[40, 23]);
            // Training: hidden rows after the embedding and each layer, and the logits.
            let batch = PackedBatch::pack(&seqs_tokens, cfg.vocab)?;
            let w = ModelWeights::from_arena(backend, m.compute_weights())?;
            let bt = BatchTensors::upload(backend, &batch)?;
            let mut x = layers::embed(backend, &w.embed, &bt.tokens)?;
            let mut train = vec![x.to_vec::<f32>()?];
            for lw in &w.layers {
                let (_, next) = layers::layer(backend, &dims, lw, x, &bt)?;
                train.push(next.to_vec::<f32>()?);
                x = next;
            }
            let (_, logits) = layers::head(backend, &dims, &w.final_norm, &w.lm_head, &x)?;
            let train_logits = logits.to_vec::<f32>()?;
            // Decode: one token of each unfinished sequence per step.
            let iw = InferWeights::from_arena(backend, &cfg, m.compute_weights(), 0, precision)?;
            let seqs = Sequences::new(&seqs_tokens, 0);
            let mut cache = KvCache::new(backend, &cfg, seqs.blocks, 16, precision.dtype())?;
            let longest = seqs_tokens.iter().map(Vec::len).max().unwrap_or(0);
            let full_table = seqs.table();
            for t in 0..longest {
                let live: Vec<usize> = (0..2).filter(|&s| t < seqs_tokens[s].len()).collect();
                let n = live.len();
                let toks: Vec<i32> = live.iter().map(|&s| seqs_tokens[s][t]).collect();
                let pos = vec![t as i32; n];
                let slots: Vec<i32> = live.iter().map(|&s| seqs.slot(s, t)).collect();
                let mut table = Vec::new();
                for &s in &live {
                    table.extend_from_slice(
                        &full_table[s * seqs.max_blocks..(s + 1) * seqs.max_blocks],
                    );
                }
                let ctx = vec![t as i32 + 1; n];
                let toks_t = Tensor::from_slice(backend, &[n], &toks)?;
                let pos_t = Tensor::from_slice(backend, &[n], &pos)?;
                let slots_t = Tensor::from_slice(backend, &[n], &slots)?;
                let table_t = Tensor::from_slice(backend, &[n, seqs.max_blocks], &table)?;
                let ctx_t = Tensor::from_slice(backend, &[n], &ctx)?;
                let attn = AttnInputs::Decode {
                    block_table: &table_t,
                    context_lens: &ctx_t,
                };
                let mut x = embedding(backend, &iw.weights.embed, &toks_t)?;
                for (l, train_rows) in train.iter().enumerate() {
                    if l > 0 {
                        x = infer::layer(
                            backend,
                            &dims,
                            &iw.weights.layers[l - 1],
                            &x,
                            &pos_t,
                            &slots_t,
                            &mut cache.k[l - 1],
                            &mut cache.v[l - 1],
                            &attn,
                        )?;
                    }
                    let got = x.to_vec::<f32>()?;
                    for (i, &s) in live.iter().enumerate() {
                        let row = batch.seq_range(s).start + t;
                        checked += 1;
                        let want = &train_rows[row * d..(row + 1) * d];
                        if let Some((e, a, b)) = first_diff(d, want, &got[i * d..(i + 1) * d]) {
                            let stage = if l == 0 {
                                "the embedding".to_string()
                            } else {
                                format!("layer {} of {}", l - 1, cfg.n_layers)
                            };
                            return Ok(Err(format!(
                                "{precision}: after {stage}, sequence {s} token {t}, element \
                                 {e}: training {a}, decode {b}"
                            )));
                        }
                    }
                }
                let rows: Vec<i32> = (0..n as i32).collect();
                let logits =
                    infer::lm_head_rows(backend, &iw.weights, &dims, &x, &rows)?.to_vec::<f32>()?;
                let v = cfg.vocab;
                for (i, &s) in live.iter().enumerate() {
                    let row = batch.seq_range(s).start + t;
                    checked += 1;
                    let want = &train_logits[row * v..(row + 1) * v];
                    if let Some((e, a, b)) = first_diff(v, want, &logits[i * v..(i + 1) * v]) {
                        return Ok(Err(format!(
                            "{precision}: logits of sequence {s} token {t}, logit {e}: training \
                             {a}, decode {b}"
                        )));
                    }
                }
            }
        }
        Ok(Ok(checked))
    };
    match run().map_err(|e| DetError::Run(format!("decode_equals_training: {e}")))? {
        Ok(n) => Ok(Verdict::pass(format!(
            "sequences of 40 and 23 tokens, f32 and bf16: {n} hidden and logits rows (the \
             embedding, every layer, the head) bit for bit"
        ))),
        Err(c) => Ok(Verdict::fail(c)),
    }
}
