//! is_gate_loss: reference against an f64 oracle and central finite differences, exact gate
//! boundaries, edge cases, emu and cuda against the reference, determinism, bad input (the
//! regularizers: is_gate_loss/regularizers.rs).

use half::bf16;
use sluice_kernels::ops::is_gate_loss::{
    is_gate_loss, is_gate_loss_in_place, is_gate_loss_reference, GateMode, GateParams,
    GateReference, TokenBatch, TokenInputs,
};
use sluice_kernels::ops::row_reduce::row_lse;
use sluice_kernels::testing::{lost_outputs, rel_norm, Rng, BF16_TOL, F32_TOL};
use sluice_kernels::{Backend, DType, Error, Tensor};

const MODES: [GateMode; 4] = [GateMode::Dis, GateMode::Icepop, GateMode::Ppo, GateMode::Pg];

/// One problem: logits [n, v] (f32 values; bf16 problems hold bf16-representable values).
#[derive(Clone)]
struct Problem {
    n: usize,
    v: usize,
    logits: Vec<f32>,
    tokens: Vec<i32>,
    behavior: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
    weight: Option<Vec<f32>>,
}

impl Problem {
    /// Random non-zero data; behavior log-probs near the true ones so every gate outcome occurs.
    fn random(seed: u64, n: usize, v: usize, weighted: bool) -> Problem {
        let mut rng = Rng::new(seed);
        let logits = rng.normal_vec(n * v, 2.0);
        let tokens: Vec<i32> = (0..n).map(|_| rng.below(v) as i32).collect();
        let behavior = (0..n)
            .map(|t| {
                let row: Vec<f64> = logits[t * v..(t + 1) * v]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let lp = row[tokens[t] as usize] - lse64(&row);
                (lp + rng.normal() * 0.25) as f32
            })
            .collect();
        let adv = (0..n).map(|_| rng.normal() as f32 + 0.1).collect();
        let mask = (0..n)
            .map(|t| {
                if t == 0 || rng.uniform() < 0.8 {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        let weight = weighted.then(|| (0..n).map(|_| 0.25 + rng.uniform() as f32).collect());
        Problem {
            n,
            v,
            logits,
            tokens,
            behavior,
            adv,
            mask,
            weight,
        }
    }
    fn into_bf16_values(mut self) -> Problem {
        for x in &mut self.logits {
            *x = bf16::from_f32(*x).to_f32();
        }
        self
    }
    fn inputs(&self) -> TokenInputs<'_> {
        TokenInputs {
            tokens: &self.tokens,
            behavior_logp: &self.behavior,
            advantages: &self.adv,
            mask: &self.mask,
            weight: self.weight.as_deref(),
            ref_logp: None,
        }
    }
    fn reference(&self, p: &GateParams) -> (GateReference, Vec<f32>) {
        let mut grad = vec![f32::NAN; self.n * self.v];
        let r = is_gate_loss_reference(&self.logits, self.n, self.v, &self.inputs(), p, &mut grad)
            .expect("reference runs");
        (r, grad)
    }
    fn reference_bf16(&self, p: &GateParams) -> (GateReference, Vec<f32>) {
        let x: Vec<bf16> = self.logits.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut grad = vec![bf16::from_f32(f32::NAN); self.n * self.v];
        let r = is_gate_loss_reference(&x, self.n, self.v, &self.inputs(), p, &mut grad)
            .expect("reference runs");
        (r, grad.iter().map(|g| g.to_f32()).collect())
    }
}

fn lse64(row: &[f64]) -> f64 {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + row.iter().map(|&x| (x - m).exp()).sum::<f64>().ln()
}

/// Per-token gate decisions of the oracle: frozen at a base point for finite differences.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Frozen {
    inside: bool,
    /// dis: the stop-gradient weight rho at the base point.
    w: f64,
}

/// The f64 oracle of DESIGN.md 3.6: loss, d loss / d logits, logp, rho, frozen gates.
struct Oracle {
    loss: f64,
    grad: Vec<f64>,
    logp: Vec<f64>,
    rho: Vec<f64>,
    frozen: Vec<Frozen>,
}

fn oracle(pb: &Problem, x: &[f64], p: &GateParams, frozen: Option<&[Frozen]>) -> Oracle {
    let (n, v) = (pb.n, pb.v);
    let beta = p.beta as f64;
    // The four bounds: the pair for negative advantages where one is given (written here
    // independently of GateParams::bounds).
    let eps = |a: f64| match p.eps_neg {
        Some((lo, hi)) if a < 0.0 => (lo as f64, hi as f64),
        _ => (p.eps_low as f64, p.eps_high as f64),
    };
    let c = |t: usize| pb.weight.as_ref().map_or(1.0, |w| w[t] as f64);
    let d: f64 = (0..n).map(|t| pb.mask[t] as f64 * c(t)).sum();
    let mut loss = 0.0;
    let mut grad = vec![0.0; n * v];
    let (mut logps, mut rhos, mut fr) = (vec![], vec![], vec![]);
    for t in 0..n {
        let row = &x[t * v..(t + 1) * v];
        let lse = lse64(row);
        let tok = pb.tokens[t] as usize;
        let logp = row[tok] - lse;
        let rho = (logp - pb.behavior[t] as f64).exp();
        let a = pb.adv[t] as f64;
        let k = pb.mask[t] as f64 * c(t);
        let (el, eh) = eps(a);
        let f = frozen.map(|f| f[t]).unwrap_or(Frozen {
            inside: match p.mode {
                GateMode::Dis => rho > 1.0 - el && rho < 1.0 + eh,
                GateMode::Icepop => rho >= 1.0 / beta && rho <= beta,
                _ => true,
            },
            w: rho,
        });
        let (term, dterm) = if k == 0.0 || !f.inside {
            (0.0, 0.0)
        } else {
            match p.mode {
                GateMode::Dis => (-k * f.w * a * logp, -k * f.w * a),
                GateMode::Pg => (-k * a * logp, -k * a),
                GateMode::Icepop | GateMode::Ppo => {
                    let s1 = rho * a;
                    let s2 = rho.clamp(1.0 - el, 1.0 + eh) * a;
                    (-k * s1.min(s2), if s1 <= s2 { -k * a * rho } else { 0.0 })
                }
            }
        };
        if d > 0.0 {
            loss += term / d;
            for j in 0..v {
                let pj = (row[j] - lse).exp();
                grad[t * v + j] = dterm / d * (if j == tok { 1.0 } else { 0.0 } - pj);
            }
        }
        logps.push(logp);
        rhos.push(rho);
        fr.push(f);
    }
    Oracle {
        loss,
        grad,
        logp: logps,
        rho: rhos,
        frozen: fr,
    }
}

fn params(mode: GateMode) -> GateParams {
    GateParams {
        mode,
        ..GateParams::default()
    }
}

fn rel_scalar(got: f32, want: f64) -> f64 {
    rel_norm(&[got], &[want])
}

#[test]
fn reference_matches_f64_oracle_every_mode() {
    for mode in MODES {
        for (i, &(n, v, weighted)) in [
            (1, 1, false),
            (1, 17, false),
            (17, 127, true),
            (40, 300, false),
            (7, 1000, true),
        ]
        .iter()
        .enumerate()
        {
            let pb = Problem::random(100 + i as u64, n, v, weighted);
            let p = params(mode);
            let (r, grad) = pb.reference(&p);
            let x: Vec<f64> = pb.logits.iter().map(|&x| x as f64).collect();
            let o = oracle(&pb, &x, &p, None);
            let ctx = format!("{mode:?} n={n} v={v}");
            // f32 tolerance: every quantity is a short chain of f32 operations on O(1) values.
            assert!(
                rel_scalar(r.loss, o.loss) <= F32_TOL,
                "{ctx}: loss {} vs {}",
                r.loss,
                o.loss
            );
            assert!(rel_norm(&r.logp, &o.logp) <= F32_TOL, "{ctx}: logp");
            assert!(rel_norm(&r.ratio, &o.rho) <= F32_TOL, "{ctx}: ratio");
            assert!(rel_norm(&grad, &o.grad) <= F32_TOL, "{ctx}: dlogits");
            let acc: Vec<u8> = (0..n)
                .map(|t| (pb.mask[t] != 0.0 && o.frozen[t].inside) as u8)
                .collect();
            assert_eq!(r.accepted, acc, "{ctx}: accepted");
            let masked: Vec<usize> = (0..n).filter(|&t| pb.mask[t] != 0.0).collect();
            assert_eq!(r.counters[0], masked.len() as f32, "{ctx}: masked count");
            assert_eq!(
                r.counters[1],
                acc.iter().map(|&a| a as f32).sum::<f32>(),
                "{ctx}"
            );
            let mean = masked.iter().map(|&t| o.rho[t]).sum::<f64>() / masked.len() as f64;
            assert!(
                rel_scalar(r.counters[2], mean) <= F32_TOL,
                "{ctx}: ratio mean"
            );
            let diff = masked
                .iter()
                .map(|&t| pb.behavior[t] as f64 - o.logp[t])
                .sum::<f64>()
                / masked.len() as f64;
            assert!(
                rel_scalar(r.counters[7], diff) <= F32_TOL,
                "{ctx}: diff mean"
            );
            let (lo, hi): (f64, f64) = masked.iter().fold((f64::INFINITY, 0.0), |(a, b), &t| {
                (a.min(o.rho[t]), b.max(o.rho[t]))
            });
            assert!(
                rel_scalar(r.counters[3], lo) <= F32_TOL
                    && rel_scalar(r.counters[4], hi) <= F32_TOL
            );
            let gated = r.counters[5] + r.counters[6];
            assert_eq!(
                gated,
                r.counters[0] - r.counters[1],
                "{ctx}: gated low + high"
            );
        }
    }
}

#[test]
fn bf16_reference_matches_oracle() {
    for mode in MODES {
        let pb = Problem::random(7, 9, 333, true).into_bf16_values();
        let p = params(mode);
        let (r, grad) = pb.reference_bf16(&p);
        let x: Vec<f64> = pb.logits.iter().map(|&x| x as f64).collect();
        let o = oracle(&pb, &x, &p, None);
        // bf16 tolerance: the gradient is rounded to bf16 (relative error 2^-9).
        assert!(rel_norm(&grad, &o.grad) <= BF16_TOL, "{mode:?}");
        assert!(
            rel_scalar(r.loss, o.loss) <= F32_TOL,
            "{mode:?}: loss is f32 throughout"
        );
    }
}

#[test]
fn gradient_matches_central_finite_differences_every_mode() {
    for mode in MODES {
        let pb = Problem::random(11, 5, 7, true);
        let p = params(mode);
        let x: Vec<f64> = pb.logits.iter().map(|&x| x as f64).collect();
        let base = oracle(&pb, &x, &p, None);
        let h = 1e-6;
        let fd: Vec<f64> = (0..x.len())
            .map(|i| {
                let mut xp = x.clone();
                let mut xm = x.clone();
                xp[i] += h;
                xm[i] -= h;
                (oracle(&pb, &xp, &p, Some(&base.frozen)).loss
                    - oracle(&pb, &xm, &p, Some(&base.frozen)).loss)
                    / (2.0 * h)
            })
            .collect();
        assert!(
            fd.iter().any(|&g| g.abs() > 1e-3),
            "{mode:?}: the gradient is not trivially 0"
        );
        // The analytic f64 gradient equals the finite differences (O(h^2) + rounding / h).
        assert!(
            rel_norm(
                &base.grad.iter().map(|&g| g as f32).collect::<Vec<_>>(),
                &fd
            ) <= 1e-6
        );
        // And the f32 reference equals them to f32 tolerance.
        let (_, grad) = pb.reference(&p);
        assert!(
            rel_norm(&grad, &fd) <= F32_TOL,
            "{mode:?}: {}",
            rel_norm(&grad, &fd)
        );
    }
}

/// A behavior log-prob that makes the f32 ratio exp(logp - b) exactly `target`, searched
/// around logp - ln(target) one ulp at a time; verified bit for bit.
fn behavior_for(logp: f32, target: f32) -> f32 {
    fn next_up(x: f32) -> f32 {
        if x == 0.0 {
            f32::from_bits(1)
        } else if x > 0.0 {
            f32::from_bits(x.to_bits() + 1)
        } else {
            f32::from_bits(x.to_bits() - 1)
        }
    }
    let next_down = |x: f32| -next_up(-x);
    let b0 = logp - target.ln();
    let (mut lo, mut hi) = (b0, b0);
    for _ in 0..100_000 {
        for b in [lo, hi] {
            if (logp - b).exp().to_bits() == target.to_bits() {
                return b;
            }
        }
        lo = next_down(lo);
        hi = next_up(hi);
    }
    panic!("no f32 behavior_logp gives ratio {target} at logp {logp}");
}

/// Rows whose token log-prob is near ln(target) (so behavior is near 0 and finely adjustable)
/// and behaviors that put rho exactly on `targets`.
fn boundary_problem(targets: &[f32]) -> Problem {
    let n = targets.len();
    let v = 5;
    let mut logits = vec![0.0f32; n * v];
    for (t, &r) in targets.iter().enumerate() {
        // token 0 with probability q (logit L: e^L / (e^L + 4) = q), so logp is near ln(r) or ln(1/r).
        let q = r.min(1.0 / r).min(0.9) as f64;
        logits[t * v] = ((4.0 * q) / (1.0 - q)).ln() as f32;
        logits[t * v + 1] = 0.125 * t as f32;
    }
    let mut pb = Problem {
        n,
        v,
        logits,
        tokens: vec![0; n],
        behavior: vec![0.0; n],
        adv: vec![1.0; n],
        mask: vec![1.0; n],
        weight: None,
    };
    for (t, &target) in targets.iter().enumerate() {
        let row = &pb.logits[t * v..(t + 1) * v];
        let logp = row[0] - row_lse(row, 1.0);
        pb.behavior[t] = behavior_for(logp, target);
    }
    pb
}

#[test]
fn gate_boundaries_are_exact() {
    let p = GateParams::default();
    let lo = 1.0f32 - p.eps_low;
    let hi = 1.0f32 + p.eps_high;
    let below = |x: f32| f32::from_bits(x.to_bits() - 1);
    let above = |x: f32| f32::from_bits(x.to_bits() + 1);
    // dis: open interval (1 - eps_low, 1 + eps_high).
    let targets = [lo, above(lo), below(hi), hi, 1.0];
    let pb = boundary_problem(&targets);
    let (r, _) = pb.reference(&params(GateMode::Dis));
    for (t, &target) in targets.iter().enumerate() {
        assert_eq!(
            r.ratio[t].to_bits(),
            target.to_bits(),
            "rho hits {target} exactly"
        );
    }
    assert_eq!(r.accepted, vec![0, 1, 1, 0, 1], "dis is open at both ends");
    assert_eq!(
        (r.counters[5], r.counters[6]),
        (1.0, 1.0),
        "gated low, high"
    );

    // icepop: closed interval [1/beta, beta].
    let (b_lo, b_hi) = (1.0f32 / p.beta, p.beta);
    let targets = [below(b_lo), b_lo, b_hi, above(b_hi), 1.0];
    let pb = boundary_problem(&targets);
    let (r, _) = pb.reference(&params(GateMode::Icepop));
    for (t, &target) in targets.iter().enumerate() {
        assert_eq!(
            r.ratio[t].to_bits(),
            target.to_bits(),
            "rho hits {target} exactly"
        );
    }
    assert_eq!(
        r.accepted,
        vec![0, 1, 1, 0, 1],
        "icepop is closed at both ends"
    );
    assert_eq!((r.counters[5], r.counters[6]), (1.0, 1.0));
}

#[test]
fn gate_boundaries_on_emu() {
    let p = GateParams::default();
    let lo = 1.0f32 - p.eps_low;
    let hi = 1.0f32 + p.eps_high;
    let below = |x: f32| f32::from_bits(x.to_bits() - 1);
    let above = |x: f32| f32::from_bits(x.to_bits() + 1);
    let (b_lo, b_hi) = (1.0f32 / p.beta, p.beta);
    // The same rows on emu: the same decisions wherever the device's rho is bit-exact too.
    for (mode, targets) in [
        (GateMode::Dis, [lo, above(lo), below(hi), hi, 1.0]),
        (
            GateMode::Icepop,
            [below(b_lo), b_lo, b_hi, above(b_hi), 1.0],
        ),
    ] {
        let pb = boundary_problem(&targets);
        let (want, _) = pb.reference(&params(mode));
        let (got, _) = run_device(&Backend::emu_with_seed(1), &pb, DType::F32, &params(mode));
        if got
            .ratio
            .iter()
            .zip(&targets)
            .all(|(a, b)| a.to_bits() == b.to_bits())
        {
            assert_eq!(got.accepted, want.accepted, "{mode:?} on emu");
        }
    }
}

/// Four clip bounds (issue 28 item 5): tokens with a negative advantage take `eps_neg`. Ratios
/// 0.9, 1.1 and 1.2 with advantages +1 and -1, (eps_low, eps_high) = (0.2, 0.28) and
/// eps_neg = (0.05, 0.05): dis keeps all three positive tokens and gates the negative ones
/// (0.9 low; 1.1 and 1.2 high); ppo clips the negative ones at 0.95 / 1.05. The CPU reference
/// against the f64 oracle; emu against the reference: gate decisions and counters exactly, the
/// rest to f32 tolerance (the device's expf is not Rust's); unset, the pair applies to every
/// token.
#[test]
fn four_clip_bounds_split_by_the_advantage_sign() {
    let targets = [0.9f32, 1.1, 1.2, 0.9, 1.1, 1.2];
    let mut pb = boundary_problem(&targets);
    pb.adv = vec![1.0, 1.0, 1.0, -1.0, -1.0, -1.0];
    let four = GateParams {
        eps_neg: Some((0.05, 0.05)),
        ..params(GateMode::Dis)
    };
    let (r, _) = pb.reference(&four);
    assert_eq!(r.accepted, vec![1, 1, 1, 0, 0, 0]);
    assert_eq!(
        (r.counters[5], r.counters[6]),
        (1.0, 2.0),
        "gated low, high"
    );
    let (two, _) = pb.reference(&params(GateMode::Dis));
    assert_eq!(
        two.accepted,
        vec![1, 1, 1, 1, 1, 1],
        "one pair for every token"
    );
    let emu = Backend::emu_with_seed(1);
    let mut checked = 0;
    for mode in [GateMode::Dis, GateMode::Ppo] {
        let p = GateParams { mode, ..four };
        let (want, wg) = pb.reference(&p);
        let x: Vec<f64> = pb.logits.iter().map(|&v| v as f64).collect();
        let o = oracle(&pb, &x, &p, None);
        assert!(
            rel_scalar(want.loss, o.loss) < 1e-5,
            "{mode:?}: {} vs {}",
            want.loss,
            o.loss
        );
        let (got, gg) = run_device(&emu, &pb, DType::F32, &p);
        assert_eq!(got.accepted, want.accepted, "{mode:?}: emu's gate");
        assert_eq!(got.counters, want.counters, "{mode:?}: emu's counters");
        assert_close(&got, &gg, &want, &wg, F32_TOL, &format!("{mode:?} on emu"));
        checked += 1;
    }
    assert_eq!(checked, 2);
    // ppo: the negative tokens' clip makes their terms differ from the one-pair run.
    let (ppo4, _) = pb.reference(&GateParams {
        mode: GateMode::Ppo,
        ..four
    });
    let (ppo2, _) = pb.reference(&params(GateMode::Ppo));
    assert_ne!(ppo4.loss.to_bits(), ppo2.loss.to_bits());
}

#[test]
fn all_masked_gives_zero_loss_and_gradient() {
    for mode in MODES {
        let mut pb = Problem::random(21, 6, 50, false);
        pb.mask = vec![0.0; 6];
        let (r, grad) = pb.reference(&params(mode));
        assert_eq!(r.loss, 0.0);
        assert!(grad.iter().all(|&g| g == 0.0), "{mode:?}: zero gradient");
        assert_eq!(r.counters, [0.0; 8]);
        assert!(r.accepted.iter().all(|&a| a == 0));
        // Masked tokens of weight 0: D = 0 too.
        let mut pb = Problem::random(22, 6, 50, true);
        pb.weight = Some(vec![0.0; 6]);
        let (r, grad) = pb.reference(&params(mode));
        assert_eq!(r.loss, 0.0);
        assert!(grad.iter().all(|&g| g == 0.0));
    }
}

/// Row 0: +-1e4 entries; row 1: -inf entries away from the token; row 2: the token at -inf;
/// row 3: all -inf (no mass). Every token masked.
fn extreme_problem() -> Problem {
    let mut pb = Problem::random(31, 4, 40, false);
    // Row 0: +-1e4 entries; row 1: -inf entries away from the token; row 2: the token at
    // -inf; row 3: all -inf (no mass).
    pb.logits[3] = 1e4;
    pb.logits[7] = -1e4;
    pb.tokens[0] = 3;
    pb.behavior[0] = 0.0;
    for j in 0..40 {
        if j % 3 == 0 && j as i32 != pb.tokens[1] {
            pb.logits[40 + j] = f32::NEG_INFINITY;
        }
    }
    pb.logits[80 + pb.tokens[2] as usize] = f32::NEG_INFINITY;
    for j in 0..40 {
        pb.logits[120 + j] = f32::NEG_INFINITY;
    }
    pb.mask = vec![1.0; 4];
    pb
}

#[test]
fn huge_and_neg_inf_logits_stay_finite() {
    for mode in MODES {
        let pb = extreme_problem();
        let (r, grad) = pb.reference(&params(mode));
        assert!(
            grad.iter().all(|g| g.is_finite()),
            "{mode:?}: finite gradient"
        );
        assert!(r.logp[0].is_finite() && r.logp[1].is_finite());
        assert_eq!(r.logp[2], f32::NEG_INFINITY);
        assert_eq!(r.logp[3], f32::NEG_INFINITY);
        assert_eq!(r.ratio[3], 0.0);
        assert!(
            grad[120..].iter().all(|&g| g == 0.0),
            "no-mass row: zero gradient"
        );
        assert!(!r.loss.is_nan() && !r.counters.iter().any(|c| c.is_nan()));
        assert!(
            r.loss.is_finite(),
            "{mode:?}: a zero-probability token is gated, clipped or adds 0"
        );
    }
}

#[test]
fn worked_example_dis() {
    // log-probs log [.3, .2, .1] against behavior log [.3, .1, .4], A = 1.
    let probs = [0.3f64, 0.2, 0.1];
    let behavior = [0.3f64, 0.1, 0.4];
    let pb = Problem {
        n: 3,
        v: 2,
        logits: probs
            .iter()
            .flat_map(|&p| [p.ln() as f32, (1.0 - p).ln() as f32])
            .collect(),
        tokens: vec![0; 3],
        behavior: behavior.iter().map(|b| b.ln() as f32).collect(),
        adv: vec![1.0; 3],
        mask: vec![1.0; 3],
        weight: None,
    };
    let (r, _) = pb.reference(&params(GateMode::Dis));
    let rate = r.counters[1] / r.counters[0];
    assert!(rate > 0.0 && rate < 1.0, "accept rate {rate}");
    assert_eq!(r.accepted, vec![1, 0, 0], "rho = 1, 2, 0.25");
    assert!(r.loss.is_finite());
    assert!(rel_scalar(r.loss, -(0.3f64.ln()) / 3.0) <= F32_TOL);
}

fn upload(b: &Backend, pb: &Problem, dtype: DType) -> (Tensor, Vec<Tensor>) {
    let logits = Tensor::from_f32_as(b, &[pb.n, pb.v], dtype, &pb.logits).unwrap();
    let mut rest = vec![
        Tensor::from_slice(b, &[pb.n], &pb.tokens).unwrap(),
        Tensor::from_slice(b, &[pb.n], &pb.behavior).unwrap(),
        Tensor::from_slice(b, &[pb.n], &pb.adv).unwrap(),
        Tensor::from_slice(b, &[pb.n], &pb.mask).unwrap(),
    ];
    if let Some(w) = &pb.weight {
        rest.push(Tensor::from_slice(b, &[pb.n], w).unwrap());
    }
    (logits, rest)
}

fn batch(rest: &[Tensor]) -> TokenBatch<'_> {
    TokenBatch {
        tokens: &rest[0],
        behavior_logp: &rest[1],
        advantages: &rest[2],
        mask: &rest[3],
        weight: rest.get(4),
        ref_logp: None,
    }
}

