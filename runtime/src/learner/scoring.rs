//! The learner's micro-batches and its forward-only scoring passes: the log-prob of every
//! trained token under other weights (decoupled PPO's proximal policy, the KL reference,
//! on-policy distillation's teachers), through the same micro-batches and row reduction as the
//! training pass, so equal weights give the learner's bits (and at zero lag the rollout's).

use super::{loss_temperature, Learner, MicroBatch, StepReport};
use crate::distill::{trajectory_gap, Teachers};
use crate::trajectory::Sample;
use sluice_kernels::{Error, Result};
use sluice_model::forward::token_logps_of_on;
use sluice_model::{Arena, PackedBatch};
use std::collections::BTreeMap;

/// Per trajectory of a step: (sample, GRPO advantage, is a repeat).
pub(super) type Flat<'a, 's> = &'a [(&'s Sample, f32, bool)];

impl Learner {
    /// Groups the trajectories `flat[i]`, i in `which` (in order), by sampling temperature, then
    /// packs them in order into micro-batches of at most `micro_batch_tokens` tokens.
    pub(super) fn micro_batches(
        &self,
        flat: Flat<'_, '_>,
        which: impl IntoIterator<Item = usize>,
    ) -> Vec<MicroBatch> {
        let mut by_temp: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for i in which {
            by_temp
                .entry(loss_temperature(flat[i].0).to_bits())
                .or_default()
                .push(i);
        }
        let mut out = Vec::new();
        for (bits, idx) in by_temp {
            let temperature = f32::from_bits(bits);
            let mut cur = MicroBatch {
                seqs: Vec::new(),
                temperature,
                tokens: 0,
            };
            for i in idx {
                let len = flat[i].0.tokens.len();
                if !cur.seqs.is_empty() && cur.tokens + len > self.cfg.micro_batch_tokens {
                    out.push(std::mem::replace(
                        &mut cur,
                        MicroBatch {
                            seqs: Vec::new(),
                            temperature,
                            tokens: 0,
                        },
                    ));
                }
                cur.seqs.push(i);
                cur.tokens += len;
            }
            if !cur.seqs.is_empty() {
                out.push(cur);
            }
        }
        out
    }

    /// The log-prob of every masked token of `flat` under `weights`, forward only. Indexed
    /// [trajectory][position]; 0 where not masked.
    pub(super) fn token_logps(&self, flat: Flat<'_, '_>, weights: &Arena) -> Result<Vec<Vec<f32>>> {
        let mut out = zeros_like(flat);
        self.score_into(flat, 0..flat.len(), weights, &mut out)?;
        Ok(out)
    }

    /// With on-policy distillation: the teachers' log-prob of every masked token of `flat`
    /// (see [`Learner::teacher_logps`]), with the gap to them (behavior - teacher) and the
    /// scored tokens counted in `report`, in total and per task. None without distillation.
    pub(super) fn opd_scores(
        &self,
        flat: Flat<'_, '_>,
        report: &mut StepReport,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        if self.cfg.opd.is_none() {
            return Ok(None);
        }
        let teachers = self.teachers.as_ref().ok_or_else(|| {
            Error::Invalid(
                "on-policy distillation is on but the learner has no teachers \
                 (Learner::set_teachers)"
                    .into(),
            )
        })?;
        let q = self.teacher_logps(flat, teachers)?;
        for ((s, _, _), q) in flat.iter().zip(&q) {
            let (sum, n) = trajectory_gap(&s.loss_mask, &s.behavior_logp, q);
            report.opd_gap_sum += sum;
            report.opd_tokens += n;
            let t = report.per_task.entry(s.task.clone()).or_default();
            t.opd_gap_sum += sum;
            t.opd_tokens += n;
        }
        Ok(Some(q))
    }

    /// The teachers' log-prob of every masked token: each trajectory scored by its task's
    /// teacher (a teacher's trajectories in their own micro-batches: batch invariance makes a
    /// row's bits independent of its neighbours). A trajectory whose task has no teacher is an
    /// error naming the task.
    pub(super) fn teacher_logps(
        &self,
        flat: Flat<'_, '_>,
        teachers: &Teachers,
    ) -> Result<Vec<Vec<f32>>> {
        let mut by_teacher: Vec<Vec<usize>> = vec![Vec::new(); teachers.len()];
        for (i, (s, _, _)) in flat.iter().enumerate() {
            let t = teachers.of(&s.task).ok_or_else(|| {
                Error::Invalid(format!(
                    "on-policy distillation: no teacher scores task {:?} (trajectory {}/{}); \
                     every task of an OPD stage needs one (opd.teachers)",
                    s.task, s.instance_id, s.group_index
                ))
            })?;
            by_teacher[t].push(i);
        }
        let mut out = zeros_like(flat);
        for (t, idx) in by_teacher.into_iter().enumerate() {
            if !idx.is_empty() {
                self.score_into(flat, idx, teachers.get(t).model.params(), &mut out)?;
            }
        }
        Ok(out)
    }

    /// Writes into `out[i]` the log-prob under `weights` of every masked token of `flat[i]`, i
    /// in `which`.
    fn score_into(
        &self,
        flat: Flat<'_, '_>,
        which: impl IntoIterator<Item = usize>,
        weights: &Arena,
        out: &mut [Vec<f32>],
    ) -> Result<()> {
        for mb in self.micro_batches(flat, which) {
            let seqs: Vec<Vec<i32>> = mb
                .seqs
                .iter()
                .map(|&i| flat[i].0.tokens.iter().map(|&t| t as i32).collect())
                .collect();
            let batch = PackedBatch::pack(&seqs, self.model.config.vocab)?;
            let mut targets = vec![0i32; batch.len()];
            for (b, &i) in mb.seqs.iter().enumerate() {
                let s = flat[i].0;
                let r = batch.seq_range(b);
                for j in 0..s.tokens.len() - 1 {
                    targets[r.start + j] = s.tokens[j + 1] as i32;
                }
            }
            let logp = token_logps_of_on(
                &self.backend,
                &self.model.config,
                weights,
                &batch,
                &targets,
                mb.temperature,
            )?;
            for (b, &i) in mb.seqs.iter().enumerate() {
                let r = batch.seq_range(b);
                for j in 0..flat[i].0.tokens.len() - 1 {
                    if flat[i].0.loss_mask[j + 1] {
                        out[i][j + 1] = logp[r.start + j];
                    }
                }
            }
        }
        Ok(())
    }
}

fn zeros_like(flat: Flat<'_, '_>) -> Vec<Vec<f32>> {
    flat.iter()
        .map(|(s, _, _)| vec![0.0; s.tokens.len()])
        .collect()
}
