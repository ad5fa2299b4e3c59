//! The cases of `sluice bench`: every op at the sizes its issue targets (GPU) and at smaller
//! sizes that finish in seconds on a CPU or the emulator (`quick`).
//!
//! Bytes and FLOPs are counted from each op's math (the minimum it must move and compute), so
//! the report's fractions are against the true roofline, not against what a kernel happens to do.

use crate::bench::{BenchCase, BenchRun, Pass};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops;
use crate::ops::gemm::GemmPath;
use crate::ops::newton_schulz::NsPrecision;
use crate::tensor::Tensor;
use crate::testing::Rng;

mod layer;

/// Inputs for timing: uniform in [-4, 4), from a hash of the index (fast and parallel even for
/// the 1.25e9 logits of the is_gate_loss target; the distribution does not matter for a timing).
/// Element i depends on `seed` and i alone, so a tensor's first rows are the same whatever its
/// row count: `sluice determinism` builds its inputs (and its batch-invariance probes) with it.
pub fn random(backend: &Backend, shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
    use rayon::prelude::*;
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n as u64)
        .into_par_iter()
        .map(|i| {
            let bits = Rng::new(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64();
            (bits >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        })
        .collect();
    Tensor::from_f32_as(backend, shape, dtype, &data)
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// C = A . B^T through `gemm_into_with_path`: the output is allocated once, before the timing.
fn gemm_case(m: usize, n: usize, k: usize, dtype: DType, path: GemmPath) -> BenchCase {
    let path_name = match (dtype, path) {
        (DType::F32, _) => "f32",
        (_, GemmPath::Mma) => "mma",
        (_, GemmPath::Wgmma) => "wgmma",
    };
    BenchCase {
        op: "gemm",
        pass: Pass::Forward,
        path: path_name,
        // The CUDA test runs the wgmma path too where the GPU is sm_90 (kernels/tests/gemm.rs).
        check: "gemm::cuda_matches_cpu_and_is_deterministic",
        cuda_only: false,
        shape: format!("M={m} N={n} K={k} {}", dtype_name(dtype)),
        // read A and B once, write C (f32)
        bytes: ((m * k + n * k) * dtype.size_bytes() + m * n * 4) as f64,
        flops: 2.0 * m as f64 * n as f64 * k as f64,
        prepare: Box::new(move |b| {
            let a = random(b, &[m, k], dtype, 5)?;
            let w = random(b, &[n, k], dtype, 6)?;
            let mut c = Tensor::zeros(b, &[m, n], DType::F32)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::gemm::gemm_into_with_path(b, &a, &w, &mut c, path)
            });
            Ok(run)
        }),
    }
}

/// The attention path of a bench row: the process's (`default`) or v3 (`wgmma`, whose CUDA
/// test checks the same GPU run).
fn attention_row_path(v3: bool, default_check: &'static str) -> (&'static str, &'static str) {
    if v3 {
        (
            "wgmma",
            "attention_wgmma::cuda_matches_the_cpu_and_decode_equals_training",
        )
    } else {
        ("default", default_check)
    }
}

fn path_of(v3: bool) -> Result<ops::attention_tile::AttentionPath> {
    if v3 {
        Ok(ops::attention_tile::AttentionPath::Wgmma)
    } else {
        ops::attention_tile::attention_path()
    }
}

