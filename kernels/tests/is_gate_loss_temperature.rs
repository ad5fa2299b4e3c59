//! is_gate_loss at a sampling temperature other than 1: logp is taken under
//! log_softmax(logits * (1 / T)), the sampler's exact scaling, so the sampler's recorded
//! log-prob and the loss's logp agree bit for bit at any temperature (DESIGN 6.6: the learner
//! computes at the rollout's temperature). Also: the gradient against an f64 oracle (with the
//! 1/T chain factor), emu against the CPU reference, and bad temperatures.

use sluice_kernels::ops::is_gate_loss::{
    is_gate_loss, is_gate_loss_reference, GateMode, GateParams, TokenBatch, TokenInputs,
};
use sluice_kernels::ops::sample::{sample, SampleParams};
use sluice_kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

const TEMPERATURES: [f32; 3] = [0.7, 1.3, 0.35];

/// The sampler's log-probs at temperature `t` equal is_gate_loss's logp at `t`, bit for bit.
fn check_sampler_equals_loss(be: &Backend, dtype: DType) {
    let mut compared = 0;
    for v in [300usize, 2050, 4104] {
        let b = 5;
        let mut rng = Rng::new(v as u64 + 11);
        let logits = rng.normal_vec(b * v, 2.5);
        let ids: Vec<u64> = (0..b).map(|_| rng.next_u64()).collect();
        let pos: Vec<i32> = (0..b).map(|_| rng.below(10_000) as i32).collect();
        for &t in &TEMPERATURES {
            let p = SampleParams {
                seed: 17,
                temperature: t,
                ..SampleParams::default()
            };
            let lt = Tensor::from_f32_as(be, &[b, v], dtype, &logits).unwrap();
            let idt = Tensor::from_slice(be, &[b], &ids).unwrap();
            let post = Tensor::from_slice(be, &[b], &pos).unwrap();
            let (tok, lp) = sample(be, &lt, &idt, &post, &p).unwrap();
            let lp: Vec<f32> = lp.to_vec().unwrap();
            let zeros = Tensor::from_slice(be, &[b], &vec![0.0f32; b]).unwrap();
            let ones = Tensor::from_slice(be, &[b], &vec![1.0f32; b]).unwrap();
            let batch = TokenBatch {
                tokens: &tok,
                behavior_logp: &zeros,
                advantages: &ones,
                mask: &ones,
                weight: None,
                ref_logp: None,
            };
            let params = GateParams {
                temperature: t,
                ..GateParams::default()
            };
            let (out, _) = is_gate_loss(be, &lt, &batch, &params).unwrap();
            let logp: Vec<f32> = out.logp.to_vec().unwrap();
            for r in 0..b {
                assert_eq!(
                    lp[r].to_bits(),
                    logp[r].to_bits(),
                    "{:?} {dtype} V={v} T={t} row {r}: sampler {} vs loss {}",
                    be.device(),
                    lp[r],
                    logp[r]
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 3 * 3 * 5, "every row of every case compared");
}

#[test]
fn sampler_logprob_equals_loss_logp_at_any_temperature_on_cpu() {
    check_sampler_equals_loss(&Backend::Cpu, DType::F32);
    check_sampler_equals_loss(&Backend::Cpu, DType::BF16);
}

#[test]
fn sampler_logprob_equals_loss_logp_at_any_temperature_on_emu() {
    check_sampler_equals_loss(&Backend::emu_with_seed(1), DType::F32);
    check_sampler_equals_loss(&Backend::emu_with_seed(2), DType::BF16);
}

struct Problem {
    n: usize,
    v: usize,
    logits: Vec<f32>,
    tokens: Vec<i32>,
    behavior: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
}

impl Problem {
    fn random(seed: u64, n: usize, v: usize) -> Problem {
        let mut rng = Rng::new(seed);
        Problem {
            n,
            v,
            logits: rng.normal_vec(n * v, 2.0),
            tokens: (0..n).map(|_| rng.below(v) as i32).collect(),
            behavior: (0..n)
                .map(|_| -(rng.uniform() as f32) * 3.0 - 0.5)
                .collect(),
            adv: (0..n).map(|_| rng.normal() as f32).collect(),
            mask: (0..n)
                .map(|_| if rng.uniform() < 0.8 { 1.0 } else { 0.0 })
                .collect(),
        }
    }
    fn inputs(&self) -> TokenInputs<'_> {
        TokenInputs {
            tokens: &self.tokens,
            behavior_logp: &self.behavior,
            advantages: &self.adv,
            mask: &self.mask,
            weight: None,
            ref_logp: None,
        }
    }
}

/// The f64 loss of `pg` mode and its gradient: L = -(1/D) sum m A logp, logp = z_tok - lse(z),
/// z = x / T; dL/dx_j = -(1/D) m A (1/T) ([j == tok] - softmax(z)_j).
fn pg_oracle(pb: &Problem, t: f64) -> (f64, Vec<f64>) {
    let d: f64 = pb.mask.iter().map(|&m| m as f64).sum();
    let mut loss = 0.0;
    let mut grad = vec![0.0f64; pb.n * pb.v];
    for r in 0..pb.n {
        let z: Vec<f64> = pb.logits[r * pb.v..(r + 1) * pb.v]
            .iter()
            .map(|&x| x as f64 / t)
            .collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
        let tok = pb.tokens[r] as usize;
        let k = pb.mask[r] as f64 * pb.adv[r] as f64;
        loss -= k * (z[tok] - lse) / d;
        for j in 0..pb.v {
            let onehot = if j == tok { 1.0 } else { 0.0 };
            grad[r * pb.v + j] = -(k / d) * (onehot - (z[j] - lse).exp()) / t;
        }
    }
    (loss, grad)
}

#[test]
fn loss_and_gradient_at_temperature_match_the_f64_oracle() {
    for (seed, n, v) in [(1u64, 1usize, 17usize), (2, 17, 127), (3, 33, 2050)] {
        let pb = Problem::random(seed, n, v);
        for &t in &TEMPERATURES {
            let params = GateParams {
                mode: GateMode::Pg,
                temperature: t,
                ..GateParams::default()
            };
            let mut grad = vec![f32::NAN; n * v];
            let r =
                is_gate_loss_reference(&pb.logits, n, v, &pb.inputs(), &params, &mut grad).unwrap();
            let (want_loss, want_grad) = pg_oracle(&pb, t as f64);
            let got: Vec<f64> = grad.iter().map(|&g| g as f64).collect();
            let e = rel_norm(&grad, &want_grad);
            assert!(e <= F32_TOL, "n={n} v={v} T={t}: gradient rel err {e}");
            assert!(
                (r.loss as f64 - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
                "n={n} v={v} T={t}: loss {} vs {want_loss}",
                r.loss
            );
            assert!(got.iter().all(|g| g.is_finite()), "every gradient written");
        }
    }
}

#[test]
fn temperature_equals_prescaled_logits_bit_for_bit() {
    // z = logits * (1 / T) is one f32 multiply, so running at T on x gives the same logp,
    // ratio and gate bits as running at T = 1 on x * (1 / T) rounded to f32 (the gradient
    // differs by the chain factor 1 / T, so it is compared by norm).
    let pb = Problem::random(9, 19, 2050);
    for &t in &TEMPERATURES {
        let s = 1.0 / t;
        let scaled: Vec<f32> = pb.logits.iter().map(|&x| x * s).collect();
        for mode in [GateMode::Dis, GateMode::Icepop, GateMode::Ppo, GateMode::Pg] {
            let at_t = GateParams {
                mode,
                temperature: t,
                ..GateParams::default()
            };
            let at_one = GateParams {
                mode,
                ..GateParams::default()
            };
            let mut ga = vec![0.0f32; pb.n * pb.v];
            let ra = is_gate_loss_reference(&pb.logits, pb.n, pb.v, &pb.inputs(), &at_t, &mut ga)
                .unwrap();
            let mut gb = vec![0.0f32; pb.n * pb.v];
            let rb = is_gate_loss_reference(&scaled, pb.n, pb.v, &pb.inputs(), &at_one, &mut gb)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ra.logp), bits(&rb.logp), "{mode:?} T={t}: logp");
            assert_eq!(bits(&ra.ratio), bits(&rb.ratio), "{mode:?} T={t}: ratio");
            assert_eq!(ra.accepted, rb.accepted, "{mode:?} T={t}: accepted");
            let want: Vec<f64> = gb.iter().map(|&g| g as f64 * s as f64).collect();
            let e = rel_norm(&ga, &want);
            assert!(
                e <= F32_TOL,
                "{mode:?} T={t}: gradient = (1/T) x prescaled: {e}"
            );
        }
    }
}

#[test]
fn emu_matches_the_reference_at_temperature() {
    let be = Backend::emu_with_seed(3);
    for (seed, n, v) in [(4u64, 1usize, 17usize), (5, 17, 2050)] {
        let pb = Problem::random(seed, n, v);
        for mode in [GateMode::Dis, GateMode::Ppo] {
            let params = GateParams {
                mode,
                temperature: 0.6,
                ..GateParams::default()
            };
            let mut want_grad = vec![0.0f32; n * v];
            let want =
                is_gate_loss_reference(&pb.logits, n, v, &pb.inputs(), &params, &mut want_grad)
                    .unwrap();
            let logits = Tensor::from_slice(&be, &[n, v], &pb.logits).unwrap();
            let tokens = Tensor::from_slice(&be, &[n], &pb.tokens).unwrap();
            let behavior = Tensor::from_slice(&be, &[n], &pb.behavior).unwrap();
            let adv = Tensor::from_slice(&be, &[n], &pb.adv).unwrap();
            let mask = Tensor::from_slice(&be, &[n], &pb.mask).unwrap();
            let batch = TokenBatch {
                tokens: &tokens,
                behavior_logp: &behavior,
                advantages: &adv,
                mask: &mask,
                weight: None,
                ref_logp: None,
            };
            let (out, dl) = is_gate_loss(&be, &logits, &batch, &params).unwrap();
            let got_grad: Vec<f32> = dl.to_vec().unwrap();
            let want64: Vec<f64> = want_grad.iter().map(|&g| g as f64).collect();
            let e = rel_norm(&got_grad, &want64);
            assert!(
                e <= F32_TOL,
                "{mode:?} n={n} v={v}: emu gradient rel err {e}"
            );
            let logp: Vec<f32> = out.logp.to_vec().unwrap();
            let want_lp: Vec<f64> = want.logp.iter().map(|&x| x as f64).collect();
            let e = rel_norm(&logp, &want_lp);
            assert!(e <= F32_TOL, "{mode:?} n={n} v={v}: emu logp rel err {e}");
        }
    }
}

#[test]
fn a_bad_temperature_is_an_error_naming_it() {
    let pb = Problem::random(6, 3, 17);
    for t in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let params = GateParams {
            temperature: t,
            ..GateParams::default()
        };
        let mut g = vec![0.0f32; pb.n * pb.v];
        match is_gate_loss_reference(&pb.logits, pb.n, pb.v, &pb.inputs(), &params, &mut g) {
            Err(e @ Error::Param { .. }) => {
                assert!(e.to_string().contains("temperature"), "{e}")
            }
            other => panic!("temperature {t}: expected a parameter error, got {other:?}"),
        }
    }
}
