//! is_gate_loss's regularizers (issue 28 item 7): the entropy (measured, and the bonus) and the
//! KL to a reference (k1, k3). A hand-worked example, an f64 oracle and finite differences,
//! emu (and cuda where a GPU exists) against the reference on ragged sizes, bit-identity of the
//! measured variant with the plain kernel, batch invariance, bad input. A submodule of
//! kernels/tests/is_gate_loss.rs (its problems and f64 oracle of the policy terms).

use super::*;
use sluice_kernels::ops::is_gate_loss::{KlEstimator, KlPenalty};

/// A problem with the reference policy's log-probs.
struct RegProblem {
    pb: Problem,
    ref_logp: Vec<f32>,
}

impl RegProblem {
    /// `Problem::random` with reference log-probs near the tokens' own (so both KL signs occur).
    fn random(seed: u64, n: usize, v: usize, weighted: bool) -> RegProblem {
        let pb = Problem::random(seed, n, v, weighted);
        let mut rng = Rng::new(seed ^ 0x5eed);
        let (r, _) = pb.reference(&params(GateMode::Pg));
        let ref_logp = r
            .logp
            .iter()
            .map(|&lp| lp + (rng.normal() * 0.3) as f32)
            .collect();
        RegProblem { pb, ref_logp }
    }
    fn inputs(&self) -> TokenInputs<'_> {
        TokenInputs {
            ref_logp: Some(&self.ref_logp),
            ..self.pb.inputs()
        }
    }
    fn reference(&self, p: &GateParams) -> (GateReference, Vec<f32>) {
        let (n, v) = (self.pb.n, self.pb.v);
        let mut grad = vec![f32::NAN; n * v];
        let r = is_gate_loss_reference(&self.pb.logits, n, v, &self.inputs(), p, &mut grad)
            .expect("reference runs");
        (r, grad)
    }
    fn reference_bf16(&self, p: &GateParams) -> (GateReference, Vec<f32>) {
        let (n, v) = (self.pb.n, self.pb.v);
        let x: Vec<bf16> = self.pb.logits.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut grad = vec![bf16::from_f32(f32::NAN); n * v];
        let r =
            is_gate_loss_reference(&x, n, v, &self.inputs(), p, &mut grad).expect("reference runs");
        (r, grad.iter().map(|g| g.to_f32()).collect())
    }
    /// Through the device entry point (outputs poisoned by the entry point on a device).
    fn run(&self, b: &Backend, dtype: DType, p: &GateParams) -> (GateReference, Vec<f32>) {
        let (logits, rest) = upload(b, &self.pb, dtype);
        let r = Tensor::from_slice(b, &[self.pb.n], &self.ref_logp).unwrap();
        let tb = TokenBatch {
            ref_logp: Some(&r),
            ..batch(&rest)
        };
        let (out, grad) = is_gate_loss(b, &logits, &tb, p).expect("device run");
        (collect(&out), grad.to_f32_vec().unwrap())
    }
}

fn with_reg(mode: GateMode, entropy: Option<f32>, kl: Option<(KlEstimator, f32)>) -> GateParams {
    GateParams {
        entropy,
        kl: kl.map(|(estimator, coef)| KlPenalty { estimator, coef }),
        ..params(mode)
    }
}

