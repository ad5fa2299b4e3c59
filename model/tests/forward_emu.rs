//! The whole model on the emulator (every op a CUDA kernel run by kernels/emu) and on CUDA where
//! a GPU exists, against the cpu device: the gradient of every named view and the logits agree
//! with the cpu within f32 tolerance; the emu gradient matches finite differences of the emu
//! loss; results are bit-identical across runs and across emulator schedule seeds; a sequence's
//! logits do not depend on its batch; SGD lowers the loss.
//! Tiny config (configs/model/tiny.toml: every feature on), so the emulator runs it in seconds.

use sluice_model::config::ModelConfig;
use sluice_model::forward::{
    logits_on, loss_and_grad_on, loss_of_on, loss_on, policy_loss_and_grad_on,
};
use sluice_model::gradcheck::check_views;
use sluice_model::kernels::device::cuda_for_tests;
use sluice_model::kernels::ops::is_gate_loss::{GateMode, GateParams, TokenInputs};
use sluice_model::kernels::testing::{rel_norm, Rng, F32_TOL};
use sluice_model::kernels::Backend;
use sluice_model::{Model, PackedBatch};

/// Tolerance (relative norm, per view) of a device's gradients and logits against the cpu's: the
/// f32 tolerance. Both compute in f32 but in different orders (the cpu GEMM sums K through
/// matrixmultiply's chunks, the CUDA kernels in one ascending FMA chain; expf differs in the last
/// ulp), each op ~1e-7 relative; through the ~40 chained ops of the backward the worst view
/// measured 6e-7 on emu (printed by the tests). A wrong kernel or a missed term gives errors of
/// order 1.
const GRAD_TOL: f64 = F32_TOL;
const LOGIT_TOL: f64 = F32_TOL;

struct Case {
    batch: PackedBatch,
    targets: Vec<i32>,
    mask: Vec<f32>,
}

