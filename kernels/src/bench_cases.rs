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
            rmsnorm_case(1024, 1024, DType::F32),
            softmax_case(256, 4096, DType::F32),
        ]
    } else {
        vec![
            gemm_case(4096, 4096, 4096, DType::BF16),
            gemm_case(8192, 8192, 8192, DType::BF16),
            gemm_case(4096, 4096, 4096, DType::F32),
            topk_case(65536, 256, 8, DType::F32),
            topk_case(65536, 256, 8, DType::BF16),
            rmsnorm_case(16384, 2048, DType::BF16),
            softmax_case(8192, 8192, DType::BF16),
        ]
    }
}
