//! The Hopper GEMM (`gemm_bf16_wgmma`, kernels/cuda/gemm_hopper.cu) on the emulator: the same
//! bits as the CPU's bf16 chain (one ascending FMA chain over K per output) in the plain,
//! batched and grouped forms, for ragged M, N and K, a ring that wraps (K steps > stages), a
//! persistent grid whose blocks take several tiles, the bf16 epilogue, and schedule seeds that
//! change nothing. The emulator's race checker follows the kernel's full/empty mbarrier ring
//! (no block barrier in its main loop): a launch with a finding fails the test.
//!
//! On a GPU the same kernel runs in scripts/gpu-check (kernels/tests/gemm.rs's CUDA tests take
//! the wgmma path on sm_90, and `cuda_wgmma_epilogues_match_the_cpu` below); tensor cores sum a
//! k16 step in their own order, so there it is compared by norm, and these bits are the
//! emulator's.

use half::bf16;
use sluice_kernels::ops::gemm::{
    gemm_batched_with_path, gemm_grouped_with_path, gemm_with_path, GemmPath,
};
use sluice_kernels::ops::gemm_hopper::gemm_wgmma_into;
use sluice_kernels::testing::{rel_norm, Rng, BF16_TOL};
use sluice_kernels::{Backend, DType, Tensor};

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn bf16_tensor(backend: &Backend, shape: &[usize], rng: &mut Rng) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32_as(backend, shape, DType::BF16, &rng.normal_vec(n, 1.0)).unwrap()
}

#[test]
fn plain_products_equal_the_cpu_bf16_chain_bit_for_bit() {
    let cpu = Backend::Cpu;
    let emu = Backend::emu_with_seed(1);
    let mut rng = Rng::new(31);
    let mut compared = 0;
    // M ragged; N over one 256-column tile (300); K: one step short of 64, exactly 64, and 264
    // (five steps: the four-stage ring wraps and its phases flip).
    for &(m, n, k) in &[
        (1, 1, 8),
        (17, 33, 40),
        (127, 17, 64),
        (130, 300, 264),
        (5, 256, 128),
    ] {
        let a = bf16_tensor(&cpu, &[m, k], &mut rng);
        let b = bf16_tensor(&cpu, &[n, k], &mut rng);
        let want = gemm_with_path(&cpu, &a, &b, GemmPath::Mma).unwrap();
        let got = gemm_with_path(
            &emu,
            &a.to_backend(&emu).unwrap(),
            &b.to_backend(&emu).unwrap(),
            GemmPath::Wgmma,
        )
        .unwrap();
        assert_eq!(bits(&got), bits(&want), "{m}x{n}x{k}");
        compared += m * n;
    }
    assert_eq!(compared, 1 + 17 * 33 + 127 * 17 + 130 * 300 + 5 * 256);
}

#[test]
fn batched_grouped_and_persistent_forms_equal_the_cpu_chain() {
    let cpu = Backend::Cpu;
    let emu = Backend::emu_with_seed(2);
    let mut rng = Rng::new(32);
    // One tile per batch entry; the emulator's persistent grid has half as many blocks as tiles,
    // so blocks take two or three tiles, and with 3 K steps per tile the four-stage ring wraps
    // across the tiles of a block.
    for &(batch, m, n, k, shared) in &[
        (5usize, 3usize, 5usize, 136usize, false),
        (3, 17, 20, 24, true),
    ] {
        let a = bf16_tensor(&cpu, &[batch, m, k], &mut rng);
        let b = if shared {
            bf16_tensor(&cpu, &[n, k], &mut rng)
        } else {
            bf16_tensor(&cpu, &[batch, n, k], &mut rng)
        };
        let want = gemm_batched_with_path(&cpu, &a, &b, GemmPath::Mma).unwrap();
        let got = gemm_batched_with_path(
            &emu,
            &a.to_backend(&emu).unwrap(),
            &b.to_backend(&emu).unwrap(),
            GemmPath::Wgmma,
        )
        .unwrap();
        assert_eq!(
            bits(&got),
            bits(&want),
            "batched {batch}x{m}x{n}x{k}, shared B {shared}"
        );
    }
    // Grouped: empty segments, a one-row segment, a segment longer than one 128-row tile, and
    // tiles whose box runs into the next segment's rows (loaded, never written).
    let offsets: [i32; 6] = [0, 0, 1, 150, 150, 170];
    let (rows, groups, n, k) = (170usize, 5usize, 40usize, 48usize);
    let a = bf16_tensor(&cpu, &[rows, k], &mut rng);
    let b = bf16_tensor(&cpu, &[groups, n, k], &mut rng);
    let o = Tensor::from_slice(&cpu, &[groups + 1], &offsets).unwrap();
    let want = gemm_grouped_with_path(&cpu, &a, &b, &o, GemmPath::Mma).unwrap();
    let got = gemm_grouped_with_path(
        &emu,
        &a.to_backend(&emu).unwrap(),
        &b.to_backend(&emu).unwrap(),
        &o.to_backend(&emu).unwrap(),
        GemmPath::Wgmma,
    )
    .unwrap();
    assert_eq!(bits(&got), bits(&want), "grouped");
}

