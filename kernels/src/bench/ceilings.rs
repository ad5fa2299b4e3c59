//! Ceilings measured in the same run as the ops, through the same harness: what this machine
//! attains at best for a copy (device-to-device bandwidth) and for a dense bf16 GEMM (cuBLAS
//! through cudarc, no PyTorch needed). The report sets every row against them as well as
//! against the nominal H200 figures, so a fraction never depends on a number from another day.

use super::{BenchCase, BenchRun, Pass};
use crate::bench_cases::random;
use crate::device::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Copy `bytes` bytes from one device buffer to another (read once, write once).
pub fn copy_case(bytes: usize) -> BenchCase {
    let n = bytes / 4;
    BenchCase {
        op: "d2d_copy",
        pass: Pass::Ceiling,
        path: "default",
        check: "",
        cuda_only: false,
        shape: format!("{} MiB", (n * 4) >> 20),
        bytes: (2 * n * 4) as f64,
        flops: 0.0,
        prepare: Box::new(move |b| {
            let src = random(b, &[n], DType::F32, 21)?;
            let mut dst = random(b, &[n], DType::F32, 22)?;
            // A device-to-device copy on cuda (cuMemcpyDtoDAsync on the tensors' stream), a
            // host copy elsewhere.
            let run: BenchRun = Box::new(move |_| dst.write_range(0, &src));
            Ok(run)
        }),
    }
}

/// C[M,N] = A[M,K] . B[N,K]^T in bf16 by cuBLAS (cublasGemmEx, f32 accumulation). Only on cuda:
/// elsewhere `prepare` says why.
pub fn cublas_gemm_case(m: usize, n: usize, k: usize) -> BenchCase {
    BenchCase {
        op: "cublas_gemm_bf16",
        pass: Pass::Ceiling,
        path: "cublas",
        check: "",
        cuda_only: true,
        shape: format!("M={m} N={n} K={k} bf16"),
        bytes: ((m * k + n * k + m * n) * 2) as f64,
        flops: 2.0 * m as f64 * n as f64 * k as f64,
        prepare: Box::new(move |b| cublas_run(b, m, n, k)),
    }
}

fn cublas_run(backend: &Backend, m: usize, n: usize, k: usize) -> Result<BenchRun> {
    use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    use half::bf16;
    let Some(cuda) = backend.cuda() else {
        return Err(Error::Device(
            "the cuBLAS ceiling needs --device cuda (cuBLAS runs only on a GPU)".into(),
        ));
    };
    // SAFETY: only tries to dlopen libcublas; cudarc would panic on first use without it.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(Error::Device(
            "libcublas is not loadable on this machine (no CUDA toolkit libraries)".into(),
        ));
    }
    let stream = cuda.stream().clone();
    let blas =
        CudaBlas::new(stream.clone()).map_err(|e| Error::Cuda(format!("cuBLAS handle: {e}")))?;
    let fill = |len: usize, seed: u64| -> Result<Vec<bf16>> {
        let mut r = crate::testing::Rng::new(seed);
        Ok((0..len)
            .map(|_| bf16::from_f32((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5))
            .collect())
    };
    let a = stream.clone_htod(&fill(m * k, 31)?)?;
    let bm = stream.clone_htod(&fill(n * k, 32)?)?;
    let mut c = stream.alloc_zeros::<bf16>(m * n)?;
    // Row-major C[M,N] = A B^T is column-major C^T[N,M] = B A^T: cuBLAS's A is our B
    // (K x N column-major, transposed), its B our A (K x M column-major).
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: k as i32,
        ldb: k as i32,
        beta: bf16::ZERO,
        ldc: n as i32,
    };
    let run: BenchRun = Box::new(move |_| {
        // SAFETY: a holds m*k, bm n*k and c m*n elements, exactly what cfg's shapes and
        // leading dimensions address; all three live on the handle's stream.
        unsafe { blas.gemm(cfg, &bm, &a, &mut c) }
            .map_err(|e| Error::Cuda(format!("cublasGemmEx: {e}")))
    });
    Ok(run)
}

/// The ceiling cases: the copy at `copy_bytes`, the cuBLAS GEMM at `gemm` = (M, N, K).
pub fn ceiling_cases(copy_bytes: usize, gemm: (usize, usize, usize)) -> Vec<BenchCase> {
    vec![
        copy_case(copy_bytes),
        cublas_gemm_case(gemm.0, gemm.1, gemm.2),
    ]
}
