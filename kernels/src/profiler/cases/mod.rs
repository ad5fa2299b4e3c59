//! The cases of `sluice emu profile`: every op of the kernel runner at two presets. This file
//! holds the per-op plans; strata.rs how each op's launches are sampled, inputs.rs the value
//! generation and the `Builder`, attention.rs the attention family's plans.
//!
//! - `small`: shapes that profile in well under 2 s each on the emulator (about 10 s for all,
//!   cold, on two busy cores), ragged where natural, every value tensor random; bf16 where the
//!   op's GPU path is bf16 (gemm, MoE, attention, the paged-attention family, Newton-Schulz),
//!   f32 elsewhere.
//! - `doc`: the shapes of docs/perf/<family>.md (DESIGN 9.1); the ops without a doc shape take a
//!   GPU-sized shape of the small model scaled up (T = 16384 tokens, d = 2048), written in the
//!   case's `shape`. The caller has enabled lazy allocation, so every large value tensor whose
//!   values steer no control flow is `Tensor::zeros` (untouched zero pages: no memory, no time);
//!   only what steers control flow or indexing is filled: token ids, sequence boundaries, block
//!   tables, context lengths, positions, slots, block offsets, the MoE inputs that decide the
//!   routing (x and w_router), the top-k scores and the sampler's logits (its pruning depends on
//!   them).
//!
//! FLOPs are the op's useful math (DESIGN 9.1): GEMM 2MNK; attention 4·D per visible (causal)
//! query-key pair forward, 2.5x that backward; paged attention 4·D per (query head, key); MoE
//! the router GEMM and the 3 expert GEMMs of the k experts of each token, the backward twice
//! that (a dX and a dW GEMM per forward GEMM); row and elementwise ops a small count per element
//! given at each case; 0 for data movement. Compulsory bytes: every input read once and every
//! output written once at its dtype, except where an op touches only part of a tensor (KV
//! caches, the parameter arena of Muon, the embedding table): there only the part it must touch.

use super::{Preset, ProfileCase};
use crate::device::Backend;
use crate::dtype::DType;
use crate::emu::profile::Strata;
use crate::error::{Error, Result};
use crate::runner;
use crate::tensor::Tensor;
use half::bf16;
use std::collections::BTreeMap;

mod attention;
mod inputs;
mod strata;
use attention::*;
use inputs::*;
use strata::*;

/// The ops that have a case (every op of [`runner::ops`], in that order).
pub fn ops() -> Vec<&'static str> {
    runner::ops().iter().map(|o| o.name).collect()
}

/// The case of `op` at `preset`, inputs built on `backend`. Unknown op: `Error::Invalid` naming it.
pub fn case(op: &str, preset: Preset, backend: &Backend) -> Result<ProfileCase> {
    let spec = runner::find(op)?;
    let plan = plan(op, preset).ok_or_else(|| {
        Error::Invalid(format!(
            "op `{op}` has no profile case at preset `{}`",
            preset.name()
        ))
    })?;
    let mut b = Builder {
        backend,
        lazy: preset == Preset::Doc,
        tensors: BTreeMap::new(),
        params: BTreeMap::new(),
        bytes: 0.0,
        seed: 0x5eed,
    };
    (plan.build)(&mut b)?;
    Ok(ProfileCase {
        op: spec.name,
        shape: plan.shape,
        op_flops: plan.flops,
        compulsory_bytes: b.bytes,
        tensors: b.tensors,
        params: b.params,
        strata: plan.strata,
    })
}

/// How `op`'s launches are sampled (by kernel name), for inputs of any shape: the strata of its
/// small case (a file's inputs have no plan of their own). Uniform for an op without a case.
pub fn strata_of(op: &str) -> fn(&str) -> Strata {
    plan(op, Preset::Small).map_or(uniform, |p| p.strata)
}

