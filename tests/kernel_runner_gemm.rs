//! `sluice kernel gemm` end to end: safetensors in, run, safetensors out, compared with an
//! independent f64 computation; bad input gives an error that names the tensor and the shape.

mod support;

use sluice_kernels::io::read_safetensors;
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Device, Tensor};
use sluice_trainer::kernel_cmd::run_kernel;
use support::{scratch_dir, write_input};

/// C = A . B^T in f64 from the values actually stored (bf16 widened exactly).
fn oracle(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[i * k + p] as f64 * b[j * k + p] as f64)
                .sum();
        }
    }
    c
}

#[test]
fn kernel_runner_gemm_matches_f64_on_ragged_shapes() {
    let dir = scratch_dir("gemm-ok");
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(21);
    for (m, n, k) in [(17, 33, 40), (1, 1, 1), (127, 17, 64), (64, 1000, 17)] {
        for dtype in [DType::F32, DType::BF16] {
            let a = Tensor::from_f32_as(&cpu, &[m, k], dtype, &rng.normal_vec(m * k, 1.0)).unwrap();
            let b = Tensor::from_f32_as(&cpu, &[n, k], dtype, &rng.normal_vec(n * k, 1.0)).unwrap();
            let input = write_input(&dir, &[("a", &a), ("b", &b)], &[]);
            let output = dir.join("out.safetensors");
            let summary = run_kernel("gemm", &input, &output, Device::Cpu).unwrap();
            assert!(summary.contains("c["), "{summary}");
            let out = read_safetensors(&output, &cpu).unwrap();
            let c = &out.tensors["c"];
            assert_eq!(c.shape(), &[m, n]);
            assert_eq!(c.dtype(), DType::F32);
            let want = oracle(&a.to_f32_vec().unwrap(), &b.to_f32_vec().unwrap(), m, n, k);
            let err = rel_norm(&c.to_vec::<f32>().unwrap(), &want);
            // The stored inputs are exact in f32 (bf16 widens exactly), so f32 accumulation is
            // the only error in either dtype.
            assert!(err <= F32_TOL, "{dtype} {m}x{n}x{k}: rel err {err:e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernel_runner_gemm_on_emu_matches_f64() {
    // The same file through the emulator (the CUDA kernels compiled for the host): f32 SIMT and
    // bf16 mma.sync paths.
    let dir = scratch_dir("gemm-emu");
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(22);
    let (m, n, k) = (17, 33, 40);
    for dtype in [DType::F32, DType::BF16] {
        let a = Tensor::from_f32_as(&cpu, &[m, k], dtype, &rng.normal_vec(m * k, 1.0)).unwrap();
        let b = Tensor::from_f32_as(&cpu, &[n, k], dtype, &rng.normal_vec(n * k, 1.0)).unwrap();
        let input = write_input(&dir, &[("a", &a), ("b", &b)], &[]);
        let output = dir.join("out.safetensors");
        run_kernel("gemm", &input, &output, Device::Emu).unwrap();
        let out = read_safetensors(&output, &cpu).unwrap();
        let want = oracle(&a.to_f32_vec().unwrap(), &b.to_f32_vec().unwrap(), m, n, k);
        let err = rel_norm(&out.tensors["c"].to_vec::<f32>().unwrap(), &want);
        assert!(err <= F32_TOL, "emu {dtype}: rel err {err:e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernel_runner_gemm_rejects_misnamed_and_misshapen_tensors() {
    let dir = scratch_dir("gemm-bad");
    let cpu = Backend::Cpu;
    let a = Tensor::from_f32_as(&cpu, &[4, 8], DType::F32, &[1.0; 32]).unwrap();
    let b_bad = Tensor::from_f32_as(&cpu, &[3, 9], DType::F32, &[1.0; 27]).unwrap();
    let output = dir.join("out.safetensors");

    // b with the wrong K: the error names `b` and the shape expected, and is bad input (exit 2).
    let input = write_input(&dir, &[("a", &a), ("b", &b_bad)], &[]);
    let err = run_kernel("gemm", &input, &output, Device::Cpu).unwrap_err();
    let msg = err.to_string();
    assert!(err.is_bad_input(), "{msg}");
    assert!(msg.contains("`b`") && msg.contains("[N,8]"), "{msg}");

    // A misnamed tensor: named in the error, with the inputs the op takes.
    let input = write_input(&dir, &[("a", &a), ("weights", &b_bad)], &[]);
    let err = run_kernel("gemm", &input, &output, Device::Cpu).unwrap_err();
    let msg = err.to_string();
    assert!(err.is_bad_input(), "{msg}");
    assert!(msg.contains("`weights`") && msg.contains("b[N,K]"), "{msg}");

    // A missing tensor.
    let input = write_input(&dir, &[("a", &a)], &[]);
    let err = run_kernel("gemm", &input, &output, Device::Cpu).unwrap_err();
    let msg = err.to_string();
    assert!(
        err.is_bad_input() && msg.contains("`b`") && msg.contains("[N,K]"),
        "{msg}"
    );

    // A misshapen a (rank 1).
    let a1 = Tensor::from_f32_as(&cpu, &[8], DType::F32, &[1.0; 8]).unwrap();
    let input = write_input(&dir, &[("a", &a1), ("b", &b_bad)], &[]);
    let err = run_kernel("gemm", &input, &output, Device::Cpu).unwrap_err();
    let msg = err.to_string();
    assert!(
        err.is_bad_input() && msg.contains("`a`") && msg.contains("[M,K]"),
        "{msg}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernel_runner_lists_gemm() {
    let list = sluice_kernels::runner::list();
    assert!(list.contains("gemm"), "{list}");
    assert!(list.contains("a[M,K]") && list.contains("b[N,K]") && list.contains("c[M,N]"));
}
