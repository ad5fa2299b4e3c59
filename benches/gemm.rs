//! gemm benchmarks: C[M,N] = A[M,K] . B[N,K]^T, FLOPs = 2 M N K.
//!
//! - CPU: the f32 reference (matrixmultiply) at 512^3 and 1024^3, and a naive triple loop at
//!   512^3 for scale. Compare with numpy/OpenBLAS: scripts/bench-numpy-gemm.py.
//! - CUDA (only where a GPU opens; skipped silently otherwise): bf16 at 4096^3 and 8192^3 with
//!   the mma.sync kernel, the wgmma kernel (Hopper only; opt-in path, unverified), and cuBLAS
//!   (cublasGemmEx, bf16 in, f32 out, f32 compute) side by side; f32 at 4096^3 against cuBLAS
//!   SGEMM (default math mode: true f32, no tf32).
//!
//! Criterion reports throughput in "elem/s" where one element is one FLOP, so "Gelem/s" reads
//! GFLOP/s and "Telem/s" TFLOP/s. A best-of-N summary line per case is printed as well.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sluice_kernels::ops::gemm::{gemm_into_with_path, gemm_reference_into, GemmPath};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Device, Tensor};
use std::time::{Duration, Instant};

fn flops(m: usize, n: usize, k: usize) -> u64 {
    2 * (m * n * k) as u64
}

/// Best wall time of `reps` calls of `f`, after one warm-up call.
fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn naive(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f32;
            for p in 0..k {
                s += a[i * k + p] * b[j * k + p];
            }
            c[i * n + j] = s;
        }
    }
}

fn cpu(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemm_cpu_f32");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let mut rng = Rng::new(1);
    for s in [512usize, 1024] {
        let a = rng.normal_vec(s * s, 1.0);
        let b = rng.normal_vec(s * s, 1.0);
        let mut out = vec![0.0f32; s * s];
        let reps = if s <= 512 { 30 } else { 10 };
        let t = best_of(reps, || gemm_reference_into(&a, &b, &mut out, s, s, s));
        println!(
            "gemm cpu f32 {s}^3 (matrixmultiply): best {:.2} ms = {:.1} GFLOP/s",
            t.as_secs_f64() * 1e3,
            flops(s, s, s) as f64 / t.as_secs_f64() / 1e9
        );
        group.throughput(Throughput::Elements(flops(s, s, s)));
        group.bench_function(BenchmarkId::new("reference", s), |bench| {
            bench.iter(|| gemm_reference_into(&a, &b, &mut out, s, s, s))
        });
        if s == 512 {
            let t = best_of(1, || naive(&a, &b, &mut out, s, s, s));
            println!(
                "gemm cpu f32 {s}^3 (naive loop): {:.1} ms = {:.2} GFLOP/s",
                t.as_secs_f64() * 1e3,
                flops(s, s, s) as f64 / t.as_secs_f64() / 1e9
            );
        }
    }
    group.finish();
}