/// The regularizers' f64 loss and gradient (added to the policy oracle's), and each row's
/// entropy, written from the definitions independently of the kernels' reference.
fn reg_oracle(rp: &RegProblem, x: &[f64], p: &GateParams) -> (f64, Vec<f64>, Vec<f64>) {
    let pb = &rp.pb;
    let (n, v) = (pb.n, pb.v);
    let c = |t: usize| pb.weight.as_ref().map_or(1.0, |w| w[t] as f64);
    let d: f64 = (0..n).map(|t| pb.mask[t] as f64 * c(t)).sum();
    let (mut loss, mut grad, mut ent) = (0.0, vec![0.0; n * v], vec![0.0; n]);
    for t in 0..n {
        let row = &x[t * v..(t + 1) * v];
        let lse = lse64(row);
        let logq: Vec<f64> = row.iter().map(|&z| z - lse).collect();
        let h: f64 = -logq.iter().map(|&l| l.exp() * l).sum::<f64>();
        ent[t] = h;
        let k = pb.mask[t] as f64 * c(t);
        if k == 0.0 || d <= 0.0 {
            continue;
        }
        let tok = pb.tokens[t] as usize;
        let (mut term, mut dlogp) = (0.0, 0.0);
        if let Some(kl) = p.kl {
            let u = rp.ref_logp[t] as f64 - logq[tok];
            let (e, de) = match kl.estimator {
                KlEstimator::K1 => (-u, 1.0),
                KlEstimator::K3 => (u.exp() - 1.0 - u, 1.0 - u.exp()),
            };
            term += kl.coef as f64 * k * e;
            dlogp += kl.coef as f64 * k * de;
        }
        let ce = p.entropy.unwrap_or(0.0) as f64;
        term -= ce * k * h;
        loss += term / d;
        for j in 0..v {
            let pj = logq[j].exp();
            let onehot = if j == tok { 1.0 } else { 0.0 };
            // d(-ce k H)/dz_j = ce k p_j (log p_j + H).
            grad[t * v + j] = (dlogp * (onehot - pj) + ce * k * pj * (logq[j] + h)) / d;
        }
    }
    (loss, grad, ent)
}

/// (entropy: None off, Some(coef); KL: estimator and coefficient).
type RegCase = (Option<f32>, Option<(KlEstimator, f32)>);

const REG_CASES: [RegCase; 4] = [
    (Some(0.0), None),
    (Some(0.05), None),
    (None, Some((KlEstimator::K1, 0.3))),
    (Some(0.02), Some((KlEstimator::K3, 0.5))),
];

