//! newton_schulz, the bits (issue 23 item 4): the split normalisation's fixed partition and
//! order, cpu = emu bit for bit where both sum every product in one ascending FMA chain
//! (K <= 256: one chunk of the CPU GEMM), batch invariance on emu (a matrix's bits do not depend
//! on n or on where it sits, which also moves its 16-byte alignment), and the bf16 path's fused
//! GEMM epilogues against the unfused composition they replaced.
//!
//! Every device output here is allocated poisoned (NaN) inside the call, so an element a kernel
//! misses fails the bit comparisons.

use half::bf16;
use sluice_kernels::ops::gemm::gemm_batched;
use sluice_kernels::ops::newton_schulz::{
    newton_schulz_bf16_reference, newton_schulz_reference, newton_schulz_with_precision,
    ns_sq_partition, ns_sum_of_squares, NsPrecision,
};
use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, DType, Tensor};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `g` as the device will see it: rounded to bf16 when the input is BF16.
fn as_input(g: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => g.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        _ => g.to_vec(),
    }
}

fn reference(precision: NsPrecision) -> fn(&[f32], usize, usize, usize, usize) -> Vec<f32> {
    match precision {
        NsPrecision::F32 => newton_schulz_reference,
        NsPrecision::Bf16 => newton_schulz_bf16_reference,
    }
}

fn on_emu(
    g: &[f32],
    (n, r, c): (usize, usize, usize),
    dtype: DType,
    steps: usize,
    precision: NsPrecision,
    seed: u64,
) -> Vec<f32> {
    let emu = Backend::emu_with_seed(seed);
    let t = Tensor::from_f32_as(&emu, &[n, r, c], dtype, g).unwrap();
    let x = newton_schulz_with_precision(&emu, &t, steps, precision).unwrap();
    assert_eq!(x.shape(), &[n, r, c]);
    assert_eq!(x.dtype(), DType::F32);
    x.to_vec::<f32>().unwrap()
}

#[test]
fn the_partition_covers_each_matrix_in_at_most_256_chunks() {
    let mut checked = 0;
    for size in [
        1usize,
        7,
        8191,
        8192,
        8193,
        20_000,
        2_097_152,   // [1024, 2048]: 256 chunks of 8192
        2_097_153,   // one more element: chunks of 16384
        536_870_912, // [16384, 32768]
        1 << 31,
    ] {
        let (chunk, parts) = ns_sq_partition(size);
        assert_eq!(chunk % 8192, 0, "size {size}: chunk {chunk}");
        assert!((1..=256).contains(&parts), "size {size}: {parts} parts");
        assert!(chunk * parts >= size, "size {size}: not covered");
        assert!(chunk * (parts - 1) < size, "size {size}: an empty chunk");
        checked += 1;
    }
    assert_eq!(checked, 10);
    assert_eq!(ns_sq_partition(2_097_152), (8192, 256));
    assert_eq!(ns_sq_partition(2_097_153), (16384, 129));
    assert_eq!(ns_sq_partition(20_000), (8192, 3));
}

/// The f32 sum of squares in the device's order is within a few f32 roundings of the f64 sum
/// (every term is positive: the relative error is at most ~(log2 terms per lane + 8 + 8) units
/// of 2^-24, far below 1e-5), and it is not the ascending f32 sum (or the CPU would not need
/// the device's order spelled out).
#[test]
fn the_sum_of_squares_is_the_f64_sum_to_f32_rounding() {
    let mut rng = Rng::new(71);
    let mut differs = 0;
    for size in [1usize, 17, 2159, 8192, 20_000, 300_001] {
        let g = rng.normal_vec(size, 1.0);
        let got = ns_sum_of_squares(&g) as f64;
        let want: f64 = g.iter().map(|&v| v as f64 * v as f64).sum();
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "size {size}: {got} vs {want}"
        );
        let ascending = g.iter().fold(0.0f32, |s, &v| v.mul_add(v, s));
        differs += usize::from(ascending.to_bits() != (got as f32).to_bits());
    }
    assert!(
        differs >= 3,
        "only {differs} of 6 sums differ from ascending"
    );
    assert_eq!(ns_sum_of_squares(&[]), 0.0);
    assert_eq!(ns_sum_of_squares(&[0.0; 9]).to_bits(), 0.0f32.to_bits());
}

