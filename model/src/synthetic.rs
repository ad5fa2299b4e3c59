//! Synthetic supervised tasks: token sequences with known answers, to check that the whole stack
//! learns (the smoke test, `sluice sft`).
//!
//! Reversing digit strings: token ids 0..=9 are the digits, [`BOS`] = 10, [`SEP`] = 11,
//! [`EOS`] = 12 (any vocabulary of at least 13 ids). A sequence is `BOS d1 .. dn SEP dn .. d1 EOS`
//! with n uniform in `min_digits..=max_digits`; the loss covers the predictions of the reversed
//! digits and of EOS (the positions from SEP on), which the model can only get right by reading
//! the digits back through attention.

use crate::batch::PackedBatch;
use sluice_kernels::testing::Rng;
use sluice_kernels::{Error, Result};

pub const BOS: i32 = 10;
pub const SEP: i32 = 11;
pub const EOS: i32 = 12;

/// One batch of the digit-reversal task: the packed sequences, the next-token targets (one per
/// token; 0 where masked) and the loss mask (1.0 on the answer's predictions).
pub struct TaskBatch {
    pub batch: PackedBatch,
    pub targets: Vec<i32>,
    pub mask: Vec<f32>,
}

/// Draws `n_seqs` digit-reversal sequences of `min_digits..=max_digits` digits from `rng`.
pub fn reverse_digits(
    rng: &mut Rng,
    n_seqs: usize,
    min_digits: usize,
    max_digits: usize,
    vocab: usize,
) -> Result<TaskBatch> {
    if vocab <= EOS as usize {
        return Err(Error::param(
            "vocab",
            format!(
                "the digit task needs at least {} token ids, got {vocab}",
                EOS + 1
            ),
        ));
    }
    if n_seqs == 0 || min_digits == 0 || max_digits < min_digits {
        return Err(Error::param(
            "digits",
            format!(
                "need n_seqs >= 1 and 1 <= min_digits <= max_digits (got {n_seqs} sequences of \
                 {min_digits}..={max_digits} digits)"
            ),
        ));
    }
    let mut seqs = Vec::with_capacity(n_seqs);
    let mut targets = Vec::new();
    let mut mask = Vec::new();
    for _ in 0..n_seqs {
        let n = min_digits + rng.below(max_digits - min_digits + 1);
        let digits: Vec<i32> = (0..n).map(|_| rng.below(10) as i32).collect();
        let mut s = vec![BOS];
        s.extend(&digits);
        s.push(SEP);
        s.extend(digits.iter().rev());
        s.push(EOS);
        // Position i predicts s[i+1]; the answer starts at SEP (i = n + 1); the last position
        // predicts nothing.
        for i in 0..s.len() {
            targets.push(if i + 1 < s.len() { s[i + 1] } else { 0 });
            mask.push(if i > n && i + 1 < s.len() { 1.0 } else { 0.0 });
        }
        seqs.push(s);
    }
    Ok(TaskBatch {
        batch: PackedBatch::pack(&seqs, vocab)?,
        targets,
        mask,
    })
}

/// Uniformly random tokens: `n_seqs` sequences of `len` ids below `vocab`, packed, with random
/// targets and every token in the loss (mask 1.0). The benches' input: what the numbers do not
/// matter, only the shapes. Returns the sequences too (for exporting the same input elsewhere).
pub fn random_tokens(
    rng: &mut Rng,
    vocab: usize,
    n_seqs: usize,
    len: usize,
) -> Result<(Vec<Vec<i32>>, TaskBatch)> {
    let seqs: Vec<Vec<i32>> = (0..n_seqs)
        .map(|_| (0..len).map(|_| rng.below(vocab) as i32).collect())
        .collect();
    let batch = PackedBatch::pack(&seqs, vocab)?;
    let targets: Vec<i32> = (0..batch.len()).map(|_| rng.below(vocab) as i32).collect();
    let mask = vec![1.0f32; batch.len()];
    Ok((
        seqs,
        TaskBatch {
            batch,
            targets,
            mask,
        },
    ))
}
