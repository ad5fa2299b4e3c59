//! Benchmarks of the model's supporting ops (rmsnorm, rope, swiglu, embedding, residual add,
//! softmax, transpose; forward and backward). CPU: the plain-slice references the model calls on the cpu
//! device. CUDA (when a GPU exists; skipped silently otherwise): the device entry points, f32
//! and bf16 inputs, synchronised per iteration. Criterion reports effective GB/s from the bytes
//! each op must move (inputs read once + outputs written once; docs/perf/<family>.md).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sluice_kernels::ops::{elementwise, embedding, rmsnorm, rope, swiglu};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::hint::black_box;
use std::time::Duration;

/// CPU shapes are kept small enough for a 2-core machine; GPU shapes are the model's.
struct Shapes {
    t: usize,
    d: usize,
    heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
}

const CPU: Shapes = Shapes {
    t: 1024,
    d: 1024,
    heads: 8,
    head_dim: 128,
    ffn: 1024,
    vocab: 8192,
};
const GPU: Shapes = Shapes {
    t: 16384,
    d: 2048,
    heads: 32,
    head_dim: 128,
    ffn: 1024 * 8,
    vocab: 151936,
};

fn data(n: usize, seed: u64) -> Vec<f32> {
    Rng::new(seed).normal_vec(n, 1.0)
}

fn tokens(t: usize, vocab: usize) -> Vec<i32> {
    let mut rng = Rng::new(9);
    (0..t).map(|_| rng.below(vocab) as i32).collect()
}

fn positions(t: usize) -> Vec<i32> {
    (0..t).map(|i| (i % 4096) as i32).collect()
}

fn configure<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g
}

fn bench_cpu(c: &mut Criterion) {
    let s = CPU;
    let (t, d) = (s.t, s.d);
    let x = data(t * d, 1);
    let w = data(d, 2);
    let dy = data(t * d, 3);
    let f4 = 4u64;

    let mut g = configure(c, "cpu");
    g.throughput(Throughput::Bytes(f4 * (2 * t * d + d) as u64));
    g.bench_function(BenchmarkId::new("rmsnorm", format!("{t}x{d}")), |b| {
        b.iter(|| {
            black_box(rmsnorm::rmsnorm_reference(&x, &w, t, d, rmsnorm::DEFAULT_EPS).unwrap())
        })
    });
    g.throughput(Throughput::Bytes(f4 * (4 * t * d + 2 * d) as u64));
    g.bench_function(
        BenchmarkId::new("rmsnorm_backward", format!("{t}x{d}")),
        |b| {
            b.iter(|| {
                black_box(
                    rmsnorm::rmsnorm_backward_reference(&x, &w, &dy, t, d, rmsnorm::DEFAULT_EPS)
                        .unwrap(),
                )
            })
        },
    );

    let (h, hd) = (s.heads, s.head_dim);
    let q = data(t * h * hd, 4);
    let pos = positions(t);
    g.throughput(Throughput::Bytes(f4 * (2 * t * h * hd + t) as u64));
    g.bench_function(BenchmarkId::new("rope", format!("{t}x{h}x{hd}")), |b| {
        b.iter(|| black_box(rope::rope_reference(&q, &pos, t, h, hd, rope::DEFAULT_THETA).unwrap()))
    });

    let f = s.ffn;
    let (a, bb, dh) = (data(t * f, 5), data(t * f, 6), data(t * f, 7));
    g.throughput(Throughput::Bytes(f4 * (3 * t * f) as u64));
    g.bench_function(BenchmarkId::new("swiglu", format!("{t}x{f}")), |b| {
        b.iter(|| black_box(swiglu::swiglu_reference(&a, &bb).unwrap()))
    });
    g.throughput(Throughput::Bytes(f4 * (5 * t * f) as u64));
    g.bench_function(
        BenchmarkId::new("swiglu_backward", format!("{t}x{f}")),
        |b| b.iter(|| black_box(swiglu::swiglu_backward_reference(&a, &bb, &dh).unwrap())),
    );

    let v = s.vocab;
    let table = data(v * d, 8);
    let tok = tokens(t, v);
    g.throughput(Throughput::Bytes(f4 * (2 * t * d + t) as u64));
    g.bench_function(
        BenchmarkId::new("embedding", format!("V{v}x{d},T{t}")),
        |b| b.iter(|| black_box(embedding::embedding_reference(&table, &tok, v, d).unwrap())),
    );
    // The backward writes every row of dtable (zeros for unused ids): V*d + T*d floats.
    g.throughput(Throughput::Bytes(f4 * (v * d + t * d + t) as u64));
    g.bench_function(
        BenchmarkId::new("embedding_backward", format!("V{v}x{d},T{t}")),
        |b| b.iter(|| black_box(embedding::embedding_backward_reference(&dy, &tok, v, d).unwrap())),
    );

    g.throughput(Throughput::Bytes(f4 * (3 * t * d) as u64));
    g.bench_function(BenchmarkId::new("residual_add", format!("{t}x{d}")), |b| {
        b.iter(|| black_box(elementwise::residual_add_reference(&x, &dy).unwrap()))
    });
    g.throughput(Throughput::Bytes(f4 * (2 * t * d) as u64));
    g.bench_function(BenchmarkId::new("softmax", format!("{t}x{d}")), |b| {
        b.iter(|| black_box(elementwise::softmax_reference(&x, t, d).unwrap()))
    });
    g.throughput(Throughput::Bytes(f4 * (3 * t * d) as u64));
    g.bench_function(
        BenchmarkId::new("softmax_backward", format!("{t}x{d}")),
        |b| b.iter(|| black_box(elementwise::softmax_backward_reference(&x, &dy, t, d).unwrap())),
    );
    // The transpose reads and writes T*d floats (the model's backward transposes activations
    // and weights for its GEMMs).
    g.throughput(Throughput::Bytes(f4 * (2 * t * d) as u64));
    g.bench_function(BenchmarkId::new("transpose", format!("{t}x{d}")), |b| {
        b.iter(|| black_box(elementwise::transpose_reference(&x, t, d).unwrap()))
    });
    g.finish();
}

