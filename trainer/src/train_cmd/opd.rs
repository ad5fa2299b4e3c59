//! On-policy distillation's teachers in `sluice train` (`[opd]`; sluice_runtime::distill):
//! checked against the run's model before the run folder is touched, loaded on the learner's
//! device at every RL stage's start (a resumed run reads them again from their files), and
//! fingerprinted so that a resume refuses teachers whose files changed.

use super::*;
use crate::config::OpdSection;
use sluice_runtime::distill::{Teacher, Teachers};
use sluice_runtime::scoring::ScoringModel;

fn bad(i: usize, message: String) -> TrainError {
    TrainError::Config(ConfigError {
        key: OpdSection::checkpoint_key(i),
        message,
    })
}

/// Every teacher must be a checkpoint of the run's architecture and vocabulary (the model
/// config's, with the tokenizer's vocabulary): an error naming the teacher's key otherwise.
pub(super) fn check_teachers(opd: &OpdSection, model_cfg: &ModelConfig) -> Result<(), TrainError> {
    for (i, t) in opd.teachers.iter().enumerate() {
        let cfg = sluice_model::checkpoint::read_config(&t.checkpoint)
            .map_err(|e| bad(i, format!("{}: {e}", t.checkpoint.display())))?;
        if let Some(diff) = cfg.architecture_diff(model_cfg) {
            return Err(bad(
                i,
                format!(
                    "{}: a teacher must have the student's architecture and vocabulary (it \
                     scores the student's token ids with the same forward); {diff} (teacher vs \
                     student)",
                    t.checkpoint.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The SHA-256 of each teacher's file, in order.
pub(super) fn digests(opd: Option<&OpdSection>) -> Result<Vec<String>, TrainError> {
    let Some(opd) = opd else {
        return Ok(Vec::new());
    };
    opd.teachers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let bytes = std::fs::read(&t.checkpoint)
                .map_err(|e| bad(i, format!("{}: {e}", t.checkpoint.display())))?;
            Ok(Sha256::digest(&bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect())
        })
        .collect()
}

/// On resume: the teachers must be the files the run started with.
pub(super) fn check_unchanged(
    opd: Option<&OpdSection>,
    saved: &[String],
) -> Result<(), TrainError> {
    let now = digests(opd)?;
    if now.len() != saved.len() {
        return Err(TrainError::Input(format!(
            "resume: the run had {} OPD teacher(s), its config now names {}",
            saved.len(),
            now.len()
        )));
    }
    if let Some(i) = (0..now.len()).find(|&i| now[i] != saved[i]) {
        return Err(bad(
            i,
            "resume: this teacher's file changed since the run started (its SHA-256 differs); \
             a resumed run must distil from the same teacher"
                .into(),
        ));
    }
    Ok(())
}

/// The teachers, loaded on the learner's device in its compute precision.
pub(super) fn load_teachers(opd: &OpdSection, learner: &Learner) -> Result<Teachers, TrainError> {
    let mut list = Vec::with_capacity(opd.teachers.len());
    for (i, t) in opd.teachers.iter().enumerate() {
        let model = ScoringModel::load(
            &t.checkpoint,
            learner.backend(),
            learner.model(),
            &format!("OPD teacher {i}"),
        )
        .map_err(|e| bad(i, e.to_string()))?;
        list.push(Teacher {
            model,
            tasks: t.tasks.clone(),
        });
    }
    Teachers::new(list).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "opd.teachers".into(),
            message: e.to_string(),
        })
    })
}