/// The shape in words of `op`'s case at `preset`, without building anything (None: no case).
pub fn shape(op: &str, preset: Preset) -> Option<String> {
    plan(op, preset).map(|p| p.shape)
}

// ---------------------------------------------------------------------------------------------
// Plans: the shape, FLOPs and strata of each op at each preset, and how to build its inputs
// ---------------------------------------------------------------------------------------------

type Build = Box<dyn FnOnce(&mut Builder<'_>) -> Result<()>>;

struct Plan {
    shape: String,
    flops: f64,
    strata: fn(&str) -> Strata,
    build: Build,
}

fn plan(op: &str, preset: Preset) -> Option<Plan> {
    let doc = preset == Preset::Doc;
    let pick = |small: usize, big: usize| if doc { big } else { small };
    // Activations: bf16 at doc shapes, f32 at small shapes.
    let act = if doc { DType::BF16 } else { DType::F32 };
    Some(match op {
        "gemm" => gemm(pick(128, 4096), pick(96, 4096), pick(64, 4096)),
        "topk" => topk(pick(100, 65536), pick(64, 256), 8),
        "sample" => sample(pick(5, 256), pick(1000, 152064), act),
        "is_gate_loss" => is_gate_loss(pick(16, 8192), pick(1000, 152064), act),
        "newton_schulz" => newton_schulz(pick(2, 64), pick(24, 1024), pick(40, 2048)),
        "moe_forward" | "moe_backward" => {
            let dims = if doc {
                MoeDims {
                    t: 16384,
                    d: 2048,
                    e: 64,
                    k: 8,
                    f: 1024,
                }
            } else {
                MoeDims {
                    t: 48,
                    d: 48,
                    e: 6,
                    k: 2,
                    f: 32,
                }
            };
            moe(dims, op == "moe_backward", doc)
        }
        "attention_forward" | "attention_backward" => {
            let (lens, h, hkv, d) = if doc {
                (vec![4096; 8], 32, 32, 128)
            } else {
                (vec![17, 33], 4, 2, 32)
            };
            attention(lens, h, hkv, d, op == "attention_backward")
        }
        "paged_attention" => {
            let (ctx, h, hkv, d, spare) = if doc {
                (vec![4096; 256], 32, 32, 128, 0)
            } else {
                (vec![17, 40, 5], 4, 2, 32, 2)
            };
            paged_attention(ctx, h, hkv, d, spare)
        }
        "kv_append" => {
            // (cached, new) per sequence, then padding rows.
            let (seqs, pad, hkv, d, nb) = if doc {
                (vec![(2048, 2048); 8], 0, 32, 128, 2048)
            } else {
                (vec![(3, 6), (0, 3)], 1, 2, 32, 4)
            };
            kv_append(seqs, pad, hkv, d, nb)
        }
        "paged_prefill" => {
            // (context, new tokens) per sequence: the new tokens are the context's last.
            let (seqs, h, hkv, d, spare) = if doc {
                (vec![(4096, 2048); 8], 32, 32, 128, 0)
            } else {
                (vec![(21, 5), (9, 9)], 4, 2, 32, 1)
            };
            paged_prefill(seqs, h, hkv, d, spare)
        }
        "rmsnorm" => rmsnorm(pick(33, 16384), pick(96, 2048), act, false),
        "rmsnorm_backward" => rmsnorm(pick(33, 16384), pick(96, 2048), act, true),
        "rope" | "rope_backward" => {
            let (seqs, len, h, d) = if doc {
                (4, 4096, 32, 128)
            } else {
                (2, 9, 4, 32)
            };
            rope(seqs, len, h, d, act, op == "rope_backward")
        }
        // Doc: the MoE expert activations, T*k = 16384*8 rows of f = 1024 (docs/perf/swiglu.md).
        "swiglu" => swiglu(pick(33, 16384 * 8), pick(80, 1024), act, false),
        "swiglu_backward" => swiglu(pick(33, 16384 * 8), pick(80, 1024), act, true),
        "embedding" => embedding(pick(50, 32768), pick(48, 2048), pick(37, 16384), act, false),
        "embedding_backward" => {
            embedding(pick(50, 32768), pick(48, 2048), pick(37, 16384), act, true)
        }
        "residual_add" => residual_add(pick(33, 16384), pick(96, 2048), act),
        "softmax" => softmax(pick(17, 16384), pick(100, 2048), act, false),
        "softmax_backward" => softmax(pick(17, 16384), pick(100, 2048), act, true),
        "transpose" => transpose(pick(33, 16384), pick(17, 2048), act),
        // Doc: a 134M-parameter slice of the arena (the runner copies p, m, v: 1.5 GiB filled).
        "adamw" => adamw(pick(1000, 1 << 27)),
        "sq_norm" => sq_norm(pick(20000, 1 << 27)),
        "muon_gather" | "muon_apply" => {
            let blocks = if doc {
                // The 64 expert matrices [1024,2048] of one MoE layer, contiguous.
                MuonBlocks {
                    n: 64,
                    r: 1024,
                    c: 2048,
                    stride: 2048,
                    base: 0,
                    step: 1024 * 2048,
                    tail: 0,
                }
            } else {
                // 3 head column blocks [24,40] of a [24,128] matrix at arena offset 16.
                MuonBlocks {
                    n: 3,
                    r: 24,
                    c: 40,
                    stride: 128,
                    base: 16,
                    step: 40,
                    tail: 8,
                }
            };
            muon(blocks, op == "muon_apply")
        }
        "cast_bf16" => cast_bf16(pick(1000, 1 << 27)),
        _ => return None,
    })
}

fn gemm(m: usize, n: usize, k: usize) -> Plan {
    let dtype = DType::BF16;
    Plan {
        shape: format!("M={m} N={n} K={k} bf16"),
        flops: 2.0 * m as f64 * n as f64 * k as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("a", &[m, k], dtype)?;
            b.values("b", &[n, k], dtype)?;
            b.output(&[m, n], DType::F32);
            Ok(())
        }),
    }
}

