//! The whole stack learns: a short supervised run on a synthetic task (reversing digit strings)
//! drives the loss well down on the cpu device, with the model's optimizers (sluice_model::optim:
//! Muon with the per-head / per-expert split for the matrices, AdamW for the rest). For
//! comparison: SGD with heavy-ball momentum 0.9 at lr 0.05 (what this test used before the
//! optimizers existed) reached a mean loss of 0.66 over the last 20 of 500 steps; Muon + AdamW
//! reach 0.02 in 300 steps.
//!
//! The task: sluice_model::synthetic::reverse_digits (sequences `BOS d1 .. dn SEP dn .. d1 EOS`
//! of 3 to 6 digits; the loss covers the reversed digits and EOS). `sluice sft` runs the same
//! training from the command line.

use sluice_model::config::ModelConfig;
use sluice_model::forward::loss_and_grad;
use sluice_model::kernels::testing::Rng;
use sluice_model::kernels::Backend;
use sluice_model::optim::{LrSchedule, OptimConfig, Optimizer};
use sluice_model::synthetic::reverse_digits;
use sluice_model::Model;
use std::time::Instant;

#[test]
fn reversing_digits_loss_drops_with_muon_and_adamw() {
    // The small config at half width and depth, so the run takes seconds on 2 cores.
    let mut cfg = ModelConfig::small();
    cfg.n_layers = 2;
    cfg.d_model = 64;
    cfg.head_dim = 16;
    cfg.expert_ffn_dim = 128;
    cfg.seed = 1;
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let mut rng = Rng::new(5);
    let start = Instant::now();
    // Muon for the matrices, AdamW for embedding/head/router/norms (the defaults: momentum
    // 0.95, Nesterov, weight decay 0.1, clip at global norm 1), 20 warmup steps then a cosine
    // down to a tenth.
    let steps = 300;
    let conf = OptimConfig::with_lrs(
        0.02,
        0.01,
        LrSchedule::WarmupCosine {
            warmup: 20,
            total: steps as u64,
            min_ratio: 0.1,
        },
    );
    let opt = Optimizer::new(&Backend::Cpu, m.layout().clone(), conf).unwrap();
    let mut state = opt.new_state(&Backend::Cpu).unwrap();
    let mut first = None;
    let mut recent = Vec::new();
    for step in 0..steps {
        let t = reverse_digits(&mut rng, 16, 3, 6, cfg.vocab).unwrap();
        let loss = loss_and_grad(&mut m, &t.batch, &t.targets, &t.mask).unwrap();
        assert!(loss.is_finite(), "step {step}: loss {loss}");
        first.get_or_insert(loss);
        recent.push(loss);
        if step % 50 == 0 {
            println!("step {step:4} loss {loss:.4} ({:.1?})", start.elapsed());
        }
        opt.step(&Backend::Cpu, &mut m.params, &m.grads, &mut state, None)
            .unwrap();
    }
    let tail: f32 = recent[recent.len() - 20..].iter().sum::<f32>() / 20.0;
    let first = first.unwrap();
    println!(
        "first loss {first:.3}, mean of the last 20 {tail:.3}, {:.1?}",
        start.elapsed()
    );
    // Start: ln(64) = 4.16 (uniform over the vocabulary). Guessing digits uniformly is
    // ln(10) = 2.30; below 1.0 the model must be reading the digits back through attention.
    // The run is deterministic: 0.021 when Muon + AdamW replaced SGD (SGD + momentum: 0.66
    // after 500 steps); below 0.2 the model reverses almost every digit string.
    assert!(first > 4.0, "initial loss {first}");
    assert!(tail < 0.2, "mean loss of the last 20 steps {tail}");
}