/// Worked by hand: V = 4, `pg` mode with advantage 0 (no policy term), entropy_coef 0.1,
/// k3 with kl_coef 0.5, tokens 0, 0, 1, masks 1, 1, 0 (D = 2).
/// - Row 0: logits 0 0 0 0: p = 1/4 each, logp = -ln 4, H = ln 4 = 1.386294. Reference
///   log-prob ln(1/2): u = ref - logp = ln 2, k3 = 2 - 1 - ln 2 = 0.306853, d/dlogp = 1 - 2 = -1.
/// - Row 1: logits ln 3, 0, 0, 0: p = 1/2, 1/6, 1/6, 1/6, logp = -ln 2, H = (ln 2 + ln 6) / 2
///   = 1.242453. Reference ln(1/4): u = -ln 2, k3 = 1/2 - 1 + ln 2 = 0.193147, d = 1/2.
/// - Row 2: out of the loss (its entropy ln 4 is still output).
///
/// loss = (1/2) [0.5 (0.306853 + 0.193147) - 0.1 (1.386294 + 1.242453)] = -0.006437.
/// dz_j = (kl_coef k dkl / D) (onehot - p_j) + (0.1 k / D) p_j (log p_j + H):
/// - row 0: coef = 0.5 * -1 / 2 = -0.25, and log p_j + H = 0 (the uniform row is at the
///   entropy's maximum): dz = -0.25 * 3/4 = -0.1875 at the token, -0.25 * -1/4 = 0.0625 else.
/// - row 1: coef = 0.5 * 0.5 / 2 = 0.125, ecoef = 0.05; log p_j + H = +-0.549306:
///   dz_0 = 0.125 * 1/2 + 0.05 * 1/2 * 0.549306 = 0.076233,
///   dz_j = 0.125 * -1/6 + 0.05 * 1/6 * -0.549306 = -0.025411 (the row sums to 0).
#[test]
fn worked_example_entropy_bonus_and_k3() {
    let l3 = 3f32.ln();
    let pb = Problem {
        n: 3,
        v: 4,
        logits: vec![0.0, 0.0, 0.0, 0.0, l3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        tokens: vec![0, 0, 1],
        behavior: vec![0.0; 3],
        adv: vec![0.0; 3],
        mask: vec![1.0, 1.0, 0.0],
        weight: None,
    };
    let rp = RegProblem {
        pb,
        ref_logp: vec![0.5f32.ln(), 0.25f32.ln(), 0.0],
    };
    let p = with_reg(GateMode::Pg, Some(0.1), Some((KlEstimator::K3, 0.5)));
    let (want_g, want_h) = (
        [
            -0.1875, 0.0625, 0.0625, 0.0625, 0.076233, -0.025411, -0.025411, -0.025411, 0.0, 0.0,
            0.0, 0.0,
        ],
        [1.386294, 1.242453, 1.386294],
    );
    for (name, b) in [("cpu", Backend::Cpu), ("emu", Backend::emu_with_seed(3))] {
        let (r, g) = rp.run(&b, DType::F32, &p);
        // The hand values carry 6 decimals: 2e-6 absolute.
        assert!((r.loss - -0.006437).abs() < 2e-6, "{name}: loss {}", r.loss);
        for (j, (&got, want)) in g.iter().zip(want_g).enumerate() {
            assert!((got - want).abs() < 2e-6, "{name}: dz[{j}] {got} vs {want}");
        }
        for (t, (&got, want)) in r.entropy.iter().zip(want_h).enumerate() {
            assert!((got - want).abs() < 2e-6, "{name}: H[{t}] {got} vs {want}");
        }
    }
    // k1 on the same rows: (1/2) [0.5 (-ln 2 + ln 2)] = 0 without the bonus; d/dlogp = 1.
    let (r, _) = rp.reference(&with_reg(GateMode::Pg, None, Some((KlEstimator::K1, 0.5))));
    assert!(r.loss.abs() < 1e-7, "k1 loss {}", r.loss);
}

#[test]
fn reference_matches_f64_oracle_and_finite_differences() {
    for mode in MODES {
        for (i, (entropy, kl)) in REG_CASES.into_iter().enumerate() {
            let p = with_reg(mode, entropy, kl);
            let rp = RegProblem::random(200 + i as u64, 6, 7, true);
            let x: Vec<f64> = rp.pb.logits.iter().map(|&x| x as f64).collect();
            let base = oracle(&rp.pb, &x, &p, None);
            let (rl, rg, rh) = reg_oracle(&rp, &x, &p);
            let want_g: Vec<f64> = base.grad.iter().zip(&rg).map(|(a, b)| a + b).collect();
            let (r, g) = rp.reference(&p);
            let ctx = format!("{mode:?} {entropy:?} {kl:?}");
            assert!(rel_scalar(r.loss, base.loss + rl) <= F32_TOL, "{ctx}: loss");
            assert!(rel_norm(&g, &want_g) <= F32_TOL, "{ctx}: dlogits");
            match entropy {
                Some(_) => assert!(rel_norm(&r.entropy, &rh) <= F32_TOL, "{ctx}: entropy"),
                None => assert!(r.entropy.is_empty(), "{ctx}: no entropy output"),
            }
            // The oracle's gradient against central differences of its loss (gates frozen).
            let h = 1e-6;
            let loss_at = |x: &[f64]| {
                oracle(&rp.pb, x, &p, Some(&base.frozen)).loss + reg_oracle(&rp, x, &p).0
            };
            let fd: Vec<f64> = (0..x.len())
                .map(|i| {
                    let (mut xp, mut xm) = (x.clone(), x.clone());
                    xp[i] += h;
                    xm[i] -= h;
                    (loss_at(&xp) - loss_at(&xm)) / (2.0 * h)
                })
                .collect();
            let want32: Vec<f32> = want_g.iter().map(|&g| g as f32).collect();
            // O(h^2) + rounding / h, as the policy terms' test.
            assert!(rel_norm(&want32, &fd) <= 1e-6, "{ctx}: oracle vs fd");
        }
    }
}

/// Ragged sizes: 1, 17 and 127 tokens; V not a multiple of the 256-thread block (300, 1000),
/// and 2050 (full 2048-entry tiles, a tail, odd f32 rows misaligned); a bf16 case.
fn ragged_cases() -> Vec<(RegProblem, DType)> {
    vec![
        (RegProblem::random(301, 1, 1000, false), DType::F32),
        (RegProblem::random(302, 17, 300, true), DType::F32),
        (RegProblem::random(303, 127, 300, false), DType::F32),
        (RegProblem::random(304, 3, 2050, true), DType::F32),
        (
            RegProblem {
                pb: RegProblem::random(305, 17, 257, false)
                    .pb
                    .into_bf16_values(),
                ref_logp: RegProblem::random(305, 17, 257, false).ref_logp,
            },
            DType::BF16,
        ),
    ]
}

fn check_device_regularizers(b: &Backend, name: &str) -> usize {
    let mut checked = 0;
    for (rp, dtype) in ragged_cases() {
        for (mode, (entropy, kl)) in [GateMode::Dis, GateMode::Ppo]
            .into_iter()
            .flat_map(|m| REG_CASES.into_iter().map(move |c| (m, c)))
        {
            let p = with_reg(mode, entropy, kl);
            let (want, gwant) = match dtype {
                DType::F32 => rp.reference(&p),
                _ => rp.reference_bf16(&p),
            };
            let (got, ggot) = rp.run(b, dtype, &p);
            let tol = if dtype == DType::F32 {
                F32_TOL
            } else {
                BF16_TOL
            };
            let ctx = format!(
                "{name} {mode:?} {entropy:?} {kl:?} {dtype} n={} v={}",
                rp.pb.n, rp.pb.v
            );
            assert_close(&got, &ggot, &want, &gwant, tol, &ctx);
            assert_eq!(got.entropy.len(), want.entropy.len(), "{ctx}: entropy rows");
            let w64: Vec<f64> = want.entropy.iter().map(|&h| h as f64).collect();
            assert!(rel_norm(&got.entropy, &w64) <= F32_TOL, "{ctx}: entropy");
            assert_eq!(lost_outputs(&got.entropy, &want.entropy), 0, "{ctx}");
            let (again, gagain) = rp.run(b, dtype, &p);
            assert_eq!(bits(&got, &ggot), bits(&again, &gagain), "{ctx}: rerun");
            checked += 1;
        }
    }
    checked
}

#[test]
fn emu_matches_reference_on_ragged_sizes() {
    let n = check_device_regularizers(&Backend::emu_with_seed(7), "emu");
    assert_eq!(n, 5 * 2 * REG_CASES.len());
}

#[test]
fn cuda_regularizers_match_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("is_gate_loss regularizers") {
        let n = check_device_regularizers(&gpu, "cuda");
        assert_eq!(n, 5 * 2 * REG_CASES.len());
    }
}

