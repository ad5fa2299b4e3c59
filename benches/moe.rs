//! MoE layer forward and backward. CPU at a modest shape (T = 1024 tokens, d = 256, f = 128,
//! E = 16 experts, top-2); CUDA (when a GPU opens; skipped silently otherwise) at that shape and
//! at the H200 target (T = 16384, d = 2048, E = 64, top-8, f = 1024) in BF16. Prints effective TFLOP/s
//! for the GEMM FLOPs the layer must do: forward 2*T*E*d (router) + 3 * 2*T*k*d*f (experts);
//! backward counted as 2x the forward (docs/perf/moe.md).

use criterion::{criterion_group, criterion_main, Criterion};
use sluice_kernels::ops::moe::{moe_backward, moe_forward, MoeConfig};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::hint::black_box;
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
struct Shape {
    t: usize,
    d: usize,
    f: usize,
    e: usize,
    k: usize,
}

const CPU_SHAPE: Shape = Shape {
    t: 1024,
    d: 256,
    f: 128,
    e: 16,
    k: 2,
};
const TARGET: Shape = Shape {
    t: 16384,
    d: 2048,
    f: 1024,
    e: 64,
    k: 8,
};

fn forward_flops(s: Shape) -> f64 {
    (2 * s.t * s.e * s.d + 3 * 2 * s.t * s.k * s.d * s.f) as f64
}

struct Inputs {
    x: Tensor,
    wr: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    dy: Tensor,
}

fn inputs(b: &Backend, s: Shape, dtype: DType) -> Inputs {
    let mut rng = Rng::new(1);
    let sd = 1.0 / (s.d as f32).sqrt();
    let sf = 1.0 / (s.f as f32).sqrt();
    let mut up = |shape: &[usize], scale: f32| {
        let n: usize = shape.iter().product();
        Tensor::from_f32_as(b, shape, dtype, &rng.normal_vec(n, scale)).unwrap()
    };
    Inputs {
        x: up(&[s.t, s.d], 1.0),
        wr: up(&[s.e, s.d], sd),
        w1: up(&[s.e, s.f, s.d], sd),
        w3: up(&[s.e, s.f, s.d], sd),
        w2: up(&[s.e, s.d, s.f], sf),
        dy: up(&[s.t, s.d], 1.0),
    }
}

/// A few timed runs outside criterion, for the TFLOP/s line.
fn report(label: &str, flops: f64, mut once: impl FnMut()) {
    once();
    let reps = 3;
    let start = Instant::now();
    for _ in 0..reps {
        once();
    }
    let s = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "moe {label}: {:.2} ms, {:.3} TFLOP/s effective ({:.2} GFLOP)",
        s * 1e3,
        flops / s / 1e12,
        flops / 1e9
    );
}

fn run_shape(c: &mut Criterion, b: &Backend, name: &str, s: Shape, dtype: DType) {
    let inp = inputs(b, s, dtype);
    let cfg = MoeConfig::new(s.k);
    let fwd = || {
        let out = moe_forward(b, &inp.x, &inp.wr, &inp.w1, &inp.w3, &inp.w2, cfg).unwrap();
        b.synchronize().unwrap();
        black_box(out);
    };
    let bwd = || {
        let g = moe_backward(b, &inp.x, &inp.wr, &inp.w1, &inp.w3, &inp.w2, &inp.dy, cfg).unwrap();
        b.synchronize().unwrap();
        black_box(g);
    };
    let label = format!(
        "{name} T={} d={} f={} E={} k={} {dtype}",
        s.t, s.d, s.f, s.e, s.k
    );
    report(&format!("forward {label}"), forward_flops(s), fwd);
    // The backward recomputes the forward: 3x the forward's FLOPs in all.
    report(&format!("backward {label}"), 3.0 * forward_flops(s), bwd);
    let mut group = c.benchmark_group(format!("moe_{name}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    group.bench_function(format!("forward_{dtype}"), |bench| bench.iter(fwd));
    group.bench_function(format!("backward_{dtype}"), |bench| bench.iter(bwd));
    group.finish();
}

fn bench(c: &mut Criterion) {
    run_shape(c, &Backend::Cpu, "cpu", CPU_SHAPE, DType::F32);
    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        run_shape(c, &gpu, "cuda", CPU_SHAPE, DType::F32);
        run_shape(c, &gpu, "cuda_bf16", CPU_SHAPE, DType::BF16);
        run_shape(c, &gpu, "cuda_target_bf16", TARGET, DType::BF16);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
