//! The teacher of an experiment that distils (`opd`; [`super::defs::teacher_steps`]): per seed,
//! the arms' starting point (the RL config's model.init: the shared warm-up, or the config's
//! own init) trained more supervised steps on the RL stages' tasks, with the config's
//! supervised settings. Same architecture and vocabulary as the student by construction.

use super::write_toml;
use crate::train_cmd::{run_train, TrainError, TrainOptions};
use std::path::{Path, PathBuf};
use toml::{Table, Value};

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