/// Measuring the entropy changes no other bit (loss, logp, ratio, counters, dlogits): the
/// entropy sum rides along the same (max, sum) steps. And the KL with coefficient 0 adds 0.
fn check_measure_is_free(b: &Backend, name: &str) {
    for (rp, dtype) in ragged_cases() {
        for mode in MODES {
            let (plain, gplain) = rp.run(b, dtype, &params(mode));
            let (m, gm) = rp.run(b, dtype, &with_reg(mode, Some(0.0), None));
            assert_eq!(m.entropy.len(), rp.pb.n);
            let strip = |r: &GateReference| GateReference {
                entropy: Vec::new(),
                ..r.clone()
            };
            let ctx = format!("{name} {mode:?} {dtype} n={}", rp.pb.n);
            assert_eq!(bits(&strip(&m), &gm), bits(&plain, &gplain), "{ctx}");
            let (k0, gk0) = rp.run(
                b,
                dtype,
                &with_reg(mode, None, Some((KlEstimator::K3, 0.0))),
            );
            assert_eq!(bits(&k0, &gk0), bits(&plain, &gplain), "{ctx}: kl_coef 0");
        }
    }
}

#[test]
fn measured_entropy_leaves_every_other_bit_cpu_and_emu() {
    check_measure_is_free(&Backend::Cpu, "cpu");
    check_measure_is_free(&Backend::emu_with_seed(2), "emu");
}

#[test]
fn cuda_measured_entropy_leaves_every_other_bit() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("is_gate_loss entropy bits") {
        check_measure_is_free(&gpu, "cuda");
    }
}