fn case(cfg: &ModelConfig, lens: &[usize], seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    let seqs: Vec<Vec<i32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(cfg.vocab) as i32).collect())
        .collect();
    let batch = PackedBatch::pack(&seqs, cfg.vocab).unwrap();
    let targets = (0..batch.len())
        .map(|_| rng.below(cfg.vocab) as i32)
        .collect();
    let mask = (0..batch.len())
        .map(|i| if i % 5 == 3 { 0.0 } else { 1.0 })
        .collect();
    Case {
        batch,
        targets,
        mask,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Loss, every gradient (downloaded) and the logits of one step on `backend`.
struct Step {
    loss: f32,
    grads: Vec<f32>,
    logits: Vec<f32>,
}

fn step(backend: &Backend, cfg: &ModelConfig, c: &Case) -> Step {
    let mut m = Model::new(cfg.clone(), backend).unwrap();
    let loss = loss_and_grad_on(backend, &mut m, &c.batch, &c.targets, &c.mask).unwrap();
    Step {
        loss,
        grads: m.grads.to_vec().unwrap(),
        logits: logits_on(backend, &m, &c.batch).unwrap(),
    }
}

/// Holds `got` to `want` (the cpu) view by view, the logits and the loss.
fn check_against_cpu(name: &str, cfg: &ModelConfig, got: &Step, want: &Step) {
    let layout = Model::new(cfg.clone(), &Backend::Cpu)
        .unwrap()
        .layout()
        .clone();
    let mut worst = (0.0f64, String::new());
    for v in layout.views() {
        let r = v.range();
        let err = rel_norm(&got.grads[r.clone()], &f64s(&want.grads[r]));
        if err > worst.0 {
            worst = (err, v.name.clone());
        }
        assert!(
            err <= GRAD_TOL,
            "{name}: gradient of `{}`: {err:.2e}",
            v.name
        );
    }
    println!("{name}: worst gradient view `{}` {:.2e}", worst.1, worst.0);
    // Padding is zero on every device.
    let mut in_view = vec![false; layout.len()];
    for v in layout.views() {
        in_view[v.range()].iter_mut().for_each(|b| *b = true);
    }
    assert!(got
        .grads
        .iter()
        .zip(&in_view)
        .all(|(&g, &inside)| inside || g == 0.0));
    let err = rel_norm(&got.logits, &f64s(&want.logits));
    println!("{name}: logits {err:.2e}");
    assert!(err <= LOGIT_TOL, "{name}: logits {err:.2e}");
    let err = ((got.loss - want.loss) / want.loss).abs() as f64;
    assert!(
        err <= LOGIT_TOL,
        "{name}: loss {} vs {}",
        got.loss,
        want.loss
    );
}

fn tiny_case() -> (ModelConfig, Case) {
    let cfg = ModelConfig::tiny();
    let c = case(&cfg, &[1, 6, 9], 7);
    (cfg, c)
}

#[test]
fn emu_gradient_and_logits_match_cpu_and_seeds_agree() {
    let (cfg, c) = tiny_case();
    let cpu = step(&Backend::Cpu, &cfg, &c);
    let e1 = Backend::emu_with_seed(1);
    let a = step(&e1, &cfg, &c);
    check_against_cpu("emu", &cfg, &a, &cpu);
    // Run to run and seed to seed: the same bits.
    let again = step(&e1, &cfg, &c);
    let other = step(&Backend::emu_with_seed(2), &cfg, &c);
    for (what, s) in [("second run", &again), ("seed 2", &other)] {
        assert_eq!(a.loss.to_bits(), s.loss.to_bits(), "emu {what}: loss");
        assert_eq!(bits(&a.grads), bits(&s.grads), "emu {what}: gradients");
        assert_eq!(bits(&a.logits), bits(&s.logits), "emu {what}: logits");
    }
}

#[test]
fn emu_features_off_match_cpu() {
    // The other branches: sigmoid router without renormalisation, MHA, no dense first layer,
    // no shared expert; a single token (experts without tokens get zero gradients).
    let mut cfg = ModelConfig::tiny();
    cfg.score_fn = sluice_model::ScoreFn::Sigmoid;
    cfg.renorm = false;
    cfg.n_kv_heads = 4;
    cfg.dense_first_layer = false;
    cfg.dense_ffn_dim = None;
    cfg.shared_expert = false;
    cfg.shared_expert_ffn_dim = None;
    let emu = Backend::emu_with_seed(1);
    for lens in [&[4usize, 7][..], &[1]] {
        let c = case(&cfg, lens, 3);
        check_against_cpu(
            &format!("emu {lens:?}"),
            &cfg,
            &step(&emu, &cfg, &c),
            &step(&Backend::Cpu, &cfg, &c),
        );
    }
}

#[test]
fn emu_gradient_matches_finite_differences() {
    // The emu forward differentiated numerically against the emu backward (grad_model.rs does
    // the same on cpu, with its tolerance and reasoning; fewer samples per view here).
    let (cfg, c) = tiny_case();
    let emu = Backend::emu_with_seed(1);
    let mut m = Model::new(cfg.clone(), &emu).unwrap();
    loss_and_grad_on(&emu, &mut m, &c.batch, &c.targets, &c.mask).unwrap();
    let checks = check_views(
        &mut m.params,
        &m.grads,
        |a| Ok(loss_of_on(&emu, &cfg, a, &c.batch, &c.targets, &c.mask)? as f64),
        3,
        1e-2,
        1e-4,
        3,
    )
    .unwrap();
    let worst = checks.iter().map(|ch| ch.rel_err).fold(0.0, f64::max);
    println!("emu finite differences: worst view {worst:.2e}");
    for ch in &checks {
        assert!(
            ch.rel_err < 3e-2,
            "emu {}: rel err {:.3e}",
            ch.name,
            ch.rel_err
        );
    }
}

#[test]
fn emu_small_widths_match_cpu() {
    // The small config's widths (d 128, 4 heads x 32, 8 experts top-2, expert FFN 256, vocab 64)
    // at one layer, 57 tokens: full 64-wide GEMM tiles and two attention key chunks.
    let mut cfg = ModelConfig::small();
    cfg.n_layers = 1;
    let c = case(&cfg, &[40, 17], 9);
    check_against_cpu(
        "emu small",
        &cfg,
        &step(&Backend::emu_with_seed(1), &cfg, &c),
        &step(&Backend::Cpu, &cfg, &c),
    );
}

#[test]
fn emu_policy_objective_matches_cpu() {
    let (cfg, c) = tiny_case();
    let mut rng = Rng::new(4);
    let adv: Vec<f32> = (0..c.batch.len()).map(|_| rng.normal() as f32).collect();
    let behavior: Vec<f32> = (0..c.batch.len())
        .map(|_| -2.0 - rng.uniform() as f32)
        .collect();
    let inputs = TokenInputs {
        tokens: &c.targets,
        behavior_logp: &behavior,
        advantages: &adv,
        mask: &c.mask,
        weight: None,
        ref_logp: None,
    };
    let params = GateParams {
        mode: GateMode::Icepop,
        ..GateParams::default()
    };
    let run = |backend: &Backend| {
        let mut m = Model::new(cfg.clone(), backend).unwrap();
        let r = policy_loss_and_grad_on(backend, &mut m, &c.batch, &inputs, &params).unwrap();
        (r, m.grads.to_vec().unwrap())
    };
    let (rc, gc) = run(&Backend::Cpu);
    let (re, ge) = run(&Backend::emu_with_seed(1));
    assert!(rel_norm(&re.logp, &f64s(&rc.logp)) <= LOGIT_TOL);
    assert!(rel_norm(&ge, &f64s(&gc)) <= GRAD_TOL);
    assert!(((re.loss - rc.loss) / rc.loss).abs() <= 1e-4);
    assert_eq!(re.accepted, rc.accepted);
    assert_eq!(re.counters[0], rc.counters[0]);
}

/// A sequence's logits are bit-identical alone and packed with others at any offset: every
/// op of the forward works row by row whatever T is (GEMM row tiles, attention key chunks and
/// the MoE's expert segments included; the lengths cross the 64-row GEMM tile and the 32-key
/// attention chunk).
fn check_batch_invariance(backend: &Backend, cfg: &ModelConfig) {
    let m = Model::new(cfg.clone(), backend).unwrap();
    let mut rng = Rng::new(2);
    let all: Vec<Vec<i32>> = [5usize, 33, 1, 40, 17]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(cfg.vocab) as i32).collect())
        .collect();
    let target = &all[3];
    let alone = logits_on(
        backend,
        &m,
        &PackedBatch::pack(&[target], cfg.vocab).unwrap(),
    )
    .unwrap();
    for order in [vec![0, 1, 3], vec![4, 3, 2, 0], vec![1, 2, 4, 0, 3]] {
        let packed: Vec<&Vec<i32>> = order.iter().map(|&i| &all[i]).collect();
        let b = PackedBatch::pack(&packed, cfg.vocab).unwrap();
        let l = logits_on(backend, &m, &b).unwrap();
        let pos = order.iter().position(|&i| i == 3).unwrap();
        let r = b.seq_range(pos);
        assert_eq!(
            bits(&l[r.start * cfg.vocab..r.end * cfg.vocab]),
            bits(&alone),
            "{backend:?} order {order:?}"
        );
    }
}