/// Runs through the device entry point; returns the outputs as a GateReference and dlogits.
fn run_device(
    b: &Backend,
    pb: &Problem,
    dtype: DType,
    p: &GateParams,
) -> (GateReference, Vec<f32>) {
    let (logits, rest) = upload(b, pb, dtype);
    let (out, grad) = is_gate_loss(b, &logits, &batch(&rest), p).expect("device run");
    (collect(&out), grad.to_f32_vec().unwrap())
}

fn collect(out: &sluice_kernels::ops::is_gate_loss::GateOutputs) -> GateReference {
    let counters: Vec<f32> = out.counters.to_vec().unwrap();
    GateReference {
        loss: out.loss.to_vec::<f32>().unwrap()[0],
        logp: out.logp.to_vec().unwrap(),
        ratio: out.ratio.to_vec().unwrap(),
        accepted: out.accepted.to_vec().unwrap(),
        counters: counters.try_into().unwrap(),
        entropy: out
            .entropy
            .as_ref()
            .map(|e| e.to_vec().unwrap())
            .unwrap_or_default(),
    }
}

fn bits(r: &GateReference, g: &[f32]) -> Vec<u32> {
    let mut v: Vec<u32> = vec![r.loss.to_bits()];
    v.extend(
        r.logp
            .iter()
            .chain(&r.ratio)
            .chain(&r.counters)
            .chain(&r.entropy)
            .chain(g)
            .map(|x| x.to_bits()),
    );
    v.extend(r.accepted.iter().map(|&a| a as u32));
    v
}

