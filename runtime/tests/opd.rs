//! On-policy distillation in the learner (issue 28 item 6, sluice_runtime::distill), on cpu,
//! against hand computations: trajectories sampled by a tiny student at version 0 (so every
//! trained token is zero-lag and the learner's logp is the behavior logp, bit for bit), two
//! teachers of other weights, each scoring one task's trajectories. The teachers' log-probs
//! are recomputed here one trajectory at a time with the model's own forward (batch
//! invariance makes them the learner's bits), and the step's loss is checked against
//!
//!   dis at ratio 1:  L = -(1/D) sum_t A_t logp_t,  A_t = coef (q_t - b_t) [+ A_grpo] [+ mean gap]
//!   KL form:         L = L_grpo + coef (1/D) sum_t k3(logp_t, q_t)
//!
//! with q the teacher's log-prob, b the behavior log-prob and D the trained tokens.

mod common;

use sluice_kernels::ops::is_gate_loss::{kl_estimate, KlEstimator};
use sluice_kernels::Backend;
use sluice_model::forward::token_logps_of_on;
use sluice_model::optim::OptimConfig;
use sluice_model::{Model, ModelConfig, PackedBatch};
use sluice_runtime::buffer::ReadyGroup;
use sluice_runtime::distill::{OpdConfig, OpdForm, Teacher, Teachers};
use sluice_runtime::learner::{Learner, LearnerConfig, StepReport};
use sluice_runtime::regularize::{KlConfig, KlPlace, Regularizers};
use sluice_runtime::scoring::ScoringModel;
use sluice_runtime::trajectory::{Sample, WeightVersion};

fn config(seed: u64) -> ModelConfig {
    let mut cfg = ModelConfig::tiny();
    cfg.vocab = 16;
    cfg.seed = seed;
    cfg
}

fn model(seed: u64) -> Model {
    Model::new(config(seed), &Backend::Cpu).unwrap()
}

/// The task of group g: "a" for even g, "b" for odd.
fn task_of(g: usize) -> &'static str {
    if g.is_multiple_of(2) {
        "a"
    } else {
        "b"
    }
}

/// Four groups of two trajectories sampled by `m` at version 0, of tasks a, b, a, b, with
/// rewards 0 and 1 in each group.
fn groups(m: &Model) -> Vec<ReadyGroup> {
    common::reward_pair_groups(m, 6, 30, |g| Some(task_of(g)))
}

/// Teachers: weights of seed 11 for task a, seed 12 for task b.
fn teachers() -> Teachers {
    let t = |seed, task: &str| Teacher {
        model: ScoringModel::copy_of(&Backend::Cpu, model(seed).compute_weights()).unwrap(),
        tasks: vec![task.to_string()],
    };
    Teachers::new(vec![t(11, "a"), t(12, "b")]).unwrap()
}

/// The teacher's log-prob of every token of `s` (0 at the first), computed on `s` alone.
fn teacher_logps(s: &Sample) -> Vec<f32> {
    let seed = if s.task == "a" { 11 } else { 12 };
    let m = model(seed);
    let seq: Vec<i32> = s.tokens.iter().map(|&t| t as i32).collect();
    let batch = PackedBatch::pack(std::slice::from_ref(&seq), 16).unwrap();
    // Row j predicts token j + 1 (the last row's target is unused).
    let mut targets: Vec<i32> = seq[1..].to_vec();
    targets.push(0);
    let t = s.sampling.temperature;
    let logp = token_logps_of_on(
        &Backend::Cpu,
        &m.config,
        m.compute_weights(),
        &batch,
        &targets,
        t,
    )
    .unwrap();
    std::iter::once(0.0)
        .chain(logp[..seq.len() - 1].iter().copied())
        .collect()
}

/// The positions of a trajectory's trained tokens (after the first).
fn trained_positions(s: &Sample) -> impl Iterator<Item = usize> + '_ {
    (1..s.tokens.len()).filter(|&j| s.loss_mask[j])
}

