//! Batch invariance of is_gate_loss: a row's outputs do not depend on the rows around it (cpu,
//! emu, cuda where a GPU exists). A submodule of kernels/tests/is_gate_loss.rs, which holds the
//! problems, the reference runs and the device runner it uses.

use super::*;

/// The row under test: random logits, its own log-prob as the behavior log-prob (rho = 1, so every
/// mode accepts it and its gradient is not zero), advantage 0.7, masked in.
pub(super) fn probe_row(seed: u64, v: usize, dtype: DType) -> Problem {
    let mut pb = Problem::random(seed, 1, v, false);
    if dtype == DType::BF16 {
        pb = pb.into_bf16_values();
    }
    pb.adv = vec![0.7];
    pb.mask = vec![1.0];
    let (r, _) = if dtype == DType::BF16 {
        pb.reference_bf16(&params(GateMode::Pg))
    } else {
        pb.reference(&params(GateMode::Pg))
    };
    pb.behavior = r.logp;
    pb
}

/// A batch of `n` random rows with `probe` placed at row `at`. Masks make the denominator D (the
/// sum of masks) the largest power of two <= n: the probe and D - 1 of the other rows are masked
/// in.
pub(super) fn batch_around(
    probe: &Problem,
    n: usize,
    at: usize,
    seed: u64,
    dtype: DType,
) -> (Problem, f32) {
    let v = probe.v;
    let mut pb = Problem::random(seed, n, v, false);
    if dtype == DType::BF16 {
        pb = pb.into_bf16_values();
    }
    pb.logits[at * v..(at + 1) * v].copy_from_slice(&probe.logits);
    pb.tokens[at] = probe.tokens[0];
    pb.behavior[at] = probe.behavior[0];
    pb.adv[at] = probe.adv[0];
    let d = 1usize << n.ilog2();
    let mut rng = Rng::new(seed ^ 0xd);
    let mut others: Vec<usize> = (0..n).filter(|&t| t != at).collect();
    // A seeded shuffle picks which of the other rows are masked in.
    for i in (1..others.len()).rev() {
        others.swap(i, rng.below(i + 1));
    }
    pb.mask = vec![0.0; n];
    pb.mask[at] = 1.0;
    for &t in &others[..d - 1] {
        pb.mask[t] = 1.0;
    }
    (pb, d as f32)
}

/// The probe row alone (N = 1) and first, in the middle and last of batches of 2, 5 and 17 rows,
/// in every mode: logp, ratio and accepted bit-identical, and the dlogits row bit-identical once
/// scaled by D. The loss divides by D = sum of masks over the batch, so the gradient row of a
/// batch is (the row's own term) / D: with D a power of two, dividing and multiplying by it is
/// exact (no result is near the subnormal range), so `dlogits_batch * D` must equal the row
/// alone's dlogits (D = 1) bit for bit, in f32 and in bf16 storage alike. V = 300 runs the scalar
/// row path; V = 2050 the vectorised one (V >= 2048) with odd rows misaligned for 16-byte loads.
/// Returns the rows compared.
fn check_row_batch_invariance(b: &Backend, name: &str, modes: &[GateMode]) -> usize {
    let mut compared = 0;
    for (dtype, v, seed) in [
        (DType::F32, 300, 91),
        (DType::F32, 2050, 92),
        (DType::BF16, 2050, 93),
    ] {
        let probe = probe_row(seed, v, dtype);
        for &mode in modes {
            let p = params(mode);
            let (alone, galone) = run_device(b, &probe, dtype, &p);
            assert_eq!(
                alone.accepted,
                vec![1],
                "{name} {mode:?}: the probe must be accepted"
            );
            assert!(
                galone.iter().filter(|g| **g != 0.0).count() > v / 2,
                "{name} {mode:?}: the probe's gradient must not be zero"
            );
            for (n, positions) in [
                (2usize, vec![0, 1]),
                (5, vec![0, 2, 4]),
                (17, vec![0, 8, 16]),
            ] {
                for at in positions {
                    let ctx = format!("{name} {mode:?} {dtype} V={v}: row {at} of {n}");
                    let (pb, d) = batch_around(&probe, n, at, seed * 100 + n as u64, dtype);
                    let (got, g) = run_device(b, &pb, dtype, &p);
                    assert_eq!(
                        got.logp[at].to_bits(),
                        alone.logp[0].to_bits(),
                        "{ctx}: logp"
                    );
                    assert_eq!(
                        got.ratio[at].to_bits(),
                        alone.ratio[0].to_bits(),
                        "{ctx}: ratio"
                    );
                    assert_eq!(got.accepted[at], alone.accepted[0], "{ctx}: accepted");
                    for (j, (&x, &y)) in g[at * v..(at + 1) * v].iter().zip(&galone).enumerate() {
                        assert_eq!(
                            (x * d).to_bits(),
                            y.to_bits(),
                            "{ctx}: dlogits[{j}] * D = {} * {d} vs alone {y}",
                            x
                        );
                    }
                    compared += 1;
                }
            }
        }
    }
    compared
}

#[test]
fn cpu_rows_are_batch_invariant() {
    let n = check_row_batch_invariance(&Backend::Cpu, "cpu", &MODES);
    assert_eq!(n, 3 * MODES.len() * 8);
}

#[test]
fn emu_rows_are_batch_invariant() {
    let n = check_row_batch_invariance(&Backend::emu_with_seed(5), "emu", &MODES);
    assert_eq!(n, 3 * MODES.len() * 8);
}

#[test]
fn cuda_rows_are_batch_invariant() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("is_gate_loss batch invariance") {
        let n = check_row_batch_invariance(&gpu, "cuda", &MODES);
        assert_eq!(n, 3 * MODES.len() * 8);
    }
}