fn assert_close(
    got: &GateReference,
    ggot: &[f32],
    want: &GateReference,
    gwant: &[f32],
    tol: f64,
    ctx: &str,
) {
    let w64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert!(
        rel_norm(&[got.loss], &[want.loss as f64]) <= F32_TOL,
        "{ctx}: loss {} vs {}",
        got.loss,
        want.loss
    );
    assert!(
        rel_norm(&got.logp, &w64(&want.logp)) <= F32_TOL,
        "{ctx}: logp"
    );
    assert!(
        rel_norm(&got.ratio, &w64(&want.ratio)) <= F32_TOL,
        "{ctx}: ratio"
    );
    assert!(
        rel_norm(&got.counters, &w64(&want.counters)) <= F32_TOL,
        "{ctx}: counters"
    );
    assert_eq!(got.accepted, want.accepted, "{ctx}: accepted");
    assert!(rel_norm(ggot, &w64(gwant)) <= tol, "{ctx}: dlogits");
    assert_eq!(
        lost_outputs(ggot, gwant),
        0,
        "{ctx}: dlogits zeroed where the reference is not"
    );
}

fn device_cases() -> Vec<(Problem, DType)> {
    vec![
        (Problem::random(41, 1, 1000, false), DType::F32),
        (Problem::random(42, 17, 300, true), DType::F32),
        (
            Problem::random(43, 5, 257, false).into_bf16_values(),
            DType::BF16,
        ),
        // V >= 2048: full tiles (16-byte loads) and a tail; V = 2050 makes odd f32 rows
        // misaligned, so both load paths run in one launch and must agree with the reference.
        (Problem::random(44, 2, 4104, true), DType::F32),
        (Problem::random(45, 3, 2050, false), DType::F32),
        (
            Problem::random(46, 2, 4104, false).into_bf16_values(),
            DType::BF16,
        ),
    ]
}