/// Top-k of router scores (f32, as the MoE router's probabilities): comparisons only, 0 FLOPs.
/// The scores steer the selection's branches, so they are filled at every preset.
fn topk(t: usize, e: usize, k: usize) -> Plan {
    Plan {
        shape: format!("T={t} E={e} k={k} f32"),
        flops: 0.0,
        strata: uniform,
        build: Box::new(move |b| {
            b.filled("scores", &[t, e], DType::F32, unit)?;
            b.param("k", k);
            b.output(&[t, k], DType::F32);
            b.output(&[t, k], DType::I32);
            Ok(())
        }),
    }
}

/// LLM-like logits: a flat bulk in [-4, 4) and about one token in 4096 some 30 nats above it,
/// so the sampler's pruning (an entry more than its Gumbel bound under the best is skipped)
/// behaves as on a real model's logits.
fn llm_logit(seed: u64, i: u64) -> f32 {
    let r = bits(seed, i);
    let base = (r >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0;
    if r & 0xfff == 0 {
        base + 30.0
    } else {
        base
    }
}

/// Sampling at temperature 1, no truncation (the RL default): 4 FLOPs per logit (scale, the
/// max/sum of the log-probability, the noise's log).
fn sample(batch: usize, v: usize, dtype: DType) -> Plan {
    Plan {
        shape: format!(
            "B={batch} V={v} {}, temperature 1, LLM-like logits",
            dt(dtype)
        ),
        flops: 4.0 * batch as f64 * v as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.filled("logits", &[batch, v], dtype, llm_logit)?;
            let ids: Vec<u64> = (0..batch as u64).map(|i| 1000 + 7 * i).collect();
            let t = Tensor::from_slice(b.backend, &[batch], &ids)?;
            b.put("request_ids", t, true);
            let pos: Vec<i32> = (0..batch as i32).map(|i| 100 + 37 * i).collect();
            b.i32s("positions", &[batch], &pos)?;
            b.output(&[batch], DType::I32);
            b.output(&[batch], DType::F32);
            Ok(())
        }),
    }
}