fn opd(form: OpdForm, coef: f32) -> LearnerConfig {
    LearnerConfig {
        opd: Some(OpdConfig {
            form: Some(form),
            coef,
        }),
        ..LearnerConfig::default()
    }
}

fn learner(cfg: LearnerConfig) -> Learner {
    let mut l = Learner::new(Backend::Cpu, model(0), OptimConfig::default(), cfg, 0).unwrap();
    if cfg.opd.is_some() {
        l.set_teachers(teachers()).unwrap();
    }
    l
}

fn weight_bits(l: &Learner) -> Vec<u32> {
    let w = l.model().params.tensor().to_vec::<f32>().unwrap();
    w.iter().map(|v| v.to_bits()).collect()
}

/// Every trained token of the batch with its trajectory's GRPO advantage: (sample, advantage).
fn trained(batch: &[ReadyGroup]) -> Vec<(&Sample, f64)> {
    // Rewards 0 and 1 in every group: advantages -/+ 0.5 / (0.5 + 1e-6).
    let a = 0.5 / (0.5 + 1e-6);
    batch
        .iter()
        .flat_map(|g| {
            g.samples
                .iter()
                .map(move |s| (s, if s.reward > 0.5 { a } else { -a }))
        })
        .collect()
}

/// -(1/D) sum_t A_t b_t with A_t = coef (q - b + shift) + grpo_weight x A_grpo, over the
/// trained tokens (b the behavior log-prob, which the learner's logp equals at zero lag).
fn advantage_loss(batch: &[ReadyGroup], coef: f64, grpo_weight: f64, shift: f64) -> f64 {
    let (mut sum, mut d) = (0.0f64, 0u64);
    for (s, a) in trained(batch) {
        let q = teacher_logps(s);
        for j in trained_positions(s) {
            let b = s.behavior_logp[j] as f64;
            let adv = coef * (q[j] as f64 - b + shift) + grpo_weight * a;
            sum += adv * b;
            d += 1;
        }
    }
    -sum / d as f64
}

/// The step's loss against the f64 value: the kernel sums D (about 40) f32 terms of size ~1
/// in f32; 1e-5 relative is a few hundred ulp of headroom over that rounding.
fn assert_loss(r: &StepReport, want: f64, what: &str) {
    assert!(
        (r.loss - want).abs() <= 1e-5 * want.abs().max(1.0),
        "{what}: loss {} against {want} by hand",
        r.loss
    );
}

/// The gap to the teachers by hand, per task, in the learner's order (trajectory by
/// trajectory, token by token): (sum of b - q, tokens).
fn gap(batch: &[ReadyGroup], task: &str) -> (f64, u64) {
    let (mut sum, mut n) = (0.0f64, 0u64);
    for g in batch.iter().filter(|g| g.task == task) {
        let mut traj_sum = Vec::new();
        for s in &g.samples {
            let q = teacher_logps(s);
            let mut t = 0.0f64;
            for j in trained_positions(s) {
                t += s.behavior_logp[j] as f64 - q[j] as f64;
                n += 1;
            }
            traj_sum.push(t);
        }
        for t in traj_sum {
            sum += t;
        }
    }
    (sum, n)
}

