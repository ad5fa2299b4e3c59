//! `sample`: batch-invariant next-token sampling over logits[B,V] (DESIGN.md 3.3).
//! CUDA: `kernels/cuda/sample.cu` (one 256-thread block per row).
//!
//! Per row, with `z = logits * scale`, `scale = 1 / temperature` (1 when greedy):
//! - The log-prob is `z[token] - lse(z)` from THE shared row reduction
//!   ([`super::row_reduce`]): at temperature 1 (and for greedy, which reports the log-prob at
//!   temperature 1) it equals is_gate_loss's `logp` for the same row, bit for bit, on each
//!   device. It is always under the full log_softmax(z), not the truncated distribution.
//! - temperature = 0: greedy, the argmax of the logits, ties to the lower index.
//! - Otherwise Gumbel-max: `token = argmax_j (z_j + G_j)` over the candidate set (ties to the
//!   lower index), which samples exactly from softmax(z) restricted to the set. `G_j =
//!   -ln(-ln u_j)` with `u_j` the open uniform of one Philox4x32-10 word ([`super::philox`]):
//!   key = seed; counter = (group, position, request id low, request id high) where, for lane
//!   `l = j % 256` and step `i = j / 256` of the shared row order, group = `(i / 4) * 256 + l`
//!   and the word is `i % 4` (each device thread draws one Philox block per four of its
//!   entries). The noise depends only on (seed, request id, position, j): batch-invariant.
//! - Candidate set: every entry when top_k = 0 (or >= V) and top_p = 1: then sampling is a single
//!   pass fused with the row reduction. Otherwise entries are ranked by the key
//!   `comp_j = ord(z_j) << 18 | (262143 - j)` (`ord` maps f32 order to u32 order; the low bits
//!   break ties toward the lower index, so all keys differ, V <= 2^18). top_k keeps
//!   `comp_j >= tau_k`, tau_k the k-th largest key; top_p then keeps `comp_j >= tau_p`, the
//!   largest threshold whose kept mass `sum exp(z_j - max z)` (shared lane order and tree) is
//!   at least `top_p` times the mass kept by top_k, and positive. Both thresholds are found by a
//!   bitwise binary search over the 50-bit keys (one counting or mass pass of the row per bit):
//!   exact and deterministic, no sort. top_p = 0 keeps only the argmax.
//! - A row whose logits are all -inf samples token 0 with log-prob -inf (never NaN). +inf or NaN
//!   logits are not supported.

use super::philox::{gumbel, philox4x32_10, sampler_counter, sampler_key};
use super::row_reduce::{lane_tree, row_logprob, Logit, RowLanes, ROW_LANES};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::runner::{OpCall, OpOutputs, OpSpec, ParamSpec, TensorSpec};
use crate::tensor::Tensor;
use half::bf16;
use rayon::prelude::*;

/// Largest vocabulary the sampler takes (the tie-break field of the ranking key is 18 bits).
pub const MAX_VOCAB: usize = 1 << 18;
/// A bound on the Gumbel noise plus margin: the largest noise is -ln(-ln(1 - 2^-24)) = 16.64;
/// the margin 15.4 absorbs the rounding of `z + GUMBEL_BOUND` for |z| < 2^27.
pub const GUMBEL_BOUND: f32 = 32.0;
/// Bits of the ranking key `ord(z) << 18 | (262143 - j)`.
const KEY_BITS: u32 = 50;

/// Sampling parameters (defaults of DESIGN.md section 7).
#[derive(Clone, Copy, Debug)]
pub struct SampleParams {
    pub seed: u64,
    /// 0 = greedy; otherwise > 0 and finite.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// In [0, 1]; 1 = off.
    pub top_p: f32,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            seed: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl SampleParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::param(
                "temperature",
                "must be finite and >= 0 (0 = greedy)",
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(Error::param("top_p", "must be in [0, 1] (1 = off)"));
        }
        Ok(())
    }
    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }
    /// The multiplier applied to the logits (exactly 1 at temperature 1 and when greedy).
    pub fn scale(&self) -> f32 {
        if self.greedy() {
            1.0
        } else {
            1.0 / self.temperature
        }
    }
    fn top_k_active(&self, v: usize) -> bool {
        self.top_k > 0 && self.top_k < v
    }
    fn filtered(&self, v: usize) -> bool {
        !self.greedy() && (self.top_k_active(v) || self.top_p < 1.0)
    }
}

/// Maps f32 order onto u32 order (the device's `ord_key`).
#[inline]
pub fn ord_key(z: f32) -> u32 {
    let b = z.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The ranking key of entry `j` (distinct for distinct j; larger = ranked first).
#[inline]
pub fn rank_key(z: f32, j: usize) -> u64 {
    ((ord_key(z) as u64) << 18) | (MAX_VOCAB - 1 - j) as u64
}

/// The Philox word of entry `j` of a row (see the module comment for the layout).
#[inline]
pub fn noise_word(seed: u64, request_id: u64, position: i32, j: usize) -> u32 {
    let (i, l) = (j / ROW_LANES, j % ROW_LANES);
    let group = ((i / 4) * ROW_LANES + l) as u32;
    philox4x32_10(
        sampler_counter(request_id, position, group),
        sampler_key(seed),
    )[i % 4]
}

/// Better candidate in the argmax order: larger score, ties to the lower index.
#[inline]
fn better(a: (f32, usize), b: (f32, usize)) -> (f32, usize) {
    if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) {
        b
    } else {
        a
    }
}

