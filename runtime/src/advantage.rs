//! GRPO advantages of a group (crate::learner; the KL reward form passes shaped rewards).

use crate::trajectory::Sample;

/// GRPO advantages of one group: (r - mean) / (std + eps), or r - mean when `std_free`. The
/// std is the population std of the group's rewards (repeats included, as trained).
pub fn advantages(samples: &[Sample], std_free: bool, eps: f32) -> Vec<f32> {
    let rewards: Vec<f64> = samples.iter().map(|s| s.reward as f64).collect();
    advantages_of(&rewards, std_free, eps)
}

/// [`advantages`] of a group's rewards (the KL reward form passes shaped ones).
pub fn advantages_of(rewards: &[f64], std_free: bool, eps: f32) -> Vec<f32> {
    let n = rewards.len().max(1) as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
    rewards
        .iter()
        .map(|r| {
            let d = r - mean;
            if std_free {
                d as f32
            } else {
                (d / (var.sqrt() + eps as f64)) as f32
            }
        })
        .collect()
}