/// GLM-5's form: the teacher's log-ratio replaces GRPO's advantage. Each task's trajectories
/// are scored by its own teacher (the per-task gaps are the bits computed here with that
/// teacher alone), every trained token's teacher log-prob is counted, the loss is the hand
/// value, the rewards no longer matter (bit for bit), and the zero-lag tokens still match.
#[test]
fn the_advantage_form_trains_on_each_tasks_teachers_log_ratio() {
    let batch = groups(&model(0));
    let masked: u64 = trained(&batch)
        .iter()
        .map(|(s, _)| s.loss_mask[1..].iter().filter(|&&m| m).count() as u64)
        .sum();
    assert!(masked >= 16, "{masked} trained tokens");
    let form = OpdForm::Advantage {
        with_grpo: false,
        center: false,
    };
    let mut l = learner(opd(form, 0.5));
    let r = l.train(&batch).unwrap();
    assert_eq!(r.opd_tokens, masked);
    for task in ["a", "b"] {
        let (sum, n) = gap(&batch, task);
        let t = &r.per_task[task];
        assert_eq!(t.opd_tokens, n, "{task}");
        assert!(n > 0);
        assert_eq!(
            t.opd_gap_sum.to_bits(),
            sum.to_bits(),
            "task {task}'s teacher"
        );
    }
    assert!(r.opd_gap_sum != 0.0, "the teachers are other weights");
    assert_loss(&r, advantage_loss(&batch, 0.5, 0.0, 0.0), "advantage form");
    assert_eq!(r.zero_lag_tokens, masked);
    assert_eq!(r.zero_lag_mismatch_tokens, 0);
    // Every token carries its own (non-zero) advantage, whatever its group's rewards.
    assert_eq!(r.gradient_unique_tokens, masked);
    let mut same_rewards = batch.clone();
    for s in same_rewards.iter_mut().flat_map(|g| g.samples.iter_mut()) {
        s.reward = 0.25;
    }
    let mut l2 = learner(opd(form, 0.5));
    l2.train(&same_rewards).unwrap();
    assert_eq!(weight_bits(&l), weight_bits(&l2), "the rewards were used");
}

/// slime's documented form (the log-ratio added to GRPO's advantage) and the centered one
/// (less the step's mean log-ratio), each against its hand loss.
#[test]
fn added_to_grpo_and_centered_forms_by_hand() {
    let batch = groups(&model(0));
    let with = OpdForm::Advantage {
        with_grpo: true,
        center: false,
    };
    let r = learner(opd(with, 0.5)).train(&batch).unwrap();
    assert_loss(&r, advantage_loss(&batch, 0.5, 1.0, 0.0), "with GRPO");
    let centered = OpdForm::Advantage {
        with_grpo: false,
        center: true,
    };
    let r = learner(opd(centered, 2.0)).train(&batch).unwrap();
    let mean_gap = r.opd_gap_sum / r.opd_tokens as f64;
    assert!(mean_gap.abs() > 1e-3, "{mean_gap}");
    assert_loss(&r, advantage_loss(&batch, 2.0, 0.0, mean_gap), "centered");
}

/// The KL form adds coef x the mean k3 estimate toward the teacher to the GRPO loss.
#[test]
fn the_kl_form_adds_coef_k3_to_the_loss() {
    let batch = groups(&model(0));
    let plain = learner(LearnerConfig::default()).train(&batch).unwrap();
    let r = learner(opd(OpdForm::Kl(KlEstimator::K3), 0.7))
        .train(&batch)
        .unwrap();
    let (mut k3, mut d) = (0.0f64, 0u64);
    for (s, _) in trained(&batch) {
        let q = teacher_logps(s);
        for j in trained_positions(s) {
            k3 += kl_estimate(KlEstimator::K3, s.behavior_logp[j], q[j]).0 as f64;
            d += 1;
        }
    }
    assert!(k3 > 0.0);
    assert_loss(&r, plain.loss + 0.7 * k3 / d as f64, "KL form");
    assert_eq!(r.zero_lag_mismatch_tokens, 0);
}

/// A teacher with the student's own weights: every log-ratio is exactly 0 (the same
/// forward), so the advantage form's step is a step on zero advantages, bit for bit.
#[test]
fn a_teacher_with_the_students_weights_gives_zero_advantages() {
    let batch = groups(&model(0));
    let mut l = Learner::new(
        Backend::Cpu,
        model(0),
        OptimConfig::default(),
        opd(
            OpdForm::Advantage {
                with_grpo: false,
                center: false,
            },
            1.0,
        ),
        0,
    )
    .unwrap();
    let own = ScoringModel::copy_of(&Backend::Cpu, model(0).compute_weights()).unwrap();
    let t = Teacher {
        model: own,
        tasks: vec!["a".into(), "b".into()],
    };
    l.set_teachers(Teachers::new(vec![t]).unwrap()).unwrap();
    let r = l.train(&batch).unwrap();
    assert!(r.opd_tokens > 0);
    assert_eq!(r.opd_gap_sum, 0.0);
    assert_eq!(r.gradient_unique_tokens, 0);
    // Zero advantages by GRPO: every group's rewards equal.
    let mut flat = batch.clone();
    for s in flat.iter_mut().flat_map(|g| g.samples.iter_mut()) {
        s.reward = 1.0;
    }
    let mut plain = learner(LearnerConfig::default());
    plain.train(&flat).unwrap();
    assert_eq!(weight_bits(&l), weight_bits(&plain));
}