/// A row with the bonus and the KL on gives the same logp, entropy and (scaled by the power-of-
/// two D) dlogits bits alone and inside batches of 5 and 17 rows.
fn check_regularized_row_batch_invariance(b: &Backend, name: &str) -> usize {
    let p = with_reg(GateMode::Dis, Some(0.03), Some((KlEstimator::K3, 0.2)));
    let mut compared = 0;
    for (dtype, v, seed) in [(DType::F32, 300, 401), (DType::BF16, 2050, 402)] {
        let probe = batch_invariance::probe_row(seed, v, dtype);
        let ref0 = probe.behavior[0] + 0.4;
        let run = |pb: &Problem, ref_at: Vec<f32>| {
            RegProblem {
                pb: pb.clone(),
                ref_logp: ref_at,
            }
            .run(b, dtype, &p)
        };
        let (alone, galone) = run(&probe, vec![ref0]);
        for (n, at) in [(5usize, 2usize), (17, 16)] {
            let (pb, d) =
                batch_invariance::batch_around(&probe, n, at, seed * 10 + n as u64, dtype);
            let mut refs: Vec<f32> = pb.behavior.iter().map(|&x| x - 0.1).collect();
            refs[at] = ref0;
            let (got, g) = run(&pb, refs);
            let ctx = format!("{name} {dtype} V={v}: row {at} of {n}");
            assert_eq!(got.logp[at].to_bits(), alone.logp[0].to_bits(), "{ctx}");
            assert_eq!(
                got.entropy[at].to_bits(),
                alone.entropy[0].to_bits(),
                "{ctx}"
            );
            for (j, (&x, &y)) in g[at * v..(at + 1) * v].iter().zip(&galone).enumerate() {
                assert_eq!((x * d).to_bits(), y.to_bits(), "{ctx}: dlogits[{j}]");
            }
            compared += 1;
        }
    }
    compared
}

#[test]
fn regularized_rows_are_batch_invariant_cpu_and_emu() {
    assert_eq!(
        check_regularized_row_batch_invariance(&Backend::Cpu, "cpu"),
        4
    );
    let emu = Backend::emu_with_seed(4);
    assert_eq!(check_regularized_row_batch_invariance(&emu, "emu"), 4);
}

#[test]
fn cuda_regularized_rows_are_batch_invariant() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("is_gate_loss regularizers rows") {
        assert_eq!(check_regularized_row_batch_invariance(&gpu, "cuda"), 4);
    }
}

#[test]
fn bad_regularizer_input_names_it() {
    let b = Backend::Cpu;
    let rp = RegProblem::random(501, 4, 10, false);
    let (logits, rest) = upload(&b, &rp.pb, DType::F32);
    let kl = with_reg(GateMode::Dis, None, Some((KlEstimator::K3, 0.1)));
    let e = is_gate_loss(&b, &logits, &batch(&rest), &kl).unwrap_err();
    assert!(e.to_string().contains("ref_logp"), "{e}");
    let short = Tensor::from_slice(&b, &[3], &[0.0f32; 3]).unwrap();
    let tb = TokenBatch {
        ref_logp: Some(&short),
        ..batch(&rest)
    };
    let e = is_gate_loss(&b, &logits, &tb, &kl).unwrap_err();
    assert!(e.to_string().contains("ref_logp"), "{e}");
    for (p, key) in [
        (with_reg(GateMode::Dis, Some(-0.1), None), "entropy_coef"),
        (
            with_reg(GateMode::Dis, Some(f32::NAN), None),
            "entropy_coef",
        ),
        (
            with_reg(GateMode::Dis, None, Some((KlEstimator::K1, -1.0))),
            "kl_coef",
        ),
    ] {
        let e = is_gate_loss(&b, &logits, &batch(&rest), &p).unwrap_err();
        assert!(e.to_string().contains(key), "{key}: {e}");
    }
    assert!(KlEstimator::parse("k2")
        .unwrap_err()
        .to_string()
        .contains("kl_estimator"));
}
