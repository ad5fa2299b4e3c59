//! Helpers shared by the model's integration tests.

use sluice_model::config::ModelConfig;
use sluice_model::kernels::testing::Rng;
use sluice_model::PackedBatch;

/// Random sequences of the given lengths packed into one batch, with random targets and a loss
/// mask that drops every fifth token from the fourth on (so masked tokens are exercised).
pub fn batch(cfg: &ModelConfig, lens: &[usize], seed: u64) -> (PackedBatch, Vec<i32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let seqs: Vec<Vec<i32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(cfg.vocab) as i32).collect())
        .collect();
    let b = PackedBatch::pack(&seqs, cfg.vocab).unwrap();
    let targets: Vec<i32> = (0..b.len()).map(|_| rng.below(cfg.vocab) as i32).collect();
    let mask: Vec<f32> = (0..b.len())
        .map(|i| if i % 5 == 3 { 0.0 } else { 1.0 })
        .collect();
    (b, targets, mask)
}
