//! `sluice eval --checkpoint F --task NAME [--samples N]`: a checkpoint's pass rate on a task's
//! held-out problems, greedy and sampled (at the config's rollout temperature), with a few
//! transcripts to read.
//!
//! The task comes from a config: `--config` if given, else the config.toml of the run folder
//! the checkpoint lives in (runs/NAME/final.safetensors, runs/NAME/checkpoints/*/...), else the
//! defaults. The engine computes in the config's `model.precision` unless `--precision` says
//! otherwise (bf16: the checkpoint's f32 weights rounded to the bf16 compute copy, a bf16 KV
//! cache).

use crate::config::{self, ConfigError, TrainConfig};
use crate::tasks::text::TextTokenizer;
use crate::train_cmd::{make_task, TrainError};
use sluice_kernels::Backend;
use sluice_model::{Model, Precision};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::eval::{pass_rate_with, PassRate};
use sluice_runtime::trajectory::{SamplingParams, TokenId, WeightVersion};
use std::io::Write;
use std::path::{Path, PathBuf};

pub struct EvalOptions {
    pub checkpoint: PathBuf,
    pub task: String,
    /// Held-out problems (default: the config's rollout.eval_problems).
    pub samples: Option<usize>,
    pub config: Option<PathBuf>,
    /// Transcripts to print per mode.
    pub show: usize,
    /// `auto`, `f32` or `bf16`; None: the config's `model.precision`.
    pub precision: Option<String>,
}

/// The config that defines the tasks for `checkpoint`.
fn config_for(o: &EvalOptions) -> Result<TrainConfig, TrainError> {
    if let Some(c) = &o.config {
        return Ok(config::load(Some(c), &[])?);
    }
    // A checkpoint inside a run folder: the run's own config.
    let mut dir: Option<&Path> = o.checkpoint.parent();
    while let Some(d) = dir {
        let c = d.join("config.toml");
        if c.is_file() {
            return Ok(config::load(Some(&c), &[])?);
        }
        dir = d.parent();
    }
    Ok(config::load(None, &[])?)
}

/// The weights file of `--checkpoint`: a safetensors file, or a checkpoint folder of a run
/// (runs/NAME/checkpoints/NNN-XXXXXXXXX/), whose learner.safetensors holds the weights.
fn weights_file(checkpoint: &Path) -> Result<PathBuf, TrainError> {
    if checkpoint.is_file() {
        return Ok(checkpoint.to_path_buf());
    }
    let inside = checkpoint.join("learner.safetensors");
    if checkpoint.is_dir() && inside.is_file() {
        return Ok(inside);
    }
    Err(TrainError::Input(format!(
        "--checkpoint {}: {}",
        checkpoint.display(),
        if checkpoint.is_dir() {
            "a folder without learner.safetensors (give a safetensors file or a checkpoint folder of a run)"
        } else {
            "no such file"
        }
    )))
}

fn render(tok: Option<&TextTokenizer>, ids: &[TokenId]) -> String {
    if let Some(tok) = tok {
        tok.render(ids)
    } else {
        format!("{ids:?}")
    }
}

/// Runs the evaluation; the report goes to `out`.
pub fn run_eval(o: &EvalOptions, out: &mut dyn Write) -> Result<(PassRate, PassRate), TrainError> {
    let cfg = config_for(o)?;
    let section = cfg.task(&o.task).cloned().or_else(|| {
        // Tasks the stages do not use are still in the table.
        config::load(None, &[]).ok()?.task(&o.task).cloned()
    });
    let Some(section) = section else {
        let names: Vec<&str> = cfg.tasks.iter().map(|t| t.name.as_str()).collect();
        return Err(TrainError::Input(format!(
            "--task {}: no such task in the config (tasks: {})",
            o.task,
            names.join(", ")
        )));
    };
    let weights = weights_file(&o.checkpoint)?;
    let backend = Backend::open(cfg.run.device).map_err(|e| {
        TrainError::Config(ConfigError {
            key: "run.device".into(),
            message: e.to_string(),
        })
    })?;
    let precision = match o.precision.as_deref() {
        None => cfg.model.precision,
        Some("auto") => Precision::default_for(cfg.run.device),
        Some(p) => Precision::parse(p)
            .map_err(|_| TrainError::Input(format!("--precision {p:?}: use auto, f32 or bf16")))?,
    };
    let mut model = Model::from_checkpoint(&weights, &backend)
        .map_err(|e| TrainError::Input(format!("--checkpoint: {e}")))?;
    model
        .set_precision(&backend, precision)
        .map_err(|e| TrainError::Run(e.to_string()))?;
    let tok = cfg.tokenizer.load()?;
    if cfg.tokenizer.model_vocab(&tok, model.config.vocab) != model.config.vocab {
        return Err(TrainError::Config(ConfigError {
            key: "tokenizer.path".into(),
            message: format!(
                "the checkpoint's model has a vocabulary of {} ids, tokenizer {} has {}: a \
                 model and its tokenizer must match",
                model.config.vocab,
                tok.version(),
                tok.vocab_size()
            ),
        }));
    }
    let task = make_task(
        &section,
        model.config.vocab,
        &crate::tasks::external::EnvIo::default(),
        &tok,
    )
    .map_err(|m| {
        TrainError::Config(ConfigError {
            key: format!("tasks.{}.kind", section.name),
            message: m,
        })
    })?;
    let text = matches!(section.kind.as_str(), "arith" | "sort" | "tool").then_some(tok.as_ref());
    let n = o.samples.unwrap_or(cfg.rollout.eval_problems).max(1);
    let r = &cfg.rollout;
    let mut engine = Engine::new(
        backend,
        &model.config,
        model.compute_weights(),
        WeightVersion(0),
        EngineConfig {
            kv_bytes: r.kv_bytes,
            block_size: r.block_size,
            max_batch_tokens: r.max_batch_tokens,
            max_seqs: r.max_seqs,
            preempt: r.preempt,
            swap: r.swap,
            precision,
        },
    )
    .map_err(|e| TrainError::Run(e.to_string()))?;
    let mut run = |temperature: f32| {
        pass_rate_with(
            &mut engine,
            task.as_ref(),
            n,
            cfg.run.seed,
            SamplingParams {
                temperature,
                top_k: r.top_k,
                top_p: r.top_p,
                max_new_tokens: r.max_new_tokens,
                seed: cfg.run.seed,
            },
            r.max_turns,
            o.show,
        )
        .map_err(|e| TrainError::Run(e.to_string()))
    };
    let greedy = run(0.0)?;
    let sampled = run(if r.temperature > 0.0 {
        r.temperature
    } else {
        1.0
    })?;
    let _ = writeln!(
        out,
        "{} on {} distinct held-out problems of task {} ({}), {precision}:",
        o.checkpoint.display(),
        greedy.problems,
        o.task,
        section.kind
    );
    for (mode, p) in [("greedy", &greedy), ("sampled", &sampled)] {
        let _ = writeln!(
            out,
            "  {mode:<8} pass rate {:.1}% ({})",
            100.0 * p.rate(),
            p.counts()
        );
        for (t, reward) in &p.transcripts {
            let _ = writeln!(out, "    [reward {reward}] {}", render(text, t));
        }
    }
    Ok((greedy, sampled))
}
