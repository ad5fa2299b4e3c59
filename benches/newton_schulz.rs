//! newton_schulz: CPU at 48 x [128,512] (a scaled-down stand-in for the head-block target),
//! 5 steps, the f32 and the bf16 path; CUDA at the targets (48 x [128,4096] and
//! 64 x [1024,2048]; BF16 input on the bf16 path (the target), BF16 and F32 input on the f32
//! path) when a GPU is present (skipped silently otherwise). Prints TFLOP/s for the FLOPs the
//! iteration must do: per matrix and step (r <= c after the transpose)
//! 2 r r c (A = X X^T) + 2 r r r (A^2) + 2 r r c (Bm X).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_kernels::ops::newton_schulz::{newton_schulz_with_precision, NsPrecision};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::hint::black_box;
use std::time::{Duration, Instant};

const STEPS: usize = 5;

fn flops(n: usize, r: usize, c: usize) -> f64 {
    let (r, c) = (r.min(c) as f64, r.max(c) as f64);
    n as f64 * STEPS as f64 * (4.0 * r * r * c + 2.0 * r * r * r)
}

fn report(label: &str, n: usize, r: usize, c: usize, mut once: impl FnMut()) {
    once();
    let reps = 3;
    let start = Instant::now();
    for _ in 0..reps {
        once();
    }
    let s = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "newton_schulz {label} {n}x[{r},{c}] steps={STEPS}: {:.2} ms, {:.2} GFLOP, {:.3} TFLOP/s",
        s * 1e3,
        flops(n, r, c) / 1e9,
        flops(n, r, c) / s / 1e12
    );
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("newton_schulz");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(3));

    let cpu = Backend::Cpu;
    let (n, r, cc) = (48, 128, 512);
    let data = Rng::new(1).normal_vec(n * r * cc, 1.0);
    let g = Tensor::from_f32_as(&cpu, &[n, r, cc], DType::F32, &data).unwrap();
    for prec in [NsPrecision::F32, NsPrecision::Bf16] {
        let p = prec.name();
        report(&format!("cpu F32 in, {p} products"), n, r, cc, || {
            black_box(newton_schulz_with_precision(&cpu, &g, STEPS, prec).unwrap());
        });
        group.throughput(Throughput::Elements(flops(n, r, cc) as u64));
        group.bench_function(format!("cpu_F32_{p}_{n}x{r}x{cc}"), |b| {
            b.iter(|| black_box(newton_schulz_with_precision(&cpu, &g, STEPS, prec).unwrap()))
        });
    }

    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        for &(n, r, cc) in &[(48, 128, 4096), (64, 1024, 2048)] {
            let data = Rng::new(2).normal_vec(n * r * cc, 1.0);
            for (dtype, prec) in [
                (DType::BF16, NsPrecision::Bf16),
                (DType::BF16, NsPrecision::F32),
                (DType::F32, NsPrecision::F32),
            ] {
                let p = prec.name();
                let g = Tensor::from_f32_as(&gpu, &[n, r, cc], dtype, &data).unwrap();
                let mut run = || {
                    black_box(newton_schulz_with_precision(&gpu, &g, STEPS, prec).unwrap());
                    gpu.synchronize().unwrap();
                };
                report(
                    &format!("cuda {dtype} in, {p} products"),
                    n,
                    r,
                    cc,
                    &mut run,
                );
                group.throughput(Throughput::Elements(flops(n, r, cc) as u64));
                group.bench_function(format!("cuda_{dtype}_{p}_{n}x{r}x{cc}"), |b| {
                    b.iter(&mut run)
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