fn bench_cuda(c: &mut Criterion) {
    let Ok(gpu) = Backend::open(Device::Cuda(0)) else {
        return;
    };
    let s = GPU;
    let (t, d) = (s.t, s.d);
    for dtype in [DType::BF16, DType::F32] {
        let e = dtype.size_bytes() as u64;
        let up = |shape: &[usize], seed: u64| {
            Tensor::from_f32_as(&gpu, shape, dtype, &data(shape.iter().product(), seed)).unwrap()
        };
        let mut g = configure(c, &format!("cuda_{dtype}"));
        let (x, w, dy) = (up(&[t, d], 1), up(&[d], 2), up(&[t, d], 3));
        // Reads in the input dtype, writes f32.
        g.throughput(Throughput::Bytes(
            e * (t * d + d) as u64 + 4 * (t * d) as u64,
        ));
        g.bench_function(BenchmarkId::new("rmsnorm", format!("{t}x{d}")), |b| {
            b.iter(|| {
                black_box(rmsnorm::rmsnorm(&gpu, &x, &w, rmsnorm::DEFAULT_EPS).unwrap());
                gpu.synchronize().unwrap();
            })
        });
        g.throughput(Throughput::Bytes(
            e * (2 * t * d + d) as u64 + 4 * (t * d + d) as u64,
        ));
        g.bench_function(
            BenchmarkId::new("rmsnorm_backward", format!("{t}x{d}")),
            |b| {
                b.iter(|| {
                    black_box(
                        rmsnorm::rmsnorm_backward(&gpu, &x, &w, &dy, rmsnorm::DEFAULT_EPS).unwrap(),
                    );
                    gpu.synchronize().unwrap();
                })
            },
        );
        let (h, hd) = (s.heads, s.head_dim);
        let q = up(&[t, h, hd], 4);
        let pos = Tensor::from_slice(&gpu, &[t], &positions(t)).unwrap();
        g.throughput(Throughput::Bytes(
            e * (t * h * hd) as u64 + 4 * (t * h * hd + t) as u64,
        ));
        g.bench_function(BenchmarkId::new("rope", format!("{t}x{h}x{hd}")), |b| {
            b.iter(|| {
                black_box(rope::rope(&gpu, &q, &pos, rope::DEFAULT_THETA).unwrap());
                gpu.synchronize().unwrap();
            })
        });
        let f = s.ffn;
        let (a, bb, dh) = (up(&[t, f], 5), up(&[t, f], 6), up(&[t, f], 7));
        g.throughput(Throughput::Bytes(
            e * (2 * t * f) as u64 + 4 * (t * f) as u64,
        ));
        g.bench_function(BenchmarkId::new("swiglu", format!("{t}x{f}")), |b| {
            b.iter(|| {
                black_box(swiglu::swiglu(&gpu, &a, &bb).unwrap());
                gpu.synchronize().unwrap();
            })
        });
        g.throughput(Throughput::Bytes(
            e * (3 * t * f) as u64 + 8 * (t * f) as u64,
        ));
        g.bench_function(
            BenchmarkId::new("swiglu_backward", format!("{t}x{f}")),
            |b| {
                b.iter(|| {
                    black_box(swiglu::swiglu_backward(&gpu, &a, &bb, &dh).unwrap());
                    gpu.synchronize().unwrap();
                })
            },
        );
        let v = s.vocab;
        let table = up(&[v, d], 8);
        let tok = Tensor::from_slice(&gpu, &[t], &tokens(t, v)).unwrap();
        g.throughput(Throughput::Bytes(
            e * (t * d) as u64 + 4 * (t * d + t) as u64,
        ));
        g.bench_function(
            BenchmarkId::new("embedding", format!("V{v}x{d},T{t}")),
            |b| {
                b.iter(|| {
                    black_box(embedding::embedding(&gpu, &table, &tok).unwrap());
                    gpu.synchronize().unwrap();
                })
            },
        );
        g.throughput(Throughput::Bytes(
            e * (t * d) as u64 + 4 * (v * d + t) as u64,
        ));
        g.bench_function(
            BenchmarkId::new("embedding_backward", format!("V{v}x{d},T{t}")),
            |b| {
                b.iter(|| {
                    black_box(embedding::embedding_backward(&gpu, &dy, &tok, v).unwrap());
                    gpu.synchronize().unwrap();
                })
            },
        );
        g.throughput(Throughput::Bytes(
            e * (2 * t * d) as u64 + 4 * (t * d) as u64,
        ));
        g.bench_function(BenchmarkId::new("residual_add", format!("{t}x{d}")), |b| {
            b.iter(|| {
                black_box(elementwise::residual_add(&gpu, &x, &dy).unwrap());
                gpu.synchronize().unwrap();
            })
        });
        g.throughput(Throughput::Bytes(e * (t * d) as u64 + 4 * (t * d) as u64));
        g.bench_function(BenchmarkId::new("softmax", format!("{t}x{d}")), |b| {
            b.iter(|| {
                black_box(elementwise::softmax(&gpu, &x).unwrap());
                gpu.synchronize().unwrap();
            })
        });
        g.throughput(Throughput::Bytes(
            e * (2 * t * d) as u64 + 4 * (t * d) as u64,
        ));
        g.bench_function(
            BenchmarkId::new("softmax_backward", format!("{t}x{d}")),
            |b| {
                b.iter(|| {
                    black_box(elementwise::softmax_backward(&gpu, &x, &dy).unwrap());
                    gpu.synchronize().unwrap();
                })
            },
        );
        g.throughput(Throughput::Bytes(e * (2 * t * d) as u64));
        g.bench_function(BenchmarkId::new("transpose", format!("{t}x{d}")), |b| {
            b.iter(|| {
                black_box(elementwise::transpose(&gpu, &x).unwrap());
                gpu.synchronize().unwrap();
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench_cpu, bench_cuda);
criterion_main!(benches);
