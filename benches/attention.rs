//! Attention benches: training forward/backward and paged decode. CPU always; CUDA at the H200
//! target shapes when a GPU is present (skipped silently otherwise). Throughput is printed as
//! elements/s where one element is one FLOP (training; 4*D per visible query-key pair and head
//! forward, 2.5x that backward) or one byte of K/V read (decode). On an sm_90 GPU the target
//! shapes run on v3 (`AttentionPath::Wgmma`) as well as on the process's path.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_kernels::ops::attention::{attention_backward_saved, attention_forward_on};
use sluice_kernels::ops::attention_tile::{attention_path, AttentionPath};
use sluice_kernels::ops::paged_attention::paged_attention_on;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::hint::black_box;
use std::time::Duration;

struct Train {
    seqs: usize,
    len: usize,
    h: usize,
    hkv: usize,
    d: usize,
}

impl Train {
    /// FLOPs of the causal forward: 4*D per visible (query, key) pair per head.
    fn fwd_flops(&self) -> u64 {
        let pairs = (self.len * (self.len + 1) / 2) as u64;
        4 * self.d as u64 * pairs * (self.h * self.seqs) as u64
    }
}

fn train_inputs(be: &Backend, s: &Train, dtype: DType) -> [Tensor; 5] {
    let mut rng = Rng::new(1);
    let t = s.seqs * s.len;
    let cu: Vec<i32> = (0..=s.seqs).map(|b| (b * s.len) as i32).collect();
    let f = |n: usize, rng: &mut Rng| rng.normal_vec(n, 1.0);
    [
        Tensor::from_f32_as(be, &[t, s.h, s.d], dtype, &f(t * s.h * s.d, &mut rng)).unwrap(),
        Tensor::from_f32_as(be, &[t, s.hkv, s.d], dtype, &f(t * s.hkv * s.d, &mut rng)).unwrap(),
        Tensor::from_f32_as(be, &[t, s.hkv, s.d], dtype, &f(t * s.hkv * s.d, &mut rng)).unwrap(),
        Tensor::from_slice(be, &[s.seqs + 1], &cu).unwrap(),
        Tensor::from_f32_as(be, &[t, s.h, s.d], dtype, &f(t * s.h * s.d, &mut rng)).unwrap(),
    ]
}

fn bench_train(
    c: &mut Criterion,
    be: &Backend,
    label: &str,
    s: &Train,
    dtype: DType,
    path: AttentionPath,
) {
    let [q, k, v, cu, dout] = train_inputs(be, s, dtype);
    let mut g = c.benchmark_group(format!("attention/{label}"));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.throughput(Throughput::Elements(s.fwd_flops()));
    g.bench_function("forward_flops", |b| {
        b.iter(|| {
            let o = attention_forward_on(path, be, &q, &k, &v, &cu, true, None).unwrap();
            be.synchronize().unwrap();
            black_box(o)
        })
    });
    let fwd = attention_forward_on(path, be, &q, &k, &v, &cu, true, None).unwrap();
    g.throughput(Throughput::Elements(s.fwd_flops() * 5 / 2));
    g.bench_function("backward_flops", |b| {
        b.iter(|| {
            let o = attention_backward_saved(
                be, &q, &k, &v, &cu, &fwd.out, &fwd.lse, &dout, true, None,
            )
            .unwrap();
            be.synchronize().unwrap();
            black_box(o)
        })
    });
    g.finish();
}

struct Decode {
    b: usize,
    h: usize,
    hkv: usize,
    d: usize,
    ctx: usize,
    bs: usize,
}

fn bench_decode(
    c: &mut Criterion,
    be: &Backend,
    label: &str,
    s: &Decode,
    dtype: DType,
    path: AttentionPath,
) {
    let mut rng = Rng::new(2);
    let mb = s.ctx.div_ceil(s.bs);
    let nb = s.b * mb;
    let cache = [nb, s.bs, s.hkv, s.d];
    let n = nb * s.bs * s.hkv * s.d;
    let q = Tensor::from_f32_as(
        be,
        &[s.b, s.h, s.d],
        dtype,
        &rng.normal_vec(s.b * s.h * s.d, 1.0),
    )
    .unwrap();
    let kc = Tensor::from_f32_as(be, &cache, dtype, &rng.normal_vec(n, 1.0)).unwrap();
    let vc = Tensor::from_f32_as(be, &cache, dtype, &rng.normal_vec(n, 1.0)).unwrap();
    // Sequence b owns blocks b, b + B, b + 2B, ... (interleaved, as a busy pool would be).
    let table: Vec<i32> = (0..s.b)
        .flat_map(|b| (0..mb).map(move |i| (i * s.b + b) as i32))
        .collect();
    let bt = Tensor::from_slice(be, &[s.b, mb], &table).unwrap();
    let cl = Tensor::from_slice(be, &[s.b], &vec![s.ctx as i32; s.b]).unwrap();
    let kv_bytes = (2 * s.b * s.ctx * s.hkv * s.d * dtype.size_bytes()) as u64;
    let mut g = c.benchmark_group(format!("paged_attention/{label}"));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    g.throughput(Throughput::Bytes(kv_bytes));
    g.bench_function("decode_kv_bytes", |b| {
        b.iter(|| {
            let o = paged_attention_on(path, be, &q, &kc, &vc, &bt, &cl, None).unwrap();
            be.synchronize().unwrap();
            black_box(o)
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    let cpu = Backend::Cpu;
    let path = attention_path().unwrap();
    let small = Train {
        seqs: 4,
        len: 256,
        h: 8,
        hkv: 2,
        d: 64,
    };
    bench_train(
        c,
        &cpu,
        "cpu_f32_4x256_h8_kv2_d64",
        &small,
        DType::F32,
        path,
    );
    let dec = Decode {
        b: 16,
        h: 8,
        hkv: 2,
        d: 64,
        ctx: 1024,
        bs: 16,
    };
    bench_decode(
        c,
        &cpu,
        "cpu_f32_b16_h8_kv2_d64_ctx1024",
        &dec,
        DType::F32,
        path,
    );
    if let Ok(gpu) = Backend::open(Device::Cuda(0)) {
        let target = Train {
            seqs: 8,
            len: 4096,
            h: 32,
            hkv: 32,
            d: 128,
        };
        bench_train(
            c,
            &gpu,
            "cuda_bf16_8x4096_h32_d128",
            &target,
            DType::BF16,
            path,
        );
        let dec = Decode {
            b: 256,
            h: 32,
            hkv: 32,
            d: 128,
            ctx: 4096,
            bs: 16,
        };
        bench_decode(
            c,
            &gpu,
            "cuda_bf16_b256_h32_d128_ctx4096",
            &dec,
            DType::BF16,
            path,
        );
        // v3 where the GPU has wgmma (sm_90), beside the process's path.
        let v3 = AttentionPath::Wgmma;
        if path != v3 && sluice_kernels::ops::attention_wgmma::check_device(&gpu).is_ok() {
            bench_train(
                c,
                &gpu,
                "cuda_bf16_8x4096_h32_d128_v3",
                &target,
                DType::BF16,
                v3,
            );
            bench_decode(
                c,
                &gpu,
                "cuda_bf16_b256_h32_d128_ctx4096_v3",
                &dec,
                DType::BF16,
                v3,
            );
        }
    }
}

criterion_group!(attention, benches);
criterion_main!(attention);
