//! A scoring model: frozen weights the learner runs forward only, to get the log-prob of every
//! trained token (crate::learner). Two roles use it: the KL reference (crate::regularize,
//! issue 28 item 7) and on-policy distillation's teachers (crate::distill, item 6). Both are
//! kept in the policy's compute precision and scored through the learner's own micro-batches
//! and row reduction, so a scoring model with the policy's weights gives the learner's bits.

use sluice_kernels::{Backend, Error, Result};
use sluice_model::{Arena, Model};
use std::path::Path;

/// Frozen weights in the learner's compute precision, with the policy's layout.
pub struct ScoringModel {
    params: Arena,
}

impl std::fmt::Debug for ScoringModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ScoringModel({} values)", self.params.layout().len())
    }
}

impl ScoringModel {
    /// A copy of `weights` (e.g. the stage's initial compute weights).
    pub fn copy_of(backend: &Backend, weights: &Arena) -> Result<ScoringModel> {
        Ok(ScoringModel {
            params: weights.cast_copy(backend, weights.dtype())?,
        })
    }

    /// The weights of a checkpoint, which must have `model`'s architecture (its vocabulary
    /// included), in `model`'s compute precision (a bf16 model rounds them as its own compute
    /// copy is rounded). `role` names the model in errors ("the KL reference", "OPD teacher
    /// 1").
    pub fn load(path: &Path, backend: &Backend, model: &Model, role: &str) -> Result<ScoringModel> {
        let (config, arena) = sluice_model::checkpoint::load_new(path, backend)?;
        if let Some(diff) = config.architecture_diff(&model.config) {
            return Err(Error::Invalid(format!(
                "{role} {} is not the policy's architecture: {diff}",
                path.display()
            )));
        }
        Ok(ScoringModel {
            params: arena.cast_copy(backend, model.compute_weights().dtype())?,
        })
    }

    /// Saves the weights (a resumed run loads them back with [`ScoringModel::load`]; bf16
    /// values come back exactly).
    pub fn save(&self, path: &Path, model: &Model) -> Result<()> {
        sluice_model::checkpoint::save_with_meta(path, &model.config, &self.params, &[], &[])
    }

    pub fn params(&self) -> &Arena {
        &self.params
    }

    /// Whether these weights can be scored with `model`'s forward: same layout and dtype.
    pub fn fits(&self, model: &Model) -> bool {
        self.params.layout() == model.layout()
            && self.params.dtype() == model.compute_weights().dtype()
    }
}