/// The fused policy loss (mode dis): 5 FLOPs per logit (max, exp and sum of the log-sum-exp,
/// the gradient's exp and scale). The behaviour log-probs sit within ±0.3 of the learner's, so
/// some tokens pass the gate and some are gated; one token in 7 is masked (a prompt token).
fn is_gate_loss(n: usize, v: usize, dtype: DType) -> Plan {
    Plan {
        shape: format!("N={n} V={v} {}, mode dis", dt(dtype)),
        flops: 5.0 * n as f64 * v as f64,
        strata: uniform,
        build: Box::new(move |b| {
            let seed = b.next_seed();
            let logit = move |i: u64| unit(seed, i) * 4.0;
            let t = if b.lazy {
                Tensor::zeros(b.backend, &[n, v], dtype)?
            } else {
                generated(b.backend, &[n, v], dtype, logit)?
            };
            b.put("logits", t, true);
            let ts = b.next_seed();
            let tokens: Vec<i32> = (0..n as u64)
                .map(|i| (bits(ts, i) % v as u64) as i32)
                .collect();
            // The learner's logp of each token: zeros give -ln V.
            let logp: Vec<f32> = (0..n)
                .map(|r| {
                    if b.lazy {
                        return -(v as f32).ln();
                    }
                    let row = |j: usize| {
                        let x = logit((r * v + j) as u64);
                        if dtype == DType::BF16 {
                            bf16::from_f32(x).to_f32()
                        } else {
                            x
                        }
                    };
                    let m = (0..v).map(row).fold(f32::NEG_INFINITY, f32::max);
                    let s: f32 = (0..v).map(|j| (row(j) - m).exp()).sum();
                    row(tokens[r] as usize) - m - s.ln()
                })
                .collect();
            let ns = b.next_seed();
            let behavior: Vec<f32> = (0..n).map(|r| logp[r] + 0.3 * unit(ns, r as u64)).collect();
            let advantages: Vec<f32> = (0..n).map(|r| unit(ns ^ 1, r as u64)).collect();
            let mask: Vec<f32> = (0..n).map(|r| if r % 7 == 3 { 0.0 } else { 1.0 }).collect();
            b.i32s("tokens", &[n], &tokens)?;
            b.f32s("behavior_logp", &[n], &behavior)?;
            b.f32s("advantages", &[n], &advantages)?;
            b.f32s("mask", &[n], &mask)?;
            b.output(&[1], DType::F32); // loss
            b.output(&[n, v], dtype); // dlogits
            b.output(&[n], DType::F32); // logp
            b.output(&[n], DType::F32); // ratio
            b.output(&[n], DType::U8); // accepted
            b.output(&[8], DType::F32); // counters
            Ok(())
        }),
    }
}

/// Newton-Schulz, 5 steps, bf16 products (the GPU path): per matrix and step (r <= c after the
/// transpose) 2 r r c (A = X X^T) + 2 r r r (A^2) + 2 r r c (B X) FLOPs.
fn newton_schulz(n: usize, r: usize, c: usize) -> Plan {
    let dtype = DType::BF16;
    let (r0, c0) = (r.min(c) as f64, r.max(c) as f64);
    Plan {
        shape: format!("n={n} [{r},{c}] bf16, 5 steps, bf16 products"),
        flops: 5.0 * n as f64 * 2.0 * r0 * r0 * (2.0 * c0 + r0),
        strata: uniform,
        build: Box::new(move |b| {
            b.values("g", &[n, r, c], dtype)?;
            b.param("precision", "bf16");
            b.output(&[n, r, c], DType::F32);
            Ok(())
        }),
    }
}