/// cuBLAS side by side with the sluice kernels on the same device and stream.
fn cuda(c: &mut Criterion) {
    let Ok(gpu) = Backend::open(Device::Cuda(0)) else {
        return; // no GPU: CUDA cases are skipped silently
    };
    let Some(cuda) = gpu.cuda() else { return };
    let hopper = cuda.arch() == sluice_kernels::cuda::PtxArch::Sm90a;
    let blas = match cudarc::cublas::CudaBlas::new(cuda.stream().clone()) {
        Ok(b) => b,
        Err(e) => {
            println!("gemm cuda: cuBLAS unavailable ({e}); sluice kernels only");
            return;
        }
    };
    let stream = cuda.stream().clone();
    let mut group = c.benchmark_group("gemm_cuda");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let mut rng = Rng::new(2);
    let cases: [(DType, usize); 3] = [(DType::BF16, 4096), (DType::BF16, 8192), (DType::F32, 4096)];
    for (dtype, s) in cases {
        let (m, n, k) = (s, s, s);
        let host_a = rng.normal_vec(m * k, 1.0);
        let host_b = rng.normal_vec(n * k, 1.0);
        let (Ok(a), Ok(b), Ok(mut out)) = (
            Tensor::from_f32_as(&gpu, &[m, k], dtype, &host_a),
            Tensor::from_f32_as(&gpu, &[n, k], dtype, &host_b),
            Tensor::zeros(&gpu, &[m, n], DType::F32),
        ) else {
            println!("gemm cuda {dtype} {s}^3: cannot allocate; skipped");
            continue;
        };
        group.throughput(Throughput::Elements(flops(m, n, k)));
        let mut paths = vec![("sluice_mma", GemmPath::Mma)];
        if dtype == DType::F32 {
            paths = vec![("sluice_f32", GemmPath::Mma)];
        } else if hopper {
            paths.push(("sluice_wgmma", GemmPath::Wgmma));
        }
        for (label, path) in paths {
            let mut run = || {
                gemm_into_with_path(&gpu, &a, &b, &mut out, path).and_then(|_| gpu.synchronize())
            };
            if let Err(e) = run() {
                println!("gemm cuda {label} {dtype} {s}^3: failed: {e}");
                continue;
            }
            let t = best_of(5, || {
                let _ = run();
            });
            println!(
                "gemm cuda {label} {dtype} {s}^3: best {:.3} ms = {:.1} TFLOP/s",
                t.as_secs_f64() * 1e3,
                flops(m, n, k) as f64 / t.as_secs_f64() / 1e12
            );
            group.bench_function(BenchmarkId::new(format!("{label}_{dtype}"), s), |bench| {
                bench.iter(&mut run)
            });
        }

        // cuBLAS on its own buffers (same values), column-major view of the row-major problem:
        // C^T[N,M] = B[N,K] . A^T, i.e. op(B) = T with lda = K, op(A) = N with ldb = K, ldc = N.
        use cudarc::cublas::sys;
        use cudarc::driver::DevicePtr;
        let (elem, bytes_a, bytes_b) = match dtype {
            DType::BF16 => (
                sys::cudaDataType::CUDA_R_16BF,
                bf16_bytes(&host_a),
                bf16_bytes(&host_b),
            ),
            _ => (
                sys::cudaDataType::CUDA_R_32F,
                bytemuck_f32(&host_a),
                bytemuck_f32(&host_b),
            ),
        };
        let (Ok(da), Ok(db), Ok(dc)) = (
            stream.clone_htod(&bytes_a),
            stream.clone_htod(&bytes_b),
            stream.alloc_zeros::<f32>(m * n),
        ) else {
            println!("gemm cuda cublas {dtype} {s}^3: cannot allocate; skipped");
            continue;
        };
        let (pa, _ga) = da.device_ptr(&stream);
        let (pb, _gb) = db.device_ptr(&stream);
        let (pc, _gc) = dc.device_ptr(&stream);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let cublas_run = || {
            // SAFETY: pa/pb/pc are live device allocations of m*k, n*k (elements of `elem`) and
            // m*n f32 on `stream`, which the handle is bound to; the dimensions and leading
            // dimensions below address exactly those extents; alpha/beta are host f32 scalars
            // matching the f32 compute type.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    m as i32,
                    k as i32,
                    &alpha as *const f32 as *const _,
                    pb as *const _,
                    elem,
                    k as i32,
                    pa as *const _,
                    elem,
                    k as i32,
                    &beta as *const f32 as *const _,
                    pc as *mut _,
                    sys::cudaDataType::CUDA_R_32F,
                    n as i32,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| e.to_string())
            .and_then(|_| stream.synchronize().map_err(|e| e.to_string()))
        };
        if let Err(e) = cublas_run() {
            println!("gemm cuda cublas {dtype} {s}^3: failed: {e}");
            continue;
        }
        let t = best_of(5, || {
            let _ = cublas_run();
        });
        println!(
            "gemm cuda cublas {dtype} {s}^3: best {:.3} ms = {:.1} TFLOP/s",
            t.as_secs_f64() * 1e3,
            flops(m, n, k) as f64 / t.as_secs_f64() / 1e12
        );
        group.bench_function(BenchmarkId::new(format!("cublas_{dtype}"), s), |bench| {
            bench.iter(&cublas_run)
        });
    }
    group.finish();
}

fn bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect()
}

fn bytemuck_f32(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

criterion_group!(benches, cpu, cuda);
criterion_main!(benches);