/// Causal training attention over `batch` sequences of `len` tokens, `h` query heads sharing
/// `hkv` key/value heads of width `d`; `v3`: on attention v3 (wgmma) instead of the process's
/// path.
fn attention_case(
    batch: usize,
    len: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    v3: bool,
) -> BenchCase {
    let t = batch * len;
    // Causal: query i sees i + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each.
    let pairs = batch as f64 * (len * (len + 1) / 2) as f64;
    let (path, check) = attention_row_path(v3, "attention::cuda_matches_reference");
    BenchCase {
        op: "attention_forward",
        pass: Pass::Forward,
        path,
        check,
        cuda_only: false,
        shape: format!(
            "{batch}x{len} tokens H={h} Hkv={hkv} D={d} {}",
            dtype_name(dtype)
        ),
        bytes: ((t * h * d + 2 * t * hkv * d) * dtype.size_bytes() + t * h * d * 4) as f64,
        flops: 4.0 * pairs * h as f64 * d as f64,
        prepare: Box::new(move |b| {
            let q = random(b, &[t, h, d], dtype, 7)?;
            let k = random(b, &[t, hkv, d], dtype, 8)?;
            let v = random(b, &[t, hkv, d], dtype, 9)?;
            let cu: Vec<i32> = (0..=batch).map(|i| (i * len) as i32).collect();
            let cu = Tensor::from_slice(b, &[batch + 1], &cu)?;
            let path = path_of(v3)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::attention::attention_forward_on(path, b, &q, &k, &v, &cu, true, None)
                    .map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// Decode: one query per sequence over a `ctx`-token paged context (block size 16); `v3` as
/// [`attention_case`].
fn paged_attention_case(
    batch: usize,
    ctx: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    v3: bool,
) -> BenchCase {
    const BLOCK: usize = 16;
    let blocks_per_seq = ctx.div_ceil(BLOCK);
    let kv_bytes = 2 * batch * ctx * hkv * d * dtype.size_bytes();
    let (path, check) = attention_row_path(v3, "paged_attention::cuda_matches_reference");
    BenchCase {
        op: "paged_attention",
        pass: Pass::Forward,
        path,
        check,
        cuda_only: false,
        shape: format!(
            "B={batch} ctx={ctx} H={h} Hkv={hkv} D={d} {}",
            dtype_name(dtype)
        ),
        bytes: (kv_bytes + batch * h * d * (dtype.size_bytes() + 4)) as f64,
        flops: 4.0 * (batch * ctx * h * d) as f64,
        prepare: Box::new(move |b| {
            let nb = batch * blocks_per_seq;
            let q = random(b, &[batch, h, d], dtype, 10)?;
            let kc = random(b, &[nb, BLOCK, hkv, d], dtype, 11)?;
            let vc = random(b, &[nb, BLOCK, hkv, d], dtype, 12)?;
            let table: Vec<i32> = (0..nb as i32).collect();
            let table = Tensor::from_slice(b, &[batch, blocks_per_seq], &table)?;
            let lens = Tensor::from_slice(b, &[batch], &vec![ctx as i32; batch])?;
            let path = path_of(v3)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::paged_attention::paged_attention_on(path, b, &q, &kc, &vc, &table, &lens, None)
                    .map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// The fused policy loss: two reads and one write of the logits (DESIGN 3.6).
fn is_gate_loss_case(n: usize, v: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "is_gate_loss",
        pass: Pass::Forward,
        path: "default",
        check: "is_gate_loss::cuda_matches_reference",
        cuda_only: false,
        shape: format!("N={n} V={v} {}", dtype_name(dtype)),
        bytes: (3 * n * v * dtype.size_bytes() + n * 4 * 5) as f64,
        flops: (5 * n * v) as f64,
        prepare: Box::new(move |b| {
            let logits = random(b, &[n, v], dtype, 13)?;
            let tokens: Vec<i32> = (0..n).map(|i| ((i * 7919) % v) as i32).collect();
            let tokens = Tensor::from_slice(b, &[n], &tokens)?;
            let behavior = Tensor::from_slice(b, &[n], &vec![-12.0f32; n])?;
            let advantages = Tensor::from_slice(b, &[n], &vec![1.0f32; n])?;
            let mask = Tensor::from_slice(b, &[n], &vec![1.0f32; n])?;
            let params = ops::is_gate_loss::GateParams::default();
            let run: BenchRun = Box::new(move |b: &Backend| {
                let batch = ops::is_gate_loss::TokenBatch {
                    tokens: &tokens,
                    behavior_logp: &behavior,
                    advantages: &advantages,
                    mask: &mask,
                    weight: None,
                    ref_logp: None,
                };
                ops::is_gate_loss::is_gate_loss(b, &logits, &batch, &params).map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// Sampling at temperature 1 with no truncation (the RL default): one read of the logits.
fn sample_case(batch: usize, v: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "sample",
        pass: Pass::Forward,
        path: "default",
        check: "sample::cuda_matches_reference",
        cuda_only: false,
        shape: format!("B={batch} V={v} {}", dtype_name(dtype)),
        bytes: (batch * v * dtype.size_bytes() + batch * 16) as f64,
        flops: (4 * batch * v) as f64,
        prepare: Box::new(move |b| {
            let logits = random(b, &[batch, v], dtype, 14)?;
            let ids: Vec<u64> = (0..batch as u64).collect();
            let ids = Tensor::from_slice(b, &[batch], &ids)?;
            let positions = Tensor::from_slice(b, &[batch], &vec![7i32; batch])?;
            let params = ops::sample::SampleParams::default();
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::sample::sample(b, &logits, &ids, &positions, &params).map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// The path name and the verifying test of an MoE row: the default path (`SLUICE_GEMM_PATH` as
/// the process has it), or every expert GEMM on the Hopper path (`GemmPath::scoped`).
fn moe_path(wgmma: bool, default: &'static str) -> (&'static str, &'static str) {
    if wgmma {
        ("wgmma", "moe::cuda_wgmma_matches_reference")
    } else {
        (default, "moe::cuda_matches_reference")
    }
}

/// The MoE rows' inputs, the same in the forward and backward rows: x [T,d], the router
/// [E,d], W1 and W3 [E,f,d], W2 [E,d,f].
fn moe_inputs(b: &Backend, [t, d, e, f]: [usize; 4], dtype: DType) -> Result<[Tensor; 5]> {
    Ok([
        random(b, &[t, d], dtype, 15)?,
        random(b, &[e, d], dtype, 16)?,
        random(b, &[e, f, d], dtype, 17)?,
        random(b, &[e, f, d], dtype, 18)?,
        random(b, &[e, d, f], dtype, 19)?,
    ])
}

/// An MoE layer forward: router, top-k, sort, three grouped expert GEMMs, combine; `wgmma`
/// puts its BF16 GEMMs on the Hopper path.
fn moe_case(
    t: usize,
    d: usize,
    e: usize,
    k: usize,
    f: usize,
    dtype: DType,
    wgmma: bool,
) -> BenchCase {
    let expert_flops = 3.0 * 2.0 * (t * k) as f64 * d as f64 * f as f64;
    let router_flops = 2.0 * t as f64 * d as f64 * e as f64;
    let (path, check) = moe_path(wgmma, "default");
    BenchCase {
        op: "moe_forward",
        pass: Pass::Forward,
        path,
        check,
        cuda_only: false,
        shape: format!("T={t} d={d} E={e} k={k} f={f} {}", dtype_name(dtype)),
        bytes: ((t * d + e * d + 3 * e * f * d) * dtype.size_bytes() + t * d * 4) as f64,
        flops: expert_flops + router_flops,
        prepare: Box::new(move |b| {
            let [x, wr, w1, w3, w2] = moe_inputs(b, [t, d, e, f], dtype)?;
            let cfg = ops::moe::MoeConfig::new(k);
            let run: BenchRun = Box::new(move |b: &Backend| {
                let _path = wgmma.then(|| GemmPath::scoped(GemmPath::Wgmma));
                ops::moe::moe_forward(b, &x, &wr, &w1, &w3, &w2, cfg).map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// Newton-Schulz over `n` matrices of [r, c] (r <= c), 5 steps: per step A = X X^T (2 r r c),
/// A^2 (2 r r r), B X (2 r r c); `precision` is the products' (f32, or bf16 operands with f32
/// accumulation on the tensor cores).
fn newton_schulz_case(
    n: usize,
    r: usize,
    c: usize,
    dtype: DType,
    precision: NsPrecision,
) -> BenchCase {
    let (r0, c0) = (r.min(c), r.max(c));
    let per_step = 2.0 * (r0 * r0) as f64 * (2 * c0 + r0) as f64;
    BenchCase {
        op: "newton_schulz",
        pass: Pass::Forward,
        path: "default",
        check: "newton_schulz::cuda_",
        cuda_only: false,
        shape: format!(
            "n={n} [{r},{c}] 5 steps {} in, {} products",
            dtype_name(dtype),
            precision.name()
        ),
        bytes: (n * r * c * (dtype.size_bytes() + 4)) as f64,
        flops: 5.0 * n as f64 * per_step,
        prepare: Box::new(move |b| {
            let g = random(b, &[n, r, c], dtype, 20)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::newton_schulz::newton_schulz_with_precision(b, &g, 5, precision).map(|_| ())
            });
            Ok(run)
        }),
    }
}

fn topk_case(t: usize, e: usize, k: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "topk",
        pass: Pass::Forward,
        path: "default",
        check: "topk::cuda_matches_cpu",
        cuda_only: false,
        shape: format!("T={t} E={e} k={k} {}", dtype_name(dtype)),
        bytes: (t * e * dtype.size_bytes() + t * k * 8) as f64,
        flops: 0.0,
        prepare: Box::new(move |b| {
            let scores = random(b, &[t, e], dtype, 1)?;
            let run: BenchRun =
                Box::new(move |b: &Backend| ops::topk::topk(b, &scores, k).map(|_| ()));
            Ok(run)
        }),
    }
}

fn rmsnorm_case(t: usize, d: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "rmsnorm",
        pass: Pass::Forward,
        path: "default",
        check: "rmsnorm::cuda_matches_reference",
        cuda_only: false,
        shape: format!("T={t} d={d} {}", dtype_name(dtype)),
        // read x and w, write y (f32)
        bytes: (t * d * dtype.size_bytes() + d * dtype.size_bytes() + t * d * 4) as f64,
        flops: (4 * t * d) as f64,
        prepare: Box::new(move |b| {
            let x = random(b, &[t, d], dtype, 2)?;
            let w = random(b, &[d], dtype, 3)?;
            let run: BenchRun =
                Box::new(move |b: &Backend| ops::rmsnorm::rmsnorm(b, &x, &w, 1e-6).map(|_| ()));
            Ok(run)
        }),
    }
}

fn softmax_case(t: usize, n: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "softmax",
        pass: Pass::Forward,
        path: "default",
        check: "elementwise::cuda_matches_reference",
        cuda_only: false,
        shape: format!("T={t} n={n} {}", dtype_name(dtype)),
        bytes: (t * n * dtype.size_bytes() + t * n * 4) as f64,
        flops: (4 * t * n) as f64,
        prepare: Box::new(move |b| {
            let x = random(b, &[t, n], dtype, 4)?;
            let run: BenchRun =
                Box::new(move |b: &Backend| ops::elementwise::softmax(b, &x).map(|_| ()));
            Ok(run)
        }),
    }
}

/// The transpose y[C,R] = x[R,C]^T: read x once, write y once (same dtype), no FLOPs.
fn transpose_case(r: usize, c: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "transpose",
        pass: Pass::Forward,
        path: "default",
        check: "elementwise::transpose_cuda_matches_reference",
        cuda_only: false,
        shape: format!("R={r} C={c} {}", dtype_name(dtype)),
        bytes: (2 * r * c * dtype.size_bytes()) as f64,
        flops: 0.0,
        prepare: Box::new(move |b| {
            let x = random(b, &[r, c], dtype, 7)?;
            let run: BenchRun =
                Box::new(move |b: &Backend| ops::elementwise::transpose(b, &x).map(|_| ()));
            Ok(run)
        }),
    }
}

/// One AdamW step over a flat F32 vector of `n` parameters (one segment): read p, g, m, v and
/// write p, m, v (28 bytes per parameter); 16 FLOPs per parameter (the scaled gradient 1, m 3,
/// v 4, the bias-corrected step 5 incl. the sqrt, the decayed update 3).
fn adamw_case(n: usize) -> BenchCase {
    BenchCase {
        op: "adamw",
        pass: Pass::Forward,
        path: "default",
        check: "optim::cuda_matches_reference",
        cuda_only: false,
        shape: format!("N={n} f32"),
        bytes: (28 * n) as f64,
        flops: (16 * n) as f64,
        prepare: Box::new(move |b| {
            let mut p = random(b, &[n], DType::F32, 8)?;
            let g = random(b, &[n], DType::F32, 9)?;
            let mut m = Tensor::zeros(b, &[n], DType::F32)?;
            let mut v = Tensor::zeros(b, &[n], DType::F32)?;
            let table = ops::optim::SegmentTable::new(
                b,
                vec![ops::optim::Segment {
                    start: 0,
                    len: n,
                    weight_decay: 0.1,
                }],
                n,
            )?;
            let hp = ops::optim::AdamWStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                bc1: 0.1,
                bc2: 0.05,
                grad_scale: 1.0,
            };
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::optim::adamw(b, &mut p, &g, &mut m, &mut v, &table, &hp)
            });
            Ok(run)
        }),
    }
}

/// The attention backward alone, from the forward's saved `out` and `lse` (computed once in
/// `prepare`): FLOPs 2.5x the forward's (DESIGN 9.1); bytes: q, k, v, out, dout read, dq, dk,
/// dv written (f32 gradients).
fn attention_backward_case(
    batch: usize,
    len: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
) -> BenchCase {
    let t = batch * len;
    let pairs = batch as f64 * (len * (len + 1) / 2) as f64;
    BenchCase {
        op: "attention_backward",
        pass: Pass::Backward,
        path: "default",
        check: "attention::cuda_matches_reference",
        cuda_only: false,
        shape: format!(
            "{batch}x{len} tokens H={h} Hkv={hkv} D={d} {}",
            dtype_name(dtype)
        ),
        bytes: ((t * h * d + 2 * t * hkv * d) * dtype.size_bytes()
            + (2 * t * h * d + t * h) * 4
            + (t * h * d + 2 * t * hkv * d) * 4) as f64,
        flops: 2.5 * 4.0 * pairs * h as f64 * d as f64,
        prepare: Box::new(move |b| {
            let q = random(b, &[t, h, d], dtype, 7)?;
            let k = random(b, &[t, hkv, d], dtype, 8)?;
            let v = random(b, &[t, hkv, d], dtype, 9)?;
            let dout = random(b, &[t, h, d], DType::F32, 23)?;
            let cu: Vec<i32> = (0..=batch).map(|i| (i * len) as i32).collect();
            let cu = Tensor::from_slice(b, &[batch + 1], &cu)?;
            let fwd = ops::attention::attention_forward(b, &q, &k, &v, &cu, true, None)?;
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::attention::attention_backward_saved(
                    b, &q, &k, &v, &cu, &fwd.out, &fwd.lse, &dout, true, None,
                )
                .map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// The MoE layer backward from the forward's saved state (run once in `prepare`, as the
/// learner's forward does before its backward); FLOPs count the backward's GEMMs, twice the
/// forward's.
fn moe_backward_case(
    t: usize,
    d: usize,
    e: usize,
    k: usize,
    f: usize,
    dtype: DType,
    wgmma: bool,
) -> BenchCase {
    let fwd_flops = 3.0 * 2.0 * (t * k) as f64 * d as f64 * f as f64 + 2.0 * (t * d * e) as f64;
    let (path, check) = moe_path(wgmma, "saved");
    BenchCase {
        op: "moe_backward",
        pass: Pass::Backward,
        path,
        check,
        cuda_only: false,
        shape: format!("T={t} d={d} E={e} k={k} f={f} {}", dtype_name(dtype)),
        bytes: (2 * (t * d + e * d + 3 * e * f * d) * dtype.size_bytes()
            + (t * d + e * d + 3 * e * f * d) * 4) as f64,
        flops: 2.0 * fwd_flops,
        prepare: Box::new(move |b| {
            let [x, wr, w1, w3, w2] = moe_inputs(b, [t, d, e, f], dtype)?;
            let dy = random(b, &[t, d], DType::F32, 24)?;
            let cfg = ops::moe::MoeConfig::new(k);
            let (_, saved) = {
                let _path = wgmma.then(|| GemmPath::scoped(GemmPath::Wgmma));
                ops::moe::moe_forward_saved(b, &x, &wr, &w1, &w3, &w2, cfg)?
            };
            let run: BenchRun = Box::new(move |b: &Backend| {
                let _path = wgmma.then(|| GemmPath::scoped(GemmPath::Wgmma));
                ops::moe::moe_backward_saved(b, &x, &wr, &w1, &w3, &w2, &dy, cfg, Some(&saved))
                    .map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// Which sizes `sluice bench` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// The doc shapes (DESIGN 9.1): what a GPU run times.
    Doc,
    /// Sizes that run in seconds on a CPU or the emulator (the default off a GPU).
    Quick,
    /// The smallest shapes that still launch every kernel path: the dry run of
    /// scripts/gpu-check, every op in a few seconds on emu.
    Tiny,
}

impl Preset {
    pub fn parse(s: &str) -> crate::error::Result<Preset> {
        match s {
            "doc" => Ok(Preset::Doc),
            "quick" => Ok(Preset::Quick),
            "tiny" => Ok(Preset::Tiny),
            other => Err(crate::error::Error::Invalid(format!(
                "unknown bench preset `{other}`; use doc, quick or tiny"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Preset::Doc => "doc",
            Preset::Quick => "quick",
            Preset::Tiny => "tiny",
        }
    }
}

/// Every case of a preset: each op forward (and backward where it has one), both GEMM paths,
/// and the ceilings (copy bandwidth, cuBLAS bf16 GEMM) that the report sets rows against.
pub fn all_cases(preset: Preset) -> Vec<BenchCase> {
    use crate::bench::ceilings::ceiling_cases;
    use GemmPath::{Mma, Wgmma};
    let mut cases = match preset {
        Preset::Tiny => vec![
            gemm_case(64, 64, 64, DType::F32, Mma),
            gemm_case(128, 128, 64, DType::BF16, Mma),
            gemm_case(128, 128, 64, DType::BF16, Wgmma),
            topk_case(64, 32, 4, DType::F32),
            is_gate_loss_case(8, 512, DType::F32),
            sample_case(4, 512, DType::F32),
            newton_schulz_case(2, 16, 32, DType::F32, NsPrecision::Bf16),
            moe_case(32, 32, 4, 2, 32, DType::F32, false),
            moe_backward_case(32, 32, 4, 2, 32, DType::F32, false),
            moe_case(32, 32, 4, 2, 32, DType::BF16, true),
            attention_case(1, 32, 2, 1, 32, DType::F32, false),
            attention_case(1, 64, 2, 1, 64, DType::BF16, true),
            attention_backward_case(1, 32, 2, 1, 32, DType::F32),
            paged_attention_case(2, 64, 2, 1, 32, DType::F32, false),
            paged_attention_case(2, 64, 2, 1, 64, DType::BF16, true),
            rmsnorm_case(32, 64, DType::F32),
            softmax_case(16, 128, DType::F32),
            transpose_case(64, 48, DType::F32),
            adamw_case(4096),
        ],
        Preset::Quick => vec![
            gemm_case(512, 512, 512, DType::F32, Mma),
            gemm_case(256, 256, 256, DType::BF16, Mma),
            gemm_case(256, 256, 256, DType::BF16, Wgmma),
            topk_case(4096, 256, 8, DType::F32),
            is_gate_loss_case(256, 32768, DType::F32),
            sample_case(64, 32768, DType::F32),
            newton_schulz_case(48, 128, 512, DType::F32, NsPrecision::F32),
            newton_schulz_case(48, 128, 512, DType::F32, NsPrecision::Bf16),
            moe_case(1024, 256, 16, 2, 128, DType::F32, false),
            moe_backward_case(256, 128, 8, 2, 64, DType::F32, false),
            attention_case(2, 128, 4, 2, 64, DType::F32, false),
            attention_case(2, 128, 4, 2, 64, DType::BF16, true),
            attention_backward_case(2, 128, 4, 2, 64, DType::F32),
            paged_attention_case(8, 512, 8, 2, 64, DType::F32, false),
            paged_attention_case(8, 512, 8, 2, 64, DType::BF16, true),
            rmsnorm_case(1024, 1024, DType::F32),
            softmax_case(256, 4096, DType::F32),
            transpose_case(1024, 1000, DType::F32),
            adamw_case(1 << 20),
        ],
        Preset::Doc => vec![
            gemm_case(4096, 4096, 4096, DType::BF16, Mma),
            gemm_case(4096, 4096, 4096, DType::BF16, Wgmma),
            gemm_case(8192, 8192, 8192, DType::BF16, Mma),
            gemm_case(8192, 8192, 8192, DType::BF16, Wgmma),
            gemm_case(4096, 4096, 4096, DType::F32, Mma),
            topk_case(65536, 256, 8, DType::F32),
            is_gate_loss_case(8192, 152064, DType::BF16),
            sample_case(256, 152064, DType::BF16),
            newton_schulz_case(48, 128, 4096, DType::BF16, NsPrecision::Bf16),
            newton_schulz_case(64, 1024, 2048, DType::BF16, NsPrecision::Bf16),
            newton_schulz_case(48, 128, 4096, DType::BF16, NsPrecision::F32),
            newton_schulz_case(64, 1024, 2048, DType::BF16, NsPrecision::F32),
            moe_case(16384, 2048, 64, 8, 1024, DType::BF16, false),
            moe_case(16384, 2048, 64, 8, 1024, DType::BF16, true),
            moe_backward_case(16384, 2048, 64, 8, 1024, DType::BF16, false),
            moe_backward_case(16384, 2048, 64, 8, 1024, DType::BF16, true),
            attention_case(8, 4096, 32, 32, 128, DType::BF16, false),
            attention_case(8, 4096, 32, 32, 128, DType::BF16, true),
            attention_backward_case(8, 4096, 32, 32, 128, DType::BF16),
            paged_attention_case(256, 4096, 32, 32, 128, DType::BF16, false),
            paged_attention_case(256, 4096, 32, 32, 128, DType::BF16, true),
            topk_case(65536, 256, 8, DType::BF16),
            rmsnorm_case(16384, 2048, DType::BF16),
            softmax_case(8192, 8192, DType::BF16),
            transpose_case(16384, 2048, DType::BF16),
            transpose_case(8192, 8192, DType::F32),
            adamw_case(1 << 28),
        ],
    };
    // The layer's supporting ops, forward and backward.
    cases.extend(match preset {
        Preset::Tiny => layer::layer_cases(
            (32, 64),
            (32, 64),
            (16, 2, 32),
            (16, 64, 32),
            (16, 128),
            DType::F32,
        ),
        Preset::Quick => layer::layer_cases(
            (1024, 1024),
            (2048, 512),
            (512, 8, 64),
            (1024, 4096, 256),
            (256, 4096),
            DType::F32,
        ),
        Preset::Doc => layer::layer_cases(
            (16384, 2048),
            (131072, 1024),
            (32768, 32, 128),
            (16384, 152064, 2048),
            (8192, 8192),
            DType::BF16,
        ),
    });
    // The ceilings first: a run cut short still has what its rows are measured against.
    let (copy_bytes, gemm) = match preset {
        Preset::Doc => (1 << 30, (8192, 8192, 8192)),
        Preset::Quick => (64 << 20, (1024, 1024, 1024)),
        Preset::Tiny => (1 << 20, (128, 128, 64)),
    };
    let mut all = ceiling_cases(copy_bytes, gemm);
    all.append(&mut cases);
    all
}

/// The case table as JSON (`sluice bench --list-json`): what scripts/peers/ reads, so the
/// peers time exactly the shapes the bench times.
pub fn cases_json(cases: &[BenchCase]) -> serde_json::Value {
    serde_json::Value::Array(
        cases
            .iter()
            .map(|c| {
                serde_json::json!({
                    "op": c.op, "pass": c.pass.name(), "path": c.path, "shape": c.shape,
                    "bytes": c.bytes, "flops": c.flops,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::time_case;

    /// The transpose and AdamW cases run on the CPU and count their bytes.
    #[test]
    fn transpose_and_adamw_cases_run() {
        for case in [transpose_case(33, 17, DType::BF16), adamw_case(1000)] {
            let r =
                time_case(&case, &Backend::Cpu, &crate::bench::TimingConfig::default()).unwrap();
            assert!(r.median_s > 0.0 && case.bytes > 0.0, "{}", case.op);
        }
        assert_eq!(
            transpose_case(33, 17, DType::BF16).bytes,
            (2 * 33 * 17 * 2) as f64
        );
        assert_eq!(adamw_case(1000).bytes, 28_000.0);
    }
}