#[derive(Clone, Copy)]
struct MoeDims {
    t: usize,
    d: usize,
    e: usize,
    k: usize,
    f: usize,
}

/// The MoE layer (bf16, softmax scores, renormalised gates). x and w_router decide the routing,
/// so they are filled (w_router at 1/sqrt(d) scale: router logits of order 1, tokens spread
/// over the experts); the expert weights and dy are zeros at doc shapes. dy is F32 (the
/// model's gradient dtype).
fn moe(m: MoeDims, backward: bool, doc: bool) -> Plan {
    let MoeDims { t, d, e, k, f } = m;
    let dtype = DType::BF16;
    let (tf, df, ef, kf, ff) = (t as f64, d as f64, e as f64, k as f64, f as f64);
    let forward = 2.0 * tf * df * ef + 3.0 * 2.0 * tf * kf * df * ff;
    Plan {
        shape: format!(
            "T={t} d={d} E={e} k={k} f={f} bf16, softmax, renorm{}",
            if backward { ", dy f32" } else { "" }
        ),
        flops: if backward { 2.0 * forward } else { forward },
        strata: if doc { moe_doc_strata } else { moe_strata },
        build: Box::new(move |b| {
            b.filled("x", &[t, d], dtype, unit)?;
            let scale = 1.0 / (d as f32).sqrt();
            b.filled("w_router", &[e, d], dtype, move |s, i| unit(s, i) * scale)?;
            b.values("w1", &[e, f, d], dtype)?;
            b.values("w3", &[e, f, d], dtype)?;
            b.values("w2", &[e, d, f], dtype)?;
            b.param("k", k);
            if backward {
                b.values("dy", &[t, d], DType::F32)?;
                b.output(&[t, d], DType::F32); // dx
                b.output(&[e, d], DType::F32); // dw_router
                b.output(&[e, f, d], DType::F32); // dw1
                b.output(&[e, f, d], DType::F32); // dw3
                b.output(&[e, d, f], DType::F32); // dw2
            } else {
                b.output(&[t, d], DType::F32); // y
                b.output(&[t, k], DType::I32); // topk_idx
                b.output(&[t, k], DType::F32); // topk_gate
            }
            Ok(())
        }),
    }
}

/// RMSNorm: forward 4 FLOPs per element (square, sum, scale by the rsqrt, scale by w);
/// backward 10 (the sum of squares again, w·dy, its dot with x, dx's two products and
/// difference, dw's product and sum).
fn rmsnorm(t: usize, d: usize, dtype: DType, backward: bool) -> Plan {
    Plan {
        shape: format!("T={t} d={d} {}", dt(dtype)),
        flops: if backward { 10.0 } else { 4.0 } * (t * d) as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("x", &[t, d], dtype)?;
            b.values("w", &[d], dtype)?;
            if backward {
                b.values("dy", &[t, d], dtype)?;
                b.output(&[t, d], DType::F32);
                b.output(&[d], DType::F32);
            } else {
                b.output(&[t, d], DType::F32);
            }
            Ok(())
        }),
    }
}

/// RoPE over `seqs` sequences of `len` tokens (positions 0..len each): 3 FLOPs per element
/// (x_i cos - x_j sin); the angles are not counted.
fn rope(seqs: usize, len: usize, h: usize, d: usize, dtype: DType, backward: bool) -> Plan {
    let t = seqs * len;
    Plan {
        shape: format!("T={t} ({seqs}x{len}) H={h} D={d} {}", dt(dtype)),
        flops: 3.0 * (t * h * d) as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values(if backward { "dy" } else { "x" }, &[t, h, d], dtype)?;
            let pos: Vec<i32> = (0..t).map(|i| (i % len) as i32).collect();
            b.i32s("positions", &[t], &pos)?;
            b.output(&[t, h, d], DType::F32);
            Ok(())
        }),
    }
}

