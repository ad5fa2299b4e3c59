//! topk at the router's target shape (T = 65536 tokens, E = 256 experts, k = 8): CPU always,
//! CUDA when a GPU is present (skipped silently otherwise). Prints rows/s and effective GB/s
//! for the bytes the op must move: T*E*sizeof(score) read + T*k*(4 + 4) written.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_kernels::ops::topk::{topk, topk_into_version, KernelVersion};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::hint::black_box;
use std::time::{Duration, Instant};

const T: usize = 65536;
const E: usize = 256;
const K: usize = 8;

fn bytes(dtype: DType) -> u64 {
    (T * E * dtype.size_bytes() + T * K * 8) as u64
}

/// This process's user + system CPU seconds (Linux /proc; None elsewhere). On a shared machine
/// wall time counts other people's work; CPU time per call does not.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ is 100 on Linux
}

/// A few timed runs outside criterion, for the rows/s and GB/s line.
fn report(label: &str, dtype: DType, mut once: impl FnMut()) {
    once();
    let reps = 5;
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    for _ in 0..reps {
        once();
    }
    let s = start.elapsed().as_secs_f64() / reps as f64;
    let cpu = match (cpu0, cpu_seconds()) {
        (Some(a), Some(b)) => format!(", {:.1} ms CPU time per call", (b - a) / reps as f64 * 1e3),
        _ => String::new(),
    };
    println!(
        "topk {label} {dtype} T={T} E={E} k={K}: {:.3} ms wall, {:.2} M rows/s, {:.2} GB/s effective{cpu}",
        s * 1e3,
        T as f64 / s / 1e6,
        bytes(dtype) as f64 / s / 1e9
    );
}

fn bench(c: &mut Criterion) {
    let mut rng = Rng::new(1);
    let data = rng.normal_vec(T * E, 1.0);
    let mut group = c.benchmark_group("topk");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));

    let cpu = Backend::Cpu;
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::from_f32_as(&cpu, &[T, E], dtype, &data).unwrap();
        report("cpu", dtype, || {
            black_box(topk(&cpu, &x, K).unwrap());
        });
        group.throughput(Throughput::Bytes(bytes(dtype)));
        group.bench_function(format!("cpu_{dtype}_T{T}_E{E}_k{K}"), |b| {
            b.iter(|| black_box(topk(&cpu, &x, K).unwrap()))
        });
    }

    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        for dtype in [DType::F32, DType::BF16] {
            for version in [KernelVersion::V1, KernelVersion::V2] {
                let x = Tensor::from_f32_as(&gpu, &[T, E], dtype, &data).unwrap();
                // Outputs allocated once: the timing is the kernel, not cudaMalloc + poison upload.
                let mut v = Tensor::poisoned(&gpu, &[T, K], DType::F32).unwrap();
                let mut i = Tensor::poisoned(&gpu, &[T, K], DType::I32).unwrap();
                let mut run = || {
                    topk_into_version(&gpu, &x, K, &mut v, &mut i, version).unwrap();
                    gpu.synchronize().unwrap();
                };
                report(&format!("cuda {version:?}"), dtype, &mut run);
                group.throughput(Throughput::Bytes(bytes(dtype)));
                group.bench_function(format!("cuda_{version:?}_{dtype}_T{T}_E{E}_k{K}"), |b| {
                    b.iter(&mut run)
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