fn check_device(b: &Backend, name: &str) {
    for (pb, dtype) in device_cases() {
        for mode in MODES {
            let p = params(mode);
            let (want, gwant) = if dtype == DType::F32 {
                pb.reference(&p)
            } else {
                pb.reference_bf16(&p)
            };
            let (got, ggot) = run_device(b, &pb, dtype, &p);
            // The gradient is stored in the logits' dtype: bf16 outputs may differ by one rounding.
            let tol = if dtype == DType::F32 {
                F32_TOL
            } else {
                BF16_TOL
            };
            let ctx = format!("{name} {mode:?} {dtype} n={} v={}", pb.n, pb.v);
            assert_close(&got, &ggot, &want, &gwant, tol, &ctx);
            let (again, gagain) = run_device(b, &pb, dtype, &p);
            assert_eq!(
                bits(&got, &ggot),
                bits(&again, &gagain),
                "{ctx}: rerun bit-identical"
            );
        }
    }
}

#[test]
fn emu_matches_reference_and_two_seeds_agree() {
    check_device(&Backend::emu_with_seed(1), "emu");
    for (pb, dtype) in device_cases() {
        let p = params(GateMode::Icepop);
        let (a, ga) = run_device(&Backend::emu_with_seed(1), &pb, dtype, &p);
        let (b, gb) = run_device(&Backend::emu_with_seed(2), &pb, dtype, &p);
        assert_eq!(
            bits(&a, &ga),
            bits(&b, &gb),
            "emu seeds 1 and 2 bit-identical"
        );
    }
}