/// SwiGLU h = silu(a) * b: 5 FLOPs per element (negate, exp, add, divide, multiply); backward
/// 10 (the sigmoid again, silu, its derivative, da and db).
fn swiglu(t: usize, f: usize, dtype: DType, backward: bool) -> Plan {
    Plan {
        shape: format!("T={t} f={f} {}", dt(dtype)),
        flops: if backward { 10.0 } else { 5.0 } * (t * f) as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("a", &[t, f], dtype)?;
            b.values("b", &[t, f], dtype)?;
            if backward {
                b.values("dh", &[t, f], dtype)?;
                b.output(&[t, f], DType::F32);
                b.output(&[t, f], DType::F32);
            } else {
                b.output(&[t, f], DType::F32);
            }
            Ok(())
        }),
    }
}

/// Token ids skewed towards low ids (density ∝ id^(-2/3), a heavy head like real text).
fn skewed_tokens(t: usize, v: usize, seed: u64) -> Vec<i32> {
    (0..t as u64)
        .map(|i| {
            let u = frac(seed, i);
            ((u * u * u * v as f64) as usize).min(v - 1) as i32
        })
        .collect()
}

/// Embedding lookup (data movement: 0 FLOPs; compulsory: the distinct rows read, tokens, out)
/// or its backward (one add per element of dout; compulsory: dout, tokens, the dense dtable).
fn embedding(v: usize, d: usize, t: usize, dtype: DType, backward: bool) -> Plan {
    Plan {
        shape: format!("V={v} d={d} T={t} {}, skewed token ids", dt(dtype)),
        flops: if backward { (t * d) as f64 } else { 0.0 },
        strata: if backward {
            embedding_backward_strata
        } else {
            uniform
        },
        build: Box::new(move |b| {
            let seed = b.next_seed();
            let tokens = skewed_tokens(t, v, seed);
            if backward {
                b.values("dout", &[t, d], dtype)?;
                b.param("vocab", v);
                b.output(&[v, d], DType::F32);
            } else {
                b.values_by("table", &[v, d], dtype, false, unit)?;
                let mut seen = vec![false; v];
                let distinct = tokens
                    .iter()
                    .filter(|&&x| !std::mem::replace(&mut seen[x as usize], true))
                    .count();
                b.bytes += bytes_of(&[distinct, d], dtype);
                b.output(&[t, d], DType::F32);
            }
            b.i32s("tokens", &[t], &tokens)?;
            Ok(())
        }),
    }
}

/// y = a + b: 1 FLOP per element.
fn residual_add(t: usize, d: usize, dtype: DType) -> Plan {
    Plan {
        shape: format!("[{t},{d}] {}", dt(dtype)),
        flops: (t * d) as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("a", &[t, d], dtype)?;
            b.values("b", &[t, d], dtype)?;
            b.output(&[t, d], DType::F32);
            Ok(())
        }),
    }
}

/// Row softmax: 4 FLOPs per element (max, subtract and exp, sum, divide); backward 4 (dy·y,
/// its sum, the difference, the product).
fn softmax(t: usize, n: usize, dtype: DType, backward: bool) -> Plan {
    Plan {
        shape: format!("T={t} n={n} {}", dt(dtype)),
        flops: 4.0 * (t * n) as f64,
        strata: uniform,
        build: Box::new(move |b| {
            if backward {
                b.values("y", &[t, n], dtype)?;
                b.values("dy", &[t, n], dtype)?;
                b.output(&[t, n], DType::F32);
            } else {
                b.values("x", &[t, n], dtype)?;
                b.output(&[t, n], DType::F32);
            }
            Ok(())
        }),
    }
}

/// y[C,R] = x[R,C]^T, same dtype: data movement.
fn transpose(r: usize, c: usize, dtype: DType) -> Plan {
    Plan {
        shape: format!("R={r} C={c} {}", dt(dtype)),
        flops: 0.0,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("x", &[r, c], dtype)?;
            b.output(&[c, r], dtype);
            Ok(())
        }),
    }
}

