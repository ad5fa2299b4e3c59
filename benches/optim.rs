//! optim: the optimizer's elementwise kernels over an arena: the global squared norm, AdamW
//! (one segment table launch), Muon's momentum + gather and apply of head blocks, and the bf16
//! compute copy. CPU at scaled-down shapes (an 8 M-element arena; 48 head blocks [128,512]);
//! CUDA at the head target (48 blocks [128,4096] of a [6144,4096]-style W_o, column
//! split) and the expert target (64 x [1024,2048]) when a GPU is present (skipped silently
//! otherwise). Prints effective GB/s for the bytes each kernel must move (docs/perf/muon.md).
//! Newton-Schulz has its own bench (benches/newton_schulz.rs).

use criterion::{criterion_group, criterion_main, Criterion};
use sluice_kernels::ops::optim::{
    adamw, cast_bf16_into, muon_apply, muon_gather, sq_norm, AdamWStep, BlockTable, MuonApply,
    MuonMomentum, Segment, SegmentTable, StridedBlock,
};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn report(label: &str, bytes: f64, mut once: impl FnMut()) {
    once();
    let reps = 3;
    let start = Instant::now();
    for _ in 0..reps {
        once();
    }
    let s = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "optim {label}: {:.3} ms, {:.1} MB, {:.1} GB/s",
        s * 1e3,
        bytes / 1e6,
        bytes / s / 1e9
    );
}

fn arena(be: &Backend, n: usize, seed: u64) -> Tensor {
    Tensor::from_slice(be, &[n], &Rng::new(seed).normal_vec(n, 1.0)).unwrap()
}

const HP: AdamWStep = AdamWStep {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    bc1: 0.1,
    bc2: 0.05,
    grad_scale: 1.0,
};

/// Elementwise kernels on `be` over an arena of `len` elements, and Muon's gather/apply on
/// `n` column blocks [rows, hd] of a [rows, n*hd] matrix.
fn run_all(be: &Backend, tag: &str, len: usize, (rows, n, hd): (usize, usize, usize)) {
    let sync = || be.synchronize().unwrap();
    let mut p = arena(be, len, 1);
    let g = arena(be, len, 2);
    let mut m = Tensor::zeros(be, &[len], DType::F32).unwrap();
    let mut v = Tensor::zeros(be, &[len], DType::F32).unwrap();
    let e = len as f64;
    report(&format!("{tag} sq_norm [{len}]"), 4.0 * e, || {
        black_box(sq_norm(be, &g).unwrap());
    });
    let segs = vec![Segment {
        start: 0,
        len,
        weight_decay: 0.1,
    }];
    let table = SegmentTable::new(be, segs, len).unwrap();
    report(&format!("{tag} adamw [{len}]"), 28.0 * e, || {
        adamw(be, &mut p, &g, &mut m, &mut v, &table, &HP).unwrap();
        sync();
    });
    let mut copy = Tensor::zeros(be, &[len], DType::BF16).unwrap();
    report(&format!("{tag} cast_bf16 [{len}]"), 6.0 * e, || {
        cast_bf16_into(be, &p, &mut copy).unwrap();
        sync();
    });

    let blen = rows * n * hd;
    let blocks: Vec<StridedBlock> = (0..n)
        .map(|h| StridedBlock {
            offset: h * hd,
            row_stride: n * hd,
        })
        .collect();
    let bt = BlockTable::new(be, blocks, rows, hd, blen).unwrap();
    let g = arena(be, blen, 3);
    let mut mom = Tensor::zeros(be, &[blen], DType::F32).unwrap();
    let mut p = arena(be, blen, 4);
    let mh = MuonMomentum {
        mu: 0.95,
        grad_scale: 1.0,
        nesterov: true,
    };
    let be_ = blen as f64;
    let mut x = muon_gather(be, &g, &mut mom, &bt, &mh).unwrap();
    report(
        &format!("{tag} muon_gather {n}x[{rows},{hd}]"),
        16.0 * be_,
        || {
            x = muon_gather(be, &g, &mut mom, &bt, &mh).unwrap();
            sync();
        },
    );
    let ap = MuonApply {
        lr: 1e-3,
        weight_decay: 0.1,
        scale: 0.2 * (rows.max(hd) as f32).sqrt(),
    };
    report(
        &format!("{tag} muon_apply {n}x[{rows},{hd}]"),
        12.0 * be_,
        || {
            muon_apply(be, &mut p, &x, &bt, &ap).unwrap();
            sync();
        },
    );
}

fn bench(c: &mut Criterion) {
    let cpu = Backend::Cpu;
    run_all(&cpu, "cpu", 8 << 20, (512, 48, 128));
    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        // The targets: W_o of 48 heads x 128 with d = 4096 (column blocks [4096,128],
        // the same bytes as 48 row blocks [128,4096]); 64 experts [1024,2048] (as column blocks
        // of one wide matrix: the same bytes as 64 contiguous expert matrices).
        run_all(&gpu, "cuda", 256 << 20, (4096, 48, 128));
        run_all(&gpu, "cuda experts", 1 << 20, (1024, 64, 2048));
    }

    let mut group = c.benchmark_group("optim");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let len = 8 << 20;
    let mut p = arena(&cpu, len, 1);
    let g = arena(&cpu, len, 2);
    let mut m = Tensor::zeros(&cpu, &[len], DType::F32).unwrap();
    let mut v = Tensor::zeros(&cpu, &[len], DType::F32).unwrap();
    let table = SegmentTable::new(
        &cpu,
        vec![Segment {
            start: 0,
            len,
            weight_decay: 0.1,
        }],
        len,
    )
    .unwrap();
    group.bench_function("adamw_cpu_8M", |b| {
        b.iter(|| adamw(&cpu, &mut p, &g, &mut m, &mut v, &table, &HP).unwrap())
    });
    group.bench_function("sq_norm_cpu_8M", |b| {
        b.iter(|| black_box(sq_norm(&cpu, &g).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
