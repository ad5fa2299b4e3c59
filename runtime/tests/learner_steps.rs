//! The learner's step structure and objectives of issue 28, against hand-made equivalents on
//! cpu:
//! - minibatches and epochs (item 1, `LearnerConfig::{minibatches, epochs}`), bit for bit: a
//!   learner step with m minibatches is m optimizer steps, each on a contiguous slice of the
//!   batch's groups with its own token mean, which is what m learner steps on those slices do;
//!   epochs repeat the pass. The version moves once per learner step, and the zero-lag audit
//!   covers only the batch's first optimizer step (the only one on the weights of the learner's
//!   version);
//! - prompt-mean aggregation (item 5, `Aggregation::Prompt`): the loss is the mean over groups
//!   of each group's token mean, checked against token-mean steps on each group alone.

mod common;

use sluice_kernels::ops::is_gate_loss::{GateMode, GateParams};
use sluice_kernels::Backend;
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig};
use sluice_runtime::buffer::ReadyGroup;
use sluice_runtime::learner::{Aggregation, Learner, LearnerConfig};
use sluice_runtime::trajectory::WeightVersion;

fn model() -> Model {
    let mut cfg = ModelConfig::tiny();
    cfg.vocab = 16;
    Model::new(cfg, &Backend::Cpu).unwrap()
}

/// Four groups of two trajectories sampled by the model at version 0 (rewards 0 and 1 in
/// each, so every advantage is non-zero), on cpu.
fn groups(m: &Model) -> Vec<ReadyGroup> {
    common::reward_pair_groups(m, 5, 10, |_| None)
}

fn learner(m: Model, minibatches: usize, epochs: usize) -> Learner {
    let cfg = LearnerConfig {
        minibatches,
        epochs,
        ..LearnerConfig::default()
    };
    Learner::new(Backend::Cpu, m, OptimConfig::default(), cfg, 0).unwrap()
}

