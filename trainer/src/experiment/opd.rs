//! The `opd` experiment's pieces (its entry is in defs.rs): its arms, its figures, and its
//! teacher. The runner trains the teacher per seed ([`teacher_steps`], [`train`]): the arms'
//! starting point (the RL config's model.init: the shared warm-up, or the config's own init)
//! trained more supervised steps on the RL stages' tasks, with the config's supervised
//! settings, so it has the student's architecture and vocabulary by construction.

use super::{write_toml, Arm, ArmRun};
use crate::train_cmd::{run_train, TrainError, TrainOptions};
use std::path::{Path, PathBuf};
use toml::{Table, Value};

/// Supervised steps of the teacher the runner trains per seed for an experiment that distils,
/// or None (every other experiment).
pub fn teacher_steps(experiment: &str) -> Option<u64> {
    match experiment {
        "opd" => Some(150),
        _ => None,
    }
}

/// The arms (each gets the seed's teacher as `opd.teachers` from the runner): GRPO alone
/// measuring the gap to the teacher (`off`), the teacher's log-ratio as every token's advantage
/// in place of GRPO's (GLM-5), the same centered on the step's mean, and GRPO plus the k3 KL
/// toward the teacher in the loss.
pub fn opd_arms() -> Vec<Arm> {
    let arm = |name: &str, sets: &[&str]| Arm {
        name: name.into(),
        sets: sets.iter().map(|s| s.to_string()).collect(),
    };
    vec![
        arm("off", &["opd.log=true"]),
        arm("advantage", &["opd.form=\"advantage\""]),
        arm(
            "advantage-centered",
            &["opd.form=\"advantage\"", "opd.center=true"],
        ),
        arm("kl", &["opd.form=\"kl\""]),
    ]
}

fn num(v: &serde_json::Value, key: &str) -> Option<f64> {
    v.get(key).and_then(serde_json::Value::as_f64)
}

/// The gap to the teacher over the stage (summary.json's `opd_reverse_kl_mean`).
pub fn kl(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "opd_reverse_kl_mean")
}

/// The gap to the teacher over the stage's last quarter of steps (at least one).
pub fn kl_end(r: &ArmRun) -> Option<f64> {
    let v: Vec<f64> = r
        .lines
        .iter()
        .filter_map(|l| num(l, "opd_reverse_kl_window"))
        .collect();
    let q = (v.len() / 4).max(1);
    (!v.is_empty()).then(|| v[v.len() - q..].iter().sum::<f64>() / q as f64)
}

pub fn scored_tokens(r: &ArmRun) -> Option<f64> {
    num(&r.summary, "opd_scored_tokens")
}

pub fn sort_pass_after(r: &ArmRun) -> Option<f64> {
    num(&r.summary["tasks"]["sort"], "pass_rate_after")
}

pub fn tool_pass_after(r: &ArmRun) -> Option<f64> {
    num(&r.summary["tasks"]["tool"], "pass_rate_after")
}

/// The RL stages' tasks, in order of first use.
fn rl_tasks(rl: &Table) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let stages = rl.get("stage").and_then(Value::as_array);
    for s in stages.into_iter().flatten() {
        let tasks = s.get("tasks").and_then(Value::as_array);
        for t in tasks.into_iter().flatten().filter_map(Value::as_str) {
            if !out.iter().any(|x| x == t) {
                out.push(t.to_string());
            }
        }
    }
    out
}

/// Trains the teacher of seed `seed` from the RL config `rl` (its model.init, seed and
/// settings) into `dir`/teacher-s`seed`; returns `opd.teachers`'s value: one teacher, its
/// final.safetensors, scoring every task of the RL stages.
pub(super) fn train(rl: &Table, steps: u64, seed: u64, dir: &Path) -> Result<Value, TrainError> {
    let tasks = rl_tasks(rl);
    let mut t = rl.clone();
    let mut stage = Table::new();
    stage.insert("kind".into(), "sft".into());
    stage.insert("steps".into(), (steps as i64).into());
    stage.insert(
        "tasks".into(),
        Value::Array(tasks.iter().cloned().map(Value::from).collect()),
    );
    t.insert("stage".into(), Value::Array(vec![Value::Table(stage)]));
    let file = dir.join(format!("teacher-s{seed}.toml"));
    write_toml(&file, &t)?;
    let out = dir.join(format!("teacher-s{seed}"));
    run_train(
        &TrainOptions {
            config: Some(file),
            out: Some(out.clone()),
            ..TrainOptions::default()
        },
        &mut std::io::sink(),
    )?;
    let checkpoint: PathBuf = out.join("final.safetensors");
    let mut teacher = Table::new();
    teacher.insert(
        "checkpoint".into(),
        checkpoint.to_string_lossy().to_string().into(),
    );
    teacher.insert(
        "tasks".into(),
        Value::Array(tasks.into_iter().map(Value::from).collect()),
    );
    Ok(Value::Array(vec![Value::Table(teacher)]))
}
