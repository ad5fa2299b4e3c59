//! newton_schulz, the bits (issue 23 item 4): the split normalisation's fixed partition and
//! order, cpu = emu bit for bit where both sum every product in one ascending FMA chain
//! (K <= 256: one chunk of the CPU GEMM), batch invariance on emu (a matrix's bits do not depend
//! on n or on where it sits, which also moves its 16-byte alignment), and the bf16 path's fused
//! GEMM epilogues against the unfused composition they replaced.
//!
//! Every device output here is allocated poisoned (NaN) inside the call, so an element a kernel
//! misses fails the bit comparisons.

use half::bf16;
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
        2_097_152,    // [1024, 2048]: 256 chunks of 8192
        2_097_153,    // one more element: chunks of 16384
        536_870_912,  // [16384, 32768]
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
    assert!(differs >= 3, "only {differs} of 6 sums differ from ascending");
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
                let one = on_emu(&g[i * size..(i + 1) * size], (1, r, c), dtype, 2, precision, 3);
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
