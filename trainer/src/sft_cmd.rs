//! `sluice sft`: supervised training of the model on the synthetic digit-reversal task
//! (sluice_model::synthetic) with Muon + AdamW, on any device. It is the smoke test
//! (model/tests/smoke.rs) as a command: progress lines, a metrics file, a held-out accuracy and
//! a checkpoint with the optimizer state at the end. `--precision bf16` trains in mixed
//! precision (the bf16 compute copy, refreshed after every step; docs/model.md, "Precision");
//! the default, `auto`, is bf16 on cuda and emu and f32 on cpu.

use sluice_kernels::testing::Rng;
use sluice_kernels::{Backend, Device, Error, Result};
use sluice_model::forward::{logits_on, loss_and_grad_on};
use sluice_model::optim::{LrSchedule, OptimConfig, Optimizer};
use sluice_model::synthetic::{reverse_digits, TaskBatch, EOS};
use sluice_model::{Model, ModelConfig, Precision};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What `sluice sft` runs.
pub struct SftOptions {
    /// Model config (TOML); the architecture and the init seed.
    pub model_config: PathBuf,
    pub device: Device,
    /// None: the device's default ([`Precision::default_for`]).
    pub precision: Option<Precision>,
    pub steps: u64,
    /// Sequences per step.
    pub batch: usize,
    pub min_digits: usize,
    pub max_digits: usize,
    /// Seed of the task's data stream.
    pub data_seed: u64,
    pub muon_lr: f32,
    pub adamw_lr: f32,
    pub warmup: u64,
    /// Print a progress line every this many steps.
    pub log_every: u64,
    /// Folder for metrics.jsonl and the final checkpoint (model.safetensors).
    pub out_dir: PathBuf,
}

/// The end of a run.
pub struct SftSummary {
    pub precision: Precision,
    pub first_loss: f32,
    /// Mean loss over the last (up to) 20 steps.
    pub final_loss: f32,
    /// Teacher-forced accuracy of the answer tokens on held-out sequences.
    pub held_out_accuracy: f64,
    pub tokens_per_s: f64,
    pub checkpoint: PathBuf,
}

fn bad(key: &str, msg: String) -> Error {
    Error::param(key, msg)
}

fn check(o: &SftOptions) -> Result<()> {
    if o.steps == 0 {
        return Err(bad("--steps", "must be at least 1".into()));
    }
    if o.batch == 0 {
        return Err(bad("--batch", "must be at least 1 sequence".into()));
    }
    if o.log_every == 0 {
        return Err(bad("--log-every", "must be at least 1".into()));
    }
    for (key, lr) in [("--muon-lr", o.muon_lr), ("--adamw-lr", o.adamw_lr)] {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(bad(key, format!("must be a positive number, got {lr}")));
        }
    }
    if o.min_digits == 0 || o.max_digits < o.min_digits {
        return Err(bad(
            "--min-digits/--max-digits (digits)",
            format!(
                "need 1 <= min <= max, got {}..={}",
                o.min_digits, o.max_digits
            ),
        ));
    }
    if o.warmup >= o.steps {
        return Err(bad(
            "--warmup",
            format!(
                "{} warmup steps leave none of the {} steps",
                o.warmup, o.steps
            ),
        ));
    }
    Ok(())
}