#[test]
fn rows_do_not_depend_on_m_and_seeds_change_nothing() {
    let emu1 = Backend::emu_with_seed(3);
    let emu2 = Backend::emu_with_seed(4);
    let mut rng = Rng::new(33);
    let (m, n, k) = (129, 24, 56);
    let a = bf16_tensor(&emu1, &[m, k], &mut rng);
    let b = bf16_tensor(&emu1, &[n, k], &mut rng);
    let full = bits(&gemm_with_path(&emu1, &a, &b, GemmPath::Wgmma).unwrap());
    let again = gemm_with_path(
        &emu2,
        &a.to_backend(&emu2).unwrap(),
        &b.to_backend(&emu2).unwrap(),
        GemmPath::Wgmma,
    )
    .unwrap();
    assert_eq!(bits(&again), full, "seeds 3 and 4");
    let host = a.to_vec::<bf16>().unwrap();
    for r in [0usize, 64, 127, 128] {
        let row = Tensor::from_slice(&emu1, &[1, k], &host[r * k..(r + 1) * k]).unwrap();
        let one = bits(&gemm_with_path(&emu1, &row, &b, GemmPath::Wgmma).unwrap());
        assert_eq!(one, full[r * n..(r + 1) * n], "row {r} alone");
    }
}

#[test]
fn the_bf16_epilogue_rounds_the_f32_result_to_nearest_even() {
    let emu = Backend::emu_with_seed(5);
    let mut rng = Rng::new(34);
    // N odd (17): pairs that straddle rows take the one-element stores.
    for &(m, n, k) in &[(17usize, 17usize, 32usize), (9, 64, 16)] {
        let a = bf16_tensor(&emu, &[m, k], &mut rng);
        let b = bf16_tensor(&emu, &[n, k], &mut rng);
        let mut c32 = Tensor::poisoned(&emu, &[m, n], DType::F32).unwrap();
        gemm_wgmma_into(&emu, &a, &b, &mut c32).unwrap();
        let mut c16 = Tensor::poisoned(&emu, &[m, n], DType::BF16).unwrap();
        gemm_wgmma_into(&emu, &a, &b, &mut c16).unwrap();
        let want: Vec<u16> = c32
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| bf16::from_f32(*v).to_bits())
            .collect();
        let got: Vec<u16> = c16
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "{m}x{n}x{k}");
    }
}

#[test]
fn the_hopper_entry_refuses_what_it_cannot_run() {
    let emu = Backend::emu_with_seed(6);
    let mut rng = Rng::new(35);
    let a = bf16_tensor(&emu, &[4, 12], &mut rng);
    let b = bf16_tensor(&emu, &[4, 12], &mut rng);
    let mut c = Tensor::poisoned(&emu, &[4, 4], DType::F32).unwrap();
    let e = gemm_wgmma_into(&emu, &a, &b, &mut c)
        .unwrap_err()
        .to_string();
    assert!(e.contains("K = 12 is not a multiple of 8"), "{e}");
    let mut c = Tensor::poisoned(&emu, &[4, 4], DType::I32).unwrap();
    let a = bf16_tensor(&emu, &[4, 16], &mut rng);
    let b = bf16_tensor(&emu, &[4, 16], &mut rng);
    let e = gemm_wgmma_into(&emu, &a, &b, &mut c)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`c`") || e.contains("c:") || e.contains("tensor c"),
        "{e}"
    );
}

/// Where a GPU exists: on sm_90 the f32 epilogue is within the bf16 tolerance of the CPU chain
/// (by relative norm), the bf16 epilogue is exactly the f32 result rounded to nearest even, and
/// two runs agree bit for bit; on other GPUs the entry refuses, naming sm_90. Skips (saying so)
/// without a GPU.
#[test]
fn cuda_wgmma_epilogues_match_the_cpu() {
    let Some(gpu) = sluice_kernels::device::cuda_for_tests("gemm_hopper cuda") else {
        return;
    };
    let cpu = Backend::Cpu;
    let mut rng = Rng::new(36);
    let (m, n, k) = (300usize, 517usize, 264usize);
    let a = bf16_tensor(&cpu, &[m, k], &mut rng);
    let b = bf16_tensor(&cpu, &[n, k], &mut rng);
    let (ag, bg) = (a.to_backend(&gpu).unwrap(), b.to_backend(&gpu).unwrap());
    let hopper = gpu
        .cuda()
        .is_some_and(|c| c.arch() == sluice_kernels::cuda::PtxArch::Sm90a);
    let mut c32 = Tensor::poisoned(&gpu, &[m, n], DType::F32).unwrap();
    if !hopper {
        let e = gemm_wgmma_into(&gpu, &ag, &bg, &mut c32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sm_90"), "{e}");
        println!("gemm_hopper cuda: not an sm_90 GPU; the refusal was checked");
        return;
    }
    gemm_wgmma_into(&gpu, &ag, &bg, &mut c32).unwrap();
    let want: Vec<f64> = gemm_with_path(&cpu, &a, &b, GemmPath::Mma)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| *v as f64)
        .collect();
    let got = c32.to_vec::<f32>().unwrap();
    let r = rel_norm(&got, &want);
    assert!(r < BF16_TOL, "f32 epilogue: relative norm {r:e}");
    let mut again = Tensor::poisoned(&gpu, &[m, n], DType::F32).unwrap();
    gemm_wgmma_into(&gpu, &ag, &bg, &mut again).unwrap();
    assert_eq!(bits(&again), bits(&c32), "two runs");
    let mut c16 = Tensor::poisoned(&gpu, &[m, n], DType::BF16).unwrap();
    gemm_wgmma_into(&gpu, &ag, &bg, &mut c16).unwrap();
    let rounded: Vec<u16> = got.iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
    let got16: Vec<u16> = c16
        .to_vec::<bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(got16, rounded, "bf16 epilogue = the f32 result rounded");
}
