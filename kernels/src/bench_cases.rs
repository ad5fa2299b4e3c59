//! The cases of `sluice bench`: every op at the sizes its issue targets (GPU) and at smaller
//! sizes that finish in seconds on a CPU or the emulator (`quick`).
//!
//! Bytes and FLOPs are counted from each op's math (the minimum it must move and compute), so
//! the report's fractions are against the true roofline, not against what a kernel happens to do.

use crate::bench::{BenchCase, BenchRun};
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops;
use crate::tensor::Tensor;
use crate::testing::Rng;

fn random(backend: &Backend, shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    Tensor::from_f32_as(backend, shape, dtype, &Rng::new(seed).normal_vec(n, 1.0))
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

fn gemm_case(m: usize, n: usize, k: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "gemm",
        shape: format!("M={m} N={n} K={k} {}", dtype_name(dtype)),
        // read A and B once, write C (f32)
        bytes: ((m * k + n * k) * dtype.size_bytes() + m * n * 4) as f64,
        flops: 2.0 * m as f64 * n as f64 * k as f64,
        prepare: Box::new(move |b| {
            let a = random(b, &[m, k], dtype, 5)?;
            let w = random(b, &[n, k], dtype, 6)?;
            let run: BenchRun = Box::new(move |b: &Backend| ops::gemm::gemm(b, &a, &w).map(|_| ()));
            Ok(run)
        }),
    }
}

/// Causal training attention over `batch` sequences of `len` tokens, `h` query heads sharing
/// `hkv` key/value heads of width `d`.
fn attention_case(
    batch: usize,
    len: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
) -> BenchCase {
    let t = batch * len;
    // Causal: query i sees i + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each.
    let pairs = batch as f64 * (len * (len + 1) / 2) as f64;
    BenchCase {
        op: "attention_forward",
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
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::attention::attention_forward(b, &q, &k, &v, &cu, true, None).map(|_| ())
            });
            Ok(run)
        }),
    }
}

/// Decode: one query per sequence over a `ctx`-token paged context (block size 16).
fn paged_attention_case(
    batch: usize,
    ctx: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
) -> BenchCase {
    const BLOCK: usize = 16;
    let blocks_per_seq = ctx.div_ceil(BLOCK);
    let kv_bytes = 2 * batch * ctx * hkv * d * dtype.size_bytes();
    BenchCase {
        op: "paged_attention",
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
            let run: BenchRun = Box::new(move |b: &Backend| {
                ops::paged_attention::paged_attention(b, &q, &kc, &vc, &table, &lens, None)
                    .map(|_| ())
            });
            Ok(run)
        }),
    }
}

fn topk_case(t: usize, e: usize, k: usize, dtype: DType) -> BenchCase {
    BenchCase {
        op: "topk",
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

/// All cases; `quick` keeps to sizes that run in seconds on a CPU or the emulator.
pub fn all_cases(quick: bool) -> Vec<BenchCase> {
    if quick {
        vec![
            gemm_case(512, 512, 512, DType::F32),
            gemm_case(256, 256, 256, DType::BF16),
            topk_case(4096, 256, 8, DType::F32),
            attention_case(2, 128, 4, 2, 64, DType::F32),
            paged_attention_case(8, 512, 8, 2, 64, DType::F32),
            rmsnorm_case(1024, 1024, DType::F32),
            softmax_case(256, 4096, DType::F32),
        ]
    } else {
        vec![
            gemm_case(4096, 4096, 4096, DType::BF16),
            gemm_case(8192, 8192, 8192, DType::BF16),
            gemm_case(4096, 4096, 4096, DType::F32),
            topk_case(65536, 256, 8, DType::F32),
            attention_case(8, 4096, 32, 32, 128, DType::BF16),
            paged_attention_case(256, 4096, 32, 32, 128, DType::BF16),
            topk_case(65536, 256, 8, DType::BF16),
            rmsnorm_case(16384, 2048, DType::BF16),
            softmax_case(8192, 8192, DType::BF16),
        ]
    }
}