#[test]
fn emu_in_place_and_u8_mask() {
    let b = Backend::emu_with_seed(1);
    let pb = Problem::random(51, 9, 300, true);
    let p = params(GateMode::Ppo);
    let (want, gwant) = run_device(&b, &pb, DType::F32, &p);
    let (mut logits, rest) = upload(&b, &pb, DType::F32);
    let out = is_gate_loss_in_place(&b, &mut logits, &batch(&rest), &p).unwrap();
    assert_eq!(
        bits(&collect(&out), &logits.to_f32_vec().unwrap()),
        bits(&want, &gwant)
    );
    // A U8 mask equals the F32 mask of 0/1.
    let m8: Vec<u8> = pb.mask.iter().map(|&m| (m != 0.0) as u8).collect();
    let mut rest = rest;
    rest[3] = Tensor::from_slice(&b, &[pb.n], &m8).unwrap();
    let (logits, _) = upload(&b, &pb, DType::F32);
    let (out, g) = is_gate_loss(&b, &logits, &batch(&rest), &p).unwrap();
    assert_eq!(
        bits(&collect(&out), &g.to_f32_vec().unwrap()),
        bits(&want, &gwant)
    );
}

#[test]
fn cpu_entry_point_in_place_and_determinism() {
    let b = Backend::Cpu;
    for (pb, dtype) in device_cases() {
        let p = params(GateMode::Dis);
        let (a, ga) = run_device(&b, &pb, dtype, &p);
        let (c, gc) = run_device(&b, &pb, dtype, &p);
        assert_eq!(bits(&a, &ga), bits(&c, &gc), "cpu rerun bit-identical");
        let (mut logits, rest) = upload(&b, &pb, dtype);
        let out = is_gate_loss_in_place(&b, &mut logits, &batch(&rest), &p).unwrap();
        assert_eq!(
            bits(&collect(&out), &logits.to_f32_vec().unwrap()),
            bits(&a, &ga),
            "in place"
        );
    }
}