/// A second moment: non-negative.
fn second_moment(seed: u64, i: u64) -> f32 {
    1e-3 * (frac(seed, i) as f32)
}

/// One AdamW step over N f32 parameters: read p, g, m, v, write p, m, v (28 bytes each); 16
/// FLOPs per parameter (as bench_cases: scaled gradient 1, m 3, v 4, the bias-corrected step 5
/// with the sqrt, the decayed update 3).
fn adamw(n: usize) -> Plan {
    Plan {
        shape: format!("N={n} f32"),
        flops: 16.0 * n as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("p", &[n], DType::F32)?;
            b.values("g", &[n], DType::F32)?;
            b.values("m", &[n], DType::F32)?;
            b.values_by("v", &[n], DType::F32, true, second_moment)?;
            for _ in 0..3 {
                b.output(&[n], DType::F32);
            }
            Ok(())
        }),
    }
}

/// The squared norm: 2 FLOPs per element.
fn sq_norm(n: usize) -> Plan {
    Plan {
        shape: format!("N={n} f32"),
        flops: 2.0 * n as f64,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("x", &[n], DType::F32)?;
            b.output(&[1], DType::F32);
            Ok(())
        }),
    }
}

/// `n` blocks [r,c] of a flat f32 arena: block k at `base + k*step`, rows `stride` apart; the
/// arena ends `tail` elements after the last block.
#[derive(Clone, Copy)]
struct MuonBlocks {
    n: usize,
    r: usize,
    c: usize,
    stride: usize,
    base: usize,
    step: usize,
    tail: usize,
}

impl MuonBlocks {
    fn len(&self) -> usize {
        self.base + (self.n - 1) * self.step + (self.r - 1) * self.stride + self.c + self.tail
    }
}

/// Muon's momentum + gather (5 FLOPs per element: the momentum's 3, Nesterov's 2; compulsory:
/// g and mom read and mom and x written at the blocks' elements, 16 bytes each) or its apply
/// (3 FLOPs: the decay, the scaled step, the difference; p read and written at the blocks'
/// elements and x read, 12 bytes each).
fn muon(m: MuonBlocks, apply: bool) -> Plan {
    let MuonBlocks { n, r, c, .. } = m;
    let elems = (n * r * c) as f64;
    let layout = if m.stride == m.c && m.step == r * c {
        "contiguous".to_string()
    } else {
        format!("row stride {}", m.stride)
    };
    Plan {
        shape: format!(
            "n={n} blocks [{r},{c}] ({layout}) of an arena of N={} f32",
            m.len()
        ),
        flops: if apply { 3.0 } else { 5.0 } * elems,
        strata: uniform,
        build: Box::new(move |b| {
            let len = m.len();
            let offsets: Vec<i32> = (0..n).map(|k| (m.base + k * m.step) as i32).collect();
            let strides = vec![m.stride as i32; n];
            if apply {
                b.values_by("p", &[len], DType::F32, false, unit)?;
                b.values("x", &[n, r, c], DType::F32)?;
                b.bytes += 8.0 * elems;
            } else {
                b.values_by("g", &[len], DType::F32, false, unit)?;
                b.values_by("mom", &[len], DType::F32, false, unit)?;
                b.param("r", r);
                b.param("c", c);
                b.bytes += 16.0 * elems;
            }
            b.i32s("offsets", &[n], &offsets)?;
            b.i32s("row_strides", &[n], &strides)?;
            Ok(())
        }),
    }
}

/// y = bf16(x): data movement (4 bytes in, 2 out per element).
fn cast_bf16(n: usize) -> Plan {
    Plan {
        shape: format!("N={n} f32 -> bf16"),
        flops: 0.0,
        strata: uniform,
        build: Box::new(move |b| {
            b.values("x", &[n], DType::F32)?;
            b.output(&[n], DType::BF16);
            Ok(())
        }),
    }
}

#[cfg(test)]
mod tests;