/// The largest 50-bit threshold `c` with `pred(c)` (pred monotone non-increasing, pred(0)).
fn search(mut pred: impl FnMut(u64) -> bool) -> u64 {
    let mut t = 0u64;
    for bit in (0..KEY_BITS).rev() {
        let c = t | (1u64 << bit);
        if pred(c) {
            t = c;
        }
    }
    t
}

/// One row of the CPU reference: (token, log-prob).
pub fn sample_row<T: Logit>(
    row: &[T],
    request_id: u64,
    position: i32,
    p: &SampleParams,
) -> (i32, f32) {
    let v = row.len();
    let scale = p.scale();
    let z = |j: usize| row[j].to_f32() * scale;
    // The shared row order (lanes, then the tree): identical to row_reduce::row_lse_state.
    let mut lanes = RowLanes::default();
    let mut best = (f32::NEG_INFINITY, usize::MAX);
    let single_pass = !p.filtered(v);
    // Philox words of the current four chunks, one block per lane (the device's layout).
    let mut words = [[0u32; 4]; ROW_LANES];
    let mut loaded = [usize::MAX; ROW_LANES];
    for (c, chunk) in row.chunks(ROW_LANES).enumerate() {
        lanes.push_chunk(chunk, scale);
        if !single_pass {
            continue;
        }
        if p.greedy() {
            for (l, &x) in chunk.iter().enumerate() {
                best = better(best, (x.to_f32() * scale, c * ROW_LANES + l));
            }
            continue;
        }
        for (l, &x) in chunk.iter().enumerate() {
            let zj = x.to_f32() * scale;
            // Pruning (the device's too): the noise is below GUMBEL_BOUND, so an entry this far
            // under the best score cannot win; skipping it changes nothing but the work.
            if zj + GUMBEL_BOUND < best.0 {
                continue;
            }
            let group = (c / 4) * ROW_LANES + l;
            if loaded[l] != group {
                words[l] = philox4x32_10(
                    sampler_counter(request_id, position, group as u32),
                    sampler_key(p.seed),
                );
                loaded[l] = group;
            }
            best = better(best, (zj + gumbel(words[l][c % 4]), c * ROW_LANES + l));
        }
    }
    let st = lanes.finish();
    let lse = st.lse();
    if st.m == f32::NEG_INFINITY {
        return (0, f32::NEG_INFINITY);
    }
    if !single_pass {
        let lane_sum = |keep: &dyn Fn(usize) -> bool| -> f32 {
            let mut acc = [0.0f32; ROW_LANES];
            for j in 0..v {
                if keep(j) {
                    acc[j % ROW_LANES] += (z(j) - st.m).exp();
                }
            }
            lane_tree(&mut acc, |a, b| a + b)
        };
        let mut lo = 0u64;
        if p.top_k_active(v) {
            lo = search(|c| (0..v).filter(|&j| rank_key(z(j), j) >= c).count() >= p.top_k);
        }
        if p.top_p < 1.0 {
            let total = lane_sum(&|j| rank_key(z(j), j) >= lo);
            let target = p.top_p * total;
            let tp = search(|c| {
                let c = c.max(lo);
                let mass = lane_sum(&|j| rank_key(z(j), j) >= c);
                mass > 0.0 && mass >= target
            });
            lo = lo.max(tp);
        }
        for j in 0..v {
            let zj = z(j);
            if rank_key(zj, j) >= lo {
                let score = zj + gumbel(noise_word(p.seed, request_id, position, j));
                best = better(best, (score, j));
            }
        }
    }
    let tok = best.1;
    (tok as i32, row_logprob(z(tok), lse))
}

/// The CPU reference over a [b, v] batch: (tokens, log-probs).
pub fn sample_reference<T: Logit>(
    logits: &[T],
    b: usize,
    v: usize,
    request_ids: &[u64],
    positions: &[i32],
    p: &SampleParams,
) -> Result<(Vec<i32>, Vec<f32>)> {
    p.validate()?;
    if b == 0 || v == 0 || v > MAX_VOCAB || logits.len() != b * v {
        return Err(Error::shape(
            "logits",
            format!("[B,V] with B >= 1 and 1 <= V <= {MAX_VOCAB}"),
            &[logits.len()],
        ));
    }
    if request_ids.len() != b {
        return Err(Error::shape(
            "request_ids",
            format!("[B] with B = {b}"),
            &[request_ids.len()],
        ));
    }
    if positions.len() != b {
        return Err(Error::shape(
            "positions",
            format!("[B] with B = {b}"),
            &[positions.len()],
        ));
    }
    let rows: Vec<(i32, f32)> = logits
        .par_chunks(v)
        .enumerate()
        .map(|(r, row)| {
            #[cfg(feature = "planted-faults")]
            let key = crate::planted::sample_key(request_ids[r], r);
            #[cfg(not(feature = "planted-faults"))]
            let key = request_ids[r];
            sample_row(row, key, positions[r], p)
        })
        .collect();
    Ok(rows.into_iter().unzip())
}