/// Runs the training; progress goes to `progress` (stdout in the CLI).
pub fn run_sft(o: &SftOptions, progress: &mut dyn std::io::Write) -> Result<SftSummary> {
    check(o)?;
    let cfg = ModelConfig::from_file(&o.model_config)?;
    if cfg.vocab <= EOS as usize {
        return Err(bad(
            "vocab",
            format!(
                "{}: the digit task needs at least {} token ids, the config has {}",
                o.model_config.display(),
                EOS + 1,
                cfg.vocab
            ),
        ));
    }
    let backend = Backend::open(o.device)?;
    let precision = o
        .precision
        .unwrap_or_else(|| Precision::default_for(o.device));
    let mut model = Model::new(cfg.clone(), &backend)?;
    model.set_precision(&backend, precision)?;
    let conf = OptimConfig::with_lrs(
        o.muon_lr,
        o.adamw_lr,
        LrSchedule::WarmupCosine {
            warmup: o.warmup,
            total: o.steps,
            min_ratio: 0.1,
        },
    );
    let opt = Optimizer::new(&backend, model.layout().clone(), conf)?;
    let mut state = opt.new_state(&backend)?;
    std::fs::create_dir_all(&o.out_dir).map_err(|e| io_err(&o.out_dir, e))?;
    let metrics_path = o.out_dir.join("metrics.jsonl");
    let mut metrics = std::fs::File::create(&metrics_path).map_err(|e| io_err(&metrics_path, e))?;
    let say = |p: &mut dyn std::io::Write, line: String| {
        // Progress is best effort: a closed stdout must not stop the training.
        let _ = writeln!(p, "{line}");
    };
    say(
        progress,
        format!(
            "sft: {} ({} parameters) on {} in {precision}, {} steps of {} sequences ({}..={} \
             digits); metrics to {}",
            o.model_config.display(),
            model.layout().param_count(),
            o.device,
            o.steps,
            o.batch,
            o.min_digits,
            o.max_digits,
            metrics_path.display()
        ),
    );
    let mut rng = Rng::new(o.data_seed);
    let start = Instant::now();
    let (mut first, mut recent, mut tokens) = (None, Vec::new(), 0usize);
    for step in 1..=o.steps {
        let t = reverse_digits(&mut rng, o.batch, o.min_digits, o.max_digits, cfg.vocab)?;
        let loss = loss_and_grad_on(&backend, &mut model, &t.batch, &t.targets, &t.mask)?;
        if !loss.is_finite() {
            return Err(Error::Invalid(format!(
                "step {step}: the loss is {loss}; lower --muon-lr / --adamw-lr"
            )));
        }
        let stats = opt.step(
            &backend,
            &mut model.params,
            &model.grads,
            &mut state,
            model.compute.as_mut(),
        )?;
        tokens += t.batch.len();
        first.get_or_insert(loss);
        recent.push(loss);
        if recent.len() > 20 {
            recent.remove(0);
        }
        let secs = start.elapsed().as_secs_f64();
        let line = format!(
            "{{\"step\":{step},\"loss\":{loss},\"grad_norm\":{},\"lr_factor\":{},\"tokens\":{tokens},\"seconds\":{secs:.3}}}",
            stats.grad_norm, stats.lr_factor
        );
        writeln!(metrics, "{line}").map_err(|e| io_err(&metrics_path, e))?;
        if step % o.log_every == 0 || step == 1 || step == o.steps {
            say(
                progress,
                format!(
                    "step {step:>5}/{}  loss {loss:.4}  grad norm {:.3}  lr x{:.3}  {:.0} tokens/s  {secs:.1}s",
                    o.steps,
                    stats.grad_norm,
                    stats.lr_factor,
                    tokens as f64 / secs.max(1e-9)
                ),
            );
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // Held out: a data stream the training never drew from.
    let mut eval_rng = Rng::new(o.data_seed ^ 0x5eed_e7a1_0000_0001);
    let held = reverse_digits(&mut eval_rng, 64, o.min_digits, o.max_digits, cfg.vocab)?;
    let held_out_accuracy = answer_accuracy(&backend, &model, &held)?;
    let checkpoint = o.out_dir.join("model.safetensors");
    state.save(&checkpoint, &cfg, &model.params)?;
    let final_loss = recent.iter().sum::<f32>() / recent.len().max(1) as f32;
    let summary = SftSummary {
        precision,
        first_loss: first.unwrap_or(f32::NAN),
        final_loss,
        held_out_accuracy,
        tokens_per_s: tokens as f64 / secs.max(1e-9),
        checkpoint,
    };
    say(progress, summary_table(&summary, o.steps, secs));
    Ok(summary)
}

/// The fraction of answer tokens (mask 1) whose argmax logit is the target.
fn answer_accuracy(backend: &Backend, model: &Model, t: &TaskBatch) -> Result<f64> {
    let logits = logits_on(backend, model, &t.batch)?;
    let v = model.config.vocab;
    let (mut right, mut total) = (0usize, 0usize);
    for (i, (&target, &m)) in t.targets.iter().zip(&t.mask).enumerate() {
        if m == 0.0 {
            continue;
        }
        let row = &logits[i * v..(i + 1) * v];
        // Ties go to the lower id, like the top-k kernels.
        let best = (0..v).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        right += usize::from(best == target as usize);
        total += 1;
    }
    Ok(right as f64 / total.max(1) as f64)
}

fn summary_table(s: &SftSummary, steps: u64, secs: f64) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n| steps | first loss | last-20 mean loss | held-out answer accuracy | tokens/s | time |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|");
    let _ = writeln!(
        t,
        "| {steps} | {:.4} | {:.4} | {:.1}% | {:.0} | {secs:.1}s |",
        s.first_loss,
        s.final_loss,
        100.0 * s.held_out_accuracy,
        s.tokens_per_s
    );
    let _ = write!(
        t,
        "checkpoint (weights + optimizer state): {}",
        s.checkpoint.display()
    );
    t
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}