#[test]
fn cuda_matches_reference() {
    if let Some(gpu) = sluice_kernels::device::cuda_for_tests("is_gate_loss") {
        check_device(&gpu, "cuda");
    }
}

#[test]
fn bad_input_is_an_error_naming_it() {
    let b = Backend::Cpu;
    let pb = Problem::random(61, 4, 10, false);
    let (logits, rest) = upload(&b, &pb, DType::F32);
    let p = GateParams::default();
    let short = Tensor::from_slice(&b, &[3], &[0i32, 1, 2]).unwrap();
    let mut bad = batch(&rest);
    bad.tokens = &short;
    match is_gate_loss(&b, &logits, &bad, &p) {
        Err(Error::Shape {
            tensor, expected, ..
        }) => {
            assert_eq!(tensor, "tokens");
            assert!(expected.contains("N = 4"), "{expected}");
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    let out_of_range = Tensor::from_slice(&b, &[4], &[0i32, 1, 10, 2]).unwrap();
    let mut bad = batch(&rest);
    bad.tokens = &out_of_range;
    let e = is_gate_loss(&b, &logits, &bad, &p).unwrap_err();
    assert!(
        e.to_string().contains("tokens") && e.to_string().contains("row 2"),
        "{e}"
    );
    let f32_tokens = Tensor::from_slice(&b, &[4], &[0.0f32; 4]).unwrap();
    let mut bad = batch(&rest);
    bad.tokens = &f32_tokens;
    assert!(matches!(
        is_gate_loss(&b, &logits, &bad, &p),
        Err(Error::DType { .. })
    ));
    let flat = Tensor::from_slice(&b, &[40], &pb.logits).unwrap();
    assert!(matches!(
        is_gate_loss(&b, &flat, &batch(&rest), &p),
        Err(Error::Shape { .. })
    ));
    let bad_p = GateParams { eps_low: 1.5, ..p };
    assert!(matches!(
        is_gate_loss(&b, &logits, &batch(&rest), &bad_p),
        Err(Error::Param { .. })
    ));
    let bad_p = GateParams { beta: 0.5, ..p };
    assert!(matches!(
        is_gate_loss(&b, &logits, &batch(&rest), &bad_p),
        Err(Error::Param { .. })
    ));
    assert!(GateMode::parse("grpo").is_err());
}

#[test]
fn huge_and_neg_inf_logits_on_emu() {
    let emu = Backend::emu_with_seed(1);
    for mode in MODES {
        let pb = extreme_problem();
        let (want, gwant) = pb.reference(&params(mode));
        let (got, ggot) = run_device(&emu, &pb, DType::F32, &params(mode));
        assert!(ggot.iter().all(|g| g.is_finite()), "{mode:?}");
        assert_eq!(got.logp[3], f32::NEG_INFINITY);
        assert_eq!(got.accepted, want.accepted, "{mode:?}");
        let w: Vec<f64> = gwant.iter().map(|&g| g as f64).collect();
        assert!(rel_norm(&ggot, &w) <= F32_TOL, "{mode:?}: dlogits");
    }
}

#[test]
fn per_token_weights_give_the_sequence_mean() {
    // Two sequences of 2 and 3 tokens; weight 1/len makes L the mean over sequences of the
    // per-sequence token means (D = sum mask * weight = 2 sequences).
    let mut pb = Problem::random(81, 5, 33, false);
    pb.weight = Some(vec![0.5, 0.5, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]);
    pb.mask = vec![1.0; 5];
    let p = params(GateMode::Pg);
    let (r, _) = pb.reference(&p);
    let x: Vec<f64> = pb.logits.iter().map(|&x| x as f64).collect();
    let logp = oracle(&pb, &x, &p, None).logp;
    let term = |t: usize| -(pb.adv[t] as f64) * logp[t];
    let seq_a = (term(0) + term(1)) / 2.0;
    let seq_b = (term(2) + term(3) + term(4)) / 3.0;
    let want = (seq_a + seq_b) / 2.0;
    assert!(rel_scalar(r.loss, want) <= F32_TOL, "{} vs {want}", r.loss);
    // Counters count tokens, not weights.
    assert_eq!(r.counters[0], 5.0);
}

// Batch invariance: kernels/tests/is_gate_loss/batch_invariance.rs.
#[path = "is_gate_loss/batch_invariance.rs"]
mod batch_invariance;
// The entropy and KL terms: kernels/tests/is_gate_loss/regularizers.rs.
#[path = "is_gate_loss/regularizers.rs"]
mod regularizers;