#[test]
fn bad_teachers_and_conflicts_are_errors() {
    let batch = groups(&model(0));
    let form = OpdForm::Advantage {
        with_grpo: false,
        center: false,
    };
    // A task without a teacher: the error names it.
    let mut l = Learner::new(
        Backend::Cpu,
        model(0),
        OptimConfig::default(),
        opd(form, 1.0),
        0,
    )
    .unwrap();
    let only_a = Teacher {
        model: ScoringModel::copy_of(&Backend::Cpu, model(11).compute_weights()).unwrap(),
        tasks: vec!["a".into()],
    };
    l.set_teachers(Teachers::new(vec![only_a]).unwrap())
        .unwrap();
    let e = l.train(&batch).unwrap_err().to_string();
    assert!(e.contains("\"b\"") && e.contains("opd.teachers"), "{e}");
    assert_eq!(l.version(), WeightVersion(0), "nothing trained");
    // Distillation without teachers.
    let mut none = Learner::new(
        Backend::Cpu,
        model(0),
        OptimConfig::default(),
        opd(form, 1.0),
        0,
    )
    .unwrap();
    assert!(none.train(&batch).is_err());
    // Teachers for a learner that does not distil.
    let mut plain = learner(LearnerConfig::default());
    assert!(plain.set_teachers(teachers()).is_err());
    // A teacher of another architecture (a wider vocabulary) is refused at load, naming it.
    let dir = std::env::temp_dir().join(format!("sluice-opd-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("wide.safetensors");
    let mut wide = config(3);
    wide.vocab = 20;
    let w = Model::new(wide, &Backend::Cpu).unwrap();
    sluice_model::checkpoint::save_with_meta(&p, &w.config, &w.params, &[], &[]).unwrap();
    let e = ScoringModel::load(&p, &Backend::Cpu, &model(0), "OPD teacher 0")
        .unwrap_err()
        .to_string();
    assert!(e.contains("OPD teacher 0") && e.contains("vocab"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    // A task under two teachers; a teacher of no task.
    let t = |task: &str| Teacher {
        model: ScoringModel::copy_of(&Backend::Cpu, model(11).compute_weights()).unwrap(),
        tasks: vec![task.to_string()],
    };
    assert!(Teachers::new(vec![t("a"), t("a")]).is_err());
    assert!(Teachers::new(vec![Teacher {
        model: ScoringModel::copy_of(&Backend::Cpu, model(11).compute_weights()).unwrap(),
        tasks: Vec::new(),
    }])
    .is_err());
    // The KL form and a KL to the reference in the loss share the kernel's one KL input.
    let both = LearnerConfig {
        regularizers: Regularizers {
            entropy_coef: 0.0,
            kl: Some(KlConfig {
                estimator: KlEstimator::K3,
                coef: 0.1,
                place: KlPlace::Loss,
            }),
        },
        ..opd(OpdForm::Kl(KlEstimator::K3), 1.0)
    };
    assert!(Learner::new(Backend::Cpu, model(0), OptimConfig::default(), both, 0).is_err());
    // k1 in the loss ignores the teacher.
    let k1 = opd(OpdForm::Kl(KlEstimator::K1), 1.0);
    assert!(Learner::new(Backend::Cpu, model(0), OptimConfig::default(), k1, 0).is_err());
}