#[test]
fn emu_logits_do_not_depend_on_the_batch() {
    check_batch_invariance(&Backend::emu_with_seed(1), &ModelConfig::tiny());
    // The small config's widths (d 128, 8 experts, vocab 64) at one layer: full GEMM tiles.
    let mut small = ModelConfig::small();
    small.n_layers = 1;
    check_batch_invariance(&Backend::emu_with_seed(2), &small);
}

#[test]
fn emu_sgd_lowers_the_loss() {
    let (cfg, c) = tiny_case();
    let emu = Backend::emu_with_seed(1);
    let mut m = Model::new(cfg.clone(), &emu).unwrap();
    let mut losses = Vec::new();
    for _ in 0..4 {
        losses.push(loss_and_grad_on(&emu, &mut m, &c.batch, &c.targets, &c.mask).unwrap());
        let g = m.grads.to_vec().unwrap();
        for (p, g) in m.params.as_mut_slice().unwrap().iter_mut().zip(&g) {
            *p -= 0.1 * g;
        }
    }
    losses.push(loss_on(&emu, &m, &c.batch, &c.targets, &c.mask).unwrap());
    println!("emu SGD losses {losses:?}");
    assert!(
        losses.windows(2).all(|w| w[1] < w[0]),
        "the loss must fall at every step: {losses:?}"
    );
}

#[test]
fn cuda_matches_cpu_and_is_deterministic() {
    let Some(gpu) = cuda_for_tests("model forward/backward on cuda") else {
        return;
    };
    let (cfg, c) = tiny_case();
    let cpu = step(&Backend::Cpu, &cfg, &c);
    let a = step(&gpu, &cfg, &c);
    check_against_cpu("cuda", &cfg, &a, &cpu);
    let b = step(&gpu, &cfg, &c);
    assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    assert_eq!(bits(&a.grads), bits(&b.grads));
    assert_eq!(bits(&a.logits), bits(&b.logits));
    check_batch_invariance(&gpu, &ModelConfig::tiny());
    let mut small = ModelConfig::small();
    small.n_layers = 2;
    check_batch_invariance(&gpu, &small);
    let c = case(&small, &[64, 17, 33], 5);
    check_against_cpu(
        "cuda small",
        &small,
        &step(&gpu, &small, &c),
        &step(&Backend::Cpu, &small, &c),
    );
}