/// cpu = emu bit for bit, both precisions, F32 and BF16 inputs. The shapes keep every product's
/// K <= 256, where the CPU GEMM sums each output in one ascending FMA chain from +0, as the emu
/// kernels do (f32: newton_schulz_matmul_f32; bf16: the emulated mma.sync); the norm, the
/// combines and the roundings are the device's by construction. Shapes: 3 chunks ([90,256]),
/// a partial last group and unaligned matrices (2159 elements: matrix 1 starts 4318 bytes in),
/// one row, one column, the transposed path, and 1 x 1.
#[test]
fn emu_equals_cpu_bit_for_bit_at_k_up_to_256() {
    let mut rng = Rng::new(72);
    let mut cases = 0;
    for &(n, r, c, steps) in &[
        (1, 90, 256, 2),
        (3, 17, 127, 2),
        (2, 127, 17, 3),
        (2, 1, 17, 5),
        (1, 17, 1, 3),
        (2, 1, 1, 1),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        for dtype in [DType::F32, DType::BF16] {
            for precision in [NsPrecision::F32, NsPrecision::Bf16] {
                let want = reference(precision)(&as_input(&g, dtype), n, r, c, steps);
                let got = on_emu(&g, (n, r, c), dtype, steps, precision, 1);
                assert!(got.iter().all(|v| v.is_finite()), "non-finite");
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{} path, {dtype} n={n} [{r},{c}] steps={steps}: emu != cpu",
                    precision.name()
                );
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 24);
}

/// Batch invariance on emu: each matrix of a batch of 3 has the bits it has alone (n = 1), on
/// both paths. Matrices of 2159 elements: in the batch, matrix 1 is not 16-byte aligned (scalar
/// loads) while alone it is (vector loads), so this also checks that the load width does not
/// change the order. [40, 300] crosses the chunk edge (12000 elements: 2 chunks) with K = 300
/// past one CPU chunk, which the emu does not care about.
#[test]
fn emu_matrices_have_the_same_bits_alone_and_in_a_batch() {
    let mut rng = Rng::new(73);
    let mut compared = 0;
    for &(r, c, dtype) in &[(17, 127, DType::BF16), (40, 300, DType::F32)] {
        let n = 3;
        let size = r * c;
        let g = rng.normal_vec(n * size, 1.0);
        for precision in [NsPrecision::F32, NsPrecision::Bf16] {
            let all = on_emu(&g, (n, r, c), dtype, 2, precision, 2);
            for i in 0..n {
                let one = on_emu(
                    &g[i * size..(i + 1) * size],
                    (1, r, c),
                    dtype,
                    2,
                    precision,
                    3,
                );
                assert_eq!(
                    bits(&all[i * size..(i + 1) * size]),
                    bits(&one),
                    "{} path [{r},{c}] {dtype}: matrix {i} differs alone",
                    precision.name()
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 12);
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = x[i * cols + j];
        }
    }
    t
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// `a` [rows, k] . `b` [cols, k]^T with bf16 operands on the cpu device: the bf16 chain, the
/// emulated mma.sync's order at every K.
fn cpu_bf16_gemm(a: &[f32], b: &[f32], rows: usize, cols: usize, k: usize) -> Vec<f32> {
    let cpu = Backend::Cpu;
    let at = Tensor::from_f32_as(&cpu, &[1, rows, k], DType::BF16, a).unwrap();
    let bt = Tensor::from_f32_as(&cpu, &[1, cols, k], DType::BF16, b).unwrap();
    gemm_batched(&cpu, &at, &bt).unwrap().to_vec().unwrap()
}

/// The bf16 path as it ran before its combines were fused into the GEMM's epilogue (issue 23
/// item 4), composed on the cpu device: the plain bf16 GEMM (`gemm_batched`, the emulated
/// mma.sync's order) and, between the products, the formulas of the removed
/// `newton_schulz_combine_bf16` kernel (v = fmaf(beta, E, alpha * P), rounded where the path
/// rounds). One matrix g [r, c].
fn unfused_bf16_path(g: &[f32], r: usize, c: usize, steps: usize) -> Vec<f32> {
    let (a, b, cc) = (3.4445f32, -4.7750f32, 2.0315f32);
    let denom = ns_sum_of_squares(g).sqrt() + 1e-7;
    let x0: Vec<f32> = g.iter().map(|&v| v / denom).collect();
    let (rr, cw, transposed) = if r > c { (c, r, true) } else { (r, c, false) };
    let mut x = if transposed { transpose(&x0, r, c) } else { x0 };
    for _ in 0..steps {
        let xb = round_bf16(&x);
        let am = cpu_bf16_gemm(&xb, &xb, rr, rr, cw);
        let ab = round_bf16(&am);
        let aa = cpu_bf16_gemm(&ab, &ab, rr, rr, rr);
        let bb: Vec<f32> = aa
            .iter()
            .zip(&am)
            .map(|(&p, &e)| bf16::from_f32(b.mul_add(e, cc * p)).to_f32())
            .collect();
        let xtb = transpose(&xb, rr, cw);
        let bx = cpu_bf16_gemm(&bb, &xtb, rr, cw, rr);
        x = bx
            .iter()
            .zip(&x)
            .map(|(&p, &e)| a.mul_add(e, 1.0 * p))
            .collect();
    }
    if transposed {
        transpose(&x, rr, cw)
    } else {
        x
    }
}

/// The fused bf16 path on emu has the bits of the unfused one (GEMM, then the combine), at
/// shapes where K > 256 (so the bf16 CPU reference, on the f32 GEMM's 256-chunks, is not
/// bit-comparable): [40, 300] (K = 300), [300, 33] (transposed: the last product writes the
/// output transposed), [130, 260] (past one 128-row tile each way). Also checked when the
/// change was made: 4 shapes of emu output (597,764 bytes) identical before and after.
#[test]
fn emu_bf16_path_has_the_bits_of_the_unfused_gemm_and_combine() {
    let mut rng = Rng::new(74);
    let mut compared = 0;
    for &(n, r, c, steps, dtype) in &[
        (2, 40, 300, 3, DType::BF16),
        (1, 300, 33, 2, DType::F32),
        (1, 130, 260, 2, DType::BF16),
    ] {
        let g = rng.normal_vec(n * r * c, 1.0);
        let gw = as_input(&g, dtype);
        let got = on_emu(&g, (n, r, c), dtype, steps, NsPrecision::Bf16, 4);
        let size = r * c;
        for i in 0..n {
            let want = unfused_bf16_path(&gw[i * size..(i + 1) * size], r, c, steps);
            assert_eq!(
                bits(&got[i * size..(i + 1) * size]),
                bits(&want),
                "n={n} [{r},{c}] {dtype}: matrix {i}: fused emu != unfused"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 4);
}