/// Samples one token per row on the backend; returns (tokens I32[B], logprobs F32[B]).
pub fn sample(
    backend: &Backend,
    logits: &Tensor,
    request_ids: &Tensor,
    positions: &Tensor,
    p: &SampleParams,
) -> Result<(Tensor, Tensor)> {
    p.validate()?;
    logits.expect_rank("logits", 2, "[B,V]")?;
    if !logits.dtype().is_float() {
        return Err(Error::DType {
            tensor: "logits".into(),
            expected: "F32 or BF16".into(),
            got: logits.dtype().to_string(),
        });
    }
    let (b, v) = (logits.shape()[0], logits.shape()[1]);
    if b == 0 || v == 0 || v > MAX_VOCAB || b > i32::MAX as usize {
        return Err(Error::shape(
            "logits",
            format!("[B,V] with B >= 1 and 1 <= V <= {MAX_VOCAB}"),
            logits.shape(),
        ));
    }
    for (name, t, dtype) in [
        ("request_ids", request_ids, DType::U64),
        ("positions", positions, DType::I32),
    ] {
        if t.shape() != [b] {
            return Err(Error::shape(
                name,
                format!("[B] with B = {b} (the rows of logits)"),
                t.shape(),
            ));
        }
        t.expect_dtype(name, dtype)?;
    }
    match backend {
        Backend::Cpu => {
            let ids = request_ids.host_slice::<u64>()?;
            let pos = positions.host_slice::<i32>()?;
            let (tokens, logprobs) = match logits.dtype() {
                DType::F32 => sample_reference(logits.host_slice::<f32>()?, b, v, ids, pos, p)?,
                _ => sample_reference(logits.host_slice::<bf16>()?, b, v, ids, pos, p)?,
            };
            Ok((
                Tensor::from_slice(backend, &[b], &tokens)?,
                Tensor::from_slice(backend, &[b], &logprobs)?,
            ))
        }
        _ => {
            let tokens = Tensor::poisoned(backend, &[b], DType::I32)?;
            let logprobs = Tensor::poisoned(backend, &[b], DType::F32)?;
            let kernel = match logits.dtype() {
                DType::F32 => "sample_f32",
                _ => "sample_bf16",
            };
            let top_k = if p.top_k_active(v) { p.top_k as i32 } else { 0 };
            backend.launch(
                &Launch::new(kernel, [b as u32, 1, 1], [ROW_LANES as u32, 1, 1])
                    .arg_tensor(logits)
                    .arg_tensor(request_ids)
                    .arg_tensor(positions)
                    .arg_tensor(&tokens)
                    .arg_tensor(&logprobs)
                    .arg_i32(v as i32)
                    .arg_u64(p.seed)
                    .arg_i32(p.greedy() as i32)
                    .arg_f32(p.scale())
                    .arg_i32(top_k)
                    .arg_f32(p.top_p),
            )?;
            Ok((tokens, logprobs))
        }
    }
}

fn run_spec(backend: &Backend, call: &OpCall) -> Result<OpOutputs> {
    let p = SampleParams {
        seed: call.param_u64("seed")?,
        temperature: call.param_f32("temperature")?,
        top_k: call.param_usize("top_k")?,
        top_p: call.param_f32("top_p")?,
    };
    let (tokens, logprobs) = sample(
        backend,
        call.tensor("logits")?,
        call.tensor("request_ids")?,
        call.tensor("positions")?,
        &p,
    )?;
    Ok(vec![("tokens", tokens), ("logprobs", logprobs)])
}

/// The `sluice kernel sample` row (DESIGN.md section 7).
pub static SPEC: OpSpec = OpSpec {
    name: "sample",
    summary: "batch-invariant sampling (Gumbel-max on Philox4x32-10 keyed by seed, request id, position); \
              logprobs under log_softmax(logits/temperature), at temperature 1 when greedy",
    inputs: &[
        TensorSpec { name: "logits", shape: "[B,V]", dtypes: "F32|BF16" },
        TensorSpec { name: "request_ids", shape: "[B]", dtypes: "U64" },
        TensorSpec { name: "positions", shape: "[B]", dtypes: "I32" },
    ],
    params: &[
        ParamSpec { name: "seed", default: Some("0"), help: "u64 generator key" },
        ParamSpec { name: "temperature", default: Some("1"), help: "0 = greedy" },
        ParamSpec { name: "top_k", default: Some("0"), help: "0 = off" },
        ParamSpec { name: "top_p", default: Some("1"), help: "1 = off" },
    ],
    outputs: &[
        TensorSpec { name: "tokens", shape: "[B]", dtypes: "I32" },
        TensorSpec { name: "logprobs", shape: "[B]", dtypes: "F32" },
    ],
    run: run_spec,
};
