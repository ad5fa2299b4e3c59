//! The whole model's gradient against central finite differences, for every named view, on the
//! tiny config (every feature on: dense first layer, MoE with a shared expert, GQA 2:1).

use sluice_model::config::{ModelConfig, ScoreFn};
use sluice_model::forward::{loss_and_grad, loss_of};
use sluice_model::gradcheck::check_views;
use sluice_model::kernels::testing::Rng;
use sluice_model::kernels::Backend;
use sluice_model::Model;

mod common;
use common::batch;

/// Tolerance, per view, relative norm: the forward is f32, so the loss carries rounding of a
/// few 1e-7 relative; through the Richardson-combined step of 1e-2 that is a few 1e-4 absolute
/// in each numeric derivative, and the views with the smallest gradients at init (W_q and W_k:
/// nearly uniform attention) have gradient entries around 1e-2, so 1-2e-2 relative is the noise
/// floor there (measured worst 1.7e-2). A wrong backward term gives errors of order 1 (see
/// tests/gradcheck.rs, which shows a 10% error in one view is caught).
const TOL: f64 = 3e-2;

fn check(cfg: ModelConfig, lens: &[usize], tol: f64) {
    check_eps(cfg, lens, tol, 1e-2)
}

fn check_eps(cfg: ModelConfig, lens: &[usize], tol: f64, eps: f32) {
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let (b, targets, mask) = batch(&cfg, lens, 7);
    let loss = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    assert!(loss.is_finite() && loss > 0.0);
    let checks = check_views(
        &mut m.params,
        &m.grads,
        |a| Ok(loss_of(&cfg, a, &b, &targets, &mask)? as f64),
        8,
        eps,
        1e-4,
        3,
    )
    .unwrap();
    let mut worst = 0.0f64;
    for c in &checks {
        println!("{:32} rel_err {:.2e}", c.name, c.rel_err);
        worst = worst.max(c.rel_err);
    }
    for c in &checks {
        assert!(
            c.rel_err < tol,
            "{}: rel err {:.3e}\n analytic {:?}\n numeric  {:?}",
            c.name,
            c.rel_err,
            c.analytic,
            c.numeric
        );
    }
    println!("worst {worst:.2e}");
}

#[test]
fn tiny_model_gradient_matches_finite_differences() {
    check(ModelConfig::tiny(), &[1, 6, 9], TOL);
}

#[test]
fn sigmoid_router_without_renorm_and_mha() {
    let mut cfg = ModelConfig::tiny();
    cfg.score_fn = ScoreFn::Sigmoid;
    cfg.renorm = false;
    cfg.n_kv_heads = 4;
    cfg.dense_first_layer = false;
    cfg.dense_ffn_dim = None;
    check(cfg, &[4, 7], TOL);
}

#[test]
fn experts_without_tokens_and_gqa_4_to_1() {
    // One token, 4 experts top-2: two experts receive nothing; their gradients must be zero.
    let mut cfg = ModelConfig::tiny();
    cfg.n_kv_heads = 1;
    check(cfg.clone(), &[1], TOL);
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let (b, targets, mask) = batch(&cfg, &[1], 7);
    loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    let w1 = m.grads.view("layers.1.moe.w1").unwrap();
    let per = w1.len() / cfg.n_experts;
    let empty = (0..cfg.n_experts)
        .filter(|e| w1[e * per..(e + 1) * per].iter().all(|&x| x == 0.0))
        .count();
    assert_eq!(empty, cfg.n_experts - cfg.top_k);
}

#[test]
fn policy_objective_gradient_and_agreement_with_the_lm_loss() {
    use sluice_model::forward::{logits, policy_loss_and_grad};
    use sluice_model::kernels::ops::is_gate_loss::{GateMode, GateParams, TokenInputs};
    let cfg = ModelConfig::tiny();
    let (b, targets, mask) = batch(&cfg, &[3, 8], 11);
    let mut rng = Rng::new(4);
    let adv: Vec<f32> = (0..b.len()).map(|_| rng.normal() as f32).collect();
    let behavior: Vec<f32> = (0..b.len()).map(|_| -2.0 - rng.uniform() as f32).collect();
    let pg = GateParams {
        mode: GateMode::Pg,
        ..GateParams::default()
    };
    let inputs = TokenInputs {
        tokens: &targets,
        behavior_logp: &behavior,
        advantages: &adv,
        mask: &mask,
        weight: None,
        ref_logp: None,
    };
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let r = policy_loss_and_grad(&mut m, &b, &inputs, &pg).unwrap();
    // logp is log_softmax of the forward's logits at the sampled tokens.
    let lg = logits(&m, &b).unwrap();
    for (t, &tok) in targets.iter().enumerate() {
        let row = &lg[t * cfg.vocab..(t + 1) * cfg.vocab];
        let mx = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
        let lse = mx + row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln();
        assert!((r.logp[t] as f64 - (row[tok as usize] as f64 - lse)).abs() < 1e-5);
    }
    // pg with advantages: its gradient matches finite differences of its loss.
    let loss_fn = |a: &sluice_model::Arena| -> sluice_model::kernels::Result<f64> {
        let mut probe = Model::new(cfg.clone(), &Backend::Cpu)?;
        probe.params.copy_from(&Backend::Cpu, a)?;
        Ok(policy_loss_and_grad(&mut probe, &b, &inputs, &pg)?.loss as f64)
    };
    let checks = check_views(&mut m.params, &m.grads, loss_fn, 4, 1e-2, 1e-4, 5).unwrap();
    for c in &checks {
        assert!(c.rel_err < TOL, "{}: {:.3e}", c.name, c.rel_err);
    }
    // pg with advantage 1 and no behavior dependence is exactly the LM loss.
    let ones = vec![1.0f32; b.len()];
    let lm_inputs = TokenInputs {
        advantages: &ones,
        ..inputs
    };
    let r = policy_loss_and_grad(&mut m, &b, &lm_inputs, &pg).unwrap();
    let g1: Vec<u32> = m
        .grads
        .as_slice()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let l = loss_and_grad(&mut m, &b, &targets, &mask).unwrap();
    assert_eq!(r.loss.to_bits(), l.to_bits());
    let g2: Vec<u32> = m
        .grads
        .as_slice()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(g1, g2);
}