fn weight_bits(l: &Learner) -> Vec<u32> {
    l.model()
        .params
        .tensor()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn two_minibatches_are_two_optimizer_steps_on_the_halves() {
    let m = model();
    let batch = groups(&m);
    let mut split = learner(model(), 2, 1);
    let r = split.train(&batch).unwrap();
    assert_eq!(r.optimizer_steps, 2);
    assert_eq!(r.version, WeightVersion(1), "one version per learner step");
    let mut by_hand = learner(model(), 1, 1);
    by_hand.train(&batch[..2]).unwrap();
    by_hand.train(&batch[2..]).unwrap();
    let w = weight_bits(&split);
    assert_eq!(w, weight_bits(&by_hand));
    assert_ne!(
        w,
        weight_bits(&learner(model(), 1, 1)),
        "the steps moved the weights"
    );

    // The audit: the first minibatch's generated tokens are zero-lag (and match bit for bit);
    // the second's are drift, on weights one optimizer step past version 0.
    let first_half: u64 = batch[..2]
        .iter()
        .flat_map(|g| &g.samples)
        .map(|s| s.loss_mask[1..].iter().filter(|&&x| x).count() as u64)
        .sum();
    assert!(first_half > 0);
    assert_eq!(r.zero_lag_tokens, first_half);
    assert_eq!(r.zero_lag_mismatch_tokens, 0);
    assert_eq!(r.mismatch_lag0.tokens, first_half);
    assert_eq!(r.mismatch_lag0.abs_diff_max, 0.0);
    assert_eq!(r.mismatch_lagpos.tokens, r.masked_tokens - first_half);
    assert!(r.mismatch_lagpos.abs_diff_max > 0.0);
}

#[test]
fn epochs_repeat_the_pass_and_more_minibatches_than_groups_give_one_a_group() {
    let m = model();
    let batch = groups(&m);
    let mut twice = learner(model(), 1, 2);
    let r = twice.train(&batch).unwrap();
    assert_eq!((r.optimizer_steps, r.version), (2, WeightVersion(1)));
    // Tokens counted once, not once per epoch.
    let masked: u64 = batch
        .iter()
        .flat_map(|g| &g.samples)
        .map(|s| s.loss_mask[1..].iter().filter(|&&x| x).count() as u64)
        .sum();
    assert_eq!(r.masked_tokens, masked);
    let mut by_hand = learner(model(), 1, 1);
    by_hand.train(&batch).unwrap();
    by_hand.train(&batch).unwrap();
    assert_eq!(weight_bits(&twice), weight_bits(&by_hand));

    // 8 minibatches of 4 groups: 4 of one group each.
    let mut many = learner(model(), 8, 1);
    assert_eq!(many.train(&batch).unwrap().optimizer_steps, 4);
    let mut one_by_one = learner(model(), 1, 1);
    for g in &batch {
        one_by_one.train(std::slice::from_ref(g)).unwrap();
    }
    assert_eq!(weight_bits(&many), weight_bits(&one_by_one));

    let cfg = LearnerConfig {
        minibatches: 0,
        ..LearnerConfig::default()
    };
    let e = Learner::new(Backend::Cpu, model(), OptimConfig::default(), cfg, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("minibatches"), "{e}");
}

/// Groups 0 and 1 of `groups`, the second with its last trajectory cut short so the two have
/// different token counts (the case where the two aggregations differ).
fn unequal(m: &Model) -> Vec<ReadyGroup> {
    let mut g: Vec<ReadyGroup> = groups(m).into_iter().take(2).collect();
    let s = &mut g[1].samples[1];
    let keep = s.prompt_len + 2;
    s.tokens.truncate(keep);
    s.loss_mask.truncate(keep);
    s.behavior_logp.truncate(keep);
    s.weight_version.truncate(keep);
    s.turns.clear();
    g
}

#[test]
fn prompt_aggregation_is_the_mean_of_the_groups_token_means() {
    let m = model();
    let batch = unequal(&m);
    let count = |g: &ReadyGroup| -> usize {
        g.samples
            .iter()
            .map(|s| s.loss_mask[1..].iter().filter(|&&x| x).count())
            .sum()
    };
    assert_ne!(
        count(&batch[0]),
        count(&batch[1]),
        "the test needs unequal groups"
    );
    let step = |aggregation: Aggregation, groups: &[ReadyGroup]| {
        let cfg = LearnerConfig {
            aggregation,
            ..LearnerConfig::default()
        };
        let mut l = Learner::new(Backend::Cpu, model(), OptimConfig::default(), cfg, 0).unwrap();
        l.train(groups).unwrap().loss
    };
    let (l0, l1) = (
        step(Aggregation::Token, &batch[..1]),
        step(Aggregation::Token, &batch[1..]),
    );
    let prompt = step(Aggregation::Prompt, &batch);
    let token = step(Aggregation::Token, &batch);
    let want = 0.5 * (l0 + l1);
    assert!(
        (prompt - want).abs() <= 1e-6 * want.abs().max(1e-3),
        "prompt mean {prompt} against the groups' token means' mean {want}"
    );
    let n = (count(&batch[0]) as f64, count(&batch[1]) as f64);
    let token_want = (l0 * n.0 + l1 * n.1) / (n.0 + n.1);
    assert!((token - token_want).abs() <= 1e-6 * token_want.abs().max(1e-3));
    assert!(
        (prompt - token).abs() > 1e-6,
        "the aggregations must differ here"
    );
    // One group: the two are the same mean.
    let one = step(Aggregation::Prompt, &batch[..1]);
    assert!(
        (one - l0).abs() <= 1e-6 * l0.abs().max(1e-3),
        "{one} vs {l0}"
    );
}

fn ppo(minibatches: usize, decoupled: Option<f32>, eps: f32) -> LearnerConfig {
    LearnerConfig {
        loss: GateParams {
            mode: GateMode::Ppo,
            eps_low: eps,
            eps_high: eps,
            ..GateParams::default()
        },
        minibatches,
        decoupled,
        ..LearnerConfig::default()
    }
}

/// Decoupled PPO (issue 28 item 4) at zero lag is PPO: the proximal log-probs are the rollout's
/// bits (same weights, same kernels), so the ratio to pi_prox is exactly 1 and the weight
/// pi_prox / mu is exactly 1: the same step, bit for bit. With two minibatches the second
/// runs on weights one step past pi_prox, and its clip acts (a tight eps of 1e-3); with one
/// minibatch it never does.
#[test]
fn decoupled_ppo_is_ppo_at_zero_lag_and_clips_across_minibatches() {
    let m = model();
    let batch = groups(&m);
    let step = |cfg: LearnerConfig| {
        let mut l = Learner::new(Backend::Cpu, model(), OptimConfig::default(), cfg, 0).unwrap();
        let r = l.train(&batch).unwrap();
        (weight_bits(&l), r)
    };
    let (plain, rp) = step(ppo(1, None, 0.2));
    let (decoupled, rd) = step(ppo(1, Some(5.0), 0.2));
    assert_eq!(plain, decoupled, "zero lag: decoupled PPO takes PPO's step");
    assert_eq!(rd.loss.to_bits(), rp.loss.to_bits());
    assert_eq!(rd.zero_lag_mismatch_tokens, 0);
    assert!(rd.zero_lag_tokens > 0);

    let (_, one) = step(ppo(1, Some(5.0), 1e-3));
    assert_eq!(
        one.clipped, 0,
        "one minibatch: pi_theta = pi_prox, nothing to clip"
    );
    let (_, two) = step(ppo(2, Some(5.0), 1e-3));
    assert!(
        two.clipped > 0,
        "the second minibatch's ratios left [1 - eps, 1 + eps]"
    );

    let bad = LearnerConfig {
        decoupled: Some(5.0),
        ..LearnerConfig::default()
    };
    let e = Learner::new(Backend::Cpu, model(), OptimConfig::default(), bad, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("decoupled"), "{e}");
}
